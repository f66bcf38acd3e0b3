"""Reduce-centric fusion: one function per reduction and the elementwise work around it.

Runs between FuseOps and FuseTIR and merges groups around reductions of one row signature with
their elementwise/broadcast producers and consumers, which TVM's FuseOps never fuses with a
reduction. Stops at matmuls, layout changes and paths leaving the group; a reduction of a whole
tensor (several long axes) to one value keeps per-element work after it apart. See docs/design.md#fusion-around-reductions."""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from tvm_ext import fallback
from tvm_ext.schedules.analysis import const_int, is_reduce_subgraph, substitute

from .bindings import CALL_TIR


TOPK = tvm.ir.Op.get("relax.topk")
ELEMENTWISE = 1  # op_pattern: 0 elementwise, 1 broadcast
INJECTIVE = 2
OPAQUE = 8  # relax's OpPatternKind kOpaque: FuseOps never fuses it with its neighbours


@dataclass
class _Node:
    """One binding of a dataflow block, as a unit that may join a group."""

    index: int
    binding: relax.VarBinding
    inputs: set = field(default_factory=set)  # indices of the nodes it reads
    signature: tuple | None = None  # (rows shape, reduced shape) of its reductions
    mergeable: bool = False
    injective: bool = False  # holds a layout change (reshape, transpose): joins only as a private producer
    transposes: bool = False  # moves the innermost axis (a patch embedding's flatten(2).transpose(1, 2))
    reorders: bool = False  # a layout change other than one reshape (a transpose, a pad: Swin's windows)
    out_shape: tuple | None = None


def _shape(expr) -> tuple | None:
    return _type_shape(expr.ty)


def _type_shape(ty) -> tuple | None:
    return tuple(ty.shape.values) if isinstance(ty, relax.TensorType) and ty.shape is not None else None


