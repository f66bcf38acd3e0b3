"""Programmatic dependent launch (tvm_ext/tir/dependent_launch.py): every kernel on sm_90+ waits
for the kernel before it before anything else, triggers no early launch of the next (its blocks'
exits do), and carries the tag with which TVM's runtime launches it that way."""

import re
import shutil
import subprocess

import numpy as np
import pytest
from tvm import relax

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET
from helpers import build_recording_launch, kernel_bodies
from tvm_ext.tir import registered_tir_passes, tir_pass_disabled
from tvm_ext.tir.cooperative_launch import COOPERATIVE_LAUNCH, DYNAMIC_SHARED_MEMORY
from tvm_ext.tir.dependent_launch import DEPENDENT_LAUNCH, dependent_launch

WAIT, TRIGGER = "tvm_builtin_ptx_griddepcontrol_wait();", "tvm_builtin_ptx_griddepcontrol_launch_dependents();"


def norm_then_softmax(rows: int = 512, width: int = 4096) -> relax.Function:
    """RMSNorm, then a softmax of its output: two kernels, the second reading the first's output."""
    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType([rows, width], "float16")), relax.Var("w", relax.TensorType([width], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1]))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_each_kernel_waits_first_and_is_tagged(arch):
    ex, src, launch = build_recording_launch(norm_then_softmax(), {**CUDA_TARGET, "arch": arch})
    bodies = kernel_bodies(src)
    assert len(bodies) == 2 and set(bodies) == set(tvm_ext.cuda_kernels(ex))
    for name, body in bodies.items():
        lines = [line.strip() for line in body.splitlines()]
        assert lines[0] == WAIT, f"{name} must wait before its first statement: {lines[:2]}"
        assert body.count(WAIT) == 1 and TRIGGER not in body, "the next kernel launches as this one's blocks exit"
        tags = launch[name]
        assert DEPENDENT_LAUNCH in tags and COOPERATIVE_LAUNCH not in tags
        assert DYNAMIC_SHARED_MEMORY not in tags or tags[-1] == DYNAMIC_SHARED_MEMORY, "TVM wants that tag last"
        axes = tags[:tags.index(DEPENDENT_LAUNCH)]
        assert "blockIdx.x" in axes and all(re.fullmatch(r"(block|thread)Idx\.[xyz]", t) for t in axes), "thread axes first"


def test_wgmma_matmul_kernels_get_it_too():
    # the hand-written Hopper kernels (TMA descriptors, mbarriers) lower through the same late phase
    bb = relax.BlockBuilder()
    a, b = relax.Var("a", relax.TensorType([512, 4096], "float16")), relax.Var("b", relax.TensorType([4096, 4096], "float16"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.astype(relax.op.matmul(a, b, out_dtype="float32"), "float16"))
        bb.emit_func_output(out)
    _, src, launch = build_recording_launch(bb.get(), {**CUDA_TARGET, "arch": "sm_90a"})
    (name, body), = kernel_bodies(src).items()
    assert "wgmma.mma_async" in src and [line.strip() for line in body.splitlines()][0] == WAIT
    assert DEPENDENT_LAUNCH in launch[name]


def test_before_hopper_and_on_cpus_nothing_changes():
    _, src, launch = build_recording_launch(norm_then_softmax(), {**CUDA_TARGET, "arch": "sm_80"})
    assert "griddepcontrol" not in src and all(DEPENDENT_LAUNCH not in tags for tags in launch.values())
    assert launch, "the recording pass saw the kernels"
    ex = tvm_ext.build(norm_then_softmax(rows=4, width=64), "llvm")
    assert tvm_ext.cuda_source(ex) == ""


def test_cooperative_kernels_are_launched_as_before():
    # a grid barrier needs every block resident at once: no early-launched neighbour may take SM room
    _, src, launch = build_recording_launch(relax_module("rms_norm", [16, 262144], "bfloat16"), CUDA_TARGET)
    (tags,) = launch.values()
    assert COOPERATIVE_LAUNCH in tags and DEPENDENT_LAUNCH not in tags and "griddepcontrol" not in src


def test_disabling_the_pass_restores_its_place():
    before = registered_tir_passes("late")
    with tir_pass_disabled(dependent_launch):
        assert dependent_launch not in registered_tir_passes("late")
        _, src, launch = build_recording_launch(norm_then_softmax(), CUDA_TARGET)
    assert "griddepcontrol" not in src and all(DEPENDENT_LAUNCH not in tags for tags in launch.values())
    assert registered_tir_passes("late") == before


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compiles_with_nvcc_for_sm_90(tmp_path):
    _, src, _ = build_recording_launch(norm_then_softmax(), CUDA_TARGET)
    (tmp_path / "k.cu").write_text(src)
    subprocess.run(["nvcc", "-arch=sm_90", "-ptx", "-o", str(tmp_path / "k.ptx"), str(tmp_path / "k.cu")],
                   capture_output=True, text=True, check=True)
    ptx = (tmp_path / "k.ptx").read_text()
    assert ptx.count("griddepcontrol.wait;") == 2 and "griddepcontrol.launch_dependents" not in ptx


@pytest.mark.gpu
def test_a_chain_of_dependent_kernels_gives_the_serial_launch_numbers(rng):
    # 20 kernel calls (two kernels, ten times each), each reading all of the one before: a kernel that
    # ran ahead of its predecessor's writes would read stale rows
    import tvm  # noqa: PLC0415

    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType([8192, 4096], "float16")), relax.Var("w", relax.TensorType([4096], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = x
            for _ in range(10):
                y = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.nn.rms_norm(y, w, axes=[-1]))))
                y = bb.emit(relax.op.multiply(y, relax.const(np.float16(4096.0))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(rng.standard_normal(shape).astype("float16"), dev) for shape in ([8192, 4096], [4096])]
    with tir_pass_disabled(dependent_launch):
        serial = tvm.runtime.vm.VirtualMachine(tvm_ext.build(mod, "cuda"), dev)["main"](*args).numpy()
    ex, src, launch = build_recording_launch(mod, "cuda")
    assert all(DEPENDENT_LAUNCH in tags for tags in launch.values()) and len(launch) == 2
    vm = tvm.runtime.vm.VirtualMachine(ex, dev)
    for _ in range(5):
        np.testing.assert_array_equal(vm["main"](*args).numpy(), serial)
