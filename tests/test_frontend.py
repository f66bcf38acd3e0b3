"""`tvm_ext.from_torch` on what real Hugging Face / torchvision models hold, and `tvm_ext.load`'s device names.

Each test is a TVM 0.27 frontend gap that a real model hit: integer cumsums (RoBERTa), half-precision convs
and BatchNorms (ResNet, MobileNetV3), any/all and tensor-bounded clamps (fp16 T5), bounded dynamic dims and
their slices (BERT), errors that name every unsupported op or keep PyTorch's advice. Tiny shapes, CPU only.
"""

import copy
import re

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module
from tvm_ext.frontend import CONVERTERS, ExportError
from tvm_ext.runtime import parse_device

torch = pytest.importorskip("torch")
from torch.export import Dim  # noqa: E402
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402


class Lambda(torch.nn.Module):
    """A module whose forward is `fn`: one op under test per module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def output_dtypes(mod) -> list[str]:
    """Dtypes of the imported `main`'s outputs (a tuple, as TVM's frontend returns them)."""
    return [str(field.dtype) for field in mod["main"].ret_ty.fields]


def run_on_cpu(mod, *inputs):
    """`mod` built with the tvm_ext pipeline for llvm and run on torch tensors; its outputs as torch tensors
    (DLPack, so that bfloat16 comes back too)."""
    outputs = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](
        *[tvm.runtime.from_dlpack(x.contiguous()) for x in inputs])
    return [torch.from_dlpack(out) for out in outputs]


def assert_imports_like_pytorch(module, *inputs, **tolerance):
    """from_torch's module has PyTorch's output dtype and, on llvm, its numbers."""
    with torch.no_grad():
        want = module(*inputs)
    mod = tvm_ext.from_torch(module, *inputs)
    assert output_dtypes(mod) == [str(want.dtype).removeprefix("torch.")]
    got, = run_on_cpu(mod, *inputs)
    torch.testing.assert_close(got, want, **tolerance)


# 1. cumsum / cumprod of bool and integer tensors


def test_position_ids_from_a_padding_mask_are_int64_and_right():
    """RoBERTa's position ids: `(ids != pad).cumsum(-1)`. TVM made a bool cumsum and LLVM codegen died
    ("Check failed: (t.MatchesCode(DLDataTypeCode::kDLFloat))")."""
    ids = torch.tensor([[0, 5, 7, 1, 1, 9, 1, 3, 4, 4, 1, 2, 8, 1, 1, 6], [1] * 8 + [2] * 8])
    assert_imports_like_pytorch(Lambda(lambda x: (x != 1).cumsum(-1)), ids)


@pytest.mark.parametrize("op, dtype, result_dtype", [
    (torch.cumsum, torch.int32, None), (torch.cumsum, torch.uint8, None), (torch.cumprod, torch.int8, None),
    (torch.cumprod, torch.bool, None), (torch.cumsum, torch.bool, torch.int32),
    (torch.cumsum, torch.int64, torch.float32), (torch.cumsum, torch.float32, None)],
    ids=lambda p: getattr(p, "__name__", str(p).removeprefix("torch.")))
def test_cumulative_ops_take_pytorch_result_dtype(op, dtype, result_dtype):
    """PyTorch sums and multiplies bool and integer inputs in int64 unless `dtype=` says otherwise;
    TVM kept the input's dtype (int32, uint8 and int8 products overflow where PyTorch's do not)."""
    x = torch.tensor([[3, 1, 0, 2, 5, 4], [7, 2, 2, 3, 1, 6]]).to(dtype)
    assert_imports_like_pytorch(Lambda(lambda t: op(t, 1, dtype=result_dtype)), x)


# 2. convolutions in fp16 / bf16


CONVS = {"conv1d": (lambda: torch.nn.Conv1d(4, 6, 3, padding=1, groups=2), (2, 4, 9)),
         "conv2d": (lambda: torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2), (1, 4, 9, 9)),
         "conv2d_no_bias": (lambda: torch.nn.Conv2d(4, 6, 3, bias=False), (1, 4, 6, 6)),
         "conv3d": (lambda: torch.nn.Conv3d(2, 3, 2), (1, 2, 3, 4, 4)),
         "conv_transpose1d": (lambda: torch.nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1), (2, 4, 5)),
         "conv_transpose2d": (lambda: torch.nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, groups=2), (1, 4, 5, 5))}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CONVS))
def test_half_precision_convs_keep_their_dtype_and_match_pytorch(name, dtype):
    """TVM's conv converters return float32: an fp16 conv with a bias failed to import (mixed dtypes
    in the add), one without made the rest of the model float32. Ours round to the input dtype, then add
    the bias, against PyTorch's float32 result of the same rounded weights."""
    make, shape = CONVS[name]
    torch.manual_seed(0)
    module, x = make().to(dtype), torch.randn(shape).to(dtype)
    with torch.no_grad():
        want = copy.deepcopy(module).float()(x.float())
    mod = tvm_ext.from_torch(module, x)
    assert output_dtypes(mod) == [str(dtype).removeprefix("torch.")]
    got, = run_on_cpu(mod, x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.parametrize("name", ["conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d"])
def test_conv_ops_export_emits_before_decomposition_are_converted_in_fp16(name):
    """conv1d.default, conv2d.default, conv_transpose1d.default, conv_transpose2d.input (what
    torch.export emits; run_decompositions makes them aten.convolution) read their own arguments."""
    make, shape = CONVS[name]
    module, x = make().half(), torch.randn(shape).half()
    program = torch.export.export(module, (x,))
    assert name in str(next(n.target for n in program.graph.nodes if n.op == "call_function"))
    mod = from_exported_program(program, custom_convert_map=CONVERTERS, run_ep_decomposition=False)
    with torch.no_grad():
        want = module(x)
    assert output_dtypes(mod) == ["float16"]
    got, = run_on_cpu(mod, x)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-3)