def _same(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _rows_regrouped(shape, rows) -> bool:
    """Whether `shape` is `rows` with only its leading axes merged or split (the same rows of the
    same innermost axis: a norm's output reshaped to [tokens, hidden] for the next Linear)."""
    if shape is None or rows is None or not shape or not rows or not tvm_ffi.structural_equal(shape[-1], rows[-1]):
        return False
    return tvm.sym.Analyzer().can_prove_equal(_product(shape[:-1]), _product(rows[:-1]))


def _product(dims):
    return functools.reduce(lambda a, b: a * b, dims, tirx.IntImm("int64", 1))


def _same_signature(a, b) -> bool:
    return _same(a[0], b[0]) and _same(a[1], b[1])


def kernel_calls(mod: tvm.IRModule, call: relax.Call) -> tuple[list, dict] | None:
    """(the call_tir calls a node stands for: itself, or a FuseOps group's body; the group's
    symbolic dims -> the caller's), or None if the node is not kernels."""
    if call.op.same_as(CALL_TIR):
        return [call], {}
    func = mod[call.op] if isinstance(call.op, relax.GlobalVar) else None
    if isinstance(func, relax.Function) and func.attrs and func.attrs.get("Primitive", False):
        calls = [b.value for block in func.body.blocks for b in block.bindings]
        if not all(isinstance(c, relax.Call) and c.op.same_as(CALL_TIR) for c in calls):
            return None
        dims = {}
        for param, arg in zip(func.params, call.args):
            passed = arg.values if isinstance(arg, relax.ShapeExpr) else _shape(arg)  # a shape: the dims passed as scalars
            for inner, outer in zip(param.ty.values if isinstance(arg, relax.ShapeExpr) else _shape(param) or (), passed or ()):
                if isinstance(inner, tirx.Var):
                    dims[inner] = outer
        return calls, dims
    return None


@tvm.transform.module_pass(opt_level=0, name="TVMExtReductionsApart")
def reductions_apart(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark every reduction kernel opaque to FuseOps, so that FuseReduceGroups alone decides what joins
    it. FuseOps fused the work on every element after a reduction to one value into its function,
    where each thread redid the whole reduction (T5's overflow clamp)."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and is_reduce_subgraph(func):
            mod.update_func(gv, func.with_attr("op_pattern", OPAQUE))
    return mod


def op_pattern(func: tirx.PrimFunc) -> int | None:
    """The op_pattern AnnotateTIROpPattern gave a PrimFunc, None where it has none."""
    return int(func.attrs["op_pattern"]) if func.attrs and "op_pattern" in func.attrs else None


def _classify(mod: tvm.IRModule, node: _Node) -> None:
    """Set what a node can merge as: reductions of one signature and elementwise work, or nothing."""
    value = node.binding.value
    found = kernel_calls(mod, value) if isinstance(value, relax.Call) else None
    if not found:
        return
    calls, dims = found
    signatures, injective = [], False
    for call in calls:
        func = mod[call.args[0]]
        pattern = op_pattern(func)
        if is_reduce_subgraph(func):
            rows = max((_shape(a) for a in call.args[1].fields if _shape(a) is not None), key=len, default=None)
            signatures.append(tuple(tuple(substitute(d, dims) for d in shape) if shape else shape
                                    for shape in (rows, _type_shape(call.ty_args[0]))))
        elif pattern is None or pattern > INJECTIVE:
            return
        else:
            node.reorders |= pattern == INJECTIVE and (injective or not _is_reshape(func))  # or a second one
            injective |= pattern == INJECTIVE
            node.transposes |= pattern == INJECTIVE and _moves_innermost(func)
    if any(not _same_signature(s, signatures[0]) for s in signatures):
        return
    node.signature = signatures[0] if signatures else None
    node.out_shape = _shape(node.binding.var)
    node.mergeable, node.injective = True, injective


def _is_reshape(func: tirx.PrimFunc) -> bool:
    """Whether `func` is one block copying its input to its output in the same row-major order."""
    blocks = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: blocks.append(b) if b.iter_vars else None), order="pre")
    if len(blocks) != 1 or not isinstance(blocks[0].body, tirx.BufferStore):
        return False
    store = blocks[0].body
    load = store.value
    if not isinstance(load, tvm.ir.TensorLoad):
        return False
    analyzer = tvm.sym.Analyzer()
    for iv in blocks[0].iter_vars:
        analyzer.bind(iv.var, iv.dom)

    def flat(indices, shape):
        return functools.reduce(lambda acc, pair: acc * pair[1] + pair[0], zip(indices, shape), tirx.IntImm("int64", 0))

    return analyzer.can_prove_equal(flat(store.indices, store.buffer.shape), flat(load.indices, load.source.shape))


def _moves_innermost(func: tirx.PrimFunc) -> bool:
    """Whether some block reads an input with a last index that does not follow the block's
    innermost axis (a transpose of the last axis), both longer than one."""
    moved = []

    def visit(block):
        spatial = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
        if not spatial or const_int(spatial[-1].dom.extent) == 1:
            return
        loads = []
        tvm_ffi.structural_walk(block.body, (tvm.ir.TensorLoad, loads.append), order="pre")
        for load in loads:
            if load.indices and const_int(load.source.shape[-1]) != 1:
                used = []
                tvm_ffi.structural_walk(load.indices[-1], (tirx.Var, used.append), order="post")
                moved.extend([load] if not any(spatial[-1].var.same_as(v) for v in used) else [])
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit), order="pre")
    return bool(moved)


def _is_whole(signature) -> bool:
    """Whether the reductions leave one value of a tensor with several long axes (T5's
    `isinf(x).any()` before its clamp); a single row ([1, ..., n]: a decoding step's norm) is a
    row like any other, and the templates serve it with the work after it."""
    if signature[1] is None or not all(const_int(d) == 1 for d in signature[1]):
        return False
    return sum(const_int(d) != 1 for d in signature[0]) > 1


