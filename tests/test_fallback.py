"""A rule of ours that raises never fails the build: each rewrite, legalization, template and TIR pass
in turn is made to raise; the build still succeeds, warns once per function and rule, and is right."""

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.runtime.vm import VirtualMachine

from tvm_ext import schedules
import tvm_ext
from bench.suite import relax_module
from tvm_ext.schedules import (block_row, column_reduce, column_split, conv2d, cpu_rows, elementwise, grid_reduce, grid_sync, matmul,
                       warp_row, wgmma_matmul)
from tvm_ext import fallback, pipeline
from tvm_ext import tir as passes
from tvm_ext.relax import welford
from conftest import CUDA_TARGET

torch = pytest.importorskip("torch")
from examples.torch_models import BertLayer, LlamaLayer, make  # noqa: E402

SM90A = {"kind": "cuda", "arch": "sm_90a"}
SM80 = {"kind": "cuda", "arch": "sm_80"}


class Layers(torch.nn.Module):
    """A LLaMA layer then a BERT layer, at test size: work for every rewrite and template."""

    def __init__(self):
        super().__init__()
        self.llama, self.bert = LlamaLayer(256, 4, 512), BertLayer(256, 4, 512)

    def forward(self, x):
        return self.bert(self.llama(x))


def _model(dtype):
    torch.manual_seed(0)
    module, x = Layers().eval().to(dtype), torch.randn(1, 64, 256).to(dtype)
    with torch.no_grad():
        expected = module(x).float().numpy()
    return tvm_ext.from_torch(module, x), x, expected


@pytest.fixture(scope="module")
def fp32():
    return _model(torch.float32)


@pytest.fixture(scope="module")
def fp16():
    return _model(torch.float16)


def _raises(*_args, **_kwargs):
    raise RuntimeError("injected")


def _named_raising_pass(name):
    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod, _ctx):
        raise RuntimeError("injected")
    return _pass


# Relax rewrites: (where the pipeline finds it, attribute, the rule's name in the warning)
REWRITES = [
    (pipeline, "combine_parallel_linears", "TVMExtCombineParallelLinears"),
    (pipeline, "fuse_attention", "TVMExtFuseAttention"),
    (pipeline, "max_from_top_one", "TVMExtMaxFromTopOne"),
    (pipeline, "half_math_in_float", "TVMExtHalfMathInFloat"),
    (welford, "pair_mean_with_variance", "TVMExtPairMeanWithVariance"),
    (pipeline, "activation_before_reshape", "TVMExtActivationBeforeReshape"),
    (pipeline, "read_transposed_operand", "TVMExtReadTransposedOperand"),
    (pipeline, "fuse_gated_epilogues", "TVMExtFuseGatedEpilogues"),
    (pipeline, "narrow_indices", "TVMExtNarrowIndices"),
]


