"""Knobs in, Schedule out: pick a strategy for a fused reduce PrimFunc.

A tuning record's strategy is applied as recorded (a contraction record the target does not pick
gives way to the heuristic); else the first strategy whose proposed knobs also apply wins. None
means no strategy fits, like dlight, and the caller falls back to TVM."""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target

from . import (attention, block_row, column_reduce, column_split, conv2d, cpu_rows, decode_attention, few_row_matmul, gemv,
               grid_reduce, grid_sync, matmul, warp_row, wgmma_matmul)
from .analysis import ROW, at_sizes, const_int, match
from .contracts import WIDTH_IN_VECTORS
from .device import device_of
from .rows import REGISTERS, fits_registers, widest_lanes

# Heuristic order: the first strategy whose default_knobs accepts the pattern wins.
STRATEGIES = {s.NAME: s for s in (warp_row, grid_reduce, grid_sync, block_row, column_split, column_reduce, cpu_rows)}
CONTRACTIONS = {s.NAME: s for s in (gemv, matmul, wgmma_matmul, conv2d, attention, decode_attention)}  # GPU templates that take a whole PrimFunc


# A symbolic row width gets one kernel per width class, chosen at run time (tvm_ext.relax.variants):
# by the largest width a class serves, and, within each, widths a multiple of a 16-byte vector
# (read and written as vectors, `vec` set by the input dtype), then of an 8-byte one, before the
# rest (`vec` 1).
# No class stages its rows in shared memory: TVM sizes a symbolic stage of several rows by the whole
# tensor (the launch fails: "Failed to set the allowed dynamic shared memory size to ..."), and
# copies a stage of one row element by element, slower than re-reading the row
# (docs/design.md#row-and-column-templates). A bounded vector class keeps the rows read twice or
# more in registers (each lane's chunks of the class's widest row, every step tested against the
# width) where a lane's share of them fits (rows.fits_registers); the bounds keep that share small.
DYNAMIC_ROW_VARIANTS = [
    (1024, {"strategy": "warp_row", "group": 32, "rows_per_block": 4, "cache": False}),
    (4096, {"strategy": "block_row", "threads": 256, "cache": False}),
    (8192, {"strategy": "block_row", "threads": 256, "cache": False}),
    (16384, {"strategy": "block_row", "threads": 512, "cache": False}),
    (32768, {"strategy": "block_row", "threads": 1024, "cache": False}),
    (None, {"strategy": "block_row", "threads": 1024, "cache": False}),
]
# Widths of a warp-a-row class that no vector divides (scalar loads, the row re-read by each pass)
# over fewer rows than fill the device SCALAR_FEW_ROWS_WAVES times at these knobs' lanes: a block of
# 128 lanes a row keeps more loads in flight than a warp a row. H200 (h200-2026-11-29-scalar1024-a.md,
# -b.md, one call): softmax 1024 x 1003 f16 10.6 -> 7.7 us, 512 x 1001 f32 10.5 -> 6.8, RMSNorm 4096 x
# 1001 f16 14.7 -> 12.3; over 16384 rows of 1003 the warp a row stays (35.3 us against 44.1).
SCALAR_FEW_ROWS_KNOBS = {"strategy": "block_row", "threads": 128, "cache": False}
SCALAR_FEW_ROWS_WAVES = 4


