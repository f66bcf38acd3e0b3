"""Multi-value reducers by name, for templates that merge partial states themselves.

The grid strategies merge partial states of different blocks in steps they write out, so they
look the combine rule up here by the name in the reduction block's ANNOTATION."""

from __future__ import annotations

from typing import Callable

ANNOTATION = "tvm_ext.reducer"
_REDUCERS: dict[str, tuple[Callable, Callable]] = {}


def register(name: str, combine: Callable, identity: Callable) -> None:
    """combine(a, b) -> merged state (lists of expressions); identity(*dtypes) -> the empty state."""
    _REDUCERS[name] = (combine, identity)


def of(block) -> tuple[Callable, Callable] | None:
    """(combine, identity) of the reducer `block` is annotated with, or None."""
    name = (block.annotations or {}).get(ANNOTATION, None)
    return None if name is None else _REDUCERS.get(str(name))
