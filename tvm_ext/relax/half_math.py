"""Half-precision arithmetic around reductions done as PyTorch does it: in float32, rounded per op.

Legalized as written, a fused fp16 softmax sums in fp16 (less accurate than the model) and spends
twice the instructions on half math. Half ops connected to a `sum`/`mean`/`max`/`min` become
`astype(op(astype(a, f32), ...), half)`. Runs before legalization; matmuls keep their dtype."""

from __future__ import annotations

import tvm
from tvm import relax

from .reduce_fusion import rewrite_bindings

HALF = ("float16", "bfloat16")
_ELEMENTWISE = ("add", "subtract", "multiply", "divide", "power", "exp", "log", "sqrt", "rsqrt", "tanh",
                "sigmoid", "erf", "negative")
ELEMENTWISE = [tvm.ir.Op.get(f"relax.{name}") for name in _ELEMENTWISE]
ACCUMULATING = [tvm.ir.Op.get("relax.sum"), tvm.ir.Op.get("relax.mean")]
SELECTING = [tvm.ir.Op.get("relax.max"), tvm.ir.Op.get("relax.min")]


def _is(call, ops) -> bool:
    return isinstance(call, relax.Call) and any(call.op.same_as(op) for op in ops)


def _half(expr) -> bool:
    return isinstance(expr.ty, relax.TensorType) and expr.ty.dtype in HALF


def _row_chain(bindings: list) -> set:
    """Vars bound to half elementwise ops or sum/mean that connect to a half reduction through
    elementwise ops (producers and consumers, transitively)."""
    calls = {b.var: b.value for b in bindings if isinstance(b.value, relax.Call)}
    joins = {v for v, c in calls.items() if _half(v) and _is(c, ELEMENTWISE + ACCUMULATING + SELECTING)}
    readers = {}
    for v in joins:
        for arg in calls[v].args:
            readers.setdefault(arg, set()).add(v)
    todo = [v for v in joins if _is(calls[v], ACCUMULATING + SELECTING) and _half(calls[v].args[0])]
    chain = set()
    while todo:
        v = todo.pop()
        if v in chain:
            continue
        chain.add(v)
        todo += [a for a in calls[v].args if a in joins] + list(readers.get(v, ()))
    return {v for v in chain if not _is(calls[v], SELECTING)}


def _in_float(call: relax.Call, dtype: str) -> relax.Expr:
    args = [relax.op.astype(a, "float32") if _half(a) else a for a in call.args]
    return relax.op.astype(relax.Call(call.op, args, call.attrs, call.ty_args), dtype)


def _rewrite(func: relax.Function):
    bindings = [b for block in func.body.blocks for b in block.bindings]
    chain = _row_chain(bindings)
    if not chain:
        return None
    return lambda b: relax.VarBinding(b.var, _in_float(b.value, b.var.ty.dtype)) if b.var in chain else b


@tvm.transform.module_pass(opt_level=0, name="TVMExtHalfMathInFloat")
def half_math_in_float(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """See the module docstring."""
    return relax.transform.Normalize()(rewrite_bindings(mod, _rewrite))
