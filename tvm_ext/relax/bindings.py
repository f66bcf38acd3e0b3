"""What the Relax rewrites of this package ask of a function's bindings: which op a value calls,
what each variable is bound to, and who uses it (a rewrite may only fold away a value nothing else
reads); the shapes of its values."""

from __future__ import annotations

import tvm
from tvm import relax


CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def op_name(expr) -> str:
    """The Relax op `expr` calls ("relax.matmul"), "" for anything else."""
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else ""


class Bindings:
    """The values of one function: what each variable is bound to and how many bindings use it
    (a variable read twice by one binding counts once)."""

    def __init__(self, func: relax.Function):
        self.value, self.uses, self.user = {}, {}, {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.value[binding.var] = binding.value
                    for var in relax.analysis.free_vars(binding.value):
                        self.uses[var] = self.uses.get(var, 0) + 1
                        self.user[var] = binding.var
        for var in relax.analysis.free_vars(func.body.body):
            self.uses[var] = self.uses.get(var, 0) + 1

    def only_use(self, var) -> bool:
        return self.uses.get(var, 0) == 1

    def sole_user(self, var):
        """The binding that is the one use of `var`, or None."""
        return self.user.get(var) if self.only_use(var) else None

    def producer(self, expr):
        return self.value.get(expr) if isinstance(expr, relax.Var) else None


def shape_of(expr) -> list | None:
    """A tensor's dims, ints where static, None when its rank is unknown."""
    shape = expr.ty.shape
    return None if shape is None else [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in shape.values]


def static_shape(expr) -> list[int] | None:
    """A tensor's dims when all are static, else None."""
    if not isinstance(expr.ty, relax.TensorType) or not isinstance(expr.ty.shape, relax.ShapeExpr):
        return None
    dims = shape_of(expr)
    return dims if dims is not None and all(isinstance(d, int) for d in dims) else None