class _Groups:
    """Union-find of nodes with each group's signature; merges only what keeps the graph acyclic."""

    def __init__(self, nodes: list):
        self.nodes, self.parent = nodes, list(range(len(nodes)))
        self.signature = {n.index: n.signature for n in nodes}

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def members(self, root: int) -> list:
        return [n for n in self.nodes if self.find(n.index) == root]

    def _fits(self, signature, members) -> bool:
        rows, reduced = signature
        return all(n.signature is not None or _same(n.out_shape, rows) or _same(n.out_shape, reduced)
                   or _rows_regrouped(n.out_shape, rows) and not n.reorders for n in members)

    def _shares_layout_change(self, members: list) -> bool:
        """Whether a layout-changing member's value is read outside the group beside another
        member's: the merged function would then write it as an extra output, which the row
        templates do not match (the residual sum before a LLaMA RMSNorm). Private to the group (a
        mask and scale before a softmax), the change is only index arithmetic in the fused kernel;
        a reshape that is the group's only output (a norm's rows regrouped for the next Linear) is
        its result where no member changes the layout otherwise (Swin's windows before its
        LayerNorm: the templates take one or the other)."""
        inside = {n.index for n in members}
        read_outside = [m for m in members if any(m.index in n.inputs for n in self.nodes if n.index not in inside)]
        reorders = any(m.reorders for m in members)
        return any(m.injective and (len(read_outside) > 1 or reorders) for m in read_outside)

    def _detour(self, a: int, b: int) -> bool:
        """Whether some path from group a to group b (or back) passes outside both."""
        consumers: dict = {}
        for n in self.nodes:
            for i in n.inputs:
                consumers.setdefault(self.find(i), set()).add(self.find(n.index))
        for start, end in ((a, b), (b, a)):
            frontier = [g for g in consumers.get(start, ()) if g not in (a, b)]
            seen = set(frontier)
            while frontier:
                g = frontier.pop()
                if g == end:
                    return True
                for nxt in consumers.get(g, ()):
                    if nxt == end:
                        return True
                    if nxt not in seen and nxt != start:
                        seen.add(nxt)
                        frontier.append(nxt)
        return False

    def try_merge(self, a: int, b: int) -> bool:
        """Merge the group of producer `a` into the group of its consumer `b`, if allowed."""
        a, b = self.find(a), self.find(b)
        sa, sb = self.signature[a], self.signature[b]
        if a == b or (sa is None and sb is None):  # elementwise with elementwise is FuseOps' business
            return False
        if sa is not None and sb is not None and (not _same_signature(sa, sb) or _same(sa[0], sa[1])):
            return False  # a whole norm op (rows in, rows out) hides its axes: it takes elementwise work only
        signature = sa or sb
        if sa is not None and sb is None and _is_whole(sa) and any(_same(n.out_shape, sa[0]) for n in self.members(b)):
            return False  # every element would wait for a reduction over all of them: no template of ours
        members = self.members(a) + self.members(b)
        if any(n.transposes for n in members):
            return False  # the reduction would read its rows down columns: no row template takes that
        if not self._fits(signature, members) or self._detour(a, b) or self._shares_layout_change(members):
            return False
        self.parent[b] = a
        self.signature[a] = signature
        return True


def _groups(mod: tvm.IRModule, block: relax.DataflowBlock) -> tuple[list, _Groups]:
    nodes = [_Node(i, b) for i, b in enumerate(block.bindings)]
    defined = {n.binding.var: n.index for n in nodes}
    for node in nodes:
        used = []
        tvm_ffi.structural_walk(node.binding.value, (relax.Var, used.append), order="pre")
        node.inputs = {defined[v] for v in used if v in defined}
        _classify(mod, node)
    groups = _Groups(nodes)
    changed = True
    while changed:  # to a fixpoint: a producer may become mergeable once its consumer joined a group
        changed = False
        for node in nodes:
            for i in sorted(node.inputs):
                if node.mergeable and nodes[i].mergeable:
                    changed |= groups.try_merge(i, node.index)
    return nodes, groups


