"""Split-K for matmuls with few rows: a legalization of relax.matmul for GPU targets.

A 16 x 4096 x 4096 fp16 matmul tiled 16 x 128 has 32 output tiles for 132 SMs: a quarter of the GPU
reads the whole weight (the case is memory-bound). Cut K into S parts instead: S partial products
`parts[s, i, j] = sum over k of a[i, s*K/S + k] * b[s*K/S + k, j]` (a batched matmul for the
matmul template, batch axis on blockIdx.z, the operands read in place), then their sum over s (one
of our column reductions, the cast back to fp16 fused into it). Only float32/int32-accumulating
fp16/int8 matmuls of static 2-D operands with M <= MAX_ROWS are split, into S parts that keep
K / S a multiple of MIN_K_PER_SPLIT; every other matmul keeps TVM's legalization.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi

MAX_ROWS = 64  # more rows already give most SMs an output tile
MIN_K_PER_SPLIT = 512  # each part still streams a long run of K through the pipelined copies
MAX_SPLITS = 8


def splits(m: int, k: int) -> int:
    """Parts to cut K into for an M-row matmul (1: leave it whole)."""
    s = MAX_SPLITS
    while s > 1 and (k % s or (k // s) % MIN_K_PER_SPLIT):
        s //= 2
    return s if m <= MAX_ROWS else 1


def _static(expr) -> list | None:
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) and expr.ty.shape is not None else None
    if shape is None or any(not isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return None
    return [int(d) for d in shape.values]


def legalize_matmul_split_k(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a, b = call.args
    sa, sb, out = _static(a), _static(b), str(call.attrs.out_dtype)
    s = splits(*sa) if sa and sb and len(sa) == 2 and len(sb) == 2 else 1
    if s == 1 or out not in ("float32", "int32") or str(a.ty.dtype) not in ("float16", "int8"):
        return tvm.ir.Op.get("relax.matmul").get_attr("FLegalize")(bb, call)
    (m, k), n, part = sa, sb[1], sa[1] // s

    def partial_products(a, b):
        r = te.reduce_axis((0, part), name="k")
        return te.compute((s, m, n), lambda p, i, j: te.sum(
            a[i, p * part + r].astype(out) * b[p * part + r, j].astype(out), axis=r), name="matmul")

    parts = bb.emit_te(partial_products, a, b, primfunc_name_hint="matmul_split_k")
    return bb.call_te(lambda x: topi.sum(x, axis=0), parts, primfunc_name_hint="split_k_sum")
