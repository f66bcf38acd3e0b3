"""Load an exported model with TVM's runtime alone.

This module imports nothing from the compiler side of the project (no pipeline, no schedules,
no tuner), so a deployment machine needs only the `tvm` package; `tvm_ext.load` is this function.
"""

from __future__ import annotations

import os
import re

import tvm
from tvm.runtime.vm import VirtualMachine

# Target kinds (what the model was built for) and other names, by the device their code runs on
_ALIASES = {"llvm": "cpu", "c": "cpu", "gpu": "cuda", "nvptx": "cuda"}
ACCEPTED = ("a tvm Device, a device or target name such as 'cpu', 'llvm', 'cuda', 'gpu' (with ':N' for device N, "
            "e.g. 'cuda:1'), or a target such as {'kind': 'cuda', 'arch': 'sm_90'}")


def parse_device(device) -> tvm.runtime.Device:
    """What `load` accepts as `device` (see ACCEPTED) as a tvm Device; None is the CPU. ValueError otherwise."""
    if device is None:
        return tvm.cpu()
    if isinstance(device, tvm.runtime.Device):
        return device
    if isinstance(device, dict):
        spelling = device.get("kind")
    elif isinstance(getattr(getattr(device, "kind", None), "name", None), str):  # a tvm.target.Target
        spelling = device.kind.name
    else:
        spelling = device
    found = re.fullmatch(r"([a-z_]+)(?::(\d+))?", spelling.strip().lower()) if isinstance(spelling, str) else None
    if found is not None:
        try:
            return tvm.device(_ALIASES.get(found[1], found[1]), int(found[2] or 0))
        except ValueError:  # a name TVM does not know either
            pass
    raise ValueError(f"unknown device {device!r}: expected {ACCEPTED}")


def load(path: str | os.PathLike, device=None) -> VirtualMachine:
    """Load a library written by `tvm_ext.export` onto `device`: a tvm Device, 'cpu' / 'llvm',
    'cuda' / 'cuda:N' / 'gpu', or the target it was built for (a dict or Target); the CPU by default."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"exported model {path!r} does not exist")
    return VirtualMachine(tvm.runtime.load_module(path), parse_device(device))
