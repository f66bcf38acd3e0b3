"""Bool vectors TVM 0.27's CUDA codegen misprints, rewritten before it sees them.

A vector load of bools is printed as a `ushort4` read (wrong bytes, misaligned faults), so the
early pass reads bool buffers through an int8 view; `Select(Broadcast(c), a, b)` is printed as
code nvcc rejects, so the late pass makes it `if_then_else(c, a, b)`."""

from __future__ import annotations

import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27


def _reads_bool(stmt) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, (TensorLoad, lambda load: found.append(load) if str(load.source.dtype) == "bool"
                                   else None), order="pre")
    return bool(found)


def bool_loads_as_bytes(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def rewrite(loop):
        if loop.kind != tirx.ForKind.VECTORIZED or not _reads_bool(loop.body):
            return loop
        views: dict = {}

        def as_bytes(load):
            if str(load.source.dtype) != "bool":
                return load
            if load.source not in views:
                views[load.source] = tirx.decl_buffer(load.source.shape, "int8", f"{load.source.name}_bytes",
                                                      data=load.source.data)
            return tirx.Cast("bool", tirx.BufferLoad(views[load.source], load.indices))

        body = tvm_ffi.structural_map(loop.body, (TensorLoad, as_bytes))
        vectorized = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                              loop.annotations)
        return tirx.SeqStmt([tirx.DeclBuffer(view, data=bools.data) for bools, view in views.items()] + [vectorized])

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, rewrite)))


bool_loads_as_bytes_pass = tirx.transform.prim_func_pass(lambda func, _mod, _ctx: bool_loads_as_bytes(func),
                                                         opt_level=0, name="TVMExtBoolLoadsAsBytes")


def uniform_selects_as_branches(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def rewrite(select):
        cond = select.condition
        if not isinstance(cond, tirx.Broadcast):
            return select
        return tirx.if_then_else(cond.value, select.true_value, select.false_value)

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.Select, rewrite)))


uniform_selects_as_branches_pass = tirx.transform.prim_func_pass(
    lambda func, _mod, _ctx: uniform_selects_as_branches(func), opt_level=0, name="TVMExtUniformSelectsAsBranches")
