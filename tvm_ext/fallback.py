"""A rule of ours that raises costs speed, never the build: what it would have done is left to TVM.

Every rewrite, legalization, schedule rule and TIR pass runs behind a guard here; a failure sends
that function down TVM's default path with one `FallbackWarning`. Inside `strict()` the guards
raise `RuleError` instead, so a caller with another choice learns which rule failed (see
docs/design.md#fallback-a-build-never-fails-because-of-us)."""

from __future__ import annotations

import contextlib
import threading
import warnings

import tvm
from tvm import relax, tirx

_state = threading.local()


class FallbackWarning(UserWarning):
    """A tvm_ext rule raised for a function; TVM's default path built that function instead."""


class RuleError(RuntimeError):
    """`rule` raised `cause` for `function` (raised by the guards inside `strict()`)."""

    def __init__(self, function: str, rule: str, cause: BaseException):
        self.function, self.rule, self.cause = function, rule, cause
        super().__init__(f"{rule} raised {reason(cause)}")


def reason(err: BaseException) -> str:
    """`Type: last line of the message`: TVM's errors carry a C++ trace above the line that matters."""
    if isinstance(err, RuleError):
        return str(err)
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1]}" if lines else type(err).__name__


def new_build() -> None:
    """Start a build: each (function, rule) pair warns once per build."""
    _state.warned = set()


def warn(function: str, rule: str, err: BaseException | str) -> None:
    """One line: `tvm_ext: <function>: <rule> failed (<reason>); falling back to TVM's default`."""
    function = function.removesuffix("_kernel")  # a device kernel is its function's
    warned = getattr(_state, "warned", None)
    if warned is not None:
        if (function, rule) in warned:
            return
        warned.add((function, rule))
    why = err if isinstance(err, str) else reason(err)
    warnings.warn(f"tvm_ext: {function}: {rule} failed ({why}); falling back to TVM's default", FallbackWarning,
                  stacklevel=3)


def warn_build_failed(function: str, err: BaseException, rule: str) -> None:
    """Warn that building `function` with `rule` raised: as the TIR pass of ours that raised where
    check_builds found one (a RuleError), else as `rule`."""
    if isinstance(err, RuleError):
        warn(function, err.rule, err.cause)
    else:
        warn(function, rule, err)


@contextlib.contextmanager
def strict():
    """Inside, the guards raise `RuleError` rather than fall back; yields the list of those raised."""
    before = getattr(_state, "strict", None)
    _state.strict = raised = []
    try:
        yield raised
    finally:
        _state.strict = before


def _fail(function: str, rule: str, err: BaseException) -> None:
    """Raise inside `strict()`, else warn."""
    raised = getattr(_state, "strict", None)
    if raised is not None:
        raised.append(err if isinstance(err, RuleError) else RuleError(function, rule, err))
        raise raised[-1] from err
    warn(function, rule, err)


def _relax_functions(mod: tvm.IRModule) -> str:
    """The module's Relax functions, FuseOps' groups (primitive functions) aside."""
    return ", ".join(gv.name_hint for gv, f in mod.functions_items()
                     if isinstance(f, relax.Function) and not (f.attrs or {}).get("Primitive", False)) or "module"


def guarded_rewrite(rewrite: tvm.transform.Pass) -> tvm.transform.Pass:
    """A Relax module pass that, where `rewrite` raises, leaves the module as it was."""
    name = rewrite.info.name

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _guarded(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return rewrite(mod)
        except Exception as err:  # noqa: BLE001 (any failure of ours must cost the rewrite, not the build)
            _fail(_relax_functions(mod), name, err)
            return mod

    return _guarded


def guarded_legalizations(custom: dict) -> dict:
    """`custom` ({op name: legalize function}) with each function falling back to TVM's own
    legalization of that call where it raises."""

    def guarded(op_name, legalize):
        def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            try:
                return legalize(bb, call)
            except Exception as err:  # noqa: BLE001
                _fail(op_name, f"legalization of {op_name}", err)
                return tvm.ir.Op.get(op_name).get_attr("FLegalize")(bb, call)

        return _legalize

    return {op_name: guarded(op_name, legalize) for op_name, legalize in custom.items()}


def guarded_tir_pass(tir_pass: tvm.transform.Pass) -> tvm.transform.Pass:
    """A TIR module pass that, where `tir_pass` raises, is run function by function and leaves each
    function it raises for as it was."""
    name = tir_pass.info.name

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _guarded(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return tir_pass(mod)
        except Exception:  # noqa: BLE001 (find the functions it fails for)
            pass
        out = mod.clone()
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                try:
                    out[gv] = tir_pass(tvm.IRModule({gv: func}, attrs=mod.attrs, global_infos=mod.global_infos))[gv]
                except Exception as err:  # noqa: BLE001
                    _fail(gv.name_hint, name, err)
        return out

    return _guarded


def guarded_hook(hook, rule: str):
    """A source hook `code -> code` that returns the code unchanged where it raises."""

    def _hook(code, target):
        try:
            return hook(code, target)
        except Exception as err:  # noqa: BLE001
            _fail("generated source", rule, err)
            return code

    return _hook
