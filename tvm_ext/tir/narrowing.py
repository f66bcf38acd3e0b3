"""int64 -> int32 index narrowing, with int32 and int64 versions where the shapes are symbolic.

Per kernel our templates scheduled, from its buffers' element counts and thread count: all below
2^31 marks it NARROW (rewritten by tir/narrow_index.py after cross-thread lowering); a bound at or
above 2^31 keeps int64; symbolic bounds build both and pick per call (relax/variants.py). See
docs/design.md#index-narrowing-and-dynamic-shapes."""

from __future__ import annotations

from functools import reduce

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_ext.schedules.contracts import ZEROED_INPUTS

from ..relax.variants import rewrite_call_sites

LIMIT = 2**31  # int32 indices hold element counts below this
SUFFIX = "_i32"
NARROW = "tvm_ext.narrow_index"  # PrimFunc attr: rewrite this kernel's indices to int32
OURS = "tvm_ext.scheduled"  # PrimFunc attr the pipeline sets on kernels a tvm_ext template scheduled


def _product(dims):
    return reduce(lambda a, b: a * b, [tirx.Cast("int64", d) if d.ty.dtype != "int64" else d for d in dims],
                  tirx.const(1, "int64"))


def index_bounds(func: tirx.PrimFunc) -> list:
    """Expressions every index of `func` stays below: each buffer's element count (parameters and
    allocations), the product of its thread-binding extents (the launched threads), and each integer
    scalar it takes (a size no buffer bounds, such as the first position of a rotary angle's range)."""
    scalars = [_product([p]) for p in func.params if isinstance(getattr(p, "ty", None), tvm.ir.PrimType)
               and str(p.ty.dtype).startswith("int")]
    buffers = list(func.params)
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, lambda b: buffers.extend(b.alloc_buffers)), order="pre")
    bounds = [_product(buf.shape) for buf in buffers if getattr(buf, "shape", None) is not None]
    threads = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda loop: threads.append(loop.extent)
                                        if loop.thread_binding is not None else None), order="pre")
    return bounds + ([_product(threads)] if threads else []) + scalars


def narrow_condition(func: tirx.PrimFunc):
    """True/False when int32 indices are safe/unsafe for every shape, else the run-time condition."""
    analyzer = tvm.sym.Analyzer()
    checks = [analyzer.simplify(bound < tirx.const(LIMIT, "int64")) for bound in index_bounds(func)]
    if any(isinstance(c, tirx.IntImm) and not c.value for c in checks):
        return False
    symbolic = [c for c in checks if not isinstance(c, tirx.IntImm)]
    return reduce(tirx.And, symbolic) if symbolic else True


@tvm.transform.module_pass(opt_level=0, name="TVMExtNarrowIndices")
def narrow_indices(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark every kernel that is safe to narrow; give the symbolic ones a marked twin."""
    table, builder = {}, relax.BlockBuilder(mod)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or not _narrowable(func):
            continue
        condition = narrow_condition(func)
        if condition is True:
            builder.update_func(gv, func.with_attr(NARROW, True))
        elif condition is not False and ZEROED_INPUTS not in func.attrs:  # state inputs: static only
            twin = builder.add_func(func.with_attr(NARROW, True), gv.name_hint + SUFFIX)
            table[gv.name_hint] = [(condition, twin), (None, gv)]
    return rewrite_call_sites(builder.get(), table)


def _narrowable(func: tirx.PrimFunc) -> bool:
    """Only our own kernels: TVM's rewrite breaks dlight's tensor-core matmuls (int64 vs int32 in their
    WMMA fragment offsets: a fp16 LLaMA layer failed to build). And TVM's rewrite narrows integer data
    too: a kernel with int64 tensors (argmax's indices) keeps int64; integer scalars (sizes) narrow."""
    return func.attrs.get(OURS, False) and not any(str(p.ty.dtype).startswith(("int", "uint"))
                                                    for p in func.params
                                                    if hasattr(p, "ty") and not isinstance(p.ty, tvm.ir.PrimType))
