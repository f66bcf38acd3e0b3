"""No vector loads of bool buffers: TVM 0.27's CUDA codegen prints a 4-lane bool load as a
`ushort4` read (8 bytes at a 1-byte-per-element address): the wrong bytes, and a misaligned-address
fault where the address is not a multiple of 8. A causal mask folded to a bool constant and fused
into our attention softmax faulted so on the H200 (LLaMA layer, seq 512). The early-phase pass
below runs such loops unrolled instead of vectorized; every other vector access stays.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27


def _reads_bool(stmt) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, (TensorLoad, lambda load: found.append(load) if str(load.source.dtype) == "bool"
                                   else None), order="pre")
    return bool(found)


def unvectorize_bool_loads(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def visit(loop):
        if loop.kind != tirx.ForKind.VECTORIZED or not _reads_bool(loop.body):
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.UNROLLED, loop.body, loop.thread_binding,
                        loop.annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, visit)))


@tvm.transform.module_pass(opt_level=0, name="TVMExtNoBoolVectors")
def no_bool_vectors(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod.update_func(gv, unvectorize_bool_loads(func))
    return mod
