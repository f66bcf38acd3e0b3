"""Reduce-centric fusion on patterns as PyTorch models spell them (through torch.export)."""

import warnings

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from conftest import CUDA_TARGET
from tvm_ext.schedules import dispatch

torch = pytest.importorskip("torch")


def _clamp_overflow(x):
    """T5's guard: clamp to the dtype's range, less a margin once any element overflowed."""
    top = torch.finfo(x.dtype).max
    bound = torch.where(torch.isinf(x).any(), top - 1000, top)
    return x.clamp(-bound, bound)


WHOLE_TENSOR = {  # a reduction to one value, then work on every element with it
    "clamp_overflow": _clamp_overflow,
    "scale_by_abs_max": lambda x: x / x.abs().amax(),
    "center": lambda x: x - x.mean(),
    "min_max_scale": lambda x: (x - x.amin()) / (x.amax() - x.amin()),
}


class _Elementwise(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _ClampThenRMSNorm(torch.nn.Module):
    """T5's feed-forward tail: the clamped hidden state is the next residual and the next norm's input."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        x = _clamp_overflow(x)
        normed = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return x, self.weight * normed.to(x.dtype)


def _unscheduled_reductions(mod, target) -> list:
    """Fused reduce functions no template of ours takes (TVM's rules would get them)."""
    target = tvm_ext.parse_target(target)
    return [name for name, func in tvm_ext.pipeline.fused_reduce_functions(mod, target).items()
            if not dispatch.plan(func, target)]


@pytest.mark.parametrize("name", sorted(WHOLE_TENSOR))
def test_a_reduction_to_one_value_is_not_fused_with_the_work_on_every_element(name, rng):
    """Every element waits for a reduction over all of them: in one kernel that reduction ran in each
    thread (T5's clamp took 3.4 ms of 14 on an H100). Split, each half has a template of ours."""
    x = torch.from_numpy(rng.standard_normal((2, 256, 256)).astype("float16"))
    mod = tvm_ext.from_torch(_Elementwise(WHOLE_TENSOR[name]), x)
    assert _unscheduled_reductions(mod, CUDA_TARGET) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", tvm_ext.FallbackWarning)
        tvm_ext.build(mod, CUDA_TARGET)
    x32 = x.float()
    got = VirtualMachine(tvm_ext.build(tvm_ext.from_torch(_Elementwise(WHOLE_TENSOR[name]), x32), "llvm"),
                         tvm.cpu())["main"](tvm.runtime.tensor(x32.numpy()))
    np.testing.assert_allclose(got[0].numpy(), WHOLE_TENSOR[name](x32).numpy(), rtol=1e-5, atol=1e-5)


def test_an_elementwise_group_read_by_the_norm_and_returned_is_computed_twice(rng):
    """The clamp is a FuseOps group (several kernels), an output and the norm's input: like a lone
    residual add, it is recomputed inside the norm so that the row templates match."""
    x = torch.from_numpy(rng.standard_normal((2, 128, 256)).astype("float16"))
    module = _ClampThenRMSNorm(256).half()
    mod = tvm_ext.from_torch(module, x)
    assert _unscheduled_reductions(mod, CUDA_TARGET) == []
    module32, x32 = _ClampThenRMSNorm(256), x.float()
    got = VirtualMachine(tvm_ext.build(tvm_ext.from_torch(module32, x32), "llvm"),
                         tvm.cpu())["main"](tvm.runtime.tensor(x32.numpy()))
    for g, want in zip(got, module32(x32), strict=True):
        np.testing.assert_allclose(g.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 256, 256), (3, 1000, 77)], ids=["aligned", "ragged"])
@pytest.mark.parametrize("name", sorted(WHOLE_TENSOR))
def test_a_reduction_to_one_value_matches_pytorch_on_the_gpu(name, shape, rng):
    """The one-value reduction (grid_reduce's last-block ticket, its scalar work in the last block) and
    the work on every element after it, on the GPU, in fp16 and fp32."""
    for dtype in ("float16", "float32"):
        x = torch.from_numpy(rng.standard_normal(shape).astype(dtype))
        module = _Elementwise(WHOLE_TENSOR[name])
        with warnings.catch_warnings():
            warnings.simplefilter("error", tvm_ext.FallbackWarning)
            executable = tvm_ext.build(tvm_ext.from_torch(module, x), "cuda")
        got = VirtualMachine(executable, tvm.cuda())["main"](tvm.runtime.tensor(x.numpy(), tvm.cuda()))[0].numpy()
        want = module(x.cuda()).cpu().numpy()
        tolerance = 2e-3 if dtype == "float16" else 1e-5
        np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=tolerance, atol=tolerance)
