"""Reductions outside the suite through the whole pipeline on the CPU, and their CUDA codegen."""

import warnings

import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from conftest import CUDA_TARGET
from patterns import PATTERNS, check, module


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern_on_llvm(name, rng):
    check(name, VirtualMachine(tvm_ext.build(module(name), "llvm"), tvm.cpu()), tvm.cpu(), rng)


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern_gets_our_cuda_schedule(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to TVM's rules
        ex = tvm_ext.build(module(name), CUDA_TARGET)
    assert tvm_ext.cuda_kernels(ex)
