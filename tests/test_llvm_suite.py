"""Every suite op compiled for the LLVM CPU target, run, and compared with float64 NumPy."""

import pytest
import tvm

import tvm_ext
from bench.suite import relax_module
from helpers import CASES, assert_close, concrete_shape, instantiate, run_case, small_shape


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_suite_case_on_llvm(case, rng):
    shape = small_shape(case)
    executable = tvm_ext.build(relax_module(case["op"], shape, case["dtype"]), "llvm")
    for values in instantiate(case, shape):  # dynamic cases: one build, every listed size
        outs, refs = run_case(executable, tvm.cpu(), case["op"], concrete_shape(shape, values), case["dtype"], rng)
        assert_close(outs, refs, case["dtype"])
