"""Multi-value reducers by name, for templates that merge partial states themselves.

The grid strategies merge partial states of different blocks in steps they write out, so they
look the combine rule up here by the name in the reduction block's ANNOTATION."""

from __future__ import annotations

from typing import Callable

import tvm
import tvm_ffi

ANNOTATION = "tvm_ext.reducer"
_REDUCERS: dict[str, tuple[Callable, Callable]] = {}


def register(name: str, combine: Callable, identity: Callable) -> None:
    """combine(a, b) -> merged state (lists of expressions); identity(*dtypes) -> the empty state."""
    _REDUCERS[name] = (combine, identity)


def of(block) -> tuple[Callable, Callable] | None:
    """(combine, identity) of the reducer `block` is annotated with, or None."""
    name = (block.annotations or {}).get(ANNOTATION, None)
    return None if name is None else _REDUCERS.get(str(name))


def register_with_tvm(name: str, size: int, combine: Callable, identity: Callable, grid: bool = True) -> None:
    """Teach TVM's reducer matcher (s_tir's RegisterReducer) the `size`-value merge `combine`, with
    the empty state `identity(*dtypes)`, and with `grid` the grid templates (register). Idempotent;
    the callbacks are global functions so that they outlive the interpreter's shutdown."""
    combiner, empty = f"tvm_ext.{name}_combine", f"tvm_ext.{name}_identity"
    if tvm.get_global_func(combiner, allow_missing=True) is not None:
        return
    tvm_ffi.register_global_func(combiner, lambda x, y: combine(x, y))
    tvm_ffi.register_global_func(empty, lambda v: identity(*[e.ty for e in v]))
    tvm.get_global_func("s_tir.schedule.RegisterReducer")(size, tvm.get_global_func(combiner),
                                                          tvm.get_global_func(empty))
    if grid:
        register(name, combine, identity)