def width_classes(pattern, device) -> list[tuple]:
    """[(condition over the symbolic width (and row count), knobs)] of DYNAMIC_ROW_VARIANTS, each
    class split by the widest vector that divides the width; the last condition None."""
    extent, lanes = pattern.reduce_extent, widest_lanes(pattern)
    classes = []
    for bound, knobs in DYNAMIC_ROW_VARIANTS:
        within = None if bound is None else extent <= bound
        row_lanes = knobs.get("group") or knobs["threads"]
        cache = REGISTERS if bound and fits_registers(pattern, row_lanes, bound) else knobs["cache"]
        for vec in [v for v in (lanes, lanes // 2) if v > 1]:  # 16 bytes, then 8
            aligned = tirx.EQ(tirx.floormod(extent, vec), tirx.const(0, str(extent.ty)))
            classes.append((aligned if within is None else tirx.And(within, aligned),
                            dict(knobs, vec=vec, max_extent=bound, cache=cache)))
        classes += _scalar_classes(pattern, device, within, dict(knobs, vec=1, max_extent=bound))
    return [(condition, knobs) for i, (condition, knobs) in enumerate(classes)
            if not _served_by_next(knobs, [later for _, later in classes[i + 1:]])]


def _scalar_classes(pattern, device, within, knobs: dict) -> list[tuple]:
    """The kernels of a class's widths no vector divides: a warp a row's class gives rows too few to
    fill the device SCALAR_FEW_ROWS_WAVES times to SCALAR_FEW_ROWS_KNOBS (at build time for a static
    row count, by a condition on a symbolic one)."""
    if knobs["strategy"] != warp_row.NAME:
        return [(within, knobs)]
    few = dict(SCALAR_FEW_ROWS_KNOBS, vec=1, max_extent=knobs["max_extent"])
    limit = SCALAR_FEW_ROWS_WAVES * device.sm_count * device.threads_per_sm // few["threads"]
    rows = pattern.row_count
    if const_int(rows) is not None:
        return [(within, few if const_int(rows) < limit else knobs)]
    fewer = tirx.LT(rows, tirx.const(limit, str(rows.ty)))
    return [(fewer if within is None else tirx.And(within, fewer), few), (within, knobs)]


def _served_by_next(knobs: dict, later: list) -> bool:
    """Whether a width class that re-reads its rows builds the kernel of the next class of its
    vector width (their knobs but the bound agree: 4096 and 8192 columns over 256 threads), so
    that the next one serves both."""
    following = next((k for k in later if k["vec"] == knobs["vec"]), None)
    unbounded = lambda k: {key: value for key, value in k.items() if key != "max_extent"}  # noqa: E731
    return knobs["cache"] != REGISTERS and following is not None and unbounded(following) == unbounded(knobs)


def few_rows_class(func: tirx.PrimFunc, pattern, device, knobs: dict) -> tuple | None:
    """(condition, knobs, Schedule) of a kernel for fewer rows than SMs, where the row count is
    symbolic and block_row, picked for many rows with `knobs`, takes such rows otherwise: a decoding
    step's norm (one row, a few sequences) is bound by each block's latency, not by bandwidth;
    None where the same kernel serves both."""
    if knobs["strategy"] != block_row.NAME:
        return None
    few = block_row.default_knobs(pattern, device, few_rows=True)
    sch = None if few == knobs else block_row.apply(match(func), device, few)
    return None if sch is None else (pattern.row_count < device.sm_count, few, sch)


def in_vectors(func: tirx.PrimFunc, width, lanes: int, bound: int | None = None) -> tirx.PrimFunc | None:
    """`func` with its symbolic row width `width` spelled `width_vectors * lanes`, `width_vectors`
    a new scalar parameter before the outputs (attr WIDTH_IN_VECTORS: the call site passes
    width // lanes after its inputs); None when the width is not a dim of a parameter.

    For a width class whose widths `lanes` divides: TVM then knows every row starts on a whole
    vector, so loads over the row vectorize (a load it cannot prove aligned becomes a gather of
    single elements) and the row splits into whole vectors without a test. `bound`: the widest
    row of the class, spelled in (`min(width_vectors, bound // lanes) * lanes`, equal for every
    width the class serves) so that TVM can bound a lane's steps over the row by it."""
    if not isinstance(width, tirx.Var) or not any(d.same_as(width) for p in func.params for d in getattr(p, "shape", [])):
        return None
    vectors = tirx.Var(f"{width.name}_vectors", width.ty)
    count = vectors if bound is None else tirx.min(vectors, tirx.const(bound // lanes, width.ty))
    # every use, in buffer shapes and the body, rebuilt as it is: PrimFunc.specialize would fold
    # `x * 1.0` and Welford's update would no longer match its registered combiner
    spelled = tvm_ffi.structural_map(func, (tirx.Var, lambda v: count * lanes if v.same_as(width) else v))
    written = []
    tvm_ffi.structural_walk(spelled.body, (s_tir.SBlock, lambda b: written.extend(w.source for w in b.writes)), order="pre")
    params = list(spelled.params)
    first_output = next(i for i, p in enumerate(params) if any(p.same_as(w) for w in written))
    params.insert(first_output, vectors)  # call_tir passes the inputs, then the scalars, then the outputs
    return tirx.PrimFunc(params, spelled.body, spelled.ret_type, spelled.attrs).with_attr(WIDTH_IN_VECTORS, [width.name, lanes])


def plan(func: tirx.PrimFunc, target: Target) -> list[tuple]:
    """The kernels to build for `func`: [(condition over its symbolic dims, knobs), ...].

    The last entry's condition is None (it serves whatever the others do not); [] when no
    strategy fits.
    """
    return [(condition, knobs) for condition, knobs, _ in _plan(func, target, build=False)]


def scheduled(func: tirx.PrimFunc, target: Target, knobs: dict | None = None) -> list[tuple]:
    """plan(func, target) with each kernel's Schedule: [(condition, knobs, Schedule | None), ...].
    `knobs` (a tuning record's, for a `tunable` function) replace the heuristic's kernel; a class
    of fewer rows than SMs stays beside it (the record was measured at one row count)."""
    return _plan(func, target, build=True, knobs=knobs)


def tunable(func: tirx.PrimFunc, target: Target) -> bool:
    """Whether one tuning record can stand for `func`'s kernels: not for a row of symbolic width on a
    GPU, whose width classes are chosen per call by the width (a point measured at one width would
    replace every class, their vectors and registers with it)."""
    pattern = match(func)
    return pattern is None or not _width_classed(pattern, device_of(target))


def _width_classed(pattern, device) -> bool:
    """Whether the pattern's kernels are width classes: GPU rows of a symbolic width."""
    return device.is_gpu and pattern.layout == ROW and const_int(pattern.reduce_extent) is None


def _plan(func, target, build: bool, knobs: dict | None = None) -> list[tuple]:
    """Heuristic proposals are applied once to learn that their strategy accepts them: that
    Schedule is handed on, not rebuilt. Width classes are scheduled only when `build`."""
    pattern, device = match(func), device_of(target)
    if pattern is None:
        return []
    if _width_classed(pattern, device):
        extent = pattern.reduce_extent
        return [(condition, class_knobs, _width_class_schedule(func, target, extent, class_knobs) if build else None)
                for condition, class_knobs in width_classes(pattern, device)]
    found = (knobs, schedule(func, target, knobs)) if knobs else _first_applicable(func, pattern, device)
    if not found:
        return []
    few = few_rows_class(func, pattern, device, found[0]) if const_int(pattern.row_count) is None else None
    return ([few] if few else []) + [(None, *found)]


def _width_class_schedule(func, target, width, knobs) -> s_tir.Schedule | None:
    """A width class's kernel: over whole vectors where the class's vector divides every width it
    serves (in_vectors), else over `func` as it is; rows in registers over the width spelled with
    the class's bound."""
    bound = knobs["max_extent"] if knobs.get("cache") == REGISTERS else None
    spelled = in_vectors(func, width, knobs["vec"], bound) if knobs["vec"] > 1 else None
    return schedule(spelled or func, target, knobs)


def _proposals(pattern, device):
    """Each strategy's heuristic knobs for the pattern, in heuristic order."""
    for strategy in STRATEGIES.values():
        knobs = strategy.default_knobs(pattern, device)
        if knobs is not None:
            yield knobs


def _first_applicable(func, pattern, device) -> tuple | None:
    """(knobs, Schedule) of the first proposal whose strategy also applies (a proposal may still
    be refused by apply)."""
    for knobs in _proposals(pattern, device):
        sch = STRATEGIES[knobs["strategy"]].apply(match(func), device, knobs)  # on a fresh schedule
        if sch is not None:
            return knobs, sch
    return None


def contraction_template(func: tirx.PrimFunc, target: Target | None = None):
    """The GPU template (module of CONTRACTIONS) that takes `func` whole: the GEMV template for one
    row against a weight as stored; for a tensor-core matmul the wgmma template where `target` has
    wgmma (sm_90a) and it fits, else the thread-level matmul template; the conv2d template for a
    direct convolution (with the elementwise work after either); the attention templates for a fused
    attention kernel and a decoding step's partial kernel (written before dispatch, their knobs a
    tuning task's); None for anything else. The one place that tells them apart."""
    for written in (attention, decode_attention):  # kernels written before dispatch, made again at a logged point
        if written.recipe(func) is not None:
            return written if written.knob_space(func) else None
    if gemv.fits(func):
        return gemv
    if target is not None and device_of(target).wgmma and wgmma_matmul.knob_space(func):
        return wgmma_matmul  # also a gated epilogue (half of C's columns): of the tiled templates, only this one writes it
    if matmul.tensor_core_matmul(func) is not None:
        return matmul
    return conv2d if conv2d.convolution(func) is not None else None


# A matmul with a symbolic row count (a sequence length) gets one kernel per class of row counts,
# chosen at run time: (the class's largest row count, the row count its tiles are planned for); the
# last class takes the rest. Classes whose plans agree share a kernel. A single row, a GEMV, is the
# pipeline's (the GEMV template on the function specialised to one row); up to 16 and up to 32 rows
# (few_row_matmul.ROW_CLASSES), the few-row template's where it fits (sm_80 and later), else these
# classes' tiles.
MATMUL_ROW_CLASSES = [(16, 16), (64, 64), (256, 256), (512, 512), (1024, 1024), (2048, 2048), (None, 8192)]


def contraction_kernels(func: tirx.PrimFunc, target: Target, logged=()) -> list[tuple]:
    """The kernels for a contraction `func` (GPU): [(condition over its symbolic dims, knobs,
    Schedule)], the last condition None; one for static sizes, one per row class
    (MATMUL_ROW_CLASSES, few_row_matmul for the fewest) for a symbolic row count; [] when no
    template of ours takes it. `logged`: tuning records' [(dims, knobs)], fastest first, each
    measured at the row count `dims` gives: the first for a class replaces the heuristic's kernel
    of that class where it is of the same template (one row count's point says nothing of the
    others' tiles)."""
    template, device = contraction_template(func, target), device_of(target)
    rows = class_rows(func, target)
    if rows is None:
        found = _heuristic(func, target)
        return [(None, *found)] if found else []
    kernels = []
    for bound in few_row_matmul.ROW_CLASSES if device.compute >= few_row_matmul.MIN_SM else ():
        found = few_row_matmul.heuristic(func, device.sm_count, rows=bound)
        if found:
            kernels.append((rows <= bound, *found))
    for bound, planned in MATMUL_ROW_CLASSES:
        if kernels and bound is not None and bound <= few_row_matmul.MAX_ROWS:
            continue
        found = template.heuristic(func, device.sm_count, rows=planned)
        if found is None:
            return []
        if kernels and kernels[-1][1] == found[0]:
            kernels.pop()
        kernels.append((None if bound is None else rows <= bound, *found))
    replaced = set()
    for dims, knobs in logged:
        at = row_class_at(kernels, dims)
        if at not in replaced and kernels[at][1]["strategy"] == knobs["strategy"]:
            replaced.add(at)
            if knobs != kernels[at][1]:
                kernels[at] = (kernels[at][0], knobs, template.apply(func, knobs))
    return kernels


def class_rows(func: tirx.PrimFunc, target: Target):
    """The symbolic row count over whose classes `func`'s kernels are chosen (a tensor-core matmul
    on a GPU with a symbolic row count, MATMUL_ROW_CLASSES), else None."""
    template = contraction_template(func, target) if device_of(target).is_gpu else None
    return symbolic_rows(func) if template in (matmul, wgmma_matmul) else None


def row_class_at(kernels: list, dims: dict) -> int:
    """Index of the kernel of `kernels` (contraction_kernels') that serves the symbolic sizes
    `dims` (by name, NOMINAL where not given): the first whose condition holds there."""
    return next(i for i, (condition, *_) in enumerate(kernels) if condition is None or at_sizes(condition, dims))


def symbolic_rows(func: tirx.PrimFunc):
    """The symbolic row count of a matmul whose other sizes are static (a tirx.Var or expression), else
    None; its epilogue may be of any shape (a gated one is half C's width)."""
    found = matmul.contraction(func, over_c=False)
    if found is None:
        return None
    extents = [iv.dom.extent for iv in found[0].get(found[1]).iter_vars]
    return extents[-3] if matmul.static_but_rows(extents) and const_int(extents[-3]) is None else None


def _heuristic(func: tirx.PrimFunc, target: Target) -> tuple | None:
    """(knobs, Schedule) the heuristic picks for `func`: on a GPU, the contraction template's (see
    contraction_template); else the first reduce strategy that fits; None when none does."""
    device = device_of(target)
    template = contraction_template(func, target) if device.is_gpu else None
    if template is conv2d:
        return conv2d.heuristic(func)
    if template is not None:
        return template.heuristic(func, device.sm_count)
    pattern = match(func)
    return None if pattern is None else _first_applicable(func, pattern, device)


def heuristic_knobs(func: tirx.PrimFunc, target: Target, dims: dict | None = None) -> dict | None:
    """The knobs the heuristic picks for `func` (a fused reduction, or on a GPU a tensor-core
    matmul or a convolution), or None if no strategy fits it. A matmul over a symbolic row count:
    those of its row class at `dims` (symbolic sizes by name, NOMINAL where not given)."""
    if class_rows(func, target) is not None:
        kernels = contraction_kernels(func, target)
        return kernels[row_class_at(kernels, dims or {})][1] if kernels else None
    found = _heuristic(func, target)
    return found[0] if found else None


def knobs_problem(func: tirx.PrimFunc, target: Target, knobs: dict) -> str | None:
    """Why a tuning record's `knobs` cannot schedule `func` on `target`, or None when they are a
    point of their strategy's space there (the points the tuner measures)."""
    name, device = knobs.get("strategy"), device_of(target)
    if name in CONTRACTIONS:
        template = contraction_template(func, target) if device.is_gpu else None
        if CONTRACTIONS[name] is not template:
            return f"are for the {name} template, which this target does not use for this function"
        points = template.knob_space(func)
    elif name in STRATEGIES:
        pattern = match(func)
        points = [] if pattern is None else STRATEGIES[name].knob_space(pattern, device)
    else:
        return f"name no strategy of tvm_ext (known: {', '.join([*STRATEGIES, *CONTRACTIONS])})"
    return None if knobs in points else f"are not a point of the {name} strategy's space for this function on this target"


def schedule(func: tirx.PrimFunc, target: Target, knobs: dict | None = None) -> s_tir.Schedule | None:
    """Schedule `func` with `knobs` (or the heuristic's); None when no strategy of ours fits."""
    if knobs and knobs.get("strategy") in CONTRACTIONS and CONTRACTIONS[knobs["strategy"]] is not contraction_template(func, target):
        knobs = None  # a thread-level matmul record (tuned on sm_90) where sm_90a takes the wgmma template
    if not knobs:
        found = _heuristic(func, target)
        return found[1] if found else None
    if knobs.get("strategy") in CONTRACTIONS:
        return CONTRACTIONS[knobs["strategy"]].apply(func, knobs)
    pattern, strategy = match(func), STRATEGIES.get(knobs.get("strategy"))
    return None if pattern is None or strategy is None else strategy.apply(pattern, device_of(target), knobs)
