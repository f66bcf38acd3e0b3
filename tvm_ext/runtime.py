"""Load an exported model with TVM's runtime alone.

This module imports nothing from the compiler side of the project (no pipeline, no schedules,
no tuner), so a deployment machine needs only the `tvm` package; `tvm_ext.load` is this function.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
import warnings

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


# An export is the shared library, then its manifest (JSON), the manifest's length (8 bytes, little
# endian) and MAGIC: one file, replaced by one rename, that dlopen reads as the library alone.
MAGIC = b"tvm_ext manifest"
_TAIL = struct.Struct("<Q16s")


class UnloadableExportError(ValueError):
    """An export that `load` refuses before any of its native code runs: truncated, corrupted, or
    built for CPU features or a GPU this machine lacks."""


def manifest_trailer(manifest: dict) -> bytes:
    """What `export` appends to the library: `manifest` as JSON, its length and MAGIC."""
    text = json.dumps(manifest, sort_keys=True).encode()
    return text + _TAIL.pack(len(text), MAGIC)


def read_manifest(path: str) -> dict | None:
    """The manifest at the end of the export at `path`, with "manifest_offset" (where it starts: the
    library's size), or None for an export without one (written before manifests).
    UnloadableExportError where the trailer is there but unreadable."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if end < _TAIL.size:
            return None
        f.seek(end - _TAIL.size)
        length, magic = _TAIL.unpack(f.read(_TAIL.size))
        if magic != MAGIC:
            return None
        if length > end - _TAIL.size:
            raise UnloadableExportError(f"exported model {path!r} is corrupted: its manifest claims {length} bytes, "
                                        f"more than the file holds")
        f.seek(end - _TAIL.size - length)
        try:
            manifest = json.loads(f.read(length))
        except ValueError as err:
            raise UnloadableExportError(f"exported model {path!r} is corrupted: unreadable manifest ({err})") from None
    manifest["manifest_offset"] = end - _TAIL.size - length
    return manifest


def file_sha256(path: str, size: int) -> str:
    """sha256 of the first `size` bytes of `path`, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while size > 0:
            chunk = f.read(min(size, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            size -= len(chunk)
    return digest.hexdigest()


def _check_integrity(path: str, manifest: dict) -> None:
    """The library part has the size and sha256 the manifest records."""
    size = manifest["manifest_offset"]
    if size != manifest.get("size"):
        raise UnloadableExportError(f"exported model {path!r} is truncated or was changed: its library holds {size} "
                                    f"bytes, the manifest says {manifest.get('size')}")
    if file_sha256(path, size) != manifest.get("sha256"):
        raise UnloadableExportError(f"exported model {path!r} is corrupted: its sha256 differs from the one recorded "
                                    "at export")


def _check_elf(path: str) -> None:
    """On Linux, the file is an ELF library whose program and section headers and loaded segments lie
    inside it: dlopen of a truncated library dies with SIGBUS instead of failing."""
    if not sys.platform.startswith("linux"):
        return
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            raise UnloadableExportError(f"exported model {path!r} is not a shared library (no ELF header)")
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        layout = order + ("16xHHIQQQIHHHHHH" if wide else "16xHHIIIIIHHHHHH")
        if len(head) < struct.calcsize(layout):
            raise UnloadableExportError(f"exported model {path!r} is truncated: {size} bytes, no whole ELF header")
        _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = struct.unpack_from(layout, head)
        ends = {"program headers": phoff + phentsize * phnum, "section headers": shoff + shentsize * shnum}
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        segment = order + ("I4xQ8x8xQ" if wide else "II8xI")  # p_type, p_offset, p_filesz
        for i in range(phnum if len(table) == phentsize * phnum else 0):
            kind, offset, filesz = struct.unpack_from(segment, table, i * phentsize)
            if kind == 1:  # PT_LOAD
                ends[f"loaded segment {i}"] = offset + filesz
    short = {what: end for what, end in ends.items() if end > size}
    if short:
        what, end = max(short.items(), key=lambda item: item[1])
        raise UnloadableExportError(f"exported model {path!r} is truncated: {size} bytes, but its {what} end at byte {end}")


def _host_cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo ('flags' on x86, 'Features' on Arm), or None
    where they cannot be read (then nothing is refused)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return None


def _check_target(path: str, manifest: dict, dev: tvm.runtime.Device) -> None:
    """The export's CPU features are this CPU's, it runs on `dev`'s kind, and a GPU it was built for
    is visible with at least its compute capability (exactly it for an arch-specific sm_XYa)."""
    flags = _host_cpu_flags()
    missing = sorted(set(manifest.get("cpu_features", [])) - flags) if flags is not None else []
    if missing:
        raise UnloadableExportError(f"exported model {path!r} was built for CPU features this machine lacks: "
                                    f"{', '.join(missing)} (target {manifest.get('target')}); rebuild it for this CPU")
    built_for = manifest.get("device", "cpu")
    if dev.type != built_for:
        raise UnloadableExportError(f"exported model {path!r} was built for {built_for}, not for device {dev}")
    arch = manifest.get("cuda_arch")
    found = re.fullmatch(r"sm_(\d+)([af]?)", arch or "")
    if found is not None:
        have = int(dev.compute_version.replace(".", ""))
        need = int(found[1])
        if have < need or (found[2] and have != need):
            raise UnloadableExportError(f"exported model {path!r} was built for {arch}, and GPU {dev} has "
                                        f"compute capability {dev.compute_version}")


def _load_device_runtime(dev: tvm.runtime.Device) -> None:
    """Load the runtime library of `dev`'s kind (libtvm_runtime_cuda for a GPU), which TVM itself
    loads only with its compiler: with TVM_USE_RUNTIME_LIB=1, no GPU would exist for this process.
    Where it cannot load (no driver), the device stays missing and `load` says so."""
    from tvm.base import _LOADED_LIBS  # noqa: PLC0415

    name = f"tvm_runtime_{tvm.runtime.Device._DEVICE_TYPE_TO_NAME.get(dev.dlpack_device_type(), '')}"
    if name in _LOADED_LIBS or name == "tvm_runtime_cpu" or not getattr(tvm.base, "_RUNTIME_ONLY", False):
        return
    from pathlib import Path  # noqa: PLC0415

    from tvm_ffi.libinfo import load_lib_ctypes  # noqa: PLC0415

    try:
        _LOADED_LIBS[name] = load_lib_ctypes(package="tvm", target_name=name, mode="RTLD_LOCAL", extra_lib_paths=[
            Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent])
    except (OSError, RuntimeError):  # not shipped, or no driver: the device stays missing
        pass


def load(path: str | os.PathLike, device=None) -> VirtualMachine:
    """Load a library written by `tvm_ext.export` onto `device`: a tvm Device, 'cpu' / 'llvm',
    'cuda' / 'cuda:N' / 'gpu', or the target it was built for (a dict or Target); by default the
    device it was built for.

    Before any of its code runs, the manifest `export` wrote is checked: size and sha256, the CPU
    features and GPU arch it was built for against this machine's. UnloadableExportError (a
    ValueError) names the file and what is wrong; an export without a manifest loads with a warning.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"exported model {path!r} does not exist")
    manifest = read_manifest(path)
    if manifest is not None:
        _check_integrity(path, manifest)
    _check_elf(path)
    dev = parse_device(device if device is not None else (manifest or {}).get("device", "cpu"))
    _load_device_runtime(dev)
    if not dev.exist:
        raise UnloadableExportError(f"cannot load exported model {path!r} on {dev}: no such device is visible")
    if manifest is None:
        warnings.warn(f"exported model {path!r} has no manifest (written before tvm_ext recorded one): its "
                      "integrity and the CPU or GPU it was built for are not checked", UserWarning, stacklevel=2)
    else:
        _check_target(path, manifest, dev)
    return VirtualMachine(tvm.runtime.load_module(path), dev)
