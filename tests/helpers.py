"""Shared by the tests: suite cases at test size, running a built module, tolerances."""

import re

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import concrete_shape, load_suite, random_inputs, reference
from tvm_ext.tir.cooperative_launch import LAUNCH_PARAMS

CASES = load_suite()
NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
RTOL = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 2e-5}


def small_shape(case: dict) -> list:
    """The case's shape with row counts cut down, reduce extents (and symbolic dims) kept."""
    op, shape = case["op"], case["shape"]
    if op == "bn_stats":
        return [3, 5, shape[2], shape[3]]
    if op == "full_sum":
        return [100003]
    if op == "col_sum":
        return [301, shape[1]]
    return [d if isinstance(d, str) else min(d, 3) for d in shape[:-1]] + shape[-1:]


def run_case(executable, device, op, shape, dtype, rng):
    """Run `main` on fresh random inputs; returns (outputs as float64, float64 references)."""
    arrays = [a.astype(NP_DTYPE[dtype]) for a in random_inputs(op, shape, rng)]
    vm = VirtualMachine(executable, device)
    out = vm["main"](*[tvm.runtime.tensor(a, device) for a in arrays])
    outs = list(out) if isinstance(out, (tuple, list, tvm_ffi.Array)) else [out]
    return [o.numpy().astype("float64") for o in outs], reference(op, arrays)


def variance_module(rows, width, dtype: str = "float32") -> tvm.IRModule:
    """`relax.op.variance` over the rows of a [rows, width] input."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([rows, width], dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.variance(x, axis=[1]))
        bb.emit_func_output(out)
    return bb.get()


def assert_close(outs, refs, dtype):
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape
        scale = max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(out - ref).max()) / scale
        assert err <= RTOL[dtype], f"max error {err:.3g} (relative to max |ref|) above {RTOL[dtype]}"


def instantiate(case: dict, shape: list, row_cap: int = 5) -> list[dict]:
    """Values for the case's symbolic dims: each listed reduce extent, row counts capped."""
    combos = [{}]
    for name, values in (case.get("dynamic") or {}).items():
        if name != shape[-1]:
            values = sorted({min(v, row_cap) for v in values})
        combos = [dict(c, **{name: v}) for c in combos for v in values]
    return combos


__all__ = ["CASES", "assert_close", "concrete_shape", "instantiate", "run_case", "small_shape", "variance_module"]


def build_recording_launch(mod, target, **options):
    """(executable, CUDA source, {kernel: launch tags}) of one build: the tags as the late passes
    leave them (a recording pass registered after the built-in ones; kernels the pipeline only
    checked, under names the build does not keep, are left out)."""
    launch = {}

    @tirx.transform.prim_func_pass(opt_level=0, name="RecordLaunchParams")
    def record(func, _mod, _ctx):
        launch[str(func.attrs["global_symbol"])] = [str(t) for t in func.attrs.get(LAUNCH_PARAMS, [])]
        return func

    tvm_ext.register_tir_pass(record, phase="late")
    try:
        ex = tvm_ext.build(mod, target, **options)
    finally:
        tvm_ext.unregister_tir_pass(record)
    kernels = tvm_ext.cuda_kernels(ex)
    return ex, tvm_ext.cuda_source(ex), {name: tags for name, tags in launch.items() if name in kernels}


def kernel_bodies(src: str) -> dict:
    """{kernel name: its CUDA body} of generated source."""
    return dict(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{\n(.*?)\n\}', src, re.S))
