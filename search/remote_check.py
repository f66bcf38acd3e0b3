"""A task's tensors made, and a candidate's outputs checked, where they are used: on an RPC server,
whose socket moves 30-60 MB/s. Seeded inputs are made there by a kernel (check.seeded's values),
and a small kernel computes each output row's largest and summed |got - want| (check.output_bounds'
two measures), so that two numbers a row cross the network instead of the whole output (100 MB for
a 49152 x 1024 fp16 norm). Only a row outside its bounds, a reference with NaN or infinities, or an
integer output bring the output here, for check_outputs' exact message."""

from __future__ import annotations

import os

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import dlight as dl

from .check import HASH_MIX, check_outputs, in_dtype, seed_mix, seeded_bits
from .runner import poison_value

_KERNELS: dict = {}  # in a runner: (connection id, dtype, target) -> (connection, the server module there)


def server_module(dtype: str, target) -> tvm.IRModule:
    """`largest(got, want, out)` and `summed(got, want, out)` over the rows of a (rows, width)
    output of `dtype` and its reference in `dtype`, `poison(out)` filling a flat output with
    runner.poison_value and, for floating point, `seeded(out, mix)` making check.seeded's values in
    a flat input; every dim symbolic: one build serves every task of that dtype."""
    rows, width, size = (tvm.tirx.Var(name, "int64") for name in ("rows", "width", "size"))
    got, want = te.placeholder((rows, width), dtype, "got"), te.placeholder((rows, width), dtype, "want")

    def error(reduce):
        k = te.reduce_axis((0, width), "k")
        return te.compute((rows,), lambda i: reduce(te.abs(got[i, k].astype("float32") - want[i, k].astype("float32")),
                                                    axis=k))

    poison = te.compute((size,), lambda _: _poison_bits(dtype), "poison")
    funcs = {name: te.create_prim_func([got, want, error(reduce)]) for name, reduce in (("largest", te.max),
                                                                                          ("summed", te.sum))}
    funcs["poison"] = te.create_prim_func([poison])
    if "float" in dtype:
        mix = tvm.tirx.Var("mix", "uint32")
        funcs["seeded"] = te.create_prim_func([te.compute((size,), lambda i: _seeded_value(i, mix, dtype), "seeded"),
                                               mix])
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name) for name, func in funcs.items()})
    if "gpu" in target.keys:
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    return mod


def _seeded_value(index, mix, dtype: str):
    """check.seeded's value at flat `index`, `mix` being check.seed_mix of its seed."""
    u32 = lambda v: tvm.tirx.const(v, "uint32")  # noqa: E731
    x = tvm.tirx.Cast("uint32", index) ^ mix
    for shift, multiplier in ((16, HASH_MIX[1]), (15, HASH_MIX[2])):
        x = (x ^ (x >> u32(shift))) * u32(multiplier)
    x = x ^ (x >> u32(16))
    bits = seeded_bits(dtype)
    steps = tvm.tirx.Cast("int32", x >> u32(32 - bits)) - (1 << (bits - 1))
    return (tvm.tirx.Cast("float32", steps) * tvm.tirx.const(2.0 ** (2 - bits), "float32")).astype(dtype)


def _poison_bits(dtype: str):
    """runner.poison_value in `dtype`, written by its bits: TVM 0.27 spells a bfloat16 NaN constant
    `__float2bfloat16_rn(nanf)`, which nvcc rejects."""
    bits = tvm.DataType(dtype).bits
    pattern = np.array([poison_value(dtype)]).astype(np.dtype(dtype)).view(f"uint{bits}")[0]
    return tvm.tirx.reinterpret(dtype, tvm.tirx.const(int(pattern), f"uint{bits}"))


def _kernel(remote, dtype: str, target, scratch: str):
    """The server module for `dtype`, built here once and loaded on `remote`'s server."""
    key = (id(remote), dtype, str(target))  # the connection is kept beside its module: its id stays its own
    if key not in _KERNELS:
        path = os.path.join(scratch, f"server-kernels-{os.getpid()}-{dtype}.so")
        tvm.compile(server_module(dtype, target), target=target).export_library(path)
        remote.upload(path)
        _KERNELS[key] = (remote, remote.load_module(os.path.basename(path)))
    return _KERNELS[key][1]


def on_server(want, remote, device, target, scratch: str) -> tuple[list, list, list]:
    """(the task's inputs, each output poisoned, each output's reference) on the server, for the
    runner's Expected `want`, made once per task. Seeded inputs are made there by the `seeded`
    kernel (check.seeded's values, bit for bit), the others (zeros) sent. A reference is sent in
    the output's dtype (exact: check.reference_arrays rounds it to it), or None for an output
    checked here: an integer one, or one whose reference has NaN or infinities. The poison is
    written there."""
    inputs = []
    for local, seed in zip(want.inputs, want.seeds):
        if seed is None:
            inputs.append(tvm.runtime.tensor(local.numpy(), device))
            continue
        inputs.append(tvm.runtime.empty(local.shape, local.dtype, device))
        _kernel(remote, str(local.dtype), target, scratch)["seeded"](_flat(inputs[-1]), seed_mix(seed))
    wants, poison = [], []
    for out, local in zip(want.outputs, want.poison):
        checkable = "float" in out.dtype and not out.special.size
        wants.append(tvm.runtime.tensor(in_dtype(out.want, out.dtype), device) if checkable else None)
        poison.append(tvm.runtime.empty(local.shape, out.dtype, device))
        _kernel(remote, out.dtype, target, scratch)["poison"](_flat(poison[-1]))
    return inputs, poison, wants


def _flat(tensor):
    return tensor._create_view((int(np.prod(tensor.shape)),))


PIECE = 1024  # a row longer than this is measured in pieces of at least this many elements, a thread each


def _pieces(width: int) -> int:
    """How many pieces a row of `width` is measured in: the largest power of two dividing it that
    leaves pieces of PIECE or more (the kernels give a thread to each row piece, in order)."""
    pieces = 1
    while width % (2 * pieces) == 0 and width // (2 * pieces) >= PIECE:
        pieces *= 2
    return pieces


def _within_bounds(got, want, out, remote, device, target, scratch: str) -> bool:
    """Whether output `got` is within `out`'s bounds of the reference `want`, both on the server."""
    kernel = _kernel(remote, out.dtype, target, scratch)
    rows, width = out.want.shape
    pieces = _pieces(width)
    shape = (rows * pieces, width // pieces)
    largest, summed = (tvm.runtime.empty((shape[0],), "float32", device) for _ in range(2))
    kernel["largest"](got._create_view(shape), want._create_view(shape), largest)
    kernel["summed"](got._create_view(shape), want._create_view(shape), summed)
    largest, summed = largest.numpy().reshape(rows, -1).max(-1), summed.numpy().reshape(rows, -1).sum(-1)
    return bool((largest <= out.element_bound).all() and (summed <= out.mass_bound).all())


def check_remote(outs: list, wants_there: list, outputs: list, remote, device, target, scratch: str) -> None:
    """check_outputs for `outs` on the server (see the module docstring); raises as it does."""
    if all(want is not None and _within_bounds(got, want, out, remote, device, target, scratch)
           for got, want, out in zip(outs, wants_there, outputs)):
        return
    check_outputs([o.numpy() for o in outs], outputs)
