"""Reduce-pattern analysis shared by every schedule template.

A fused reduce subgraph, producers inlined, is a chain of blocks over the same leading axes (the
rows): reductions over the same trailing axes, then an epilogue. Templates differ only in how they
map that chain onto threads, so the matching lives here."""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import IterInfo, SBlockInfo, normalize_prim_func
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

from .contracts import NOMINAL, PIVOT, WIDER

ROW = "row"  # the innermost reduce axis is the innermost (contiguous) axis of the input
COLUMN = "column"  # the innermost input axis is a spatial one: reduce across rows


@dataclass
class ReducePattern:
    """A PrimFunc matched as `reductions over trailing axes + epilogue`, ready to schedule."""

    sch: s_tir.Schedule
    reductions: list[SBlockInfo]  # in program order
    epilogue: SBlockInfo | None  # the last, injective block; None if the last block reduces
    row_outputs: list[SBlockInfo]  # further one-value-per-row outputs before it (mean beside variance)
    num_spatial: int  # leading spatial axes shared by all blocks
    num_reduce: int  # trailing reduce axes of every reduction
    layout: str  # ROW or COLUMN
    row_count: tirx.PrimExpr  # product of the spatial extents
    reduce_extent: tirx.PrimExpr  # product of the reduce extents
    source: tirx.PrimFunc  # the function matched
    prologue: list[SBlockInfo]  # per-row pivot blocks kept apart before the reductions (match's pivots_apart)

    def with_pivots_apart(self) -> ReducePattern:
        """This function matched again (a fresh schedule) with its pivots apart; self when it has
        none, or when that match fails."""
        if not _pivot_blocks(self.source.body):
            return self
        return match(self.source, pivots_apart=True) or self

    @property
    def blocks(self) -> list[SBlockInfo]:
        return self.reductions + self.row_outputs + ([self.epilogue] if self.epilogue else [])

    @property
    def row_reductions(self) -> list[SBlockInfo]:
        """Reductions to compute under the row loop of the last block (all but that block)."""
        return self.reductions if self.epilogue is not None else self.reductions[:-1]

    def merge_outputs(self) -> bool:
        """Put the per-row outputs under the last block's row loop (one loop nest to schedule).

        False when that block works on every element: its loops then differ from theirs.
        """
        if not self.row_outputs:
            return True
        last = self.blocks[-1].block_rv
        if len(self.sch.get_loops(last)) != self.num_spatial:
            return False
        loops = []
        for block in [info.block_rv for info in self.row_outputs] + [last]:
            nest = self.sch.get_loops(block)
            loop = nest[0] if len(nest) == 1 else self.sch.fuse(*nest)
            if not any(self.sch.get(loop).same_as(self.sch.get(seen)) for seen in loops):
                loops.append(loop)  # the outputs of one multi-output compute share their loops
        if len(loops) > 1:
            self.sch.merge(*loops)
        return True

    def input_buffers(self) -> list[tirx.Buffer]:
        """Function parameters read by the reductions: the tensors worth caching on chip."""
        params = list(self.sch.mod["main"].params)
        found = []
        for info in self.reductions:
            for region in self.sch.get(info.block_rv).reads:
                buf = region.source
                if any(buf.same_as(p) for p in params) and not any(buf.same_as(f) for f in found):
                    found.append(buf)
        return found

    @staticmethod
    def dtype_bytes(buf: tirx.Buffer) -> int:
        return tvm.DataType(str(buf.ty.dtype)).bits // 8


def const_int(expr) -> int | None:
    """The value of a static extent, None for a symbolic one."""
    if isinstance(expr, int):
        return expr
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def at_sizes(expr, dims: dict | None) -> int:
    """The value of `expr` (an extent, a condition) with each symbolic size set to `dims[its name]`
    (NOMINAL where not given): what a tuning run measures a symbolic size at."""
    if const_int(expr) is not None:
        return const_int(expr)
    fixed = tvm_ffi.structural_map(expr, (tirx.Var, lambda v: tirx.const(int((dims or {}).get(v.name, NOMINAL)), v.ty)))
    return int(tvm.sym.Analyzer().simplify(fixed))


def size_of(expr):
    """A static extent as an int, a symbolic one as the expression itself."""
    value = const_int(expr)
    return expr if value is None else value


def _product(exprs):
    return reduce(lambda a, b: a * b, exprs)


def _layout_of(sch: s_tir.Schedule, info: SBlockInfo) -> str | None:
    """ROW when the last index of the reduction's big input is the innermost reduce var."""
    block = sch.get(info.block_rv)
    reduce_vars = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    spatial_vars = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    written = [w.source for w in block.writes]
    loads = []
    tvm_ffi.structural_walk(block.body, (tvm.ir.TensorLoad, loads.append), order="pre")
    for load in loads:
        if not load.indices or any(load.source.same_as(w) for w in written):
            continue
        used = set()
        tvm_ffi.structural_walk(load.indices[-1], (tirx.Var, lambda v: used.add(v)), order="post")
        if reduce_vars and any(reduce_vars[-1].same_as(v) for v in used):
            return ROW
        if any(any(s.same_as(v) for v in used) for s in spatial_vars):
            return COLUMN
    return None


