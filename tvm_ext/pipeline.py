"""The `tvm_ext` Relax pipeline: legalize, fuse, schedule fused reductions with our templates.

The order of the passes, and why each sits where it does, is in docs/design.md (top); our TIR
passes run later, inside `tvm.compile`, under the TIR pipeline of the same name (`tvm_ext.tir`)."""

from __future__ import annotations

import os
import warnings

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from tvm_ext import schedules
from tvm_ext.schedules import attention, decode_attention, gemv
from tvm_ext.schedules.analysis import is_reduce_subgraph
from tvm_ext.schedules.device import device_of
from tvm_ext.schedules.elementwise import Elementwise
from tvm_ext.schedules.contracts import ZEROED_INPUTS

from . import fallback
from .relax import welford
from .relax.attention import fuse_attention
from .relax.gated_linears import fuse_gated_epilogues
from .relax.half_math import half_math_in_float
from .relax.legalize import legalizations
from .tir.narrowing import OURS, narrow_indices
from .tir.symbolic_wraps import drop_symbolic_wraps
from .tir import BUILT_BY_US, check_builds
from .relax.parallel_matmuls import combine_parallel_linears
from .records import Database
from .relax.reduce_fusion import FuseReduceGroups, max_from_top_one, reductions_apart
from .relax.split_k import legalization as split_k_legalization
from .target import without_arch_specific
from .relax.layout_rewrites import activation_before_reshape, read_transposed_operand
from .relax.variants import rewrite_call_sites

PIPELINE = "tvm_ext"
SCHEDULED = "tirx.is_scheduled"
OPTIONS = ("variance", "narrow_index")  # build options this pipeline understands
# variance="tuned": each fused function's statistics by whichever of these algorithms its tuning
# records found faster (Welford where they do not say); the one-pass algorithm cancels, so never it
TUNED = "tuned"
TUNED_AMONG = ("welford", "two_pass")


@tvm.transform.module_pass(opt_level=0, name="TVMExtScheduleReductions")
class ScheduleReductions:
    """Schedule each fused PrimFunc that reduces (matmuls aside) with this project's templates.

    Knobs come from the tuning log when it has a record for the function, else from the
    heuristic. A function no template fits, or whose schedule raises anywhere up to code generation,
    is left for TVM's rules, with a one-line warning.
    """

    def __init__(self, database: Database | None = None):
        self.database = database

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current()
        if self.database:
            self.database.warn_if_foreign(target)
        dispatch, builder = {}, relax.BlockBuilder(mod)
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, tirx.PrimFunc) or func.attrs.get(SCHEDULED, False) or not is_reduce_subgraph(func):
                continue
            knobs = self.database.lookup(func, target) if self.database and schedules.tunable(func, target) else None
            try:
                kernels = [(cond, sch) for cond, _, sch in schedules.scheduled(func, target, knobs)]
                for _, sch in kernels if "gpu" in target.keys else []:  # CPU schedules are plain loops
                    if sch is not None:
                        check_builds(sch.mod["main"], gv.name_hint, target)
            except Exception as err:  # noqa: BLE001 (a template bug must cost speed, never the build)
                fallback.warn_build_failed(gv.name_hint, err, "tvm_ext reduction templates")
                continue
            if not kernels or any(sch is None for _, sch in kernels):
                warnings.warn(f"tvm_ext: {gv.name_hint}: no tvm_ext schedule matches it; falling back to TVM's default "
                              "schedule", stacklevel=2)
                continue
            _install(builder, gv, [(cond, sch.mod["main"].with_attrs({SCHEDULED: True, OURS: True})) for cond, sch in kernels],
                     dispatch)
        return _dispatched(builder, dispatch)


def _install(builder: relax.BlockBuilder, gv: tvm.ir.GlobalVar, kernels: list, dispatch: dict) -> None:
    """Put the scheduled `kernels` ([(condition, PrimFunc)]) of function `gv` in the module: one
    kernel of the same signature in its place, else (several kernels, one per class of sizes, or a
    new signature) new functions, recorded in `dispatch` for their call sites."""
    if len(kernels) == 1 and ZEROED_INPUTS not in (kernels[0][1].attrs or {}):
        builder.update_func(gv, kernels[0][1])
    else:
        dispatch[gv] = [(cond, builder.add_func(f, f"{gv.name_hint}_v{i}")) for i, (cond, f) in enumerate(kernels)]


