"""Import TVM's tensor intrinsics (`tvm.s_tir.tensor_intrin`) in seconds instead of minutes.

The TVMScript parser calls `inspect.stack()` for each of ~500 functions, which scans `sys.modules`
per frame. For the import it is swapped for a frame walk that reads only the current line from
`linecache`. Measured: see docs/design.md#the-pytorch-frontend."""

from __future__ import annotations

import inspect
import linecache
import sys


def _frames(context: int = 1) -> list:
    """inspect.stack() without the module lookup: each caller frame with its current line."""
    out, frame = [], sys._getframe(1)
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        lines = [linecache.getline(filename, lineno)] if context else None
        out.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, lines, 0 if context else None))
        frame = frame.f_back
    return out


def import_tensor_intrinsics() -> None:
    """Import (and so register) tvm.s_tir.tensor_intrin; a no-op once imported."""
    if "tvm.s_tir.tensor_intrin.cuda" in sys.modules:
        return
    real, inspect.stack = inspect.stack, _frames
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401,PLC0415
    finally:
        inspect.stack = real
