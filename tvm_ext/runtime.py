"""Load an exported model with TVM's runtime alone.

This module imports nothing from the compiler side of the project (no pipeline, no schedules,
no tuner), so a deployment machine needs only the `tvm` package; `tvm_ext.load` is this function.
"""

from __future__ import annotations

import os

import tvm
from tvm.runtime.vm import VirtualMachine


def load(path: str | os.PathLike, device=None) -> VirtualMachine:
    """Load a library written by `tvm_ext.export` onto `device` (a tvm Device, 'cpu' or 'cuda')."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"exported model {path!r} does not exist")
    if device is None:
        device = tvm.cpu()
    elif isinstance(device, str):
        device = tvm.device(device)
    return VirtualMachine(tvm.runtime.load_module(path), device)