def _dispatched(builder: relax.BlockBuilder, dispatch: dict) -> tvm.IRModule:
    """The module with the call sites of each function in `dispatch` choosing among its kernels, and
    the function itself gone."""
    mod = rewrite_call_sites(builder.get(), {gv.name_hint: kernels for gv, kernels in dispatch.items()})
    for gv in dispatch:
        del mod[gv]
    return mod


@tvm.transform.module_pass(opt_level=0, name="TVMExtScheduleContractions")
class ScheduleContractions:
    """Schedule fp16/bf16/int8 matmuls and direct convolutions, with the elementwise work FuseOps put
    after them, with our GPU templates (knobs from the tuning log, else the template's heuristic);
    the auto-tensorization TIR pass makes tensor-core code of the matmuls at build time. A symbolic
    row count gets a kernel per class of row counts, chosen at run time (one row: a GEMV).
    The rest (other symbolic sizes, rows not a whole number of 16-byte vectors), and a function
    whose schedule raises anywhere up to code generation (one warning), stays for TVM's dlight rules."""

    def __init__(self, database: Database | None = None):
        self.database = database

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current()
        dispatch, builder = {}, relax.BlockBuilder(mod)
        for gv, func in list(mod.functions_items()):
            written = next((t for t in (attention, decode_attention)  # its recipe decoded in the guard
                            if isinstance(func, tirx.PrimFunc) and t.RECIPE in (func.attrs or {})), None)
            if not isinstance(func, tirx.PrimFunc) or func.attrs.get(SCHEDULED, False) and not (written and self.database):
                continue  # a kernel written before dispatch (attention) is remade only at a logged point
            try:
                if schedules.contraction_template(func, target) is None:
                    continue
                classed = schedules.class_rows(func, target) is not None  # its records stand for their row class
                knobs = self.database.lookup(func, target) if self.database and not classed else None
                if written and knobs in (None, written.DEFAULT_KNOBS):
                    continue  # written at these knobs
                logged = self.database.lookup_classes(func, target) if self.database and classed else ()
                kernels = [(None, schedules.schedule(func, target, knobs))] if knobs else \
                    [(cond, sch) for cond, _, sch in schedules.contraction_kernels(func, target, logged)]
                rows = schedules.symbolic_rows(func)
                one_row = _single_row_kernel(func, rows, target) if rows is not None else None
                for sch in [sch for _, sch in kernels] + [one_row]:
                    if sch is not None:
                        check_builds(sch.mod["main"], gv.name_hint, target)
            except Exception as err:  # noqa: BLE001 (a template bug must cost speed, never the build)
                fallback.warn_build_failed(gv.name_hint, err, "tvm_ext contraction templates")
                continue
            if kernels and all(sch is not None for _, sch in kernels):
                # a symbolic row count: int32 twins where the sizes allow (tvm_ext/tir/narrowing.py)
                narrowed = rows is not None or bool(func.attrs.get(OURS, False))  # decoding attention's, as written
                scheduled = [(cond, sch.mod["main"].with_attrs({SCHEDULED: True, OURS: narrowed})) for cond, sch in kernels]
                _install(builder, gv, ([(rows == 1, one_row.mod["main"].with_attr(SCHEDULED, True))] if one_row else [])
                         + scheduled, dispatch)
        return _dispatched(builder, dispatch)


def _single_row_kernel(func: tirx.PrimFunc, rows, target: Target) -> s_tir.Schedule | None:
    """The GEMV of a matmul with a symbolic row count `rows` at one row (specialised to 1): our GEMV
    template's, else dlight's rule (judged on the portable architecture, as in dlight_defaults);
    None where both refuse it. One row is memory-bound, and a tile of rows would read the weight
    below bandwidth."""
    if not isinstance(rows, tirx.Var):
        return None
    param = next((p for p in func.params if any(d.same_as(rows) for d in getattr(p, "shape", []))), None)
    if param is None:
        return None
    one = tirx.decl_buffer([tirx.IntImm(str(rows.ty), 1) if d.same_as(rows) else d for d in param.shape], param.dtype,
                           name=param.name)
    single = func.specialize({param: one})
    found = gemv.heuristic(single, device_of(target).sm_count)
    if found is not None:
        return found[1]
    with without_arch_specific(target) if target.kind.name == "cuda" else target:
        return dl.gpu.GEMV().apply(single, Target.current(), False)