def _reduction_blocks(func: tirx.PrimFunc) -> list:
    blocks = []
    visit = lambda b: blocks.append(b) if any(iv.iter_type == tirx.IterVar.CommReduce for iv in b.iter_vars) else None
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit), order="pre")
    return blocks


def _is_contraction(block) -> bool:
    """Two different buffers both indexed by a reduce var: a matmul/GEMV, not a norm or a sum."""
    reduce_vars = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    indexed = []  # buffers, told apart by identity: two may share a name (Relax values both called `lv`)
    for region in block.reads:
        used = []
        for rng in region.region:
            tvm_ffi.structural_walk(rng.min, (tirx.Var, used.append), order="post")
        if any(any(r.same_as(u) for u in used) for r in reduce_vars) and not any(region.source.same_as(b) for b in indexed):
            indexed.append(region.source)
    return len(indexed) >= 2


def is_reduce_subgraph(func: tirx.PrimFunc) -> bool:
    """Whether `func` is this project's business: it reduces, and none of its reductions contracts."""
    blocks = _reduction_blocks(func)
    return bool(blocks) and not any(_is_contraction(b) for b in blocks)


def _widen_union_reads(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """Declare whole dimensions where inlining left a read region that is a union (min/max of
    iterators, e.g. Welford's pivot x[r, 0] beside x[r, k]): once loops are split over threads,
    TVM cannot bound such a region and a shared-memory stage of it gets a symbolic size.
    None when no region needs it."""

    def is_union(rng):
        found = []
        tvm_ffi.structural_walk(rng.min, [(tirx.Min, found.append), (tirx.Max, found.append)], order="pre")
        return bool(found)

    widened = []

    def widen(block):
        if not any(is_union(rng) for r in block.reads for rng in r.region):
            return block
        widened.append(block.name_hint)
        reads = [tvm.ir.TensorRegion(r.source, [tvm.ir.Range.from_min_extent(tirx.const(0, d.ty.dtype), d)
                                                if is_union(rng) else rng for rng, d in zip(r.region, r.source.shape)], r.ty)
                 for r in block.reads]
        return s_tir.SBlock(block.iter_vars, reads, block.writes, block.name_hint, block.body, block.init,
                            block.alloc_buffers, block.match_buffers, block.annotations)

    body = tvm_ffi.structural_map(func.body, (s_tir.SBlock, widen))
    return func.with_body(body) if widened else None


def _exact_row_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with `(x * d + y) // d` and `(x * d + y) % d` read as `x` and `y` wherever the block
    vars' ranges prove 0 <= y < d. A reshape over a symbolic dim (LayerNorm's statistics kept as
    [2, seq, 1], `(v0 * seq + v1) // seq`) leaves them, TVM's simplifier does not remove them for a
    symbolic `d`, and a block of several rows then reads per-row values TVM cannot bound."""
    if all(const_int(d) is not None for p in func.params for d in getattr(p, "shape", [])):
        return func  # static shapes: TVM simplifies these itself
    analyzer = tvm.sym.Analyzer()

    def bind(block):
        for iv in block.iter_vars:
            analyzer.bind(iv.var, iv.dom)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, bind), order="pre")

    def terms(e):
        return terms(e.a) + terms(e.b) if isinstance(e, tirx.Add) else [e]

    def split(n, d):
        """(x, y) with n = x * d + y and 0 <= y < d, or None: y the terms of n that d does not divide."""
        parts = terms(n)
        whole = [t for t in parts if const_int(analyzer.simplify(tirx.floormod(t, d))) == 0]
        rest = [t for t in parts if not any(t.same_as(w) for w in whole)]
        if not whole or not rest:
            return None
        y = reduce(lambda a, b: a + b, rest)
        if not (analyzer.can_prove(y >= 0) and analyzer.can_prove(y < d)):
            return None
        return analyzer.simplify(tirx.floordiv(reduce(lambda a, b: a + b, whole), d)), y

    def div(e):
        found = split(e.a, e.b)
        return e if found is None else found[0]

    def mod(e):
        found = split(e.a, e.b)
        return e if found is None else found[1]

    return tvm_ffi.structural_map(func, [(tirx.FloorDiv, div), (tirx.FloorMod, mod)])


def _is_pivot(block) -> bool:
    return PIVOT in (block.annotations or {})


def _pivot_blocks(body) -> list:
    """The blocks of `body` annotated as pivots (contracts.PIVOT)."""
    found = []
    tvm_ffi.structural_walk(body, (s_tir.SBlock, lambda b: found.append(b) if _is_pivot(b) else None), order="pre")
    return found


def _apart(sch: s_tir.Schedule, infos: list, pivots_apart: bool) -> tuple[list, list]:
    """(infos to inline or match, pivot infos kept apart): the pivots are split off only when asked."""
    pivots = [i for i in infos if pivots_apart and _is_pivot(sch.get(i.block_rv))]
    return [i for i in infos if not any(i is p for p in pivots)], pivots


def _share_loops(sch: s_tir.Schedule, infos: list) -> bool:
    """Put blocks that each work on every element (a residual sum written beside the normed
    value) under one loop nest, the last one's: the templates then schedule them as one epilogue."""
    try:
        nests = [sch.get_loops(info.block_rv) for info in infos]
        for depth in range(len(nests[-1])):
            sch.merge(*[nest[depth] for nest in nests])
    except (RuntimeError, ValueError):  # loops of different extents or nesting (ScheduleError): not one epilogue
        return False
    return True