def _inline(mod, member: _Node, subst: dict, bindings: list) -> None:
    """Append `member`'s kernel calls to `bindings`, its inputs replaced through `subst`."""
    value = member.binding.value
    _, dims = kernel_calls(mod, value)
    if value.op.same_as(CALL_TIR):
        steps, result = [(member.binding.var, value)], member.binding.var
    else:  # a FuseOps group: its body, its parameters and symbolic dims replaced by the caller's
        func = mod[value.op]
        for param, arg in zip(func.params, value.args):
            subst[param] = subst.get(arg, arg)
        steps, result = [(b.var, b.value) for block in func.body.blocks for b in block.bindings], func.body.body
    for var, call in steps:
        args = relax.Tuple([substitute(a, dims) if isinstance(a.ty, tvm.ir.PrimType) else subst.get(a, a)
                            for a in call.args[1].fields])
        extra = [relax.ShapeExpr([substitute(v, dims) for v in e.values]) if isinstance(e, relax.ShapeExpr) else e
                 for e in call.args[2:]]
        new_call = relax.Call(call.op, [call.args[0], args, *extra], call.attrs, [_retyped(t, dims) for t in call.ty_args])
        subst[var] = relax.DataflowVar(var.name, _retyped(var.ty, dims))
        bindings.append(relax.VarBinding(subst[var], new_call))
    subst[member.binding.var] = subst[result]


def _retyped(ty, dims: dict):
    """A tensor type with the symbolic dims of `dims` replaced (other types as they are)."""
    if not dims or not isinstance(ty, relax.TensorType) or ty.shape is None:
        return ty
    return relax.TensorType([substitute(d, dims) for d in ty.shape.values], ty.dtype)


def _operands(call: relax.Call) -> list:
    """The Relax values a kernel call reads (not its symbolic dims or output types)."""
    return list(call.args[1].fields) if call.op.same_as(CALL_TIR) else list(call.args)


def _group_function(mod, members: list, outputs: list) -> tuple[relax.Function, list]:
    """(the Primitive function computing `members`, the outside values it takes)."""
    inside = {m.binding.var for m in members}
    external: list = []
    for m in members:  # tensor constants too: FuseTIR accepts none inside a primitive function
        external += [v for v in _operands(m.binding.value) if isinstance(v, (relax.Var, tvm.ir.expr.GenericConst))
                     and v not in inside and not any(v.same_as(e) for e in external)]
    # symbolic dims the kernels take as scalars (those no operand's shape defines, as in `past + 1`)
    # go in as one shape, as FuseOps passes them: a shape parameter defines them for the types inside
    passed = [d for m in members for v in _operands(m.binding.value)
              for d in (v.values if isinstance(v, relax.ShapeExpr) else [v] if isinstance(v.ty, tvm.ir.PrimType) else [])]
    dims = list({str(d): d for d in passed}.values())
    external = [v for v in external if not isinstance(v.ty, tvm.ir.PrimType)]
    params = [relax.Var(v.name if isinstance(v, relax.Var) else f"const{i}", v.ty) for i, v in enumerate(external)]
    subst, bindings = dict(zip(external, params)), []
    if dims:
        external.append(relax.ShapeExpr(dims))
        params.append(relax.Var("tir_vars", external[-1].ty))
    for m in members:
        _inline(mod, m, subst, bindings)
    read_inside = {v for m in members for v in _operands(m.binding.value)}
    for v in outputs:
        member = next(m for m in members if m.binding.var.same_as(v))
        if v in read_inside and member.signature is None:
            # elementwise work that is also an input of the chain (a residual sum, T5's clamp):
            # computed twice, so that the copy the chain reads inlines into it and the output is
            # written by the last loop nest
            again = dict(subst)
            _inline(mod, member, again, bindings)
            subst[v] = again[v]
    results = [subst[v] for v in outputs]
    if len(results) == 1:
        out = relax.Var("gv", results[0].ty)
        bindings.append(relax.VarBinding(out, results[0]))
    else:
        out = relax.Var("gv", relax.TupleType([r.ty for r in results]))
        bindings.append(relax.VarBinding(out, relax.Tuple(results)))
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], out)
    func = relax.Function(params, body, out.ty, is_pure=True).with_attr("Primitive", True)
    return func, external


def merged_call(builder: relax.BlockBuilder, mod, bindings: list, name: str) -> relax.Call:
    """A call of a new Primitive function computing `bindings` (kernel calls or FuseOps groups, in
    order) and returning the last one's value."""
    func, external = _group_function(mod, [_Node(i, b) for i, b in enumerate(bindings)], [bindings[-1].var])
    return relax.Call(builder.add_func(func, ("fused_" + name)[:80]), external)


