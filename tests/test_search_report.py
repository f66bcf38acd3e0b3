"""The tuning run's picture (search/report.py) and the tensor-core work it draws (check.task_flops):
FLOPs counted from the task's own contraction block, a third panel only for runs with such tasks,
the peak line where the architecture is known."""

import json
import struct

import pytest
import torch
import tvm

import tvm_ext
from bench.suite import relax_module
from tvm_ext.records import VERSION
from tvm_ext.search.check import task_flops
from tvm_ext.search.report import tensor_peak_tflops, write_report
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.tuner import TaskReport

CUDA = tvm_ext.parse_target({"kind": "cuda", "arch": "sm_90a"})


def _tasks(module, *inputs):
    return {t.name: t for t in extract_tasks(tvm_ext.from_torch(module.half(), *inputs), CUDA)}


def test_flops_are_counted_from_the_matmul_and_the_convolution_and_nothing_else():
    linear = _tasks(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512)),
                    torch.randn(64, 256, dtype=torch.float16))
    assert {name: task_flops(t.func) for name, t in linear.items()} == {"fused_matmul_cast_add": 2 * 64 * 256 * 512,
                                                                         "layer_norm": 0}
    conv = _tasks(torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU()),
                  torch.randn(2, 16, 8, 8, dtype=torch.float16))
    assert [task_flops(t.func) for t in conv.values()] == [2 * 2 * 32 * 8 * 8 * 16 * 9]
    (rms,) = extract_tasks(relax_module("rms_norm", [64, 256], "float16"), CUDA)  # x * x: not a contraction
    assert task_flops(rms.func) == 0


def _png_width(path) -> int:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[16:20])[0]


@pytest.mark.parametrize("tflops, width", [(0.0, 1300), (450.0, 1900)])
def test_the_picture_has_a_tensor_core_panel_only_for_runs_with_tensor_core_work(tmp_path, tflops, width):
    pytest.importorskip("matplotlib")
    log = tmp_path / "run.json"
    log.write_text("".join(json.dumps({"key": "k", "task": "t", "knobs": {"strategy": "x"}, "us": us, "error": None, "version": VERSION,
                                       "tvm": tvm.__version__}) + "\n" for us in (30, 20, 25)))
    reports = [TaskReport("t", 1, 3, 20.0, 30.0, 2000.0, 0.5, {"strategy": "x"}, tflops)]
    assert _png_width(write_report(str(log), reports, str(tmp_path / "run.png"), 989.0)) == width


def test_the_peak_is_the_architectures_where_the_table_knows_it():
    assert tensor_peak_tflops(CUDA) == 989.0
    assert tensor_peak_tflops(tvm_ext.parse_target({"kind": "cuda", "arch": "sm_80"})) == 312.0
    assert tensor_peak_tflops(tvm_ext.parse_target({"kind": "cuda", "arch": "sm_75"})) is None
    assert tensor_peak_tflops(tvm_ext.parse_target("llvm")) is None


def test_long_task_names_are_shortened_in_the_picture_only():
    from tvm_ext.search.report import SHORT, _short  # noqa: PLC0415

    name = "fused_cast_power_mean_add_tir_rsqrt_multiply_cast1_multiply1_reshape"
    short = _short(name)
    assert len(short) <= SHORT and short.startswith("fused_cast_power") and short.endswith("multiply1_reshape"[-16:])
    assert "..." in short and _short("fused_matmul_nt_cast2") == "fused_matmul_nt_cast2"