def fused_passes(target, **options) -> list:
    """Everything up to the fused PrimFuncs the schedules see: Linear layers that share an input
    joined into one matmul (parallel_matmuls.py; on sm_90a a pair of one width interleaved in runs of
    rows, gated_linears.py), spelled-out attention replaced by the
    fused kernel (sm_90a), top-1 sorts that are maxima made
    maxima (before the library dispatch turns them into sort kernels), half arithmetic around
    reductions done in float32 with PyTorch's rounding points (half_math.py), library dispatch, the
    pairing of mean with variance (Welford), activations and residual adds moved before reshapes and
    matmuls by a transposed operand reading it untransposed (layout_rewrites.py), legalization (split-K for few-row
    matmuls on GPUs, split_k.py) with the index wraps of symbolic reshapes dropped where they cannot wrap
    (tir/symbolic_wraps.py), and fusion (FuseOps, then ours: around reductions, and a gated
    activation into its matmul)."""
    variance = options.get("variance", "welford")
    statistics = [welford.pair_mean_with_variance] if variance == "welford" else []
    device = device_of(target)
    split_k = {"relax.matmul": split_k_legalization(device.sm_count)} if device.is_gpu else {}
    guarded = fallback.guarded_rewrite  # a rewrite of ours that raises is skipped, with a warning
    return [guarded(p) for p in (combine_parallel_linears, fuse_attention, max_from_top_one, half_math_in_float)] \
        + relax.pipeline.library_dispatch_passes(target) + [guarded(p) for p in statistics] + [
        guarded(activation_before_reshape),  # first: it recognises a residual's matmul as relax.matmul, before it is matmul_nt
        guarded(read_transposed_operand),
        relax.transform.LegalizeOps(customize_legalize_map=fallback.guarded_legalizations({**legalizations(variance),
                                                                                           **split_k})),
        guarded(drop_symbolic_wraps),
        relax.transform.AnnotateTIROpPattern(),
        guarded(reductions_apart),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        guarded(FuseReduceGroups()),
        guarded(fuse_gated_epilogues),
        relax.transform.FuseTIR(),
    ]


def fused_module(mod: tvm.IRModule, target, **options) -> tvm.IRModule:
    """`mod` legalized and fused as the pipeline does it, before any scheduling (with
    `variance="tuned"`, the Welford variant: see fused_variants)."""
    if options.get("variance") == TUNED:
        options = {**options, "variance": TUNED_AMONG[0]}
    with target:
        return tvm.transform.Sequential(fused_passes(target, **options))(mod)


def fused_variants(mod: tvm.IRModule, target, **options) -> list:
    """The fused modules a build chooses among: `mod` fused once, or with `variance="tuned"` once
    per algorithm of TUNED_AMONG (Welford's first), whose tasks the tuner measures alike."""
    if options.get("variance") != TUNED:
        return [fused_module(mod, target, **options)]
    return [fused_module(mod, target, **{**options, "variance": algorithm}) for algorithm in TUNED_AMONG]


def _signature(func: tirx.PrimFunc) -> list:
    """Each parameter's (shape, dtype), or type for a scalar."""
    return [(list(p.shape), str(p.ty.dtype)) if hasattr(p, "shape") else str(p.ty) for p in func.params]


def choose_variants(variants: list, target: Target, database: Database) -> tvm.IRModule:
    """The first of `variants` (fused modules of one model), each of its functions replaced by
    another variant's function of the same name and signature whose tuning record is faster. A
    function without a record in every variant keeps the first's (Welford, the default)."""
    chosen, *others = variants  # fresh modules of this build: updated in place
    others = [{g.name_hint: f for g, f in other.functions_items()} for other in others]
    for gv, func in list(chosen.functions_items()):
        best = database.latency(func, target) if isinstance(func, tirx.PrimFunc) else None
        for other in others:
            alt = other.get(gv.name_hint)
            if best is None or not isinstance(alt, tirx.PrimFunc) \
                    or not tvm_ffi.structural_equal(_signature(alt), _signature(func), map_free_vars=True):
                continue
            us = database.latency(alt, target)
            if us is not None and us < best:
                chosen.update_func(gv, alt)
                best = us
    return chosen


def fused_reduce_functions(mod: tvm.IRModule, target, **options) -> dict:
    """{name: PrimFunc} of the fused reduce subgraphs the pipeline will schedule (the tuner's tasks)."""
    return {gv.name_hint: f for gv, f in fused_module(mod, target, **options).functions_items()
            if isinstance(f, tirx.PrimFunc) and is_reduce_subgraph(f)}