def _rewrite_block(builder: relax.BlockBuilder, mod, block, used_after: set):
    nodes, groups = _groups(mod, block)
    by_root: dict = {}
    for n in nodes:
        by_root.setdefault(groups.find(n.index), []).append(n)
    fused = {root: ms for root, ms in by_root.items() if len(ms) > 1}
    if not fused:
        return block
    readers: dict = {}
    for n in nodes:
        for i in n.inputs:
            readers.setdefault(i, set()).add(groups.find(n.index))
    emitted: dict = {}  # root -> the bindings that replace its members
    for root, members in fused.items():
        outputs = [m.binding.var for m in members
                   if m.binding.var in used_after or any(r != root for r in readers.get(m.index, ()))]
        func, external = _group_function(mod, members, outputs)
        name = "fused_" + "_".join(dict.fromkeys(_name(mod, m) for m in members))
        unfusable = _fuse_tir_error(mod, func)
        if unfusable is not None:  # its members stay as FuseOps left them
            fallback.warn(name[:80], "FuseReduceGroups", unfusable)
            continue
        gv = builder.add_func(func, name[:80])
        call = relax.Call(gv, external)
        if len(outputs) == 1:
            emitted[root] = [relax.VarBinding(outputs[0], call)]
        else:
            tup = relax.DataflowVar("fused", relax.TupleType([v.ty for v in outputs]))
            emitted[root] = [relax.VarBinding(tup, call)] + [
                relax.VarBinding(v, relax.TupleGetItem(tup, i)) for i, v in enumerate(outputs)]
    fused = {root: members for root, members in fused.items() if root in emitted}
    return relax.DataflowBlock(_topological(nodes, groups, fused, emitted)) if fused else block


def _fuse_tir_error(mod: tvm.IRModule, func: relax.Function) -> Exception | None:
    """What FuseTIR raises making one kernel of the group function `func`, or None. Its matcher
    wants each kernel's shapes spelled as the values passed to it (`4 * s` is not `s * 4`), which a
    group of kernels typed apart may break (Swin's window masks built for any batch)."""
    called = []  # the kernels the group calls: FuseTIR needs no other function of the model
    tvm_ffi.structural_walk(func.body, (tvm.ir.GlobalVar, called.append), order="pre")
    builder = relax.BlockBuilder(tvm.IRModule({gv: mod[gv] for gv in called}))
    group = builder.add_func(func, "group")
    params = [relax.Var(p.name, p.ty) for p in func.params]
    with builder.function("main", params):
        with builder.dataflow():
            out = builder.emit_output(relax.Call(group, params))
        builder.emit_func_output(out)
    try:
        relax.transform.FuseTIR()(builder.get())
    except Exception as err:  # noqa: BLE001 (whatever it is, the group is not built)
        return err
    return None


def _topological(nodes, groups, fused, emitted) -> list:
    """Bindings in an order where every value is defined before use: groups are emitted whole, in
    the place of their last-ready member, everything else keeps its relative order."""
    unit = {n.index: groups.find(n.index) if groups.find(n.index) in fused else ("single", n.index) for n in nodes}
    needs = {}
    for n in nodes:
        needs.setdefault(unit[n.index], set()).update(unit[i] for i in n.inputs if unit[i] != unit[n.index])
    order, done = [], set()
    pending = list(dict.fromkeys(unit[n.index] for n in nodes))
    while pending:
        ready = next(u for u in pending if needs.get(u, set()) <= done)
        pending.remove(ready)
        done.add(ready)
        order += emitted[ready] if ready in emitted else [nodes[ready[1]].binding]
    return order


def with_blocks(func: relax.Function, blocks: list) -> relax.Function:
    """`func` with its body's binding blocks replaced."""
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def _name(mod, node: _Node) -> str:
    value = node.binding.value
    target = value.args[0] if value.op.same_as(CALL_TIR) else value.op
    return target.name_hint.removeprefix("fused_")