def _build(mod, target):
    """(executable, the FallbackWarning messages) of a build that must not raise."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executable = tvm_ext.build(mod, target)
    messages = [str(w.message) for w in caught if issubclass(w.category, fallback.FallbackWarning)]
    assert len(messages) == len(set(messages)), messages  # once per function and rule
    return executable, messages


def _run(executable, x):
    (out,) = VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x.float().numpy()))  # one output
    return out.numpy()


def _check_fell_back(messages, rule):
    assert messages, f"no fallback warning for {rule}"
    assert all(f": {rule} failed (RuntimeError: injected); falling back to TVM's default" in m for m in messages), messages


def test_no_warning_without_a_fault(fp16):
    mod, _, _ = fp16
    for target in (SM90A, SM80):
        _, messages = _build(mod, target)
        assert messages == []


@pytest.mark.parametrize("owner, attr, rule", REWRITES, ids=[r[1] for r in REWRITES])
def test_raising_rewrite_is_skipped(monkeypatch, fp32, fp16, owner, attr, rule):
    monkeypatch.setattr(owner, attr, _named_raising_pass(rule))
    mod, x, expected = fp32
    executable, messages = _build(mod, "llvm")
    _check_fell_back(messages, rule)
    assert [m.split(":")[1].strip() for m in messages] == ["main"]
    np.testing.assert_allclose(_run(executable, x), expected, rtol=1e-4, atol=1e-4)
    executable, messages = _build(fp16[0], SM90A)
    _check_fell_back(messages, rule)
    assert tvm_ext.cuda_kernels(executable)


def test_raising_fuse_reduce_groups_is_skipped(monkeypatch, fp32):
    monkeypatch.setattr(pipeline, "FuseReduceGroups", lambda: _named_raising_pass("TVMExtFuseReduceGroups"))
    mod, x, expected = fp32
    executable, messages = _build(mod, "llvm")
    _check_fell_back(messages, "TVMExtFuseReduceGroups")
    np.testing.assert_allclose(_run(executable, x), expected, rtol=1e-4, atol=1e-4)


def test_raising_legalization_uses_tvms(monkeypatch, fp32, fp16):
    ours = pipeline.legalizations
    monkeypatch.setattr(pipeline, "legalizations", lambda variance: {**ours(variance), "relax.nn.layer_norm": _raises})
    monkeypatch.setattr(pipeline, "split_k_legalization", lambda sm_count: _raises)  # relax.matmul's
    mod, x, expected = fp32
    executable, messages = _build(mod, "llvm")
    _check_fell_back([m for m in messages if "layer_norm" in m], "legalization of relax.nn.layer_norm")
    np.testing.assert_allclose(_run(executable, x), expected, rtol=1e-4, atol=1e-4)
    executable, messages = _build(fp16[0], SM90A)
    _check_fell_back([m for m in messages if "matmul" in m], "legalization of relax.matmul")


# Templates: (module, what the dispatcher calls, work for it as (op, shape, dtype) of the suite or a
# model, target whose build reaches it)
TEMPLATES = [
    (warp_row, "apply", ("softmax", [64, 1024], "float16"), SM90A),
    (block_row, "apply", ("layer_norm", [64, 8192], "float16"), SM90A),
    (grid_reduce, "apply", ("row_sum", [64, 131072], "float32"), SM90A),
    (grid_sync, "apply", ("rms_norm", [16, 262144], "bfloat16"), SM90A),
    (column_reduce, "apply", ("col_sum", [512, 65536], "float32"), SM90A),
    (column_split, "apply", ("col_sum", [262144, 64], "float32"), SM90A),
    (wgmma_matmul, "_apply", "layers", SM90A),
    (matmul, "apply", "layers", SM80),
    (conv2d, "apply", "resnet", SM80),
]


def _work(spec, fp16):
    if spec == "layers":
        return fp16[0]
    if spec == "resnet":
        torch.manual_seed(0)
        module, x = make("resnet-tiny-folded-bn")
        return tvm_ext.from_torch(module, x)
    return relax_module(*spec)


@pytest.mark.parametrize("template, attr, spec, target", TEMPLATES, ids=[t[0].NAME for t in TEMPLATES])
def test_raising_template_falls_back_to_tvm(monkeypatch, fp16, template, attr, spec, target):
    mod = _work(spec, fp16)
    reference = tvm_ext.cuda_kernels(tvm_ext.build(mod, target))
    monkeypatch.setattr(template, attr, _raises)
    executable, messages = _build(mod, target)
    _check_fell_back(messages, "tvm_ext reduction templates" if template in schedules.STRATEGIES.values()
                     else "tvm_ext contraction templates")
    assert len(tvm_ext.cuda_kernels(executable)) >= len(reference)


def test_raising_cpu_template_falls_back_and_stays_right(monkeypatch, rng):
    monkeypatch.setattr(cpu_rows, "apply", _raises)
    executable, messages = _build(relax_module("softmax", [8, 300], "float32"), "llvm")
    _check_fell_back(messages, "tvm_ext reduction templates")
    x = rng.standard_normal([8, 300]).astype("float32")
    out = VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_raising_templates_leave_the_model_right_on_the_gpu(monkeypatch, fp16):
    mod, x, expected = fp16
    for template, attr in ((wgmma_matmul, "_apply"), (matmul, "apply"), (warp_row, "apply")):
        monkeypatch.setattr(template, attr, _raises)
    executable, messages = _build(mod, "cuda")
    assert messages
    dev = tvm.cuda()
    (out,) = VirtualMachine(executable, dev)["main"](tvm.runtime.tensor(x.numpy(), dev))
    np.testing.assert_allclose(out.numpy().astype("float32"), expected, rtol=2e-2, atol=2e-2)


def test_raising_dlight_rule_declines(monkeypatch, fp16):
    monkeypatch.setattr(elementwise, "apply", _raises)
    executable, messages = _build(fp16[0], SM90A)
    _check_fell_back(messages, "Elementwise")
    assert tvm_ext.cuda_kernels(executable)


@pytest.mark.parametrize("name", ["TVMExtNarrowIndex", "TVMExtAutoTensorize", "TVMExtBoolLoadsAsBytes",
                                  "TVMExtCooperativeLaunch", "TVMExtDependentLaunch", "TVMExtWelfordLower"])
def test_raising_tir_pass_leaves_the_function_to_tvm(monkeypatch, fp16, name):
    target = SM80 if name == "TVMExtAutoTensorize" else SM90A  # sm_90a's matmuls are wgmma, not tensorized
    registered = {phase: passes.registered_tir_passes(phase) for phase in passes.PHASES}
    (phase, index), = [(ph, i) for ph, ps in registered.items() for i, p in enumerate(ps) if p.info.name == name]
    monkeypatch.setitem(passes._passes, phase, registered[phase][:index] + [_named_raising_pass(name)]
                        + registered[phase][index + 1:])
    executable, messages = _build(fp16[0], target)
    _check_fell_back(messages, name)
    assert tvm_ext.cuda_kernels(executable)


def test_relax_function_names_the_function(monkeypatch):
    """A rewrite failing on a module of two Relax functions names both."""
    monkeypatch.setattr(pipeline, "fuse_attention", _named_raising_pass("TVMExtFuseAttention"))
    bb = relax.BlockBuilder()
    for name in ("main", "other"):
        x = relax.Var("x", relax.TensorType([4, 8], "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.nn.softmax(x))
            bb.emit_func_output(out)
    _, messages = _build(bb.get(), "llvm")
    assert messages == ["tvm_ext: main, other: TVMExtFuseAttention failed (RuntimeError: injected); falling back to "
                        "TVM's default"]


def test_a_schedule_with_a_per_thread_array_of_symbolic_size_is_refused_before_code_generation():
    # CUDA's code generator raises on such an array after every TIR pass has run; the check that
    # decides between our schedule and TVM's must see it, or the build fails instead of falling back
    from tvm.script import tirx as T  # noqa: PLC0415

    @T.prim_func(private=True, s_tir=True)
    def per_thread_row(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (T.int64(4), n), "float32")
        B = T.match_buffer(b, (T.int64(4),), "float32")
        for row in T.thread_binding(T.int64(4), thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(1), thread="threadIdx.x"):
                with T.sblock("copy"):
                    row_local = T.sblock_alloc_buffer((n,), scope="local")
                    for j in range(n):
                        row_local[j] = A[row, j]
                    B[row] = row_local[0]

    target = tvm_ext.parse_target(CUDA_TARGET)
    with pytest.raises(ValueError, match="per-thread array row_local of symbolic size"):
        passes.check_builds(per_thread_row, "per_thread_row", target)
