"""Index wraps a symbolic shape leaves in legalized TIR, dropped where they cannot wrap.

TOPI's reshape of a tensor with a symbolic dim s reads `x[(... + i) % s, ...]`: provably `x[i, ...]`
for i in [0, s), but TVM's simplifier does not prove it, and AnnotateTIROpPattern calls such a
function opaque. FuseOps then fuses nothing across it: in a build for any batch or length each
slice of a joined matmul's output became a kernel of its own. Here `a % b` and `a // b` whose `a`
lies in [0, b) become `a` and 0, the block's iterators bound to their domains and the function's
symbolic dims to at least 1 (a tensor of a dim 0 holds nothing to index).

The same reshape into a leading axis of 1 ([s, d] to [1, s, h, d / h]) reads `x[0 + v0 * s + v1, ...]`
with v0 in [0, 1): an index that names s, which AnnotateTIROpPattern also calls opaque (a load
reading a variable that the store does not index). Such indices are simplified, which drops s."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad builds in 0.27


def _symbolic_dims(func: tirx.PrimFunc) -> list:
    """The tirx.Vars among the function's buffer shapes."""
    found = {}
    for param in func.params:
        for dim in getattr(param, "shape", []):
            for var in [] if isinstance(dim, tirx.IntImm) else tirx.analysis.undefined_vars(dim):
                found[var.name] = var
    return list(found.values())


def drop_wraps(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its wraps that cannot wrap dropped (see the module docstring); itself when it has none."""
    dims = _symbolic_dims(func)
    if not dims:
        return func
    analyzer = tvm.sym.Analyzer()
    for dim in dims:
        analyzer.bind(dim, tvm.ir.Range.from_min_extent(tirx.IntImm(str(dim.ty), 1), tirx.IntImm(str(dim.ty), 2**31 - 1)))

    def bind(block):
        for iv in block.iter_vars:
            analyzer.bind(iv.var, iv.dom)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, bind), order="pre")  # every block's iterators, before any index is read

    def within(a, b) -> bool:
        return analyzer.can_prove(a >= 0) and analyzer.can_prove(a < b)

    def wrap(expr):
        return expr.a if within(expr.a, expr.b) else expr

    def quotient(expr):
        return tirx.IntImm(str(expr.ty), 0) if within(expr.a, expr.b) else expr

    def dims_in(expr) -> set:
        return {d.name for d in dims if any(v.same_as(d) for v in tirx.analysis.undefined_vars(expr))}

    def plain_index(index):
        """`index` simplified where that drops a symbolic dim from it, else as it is."""
        named = dims_in(index)
        if not named:
            return index
        simple = analyzer.simplify(index)
        return simple if dims_in(simple) < named else index

    wraps = [(tirx.FloorMod, wrap), (tirx.FloorDiv, quotient)]

    def load(node):  # (a load's handler takes its indices' wraps too)
        indices = [plain_index(tvm_ffi.structural_map(i, wraps)) for i in node.indices]
        return node if all(a.same_as(b) for a, b in zip(indices, node.indices)) else tirx.BufferLoad(node.source, indices)

    body = tvm_ffi.structural_map(func.body, [*wraps, (TensorLoad, load)])
    return func if body.same_as(func.body) else func.with_body(body)


@tirx.transform.prim_func_pass(opt_level=0, name="TVMExtDropSymbolicWraps")
def drop_symbolic_wraps(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """drop_wraps on every PrimFunc of a module."""
    return drop_wraps(func)