@tvm.transform.module_pass(opt_level=0, name="TVMExtDlightDefaults")
def dlight_defaults(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """TVM's dlight rules for what our templates leave (symbolic matmuls among them), judged on the
    architecture's portable variant: dlight reads "sm_90a" as no tensor cores at all (its version
    check wants digits), and its tensor-core code for sm_90 runs as well on sm_90a."""
    target = Target.current()
    rules = (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), Elementwise(),
             dl.gpu.Fallback())
    with without_arch_specific(target) if target.kind.name == "cuda" else target:
        portable = Target.current()
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and not func.attrs.get(SCHEDULED, False):
                found = _first_schedule(gv.name_hint, func, portable, rules)
                if found is not None:  # our elementwise rule's kernels get int32 twins like our templates'
                    rule, sch = found
                    mod[gv] = sch.mod["main"].with_attrs({SCHEDULED: True, OURS: isinstance(rule, Elementwise)})
    return mod


def _first_schedule(name: str, func: tirx.PrimFunc, target: Target, rules) -> tuple | None:
    """(rule, Schedule) of the first rule that takes `func`, as dlight's ApplyDefaultSchedule does; a
    rule that raises is passed over, with a warning."""
    for rule in rules:
        try:
            sch = rule.apply(func, target, False)
        except Exception as err:  # noqa: BLE001 (the next rule, down to dlight's fallback, takes it)
            fallback.warn(name, type(rule).__name__, err)
            continue
        if sch is not None:
            return rule, sch[0] if isinstance(sch, list) else sch
    return None


@tvm.transform.module_pass(opt_level=0, name="TVMExtMarkKernels")
def _marked_for_our_tir_pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every kernel marked BUILT_BY_US: TVM's default TIR pipeline then runs ours (tvm_ext/tir)."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod.update_func(gv, func.with_attr(BUILT_BY_US, True))
    return mod


def tvm_ext_pipeline(database: str | os.PathLike | Database | None = None, **options) -> tvm.transform.Pass:
    """The pass `tvm_ext.build` runs (also `relax.get_pipeline("tvm_ext", database=...)`)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown tvm_ext build option(s) {unknown}; known: {list(OPTIONS)}")
    variance = options.get("variance", "welford")
    if variance == TUNED and database is None:
        raise ValueError('variance="tuned" picks each statistic\'s algorithm by its tuning records: pass a database '
                         "(a log written by scripts/tune.py --variance tuned)")
    legalizations(TUNED_AMONG[0] if variance == TUNED else variance)  # a bad option value fails here, before any work
    narrow = options.get("narrow_index", True)
    if not isinstance(narrow, bool):
        raise ValueError(f"narrow_index must be True or False, not {narrow!r}")
    if database is not None and not isinstance(database, Database):
        database = Database.load(database)

    @tvm.transform.module_pass(opt_level=0, name="TVMExtPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = Target.current()
        if target is None:
            raise ValueError("the tvm_ext pipeline needs a target: run it inside `with target:` or via tvm_ext.build")
        fallback.new_build()
        if options.get("variance") == TUNED:
            mod = choose_variants(fused_variants(mod, target, **options), target, database)
            fused = []
        else:
            fused = fused_passes(target, **options)
        passes = fused + [
            # relax.pipeline.dataflow_lower_passes(llvm) raises in 0.27; these are its passes, with
            # scheduling moved after ToNonDataflow so that kernel variants can be chosen by an `if`
            relax.transform.RewriteDataflowReshape(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            ScheduleReductions(database),
        ]
        if "gpu" in target.keys:
            passes += [ScheduleContractions(database), dlight_defaults]
        passes += ([fallback.guarded_rewrite(narrow_indices)] if narrow else []) + [relax.transform.CallTIRRewrite()]
        passes += relax.pipeline.finalize_passes(target) + [_marked_for_our_tir_pipeline]
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def register() -> None:
    """Make `relax.get_pipeline("tvm_ext")` return this pipeline (idempotent)."""
    from tvm.relax import pipeline as relax_pipeline  # the registry lives here

    if PIPELINE not in relax_pipeline.PIPELINE_MAP:
        relax.register_pipeline(PIPELINE)(tvm_ext_pipeline)
