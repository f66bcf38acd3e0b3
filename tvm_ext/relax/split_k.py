"""Split-K for matmuls with few rows (MAX_ROWS): a GPU legalization of relax.matmul.

With few rows the template's smallest tile leaves most SMs idle, so K is cut into S parts: a
batched matmul of partial products (parts on blockIdx.z, operands read in place) and a column
reduction `sum(parts, axis=0)` carrying the epilogue. Fewer rows than one tile (2 to 15: a small
batch's decoding step) are padded to it with zero rows. Other matmuls keep TVM's legalization.
See docs/design.md#split-k."""

from __future__ import annotations

import tvm
from tvm import relax, te, topi

from tvm_ext.schedules import matmul
from tvm_ext.schedules.contracts import TENSOR_CORE_DTYPES, WIDER

from .bindings import shape_of
from .reduce_fusion import OPAQUE

SMALLEST_TILE = (16, 64)  # rows x columns of the matmul template's one-warp tile
K_TILE = 64  # k per step of the few-row tilings: a part must hold whole steps
# blocks per SM the split aims for: 4 and 8 parts run their partial products equally fast at
# 16 x 4096 x 4096 (docs/design.md#split-k), and fewer parts leave fewer partial sums to add
WAVES = 1.5
MIN_K_PER_PART = 512
MAX_ROWS = 64  # a decoding step's or a small batch's rows
MAX_PARTS = 16


def parts(m: int, n: int, k: int, sm_count: int) -> int:
    """How many parts to cut K into (1: leave the matmul whole)."""
    if m > MAX_ROWS or m % SMALLEST_TILE[0] or n % SMALLEST_TILE[1]:
        return 1  # more rows take larger tiles; the template pads no split K's parts
    tiles = m // SMALLEST_TILE[0] * (n // SMALLEST_TILE[1])
    s = 1
    while s < MAX_PARTS and tiles * s < WAVES * sm_count and k % (2 * s) == 0 and k // (2 * s) >= MIN_K_PER_PART \
            and (k // (2 * s)) % K_TILE == 0:
        s *= 2
    return s


def partial_products(a: te.Tensor, b: te.Tensor, count: int, out_dtype: str) -> te.Tensor:
    """parts[p, i, j] = sum over the p-th K/count of k of a[i, k] * b[k, j], in `out_dtype`."""
    part = a.shape[1] // count
    k = te.reduce_axis((0, part), name="k")
    return te.compute((count, a.shape[0], b.shape[1]), lambda p, i, j: te.sum(
        a[i, p * part + k].astype(out_dtype) * b[p * part + k, j].astype(out_dtype), axis=k), name="matmul")


def _opaque(bb: relax.BlockBuilder, var: relax.Var) -> relax.Var:
    """`var`, computed by a PrimFunc that FuseOps leaves alone: fused into the matmul after it, a pad
    would make a function the matmul template does not take."""
    gv = bb.lookup_binding(var).args[0]
    bb.update_func(gv, bb.get()[gv].with_attr("op_pattern", OPAQUE))
    return var


def legalization(sm_count: int):
    """relax.matmul's legalization for a GPU of `sm_count` SMs: split K where it has few rows."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        a, b = call.args
        sa, sb, out = shape_of(a), shape_of(b), str(call.attrs.out_dtype)
        count, rows = 1, None
        if len(sa or []) == len(sb or []) == 2 and all(isinstance(d, int) for d in sa + sb) \
                and str(a.ty.dtype) in TENSOR_CORE_DTYPES and WIDER[str(a.ty.dtype)] == out \
                and b.ty.dtype == a.ty.dtype:
            rows = max(sa[0], SMALLEST_TILE[0])  # fewer rows than one tile padded to it (more: the template pads them)
            count = parts(rows, sb[1], sa[1], sm_count)
        if count > 1:  # only what the matmul template then takes (else TVM's default schedules it)
            ops = [te.placeholder(shape, str(x.ty.dtype)) for shape, x in (([rows, sa[1]], a), (sb, b))]
            if matmul.heuristic(te.create_prim_func([*ops, partial_products(*ops, count, out)]), sm_count) is None:
                count = 1
        if count == 1:
            return tvm.ir.Op.get("relax.matmul").get_attr("FLegalize")(bb, call)
        if rows != sa[0]:  # zero rows below A's (a copy of A, a few KB): the template pads no split K's parts
            a = _opaque(bb, bb.emit(bb.call_te(topi.nn.pad, a, [0, 0], [rows - sa[0], 0], primfunc_name_hint="split_k_pad"),
                                    name_hint="split_k_rows"))
        products = bb.emit_te(partial_products, a, b, count, out, primfunc_name_hint="matmul_split_k")

        def total(partial: te.Tensor) -> te.Tensor:  # the padded rows dropped
            summed = topi.sum(partial, axis=0)
            return summed if rows == sa[0] else topi.strided_slice(summed, [0, 0], [sa[0], sb[1]])

        return bb.call_te(total, products, primfunc_name_hint="split_k_sum")

    return legalize
