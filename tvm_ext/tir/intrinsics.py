"""Import TVM's tensor intrinsics (`tvm.s_tir.tensor_intrin`) in seconds instead of minutes.

The package defines ~500 TVMScript functions; the parser calls `inspect.stack()` for each, and
that resolves every frame's module by scanning `sys.modules`: 40 s on our CPU machine, 115 s in a
process that has imported PyTorch (thousands of modules), paid on the first build that reaches
dlight's tensor-core matmul rule, in every MetaSchedule builder process, and by our WMMA pass.
The parser only reads each frame and its current source line, so for the import `inspect.stack`
is swapped for a walk of the frames that reads that line from `linecache`: 4.8 s.
"""

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
