"""The hook where this project's TIR passes run: after scheduling, before code generation.

Registers the TIR pipeline "tvm_ext" (TVM's default s_tir pipeline with our "early" passes on
SBlock-form PrimFuncs and "late" passes on device kernels before codegen). Each pass runs behind
`fallback.guarded_tir_pass`; `check_builds` runs a schedule through all of it before the pipeline
takes it, so a schedule some pass cannot take goes back to TVM's rules."""

from __future__ import annotations

import contextlib
import warnings

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import pipeline as s_tir_pipeline
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods
from tvm.tirx.compilation_pipeline import PIPELINE_MAP

from .. import fallback

TIR_PIPELINE = "tvm_ext"
BUILT_BY_US = "tvm_ext.relax_pipeline"  # PrimFunc attr: made by the Relax pipeline "tvm_ext", for this TIR pipeline
PHASES = ("early", "late")
_passes: dict[str, list] = {phase: [] for phase in PHASES}


def register_tir_pass(tir_pass: tvm.transform.Pass, phase: str = "early") -> tvm.transform.Pass:
    if phase not in PHASES:
        raise ValueError(f"unknown TIR pass phase {phase!r}: expected one of {PHASES}")
    _passes[phase].append(tir_pass)
    return tir_pass


def unregister_tir_pass(tir_pass: tvm.transform.Pass) -> None:
    for passes in _passes.values():
        if tir_pass in passes:
            passes.remove(tir_pass)


def registered_tir_passes(phase: str) -> list:
    return list(_passes[phase])


@contextlib.contextmanager
def tir_pass_disabled(tir_pass: tvm.transform.Pass):
    """Builds inside run without `tir_pass` (A/B measurements); it is put back in its place after."""
    places = [(phase, passes.index(tir_pass)) for phase, passes in _passes.items() if tir_pass in passes]
    unregister_tir_pass(tir_pass)
    try:
        yield
    finally:
        for phase, index in places:
            _passes[phase].insert(index, tir_pass)


def _tir_pipeline():
    lower, finalize_host, finalize_device = s_tir_pipeline.default_s_tir_pipeline()

    @tvm.transform.module_pass(opt_level=0, name="TVMExtTIRPipeline")
    def _pipeline(mod, ctx):
        # software-pipelined copies (the matmul template's `stages`) become cp.async; TVM only
        # marks the copies a schedule annotated as asynchronous, so other kernels are unchanged
        config = {**dict(ctx.config), "tirx.use_async_copy": True}
        with tvm.transform.PassContext(ctx.opt_level, ctx.required_pass, ctx.disabled_pass, ctx.instruments, config):
            return lower(_guarded("early")(mod))

    def _finalize_device():
        return tvm.transform.Sequential([_guarded("late"), finalize_device()])

    return _pipeline, finalize_host, _finalize_device


def _guarded(phase: str) -> tvm.transform.Pass:
    return tvm.transform.Sequential([fallback.guarded_tir_pass(p) for p in _passes[phase]])


def _default_taking_ours(default_factory):
    """TVM's default TIR pipeline, running ours instead (with a warning) for a module that the Relax
    pipeline "tvm_ext" made: `tvm.compile(..., relax_pipeline="tvm_ext")` without
    `tir_pipeline="tvm_ext"` would build matmuls without their tensor-core code and grid-sync
    kernels without the cooperative launch their barrier needs."""
    def factory(**kwargs):
        lower, finalize_host, finalize_device = default_factory(**kwargs)
        ours_lower, _, ours_finalize_device = _tir_pipeline()
        chosen = {"ours": False}

        @tvm.transform.module_pass(opt_level=0, name="TVMExtDefaultTIRPipeline")
        def _lower(mod, _ctx):
            chosen["ours"] = any(isinstance(f, tirx.PrimFunc) and f.attrs.get(BUILT_BY_US, False)
                                 for _, f in mod.functions_items())
            if not chosen["ours"]:
                return lower(mod)
            warnings.warn(f"tvm_ext: kernels scheduled by relax_pipeline=\"tvm_ext\" are built with tir_pipeline="
                          f"\"{TIR_PIPELINE}\" (the default would drop their tensor-core code and cooperative launch);"
                          f" pass tir_pipeline=\"{TIR_PIPELINE}\" to tvm.compile, or use tvm_ext.build", stacklevel=2)
            return ours_lower(mod)

        return _lower, finalize_host, lambda: (ours_finalize_device if chosen["ours"] else finalize_device)()

    return factory


tirx.register_tir_pipeline(TIR_PIPELINE, _tir_pipeline)
tirx.register_tir_pipeline("s_tir", _default_taking_ours(PIPELINE_MAP["s_tir"]))  # what "default" and None build with


def check_builds(func: tirx.PrimFunc, name: str, target: Target) -> None:
    """Run the TIR half of a build on one scheduled function: our passes, TVM's lowering, the
    host/device split and the device finalization (all but code generation). Raises what the build
    would raise (a per-thread array of symbolic size too, which code generation refuses);
    `fallback.RuleError` where a pass of ours raised."""
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    mod = tirx.transform.BindTarget(target if target.host is not None else Target(target, host="llvm"))(mod)
    lower, _, finalize_device = _tir_pipeline()
    with fallback.strict() as raised:
        try:
            _, device_mods = split_host_device_mods(lower(mod))
            for device_mod in device_mods.values():
                _constant_local_arrays(finalize_device()(device_mod))
        except Exception as err:
            if raised:  # a pass of ours: its RuleError, which crossing TVM's C++ made a RuntimeError
                raise raised[-1] from err
            raise


def _constant_local_arrays(device_mod: tvm.IRModule) -> None:
    """Raise where a kernel keeps a per-thread array of a size known only at run time, which CUDA's
    code generator refuses ("Can only handle constant size stack allocation") after this check."""
    def check(alloc):
        buf = alloc.buffer
        if str(buf.scope()) == "local" and any(not isinstance(d, tirx.IntImm) for d in buf.shape):
            raise ValueError(f"per-thread array {buf.name} of symbolic size {list(buf.shape)}")

    for _, func in device_mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, check), order="pre")


def _register_builtin_passes() -> None:
    from .bool_vectors import bool_loads_as_bytes_pass, uniform_selects_as_branches_pass  # noqa: PLC0415
    from .cooperative_launch import cooperative_launch  # noqa: PLC0415
    from .dependent_launch import dependent_launch  # noqa: PLC0415
    from .narrow_index import narrow_index  # noqa: PLC0415
    from .source_hook import register_source_hook  # noqa: PLC0415
    from .welford_lower import welford_lower  # noqa: PLC0415

    from .tensorize import AutoTensorize  # noqa: PLC0415

    register_tir_pass(narrow_index, phase="early")
    register_tir_pass(AutoTensorize, phase="early")
    register_tir_pass(bool_loads_as_bytes_pass, phase="early")
    register_tir_pass(cooperative_launch, phase="late")
    register_tir_pass(dependent_launch, phase="late")  # after: it leaves cooperative kernels alone
    register_tir_pass(welford_lower, phase="late")
    register_tir_pass(uniform_selects_as_branches_pass, phase="late")
    register_source_hook()


_register_builtin_passes()
