"""Reductions outside the suite through the whole pipeline on the CPU, and their CUDA codegen."""

import warnings

import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from conftest import CUDA_TARGET
from barriers import divergent_barriers
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


@pytest.mark.parametrize("name", PATTERNS)
def test_no_barrier_under_a_thread_dependent_branch(name):
    # such a barrier deadlocks the block: log_softmax over 3000 columns hung the GPU this way
    src = tvm_ext.cuda_source(tvm_ext.build(module(name), CUDA_TARGET))
    assert divergent_barriers(src) == []