def _with_row_loop(sch: s_tir.Schedule, info: SBlockInfo) -> SBlockInfo:
    """`info` of a block after the reductions of a single row, with the unit row loop that
    normalization drops from element-wise work ([1, n] becomes [n]) put back in front, so the
    block reads as element work ("SS"), not as n one-value rows."""
    if not info.iters or all(const_int(d) == 1 for d in info.dom()):
        return info  # the row's own scalar work (a mean, a norm's statistic): no axis of its own
    index_map = tirx.IndexMap.from_func(lambda *axes: (tirx.const(0, str(axes[0].ty.dtype)), *axes), ndim=len(info.iters))
    sch.transform_block_layout(info.block_rv, index_map)
    loops = sch.get_loops(info.block_rv)
    return SBlockInfo(info.name, [IterInfo("S", sch.get(loop).loop_var, sch.get(loop).extent, loop) for loop in loops],
                      info.block_rv, info.is_reduction())


def match(func: tirx.PrimFunc, pivots_apart: bool = False) -> ReducePattern | None:
    """Match `func` as a fused reduce subgraph, or return None (then another rule must serve it).

    A pivot (contracts.PIVOT: a per-row value the reduction's elements are shifted by) is inlined
    into its reduction, which then reads the row's first element beside its own; with
    `pivots_apart` it stays a block of its own (`prologue`), so the reduction reads one element
    of the row per instance, which a template can load as vectors (rows._wide_reads)."""
    sch = s_tir.Schedule(_exact_row_indices(func))
    infos = normalize_prim_func(sch)
    if not infos:
        return None
    infos, prologue = _apart(sch, infos, pivots_apart)
    infos = try_inline_contiguous_spatial(sch, infos)
    if not infos or not any(info.is_reduction() for info in infos):
        return None
    widened = _widen_union_reads(sch.mod["main"])
    if widened is not None:  # a fresh schedule of the function with its reads widened
        sch = s_tir.Schedule(widened)
        infos, prologue = _apart(sch, normalize_prim_func(sch), pivots_apart)
    kind = infos[0].dom_kind()
    num_spatial = len(kind) - len(kind.lstrip("S"))
    num_reduce = len(kind) - num_spatial
    if num_reduce == 0 or kind != "S" * num_spatial + "R" * num_reduce:
        return None
    count = max(i for i, info in enumerate(infos) if info.is_reduction()) + 1
    head, tail = infos[:count], infos[count:]
    if any(info.dom_kind() != kind for info in head):
        return None
    row_kind = "S" * num_spatial
    dom = head[0].dom()
    one_row = num_spatial == 1 and const_int(dom[0]) == 1  # a whole tensor reduced: its scalar work has no axis
    row_kinds = (row_kind, "") if one_row else (row_kind,)
    if one_row:
        tail = [_with_row_loop(sch, info) for info in tail]
    if any(not info.is_injective() or info.dom_kind() not in (*row_kinds, "S" * len(kind)) for info in tail):
        return None
    *row_outputs, epilogue = tail or [None]
    element_outputs = [info for info in row_outputs if info.dom_kind() not in row_kinds]
    if element_outputs and not _share_loops(sch, element_outputs + [epilogue]):
        return None
    row_outputs = [info for info in row_outputs if info.dom_kind() in row_kinds]
    layout = _layout_of(sch, head[0])
    if layout is None:
        return None
    return ReducePattern(
        sch=sch,
        reductions=head,
        epilogue=epilogue,
        row_outputs=row_outputs,
        num_spatial=num_spatial,
        num_reduce=num_reduce,
        layout=layout,
        row_count=_product(dom[:num_spatial]) if num_spatial else tirx.const(1, "int64"),
        reduce_extent=_product(dom[num_spatial:]),
        source=func,
        prologue=prologue,
    )


def substitute(expr, bindings: dict):
    """`expr` with the tirx.Vars of `bindings` replaced by their values."""

    def replace(var):
        for key, value in bindings.items():
            if key.same_as(var):
                return value
        return var

    return tvm_ffi.structural_map(expr, (tirx.Var, replace))


def multiply_accumulate(store) -> tuple | None:
    """(a load, b load) when `store` is `c = c + cast(a) * cast(b)` with a and b of one low-precision
    dtype and c of the wider one, else None."""
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, product = store.value.a, store.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer) and isinstance(product, tirx.Mul)):
        return None
    loads = [x.value for x in (product.a, product.b) if isinstance(x, tirx.Cast)]
    if len(loads) != 2 or not all(isinstance(x, TensorLoad) for x in loads):
        return None
    a, b = loads
    if WIDER.get(str(a.source.dtype)) != str(store.buffer.dtype) or a.source.dtype != b.source.dtype:
        return None
    return a, b
