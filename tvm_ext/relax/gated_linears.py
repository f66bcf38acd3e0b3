"""A gated MLP's activation in its joined matmul's epilogue (sm_90a): silu(x @ Wg.T) * (x @ Wu.T) as one kernel.

Without it, a second kernel reads both halves of the joined gate/up output after the matmul has
written twice the bytes the MLP goes on with. The joint weight's rows alternate runs of GATE_RUN
rows of each layer, so one thread holds both halves of an output column; the matmul and its reader
become one function (docs/design.md#warpgroup-matmuls-wgmma)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvm_ext.schedules.contracts import GATE_RUN, gate_column
from tvm_ext.schedules.wgmma_matmul import K_TILE

from .bindings import Bindings
from .reduce_fusion import INJECTIVE, kernel_calls, merged_call, op_pattern, with_blocks

OUT_ELEMWISE_FUSABLE = 4  # op_pattern of a matmul's PrimFunc


def interleavable(weights: list[np.ndarray]) -> bool:
    """Whether joined layers can share their tiles: two of one width, a whole number of runs, a
    depth the wgmma template takes (each row class's template then writes a gated epilogue)."""
    return len(weights) == 2 and weights[0].shape == weights[1].shape and weights[0].shape[0] % GATE_RUN == 0 \
        and weights[0].shape[1] % K_TILE == 0


def interleaved(weights: list[np.ndarray]) -> np.ndarray:
    """The joint [2n, k] weight whose row gate_column(j, half) is row j of layer `half`'s."""
    n = weights[0].shape[0]
    joint = np.empty((2 * n, *weights[0].shape[1:]), weights[0].dtype)
    for half, weight in enumerate(weights):
        joint[gate_column(np.arange(n), half)] = weight
    return joint


def half_view(joint: relax.Expr, half: int, rows: int, n: int) -> relax.Expr:
    """Layer `half`'s [rows, n] result, read out of the interleaved joint output."""
    runs = relax.op.reshape(joint, [rows, n // GATE_RUN, 2, GATE_RUN])
    return relax.op.reshape(relax.op.strided_slice(runs, axes=[2], begin=[half], end=[half + 1], assume_inbound=True),
                            [rows, n])


@tvm.transform.module_pass(opt_level=0, name="TVMExtFuseGatedEpilogues")
def fuse_gated_epilogues(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Merge each matmul group whose only reader is one elementwise group reading it through
    `half_view` into one Primitive function (between FuseOps and FuseTIR)."""
    builder = relax.BlockBuilder(mod)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Primitive", False)) \
                or not isinstance(func.body, relax.SeqExpr):
            continue
        chain, blocks = Bindings(func), []
        for block in func.body.blocks:
            merged, defined = {}, {b.var: b for b in block.bindings}  # merged: epilogue's var -> (matmul, epilogue)
            for binding in block.bindings:
                producer = _gated_producer(mod, chain, binding, defined)
                if producer is not None:
                    merged[binding.var] = (producer, binding)
            absorbed = {producer.var for producer, _ in merged.values()}
            bindings = []
            for binding in block.bindings:
                if binding.var in absorbed:
                    continue
                if binding.var in merged:
                    producer = merged[binding.var][0]
                    name = producer.value.op.name_hint.removeprefix("fused_") + "_gated"
                    binding = relax.VarBinding(binding.var, merged_call(builder, mod, list(merged[binding.var]), name))
                bindings.append(binding)
            blocks.append(type(block)(bindings) if merged else block)
        if any(a is not b for a, b in zip(blocks, func.body.blocks)):
            builder.update_func(gv, with_blocks(func, blocks))
    return relax.transform.DeadCodeElimination()(builder.get())


def _gated_producer(mod, chain: Bindings, binding, defined: dict):
    """The binding of the matmul group `binding` (an elementwise group) reads through half_view,
    when that is its only reader and both are in one block (whose bindings `defined` holds by
    variable); else None."""
    group, calls = _group(mod, binding.value)
    if group is None or any(_pattern(mod, c) > INJECTIVE for c in calls):
        return None
    for arg, param in zip(binding.value.args, group.params):
        producer = defined.get(arg)
        if producer is None or not chain.only_use(arg):
            continue
        _, producer_calls = _group(mod, producer.value)
        if any(_pattern(mod, c) == OUT_ELEMWISE_FUSABLE for c in producer_calls) \
                and any(_is_run_view(call, param) for call in calls):
            return producer
    return None


def _group(mod, value) -> tuple[relax.Function | None, list]:
    """(the FuseOps group, a Primitive function of kernel calls, that `value` calls, its kernel
    calls), or (None, []) for any other value."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, relax.GlobalVar):
        return None, []
    func, found = mod[value.op], kernel_calls(mod, value)
    return (func, found[0]) if func.attrs and func.attrs.get("Primitive", False) and found else (None, [])


def _pattern(mod, call) -> int:
    """The op_pattern of a kernel call's PrimFunc (none known: above every pattern, like opaque)."""
    pattern = op_pattern(mod[call.args[0]])
    return 1 << 30 if pattern is None else pattern


def _is_run_view(call, param) -> bool:
    """Whether `call` is half_view's first reshape (into runs of GATE_RUN, two per column group) of `param`."""
    out = call.ty_args[0]  # a tuple for a kernel with several outputs
    shape = out.shape if isinstance(out, relax.TensorType) else None
    return any(a.same_as(param) for a in call.args[1].fields) and shape is not None and \
        [d.value if isinstance(d, tvm.tirx.IntImm) else None for d in shape.values[-2:]] == [2, GATE_RUN]