class SqueezeExcite(torch.nn.Module):
    """MobileNetV3's block in small: conv, BatchNorm, ReLU, then the channels scaled by their hard-sigmoid gate."""

    def __init__(self, affine: bool):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 6, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(6, affine=affine)
        with torch.no_grad():  # statistics a trained model has, not the initial zeros and ones
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = torch.relu(self.norm(self.conv(x)))
        return y * torch.nn.functional.hardsigmoid(y.mean((2, 3), keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_half_precision_batch_norm_stays_in_its_dtype(dtype, affine):
    """TVM legalizes an fp16 batch_norm to float32: ResNet ran in float32 after it, and MobileNetV3 did not
    build (fp16 gate times float32 activations). Ours normalizes in float32 and rounds once, as PyTorch."""
    torch.manual_seed(0)
    module, x = SqueezeExcite(affine).eval().to(dtype), torch.randn(1, 4, 6, 6).to(dtype)
    with torch.no_grad():
        want = copy.deepcopy(module).float()(x.float())
    got, = run_on_cpu(tvm_ext.from_torch(module, x), x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2 if dtype == torch.bfloat16 else 4e-3)


# 3. any / all


TRUTH_INPUT = torch.tensor([[[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]], [[2.0, -1.0, float("nan")], [0.0, float("inf"), 1.0]]])


@pytest.mark.parametrize("fn", [
    lambda x: torch.isinf(x).any(),  # T5's fp16 overflow check
    lambda x: x.any(), lambda x: x.all(), lambda x: x.any(-1), lambda x: x.all(-1, keepdim=True),
    lambda x: (x > 0).any(1), lambda x: x.any(dim=(0, 2)), lambda x: x.all(dim=(1, 2), keepdim=True),
    lambda x: x.any(dim=())], ids=["isinf_any", "any", "all", "any_dim", "all_dim_keepdim", "bool_any_dim",
                                   "any_dims", "all_dims_keepdim", "any_no_dims"])
def test_any_and_all_of_fp16_tensors_are_bools_like_pytorch(fn):
    """any.default did not import (fp16 T5), any.dim of a float tensor returned its float max;
    NaN and negative numbers count as true, as in PyTorch."""
    assert_imports_like_pytorch(Lambda(fn), TRUTH_INPUT.half())


@pytest.mark.parametrize("fn", [lambda x: x.all(), lambda x: x.all(0), lambda x: x.all(dim=(0, 1), keepdim=True),
                                lambda x: x.any(1)], ids=["all", "all_dim", "all_dims", "any_dim"])
def test_all_ops_convert_where_export_is_not_decomposed(fn):
    """run_decompositions spells all() as not(any(not x)); the aten.all ops themselves convert too."""
    x = torch.tensor([[True, True, False], [True, True, True]])
    program = torch.export.export(Lambda(fn), (x,))
    mod = from_exported_program(program, custom_convert_map=CONVERTERS, run_ep_decomposition=False)
    got, = run_on_cpu(mod, x)
    assert torch.equal(got, fn(x))


@pytest.mark.parametrize("fn", [lambda x: x.abs().amax(), lambda x: x.amin(), lambda x: x.amax(dim=1, keepdim=True),
                                lambda x: x.amin(dim=(0, 2))], ids=["amax", "amin", "amax_dim_keepdim", "amin_dims"])
def test_amax_and_amin_import_over_every_axis_or_the_given_ones(fn):
    """aten.amax/amin did not import (`x / x.abs().amax()`); with no dim they reduce every axis."""
    x = torch.linspace(-3, 5, 2 * 3 * 4).reshape(2, 3, 4)[:, torch.tensor([2, 0, 1])]
    assert_imports_like_pytorch(Lambda(fn), x)


def test_t5_overflow_clamp_stays_fp16():
    """T5's fp16 layers clamp with bounds from torch.where(isinf(h).any(), max - 1000, max): float32 0-d
    tensors, which PyTorch's type promotion leaves fp16; TVM's clamp.Tensor mixed the dtypes and failed."""
    def clamp(h):
        bound = torch.where(torch.isinf(h).any(), torch.finfo(h.dtype).max - 1000, torch.finfo(h.dtype).max)
        return torch.clamp(h, min=-bound, max=bound)

    assert_imports_like_pytorch(Lambda(clamp), torch.tensor([[1.0, -7e4, 65504.0], [float("inf"), 3.0, -2.0]]).half())


# 4. dynamic dims with bounds; torch.export's errors in full


class PositionEmbedding(torch.nn.Module):
    """BERT's embeddings in small: position ids sliced from a 512-long buffer, so seq <= 512."""

    def __init__(self):
        super().__init__()
        self.positions = torch.nn.Embedding(512, 8)
        self.register_buffer("position_ids", torch.arange(512).expand(1, -1), persistent=False)

    def forward(self, x, mask):
        batch, seq = x.shape[:2]
        return (x + self.positions(self.position_ids[:, :seq].expand(batch, seq))) * mask[..., None]


@pytest.mark.parametrize("dynamic", [
    {0: {1: ("seq", 1, 512)}, 1: {1: "seq"}},  # a bare name takes the range given for it elsewhere
    {0: {1: Dim("seq", max=512)}, 1: {1: Dim("seq", max=512)}}], ids=["tuple", "Dim"])
def test_bounded_dynamic_dims_import_and_run_every_length(dynamic):
    """The bound reaches the Relax function under the dim's name (torch.export names it s0, s27, ...;
    a tuning run's --dims seq=512 names it as the user did), and the slice of the position ids
    builds: TVM clamped its length to min(seq, 512), a shape no other tensor has, and the build failed."""
    torch.manual_seed(0)
    module = PositionEmbedding()
    x, mask = torch.randn(1, 16, 8), torch.ones(1, 16)
    mod = tvm_ext.from_torch(module, x, mask, dynamic=dynamic)
    assert {k: int(v) for k, v in mod["main"].attrs["tir_var_upper_bound"].items()} == {"seq": 512}
    assert [str(p.ty.shape.values[1]) for p in mod["main"].params] == ["seq", "seq"]
    executable = tvm_ext.build(mod, "llvm")
    for seq in (3, 512):
        x, mask = torch.randn(1, seq, 8), (torch.rand(1, seq) > 0.3).float()
        got = VirtualMachine(executable, tvm.cpu())["main"](*map(tvm.runtime.tensor, (x.numpy(), mask.numpy())))
        with torch.no_grad():
            np.testing.assert_allclose(got[0].numpy(), module(x, mask).numpy(), rtol=1e-6, atol=1e-6)


def test_export_refusal_keeps_pytorchs_whole_message_and_its_suggested_bound():
    """Without a bound torch.export refuses BERT's seq dim; its advice ("Suggested fixes: seq =
    Dim('seq', max=512)") is in the middle of a long message, so all of it must reach the user."""
    with pytest.raises(ExportError) as err:
        tvm_ext.from_torch(PositionEmbedding(), torch.randn(1, 16, 8), torch.ones(1, 16),
                           dynamic={0: {1: "seq"}, 1: {1: "seq"}})
    message = str(err.value)
    assert isinstance(err.value, ValueError) and message.startswith("torch.export could not export the model")
    assert "dynamic= as (name, min, max)" in message.splitlines()[0]
    assert "Constraints violated (seq)" in message and "Suggested fixes" in message
    assert "Dim('seq', max=512)" in message and "draft_export()" in message  # its first lines and last
    assert isinstance(err.value.__cause__, torch._dynamo.exc.UserError)


@pytest.mark.parametrize("dynamic, match", [
    ({2: {0: "n"}}, "dynamic names input(s) [2], but the model gets 2 example input(s)"),
    ({0: {1: ("seq", 1, 512)}, 1: {1: ("seq", 1, 500)}},
     "dynamic dim 'seq' is given two ranges, [1, 512] and [1, 500]"),
    ({0: {1: ("seq", 9, 2)}}, "dynamic dim ('seq', 9, 2): Cannot create Dim with inconsistent min=9, max=2")])
def test_bad_dynamic_specs_are_value_errors_that_say_what_is_wrong(dynamic, match):
    """An input the model does not have was ignored before; two ranges for one name, or an empty one,
    are caught before torch.export runs."""
    with pytest.raises(ValueError, match=re.escape(match)):
        tvm_ext.from_torch(PositionEmbedding(), torch.randn(1, 16, 8), torch.ones(1, 16), dynamic=dynamic)


# 5. every unsupported op at once


def test_every_unsupported_op_is_named_at_once_branches_included():
    """TVM's own check looks at the top-level graph only (it would name digamma alone); the ops of
    torch.cond's branches (lgamma, i0) are named too, sorted."""
    def branches(x):
        return torch.cond(x.sum() > 0, lambda t: torch.lgamma(t).sum(-1), lambda t: torch.special.i0(t).sum(-1),
                          (x,)) + torch.digamma(x).sum(-1)

    with pytest.raises(tvm_ext.UnsupportedOperatorError) as err:
        tvm_ext.from_torch(Lambda(branches), torch.randn(2, 8))
    assert err.value.ops == ["digamma.default", "i0.default", "lgamma.default"]
    assert "digamma.default, i0.default, lgamma.default" in str(err.value)


# 6. tvm_ext.load's device names


@pytest.fixture(scope="module")
def exported_row_sum(tmp_path_factory):
    return tvm_ext.export(tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "llvm"),
                          tmp_path_factory.mktemp("load") / "row_sum.so")


@pytest.mark.parametrize("device", [None, "cpu", "llvm", "cpu:0", tvm.cpu(), {"kind": "llvm"},
                                    tvm.target.Target({"kind": "llvm"})], ids=str)
def test_load_takes_cpu_device_and_target_spellings(exported_row_sum, device, rng):
    """The target a model was built for names its device too: `load(path, "llvm")` was "Unknown device"."""
    x = rng.standard_normal((4, 8)).astype("float32")
    out = tvm_ext.load(exported_row_sum, device)["main"](tvm.runtime.tensor(x))
    np.testing.assert_allclose(out.numpy(), x.sum(-1), rtol=1e-5)


@pytest.mark.parametrize("device, expected", [
    ("cuda", tvm.cuda(0)), ("cuda:1", tvm.cuda(1)), ("gpu", tvm.cuda(0)), ("GPU:2", tvm.cuda(2)),
    (tvm.cuda(3), tvm.cuda(3)), ({"kind": "cuda", "arch": "sm_90"}, tvm.cuda(0)),
    (tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), tvm.cuda(0)), ("rocm", tvm.rocm(0))], ids=str)