@tvm.transform.module_pass(opt_level=0, name="TVMExtFuseReduceGroups")
class FuseReduceGroups:
    """Merge FuseOps' output around reductions (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Primitive", False)):
                continue
            if not isinstance(func.body, relax.SeqExpr):
                continue
            blocks = list(func.body.blocks)
            new_blocks = []
            for i, block in enumerate(blocks):
                if not isinstance(block, relax.DataflowBlock):
                    new_blocks.append(block)
                    continue
                after = []
                for later in blocks[i + 1:]:
                    tvm_ffi.structural_walk(later, (relax.Var, after.append), order="pre")
                tvm_ffi.structural_walk(func.body.body, (relax.Var, after.append), order="pre")
                used_after = set(after) | {b.var for b in block.bindings if not isinstance(b.var, relax.DataflowVar)}
                new_blocks.append(_rewrite_block(builder, mod, block, used_after))
            if any(a is not b for a, b in zip(new_blocks, blocks)):
                builder.update_func(gv, with_blocks(func, new_blocks))
        return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(builder.get()))


def rewrite_bindings(mod: tvm.IRModule, rewriter) -> tvm.IRModule:
    """`mod` with each Relax function's bindings passed through `rewriter(func)` (a function of
    one binding, or None to leave that function alone)."""
    builder = relax.BlockBuilder(mod)
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        rewrite = rewriter(func)
        if rewrite is not None:
            blocks = [type(block)([rewrite(b) for b in block.bindings]) for block in func.body.blocks]
            builder.update_func(gv, with_blocks(func, blocks))
    return builder.get()


@tvm.transform.module_pass(opt_level=0, name="TVMExtMaxFromTopOne")
def max_from_top_one(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """`x.max(-1, keepdim=True)[0]` in PyTorch reaches Relax as a top-1 sort (TVM's frontend maps
    max-with-indices to topk): where only the values are used, it becomes the max (min) reduction
    it is, which legalizes to one reduction and fuses (a spelled-out softmax: 1 kernel, not 7)."""
    mod = relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(
        rewrite_bindings(mod, _forward_tuple_items)))
    return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(rewrite_bindings(mod, _top_one_as_max)))


def _is_top_one(call) -> bool:
    return call.op.same_as(TOPK) and int(call.attrs.k) == 1


def _top_one_as_max(func: relax.Function):
    """Rewrites `v = top[0]` of a top-1 sort read only for its values into `v = max(x)` (or min)."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    tops = {b.var: b.value for b in bindings if isinstance(b.value, relax.Call) and _is_top_one(b.value)}
    values_only = {v for v in tops if _only_values_read(v, bindings, func.body.body)}
    if not values_only:
        return None
    reduce_op = {True: relax.op.max, False: relax.op.min}

    def rewrite(b):
        value = b.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in values_only:
            top = tops[value.tuple_value]
            return relax.VarBinding(b.var, reduce_op[bool(top.attrs.largest)](
                top.args[0], axis=[int(top.attrs.axis)], keepdims=True))
        return b
    return rewrite


def _forward_tuple_items(func: relax.Function):
    """`t = (a, b); u = t[0]` -> `u = a` (the frontend rebuilds topk's tuple before reading it),
    so that a value read of the topk shows as one."""
    literals = {b.var: b.value for block in func.body.blocks for b in block.bindings
                if isinstance(b.value, relax.Tuple)}

    def forward(b):
        value = b.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in literals:
            return relax.VarBinding(b.var, literals[value.tuple_value].fields[value.index])
        return b
    return forward


def _only_values_read(var, bindings, result) -> bool:
    """Whether `var` (a topk's tuple) is read only as element 0 (the values, not the indices)."""
    reads, value_reads = [], []
    for b in bindings:
        tvm_ffi.structural_walk(b.value, (relax.Var, lambda v: reads.append(v) if v.same_as(var) else None),
                                order="pre")
        if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value.same_as(var) and b.value.index == 0:
            value_reads.append(b)
    tvm_ffi.structural_walk(result, (relax.Var, lambda v: reads.append(v) if v.same_as(var) else None), order="pre")
    return bool(value_reads) and len(reads) == len(value_reads)
