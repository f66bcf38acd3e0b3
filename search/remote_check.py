"""A candidate's outputs checked where they are, on an RPC server: a small kernel there computes
each row's largest and summed |got - want| (check.output_bounds' two measures), so that two
numbers a row cross the network instead of the whole output (100 MB for a 49152 x 1024 fp16 norm:
seconds a candidate through a server's socket). Only a row outside its bounds, a reference with
NaN or infinities, or an integer output bring the output here, for check_outputs' exact message."""

from __future__ import annotations

import os

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import dlight as dl

from .check import check_outputs

_KERNELS: dict = {}  # in a runner: (output dtype, target) -> the row-errors module on its server


def row_errors_module(dtype: str, target) -> tvm.IRModule:
    """`largest(got, want, out)` and `summed(got, want, out)` over the rows of a (rows, width)
    output of `dtype`, with both dims symbolic: one build serves every task of that dtype."""
    rows, width = tvm.tirx.Var("rows", "int64"), tvm.tirx.Var("width", "int64")
    got, want = te.placeholder((rows, width), dtype, "got"), te.placeholder((rows, width), "float32", "want")

    def error(reduce):
        k = te.reduce_axis((0, width), "k")
        return te.compute((rows,), lambda i: reduce(te.abs(got[i, k].astype("float32") - want[i, k]), axis=k))

    mod = tvm.IRModule({name: te.create_prim_func([got, want, error(reduce)]).with_attr("global_symbol", name)
                        for name, reduce in (("largest", te.max), ("summed", te.sum))})
    if "gpu" in target.keys:
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    return mod


def _kernel(remote, dtype: str, target, scratch: str):
    """The row-errors module for `dtype`, built here once and loaded on the server."""
    if (dtype, str(target)) not in _KERNELS:
        path = os.path.join(scratch, f"row-errors-{os.getpid()}-{dtype}.so")
        tvm.compile(row_errors_module(dtype, target), target=target).export_library(path)
        remote.upload(path)
        _KERNELS[(dtype, str(target))] = remote.load_module(os.path.basename(path))
    return _KERNELS[(dtype, str(target))]


def on_server(outputs: list, device) -> list:
    """Each output's reference as float32 rows on the server, uploaded once per task (None for an
    output checked here: an integer one, or one whose reference has NaN or infinities)."""
    return [tvm.runtime.tensor(out.want, device) if "float" in out.dtype and not out.special.size else None
            for out in outputs]


def _within_bounds(got, want, out, remote, device, target, scratch: str) -> bool:
    kernel = _kernel(remote, out.dtype, target, scratch)
    largest, summed = (tvm.runtime.empty((out.want.shape[0],), "float32", device) for _ in range(2))
    rows = got._create_view(out.want.shape)
    kernel["largest"](rows, want, largest)
    kernel["summed"](rows, want, summed)
    return bool((largest.numpy() <= out.element_bound).all() and (summed.numpy() <= out.mass_bound).all())


def check_remote(outs: list, wants_there: list, outputs: list, remote, device, target, scratch: str) -> None:
    """check_outputs for `outs` on the server (see the module docstring); raises as it does."""
    if all(want is not None and _within_bounds(got, want, out, remote, device, target, scratch)
           for got, want, out in zip(outs, wants_there, outputs)):
        return
    check_outputs([o.numpy() for o in outs], outputs)
