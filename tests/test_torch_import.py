"""Norms written as PyTorch code, imported through TVM's torch frontend: one kernel each.

Needs PyTorch (not a project dependency): skipped where it is not installed. (A softmax spelled
with x.amax(-1) is not here: TVM 0.27's frontend does not convert amax.)
"""

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from conftest import CUDA_TARGET

torch = pytest.importorskip("torch")
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402


class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight.to(x.dtype)


class PreNormBlock(torch.nn.Module):
    """Residual add, RMSNorm, SiLU: what sits between a transformer's matmuls."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = LlamaRMSNorm(hidden)

    def forward(self, x, residual):
        h = x + residual
        return h, torch.nn.functional.silu(self.norm(h))


class SpelledSoftmax(torch.nn.Module):
    def forward(self, x):  # x.max(-1)[0]: TVM's frontend makes a top-1 sort of it; the pipeline a max
        e = torch.exp(x - x.max(-1, keepdim=True)[0])
        return e / e.sum(-1, keepdim=True)


def imported(module, *example):
    return from_exported_program(torch.export.export(module.eval(), example), keep_params_as_input=False)


@pytest.mark.parametrize("module, inputs", [
    (LlamaRMSNorm(1024), 1), (PreNormBlock(1024), 2), (SpelledSoftmax(), 1),
    (torch.nn.Sequential(torch.nn.LayerNorm(1024), torch.nn.GELU()), 1)], ids=["rms", "prenorm", "softmax", "ln_gelu"])
def test_imported_pytorch_norms_are_one_kernel_and_right(module, inputs):
    torch.manual_seed(0)
    example = [torch.randn(64, 1024) for _ in range(inputs)]
    mod = imported(module, *example)
    kernels = tvm_ext.cuda_kernels(tvm_ext.build(mod, CUDA_TARGET))
    assert len(kernels) == 1, kernels
    vm = VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in example])
    got = [g.numpy() for g in got] if not hasattr(got, "numpy") else [got.numpy()]
    with torch.no_grad():
        want = module(*example)
    for g, w in zip(got, want if isinstance(want, tuple) else (want,), strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-5)