def test_gpu_spellings_name_the_gpu_device(device, expected):
    """Without a GPU here, what `load` would run on: TVM's names, 'gpu', and CUDA targets."""
    assert parse_device(device) == expected


@pytest.mark.parametrize("device", ["cdua", "cuda:x", "cuda -arch=sm_90", "", 42, {"arch": "sm_90"}], ids=str)
def test_bad_device_is_a_value_error_naming_it_and_what_is_accepted(exported_row_sum, device):
    """TVM's own message named neither the spellings it takes nor the target forms."""
    with pytest.raises(ValueError, match=re.escape(f"unknown device {device!r}: expected a tvm Device")) as err:
        tvm_ext.load(exported_row_sum, device)
    assert "'llvm', 'cuda'" in str(err.value) and "'cuda:1'" in str(err.value)


def test_a_view_after_sdpa_survives_decomposition():
    """GPT-2 merges its heads after SDPA with a view that is one only at export time."""

    class MergeHeads(torch.nn.Module):
        def forward(self, q):
            a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            return a.transpose(1, 2).reshape(2, 8, 32).view(-1, 32)

    q = torch.randn(2, 4, 8, 8)
    mod = tvm_ext.from_torch(MergeHeads(), q)
    (out,) = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(q.numpy()))
    np.testing.assert_allclose(out.numpy(), MergeHeads()(q).numpy(), rtol=1e-5, atol=1e-6)
