"""PyTorch models in: `torch.export` then TVM 0.27's `from_exported_program`, with errors a user can act on.

PyTorch is imported here only when called (it is an optional extra: deployment needs none of it).
"""

from __future__ import annotations

import tvm
from tvm import relax


class UnsupportedOperatorError(ValueError):
    """The model uses PyTorch ops that TVM's frontend cannot convert; `ops` names them."""

    def __init__(self, ops: list[str]):
        self.ops = ops
        super().__init__(f"TVM 0.27's PyTorch frontend cannot import the op(s) {', '.join(ops)}: rewrite those "
                         "parts of the model with supported ops, or keep them outside the compiled module")


class ExportError(ValueError):
    """`torch.export` refused the model (e.g. `dynamic` dims whose range the model does not allow);
    the message holds PyTorch's whole text, suggested fixes included."""


def _arguments(node, importer=None) -> dict:
    """`node`'s arguments by their names in the op's schema, defaults filled in; tensors and sizes as the
    importer's Relax values, or as fx nodes without an importer."""
    named = {}
    for i, arg in enumerate(node.target._schema.arguments):
        given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
        named[arg.name] = given if importer is None else importer._retrieve_args(given)
    return named


def _cast(bb: relax.BlockBuilder, x, dtype: str):
    """`x` in `dtype`: itself when it already is, else a cast the block builder emits."""
    return x if str(x.ty.dtype) == dtype else bb.emit(relax.op.astype(x, dtype))


def _rounded(importer, dtype: str, product, bias):
    """A float32 product (PyTorch accumulates matmuls and convs in float32 too) rounded to the inputs'
    dtype, then the bias in that dtype. `product`: an expression, or a value the importer emitted."""
    bb = importer.block_builder
    out = _cast(bb, product if isinstance(product, relax.Var) else bb.emit(product), dtype)
    return out if bias is None else bb.emit(relax.op.add(out, bias))


def _linear(node, importer):
    """aten.linear. TVM 0.27's converters of matmuls return float32 whatever the inputs, so in an fp16
    model the next op meets mixed dtypes and the import fails ("Binary operators must have the same
    datatype"), or the rest of the model runs in float32."""
    args = importer.retrieve_args(node)
    x, weight, bias = args[0], args[1], (args[2] if len(args) > 2 else None)
    return _rounded(importer, str(x.ty.dtype), relax.op.linear(x, weight, None, "float32"), bias)


def _addmm(node, importer):
    """aten.addmm (linear with a bias on 2-D inputs, as export decomposes it): same fix as _linear."""
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
        return importer._addmm(node)  # scaled forms: TVM's own (fine for float32)
    bias, a, b = importer.retrieve_args(node)[:3]
    return _rounded(importer, str(a.ty.dtype), relax.op.matmul(a, b, out_dtype="float32"), bias)


def _matmul(node, importer):
    """aten.matmul / mm / bmm: same fix as _linear."""
    a, b = importer.retrieve_args(node)[:2]
    return _rounded(importer, str(a.ty.dtype), relax.op.matmul(a, b, out_dtype="float32"), None)


def _convolution(node, importer):
    """aten.convolution (what export leaves of every conv) and conv1d/2d/3d, conv_transpose1d/2d: TVM's
    conv implementations (layouts and all), bias left out, so that the float32 result is rounded to the
    input dtype before the bias is added, as in _linear (TVM's own fail on an fp16 conv with a bias)."""
    args = _arguments(node, importer)
    x, bias = args["input"], args["bias"]
    transposed = args.get("transposed", node.target.__name__.startswith("conv_transpose"))
    spatial = x.ty.ndim - 2
    impl = getattr(importer, f"_conv{'_transpose' if transposed else ''}{spatial}d_impl", None)
    if impl is None:
        raise ValueError(f"TVM 0.27 has no {spatial}-D {'transposed ' if transposed else ''}convolution")
    extra = {"output_padding": args["output_padding"]} if transposed else {}
    out = impl(x, args["weight"], None, strides=args["stride"], padding=args["padding"], dilation=args["dilation"],
               groups=args["groups"], **extra)
    if bias is not None:
        bias = relax.op.reshape(bias, (1, -1) + (1,) * spatial)
    return _rounded(importer, str(x.ty.dtype), out, bias)


def _batch_norm(node, importer):
    """aten._native_batch_norm_legit_no_training (BatchNorm in eval mode) of fp16 / bf16 input: in float32,
    rounded once, as PyTorch computes it. TVM's legalization of an fp16 batch_norm returns float32 (TOPI
    adds epsilon as a float32 constant), so an fp16 ResNet ran in float32 from its first BatchNorm on, and fp16
    MobileNetV3 failed to build (its squeeze-excite multiplies fp16 by that float32)."""
    args = _arguments(node, importer)
    x = args["input"]
    dtype = str(x.ty.dtype)
    if dtype == "float32":
        return importer._batch_norm_legit_no_training(node)
    bb = importer.block_builder

    def in_float32(t):
        return None if t is None else bb.emit(relax.op.astype(t, "float32"))

    channels = x.ty.shape[1]
    weight, bias = in_float32(args["weight"]), in_float32(args["bias"])
    out = bb.emit(relax.op.nn.batch_norm(
        in_float32(x), relax.op.ones((channels,), "float32") if weight is None else weight,
        relax.op.zeros((channels,), "float32") if bias is None else bias, in_float32(args["running_mean"]),
        in_float32(args["running_var"]), axis=1, epsilon=args["eps"], center=bias is not None,
        scale=weight is not None, training=False))
    return bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(out, 0)), dtype))


def _cumulative(op):
    """aten.cumsum / cumprod. PyTorch sums and multiplies bool and integer inputs in int64 unless `dtype=`
    says otherwise; TVM's converter keeps the input dtype, and LLVM codegen fails on a bool cumsum
    (what `(ids != pad).cumsum(-1)`, a transformer's position ids, is)."""
    def convert(node, importer):
        args = _arguments(node, importer)
        x = args["self"]
        dtype = str(x.ty.dtype)
        if args["dtype"] is not None:
            dtype = importer._convert_data_type(args["dtype"])
        elif dtype == "bool" or dtype.startswith(("int", "uint")):
            dtype = "int64"
        return importer.block_builder.emit(op(_cast(importer.block_builder, x, dtype), args["dim"]))
    return convert


def _truth_reduction(reduce):
    """aten.any / aten.all (.default, .dim, .dims): whether any / all elements are nonzero (NaN counts, as
    in PyTorch), as the max / min of the elements as bools in uint8 (Relax's max and min take no bools).
    TVM converts neither any.default nor all, and converts any.dim of a float tensor to its float max."""
    def convert(node, importer):
        args = _arguments(node, importer)
        bb = importer.block_builder
        x = args["self"]
        if str(x.ty.dtype) != "bool":
            x = bb.emit(relax.op.astype(x, "bool"))
        flags = bb.emit(reduce(relax.op.astype(x, "uint8"), args.get("dim"), keepdims=args.get("keepdim", False)))
        return bb.emit(relax.op.not_equal(flags, relax.const(0, "uint8")))
    return convert


def _extremum(reduce):
    """aten.amax / aten.amin: the max / min over `dim`, every axis when it is empty (PyTorch's default,
    `x.abs().amax()`); TVM converts neither."""
    def convert(node, importer):
        args = _arguments(node, importer)
        axes = list(args["dim"]) or None
        return importer.block_builder.emit(reduce(args["self"], axes, keepdims=args["keepdim"]))
    return convert


def _slice(node, importer):
    """aten.slice.Tensor. TVM clamps a symbolic end to the dim's size: BERT's position ids, `ids[:, :seq]`
    of 512, get length min(seq, 512), which no other tensor's shape is, and the build fails ("emit_te now
    only supports Tensor that has ShapeExpr shape"). Where torch.export proved the slice in bounds (with
    `dynamic`'s bound seq <= 512 its result is `end - start` long), TVM is told so."""
    import torch  # noqa: PLC0415

    args, end = _arguments(node, importer), _arguments(node)["end"]
    start, step = (0 if args["start"] is None else args["start"]), args["step"]
    length = node.meta["val"].shape[args["dim"]]  # as torch.export worked it out
    end_size = end.meta.get("val") if isinstance(end, torch.fx.Node) else None
    if isinstance(start, int) and isinstance(step, int) and step == 1 and isinstance(length, torch.SymInt) \
            and isinstance(end_size, torch.SymInt) and length.node.expr == end_size.node.expr - start:
        axis = args["dim"] % len(node.meta["val"].shape)  # stock TVM's legalization takes no negative axis here
        return importer.block_builder.emit(relax.op.strided_slice(
            args["self"], [axis], [start], [args["end"]], [1], assume_inbound=True))
    return importer._slice(node)


def _clamp_tensor(node, importer):
    """aten.clamp.Tensor (bounds as tensors), in PyTorch's result dtype. T5's fp16 overflow clamp has float32
    bounds (from a torch.where of Python floats), which PyTorch's type promotion leaves fp16; TVM's converter
    mixes the dtypes ("Binary operators must have the same datatype")."""
    args = _arguments(node, importer)
    bb = importer.block_builder
    dtype = importer._convert_data_type(node.meta["val"].dtype)
    out = _cast(bb, args["self"], dtype)
    for bound, op in ((args["min"], relax.op.maximum), (args["max"], relax.op.minimum)):
        if bound is not None:
            out = bb.emit(op(out, _cast(bb, bound, dtype)))
    return out


CONVERTERS = {"linear.default": _linear, "addmm.default": _addmm, "matmul.default": _matmul, "mm.default": _matmul,
              "bmm.default": _matmul, "cumsum.default": _cumulative(relax.op.cumsum),
              "cumprod.default": _cumulative(relax.op.cumprod), "slice.Tensor": _slice,
              "clamp.Tensor": _clamp_tensor}
CONVERTERS.update({f"{op}.{overload}": _convolution for op, overload in [
    ("convolution", "default"), ("conv1d", "default"), ("conv2d", "default"), ("conv3d", "default"),
    ("conv_transpose1d", "default"), ("conv_transpose2d", "input")]})
CONVERTERS["_native_batch_norm_legit_no_training.default"] = _batch_norm
CONVERTERS.update({"amax.default": _extremum(relax.op.max), "amin.default": _extremum(relax.op.min)})
CONVERTERS.update({f"{name}.{overload}": _truth_reduction(reduce) for name, reduce in [
    ("any", relax.op.max), ("all", relax.op.min)] for overload in ("default", "dim", "dims")})


def _dynamic_shapes(dynamic: dict, inputs: int) -> list:
    """`dynamic` ({input index: {dim: name, (name, min, max) or torch.export.Dim}}) as torch.export's
    `dynamic_shapes`: one Dim per name, so that dims of one name share their size, and a bare name
    takes the range given for it elsewhere."""
    import torch  # noqa: PLC0415

    unknown = sorted(set(dynamic) - set(range(inputs)), key=str)
    if unknown:
        raise ValueError(f"dynamic names input(s) {unknown}, but the model gets {inputs} example input(s)")

    def named(spec) -> tuple:
        """(name, Dim or None for a bare name); a name of None for Dim.AUTO and other hints."""
        if isinstance(spec, str):
            return spec, None
        if isinstance(spec, tuple):
            name, low, high = spec
            try:
                return name, torch.export.Dim(name, min=low, max=high)
            except AssertionError as err:  # torch's check of the range
                raise ValueError(f"dynamic dim {spec!r}: {err}") from None
        return getattr(spec, "__name__", None), spec

    dims = {}
    for name, dim in (named(spec) for shapes in dynamic.values() for spec in shapes.values()):
        if name is not None and dim is not None:
            first = dims.setdefault(name, dim)
            if (first.min, first.max) != (dim.min, dim.max):
                raise ValueError(f"dynamic dim {name!r} is given two ranges, [{first.min}, {first.max}] and "
                                 f"[{dim.min}, {dim.max}]")

    def shared(spec):
        name, dim = named(spec)
        return dim if name is None else dims.setdefault(name, dim or torch.export.Dim(name))

    return [{d: shared(spec) for d, spec in dynamic.get(i, {}).items()} or None for i in range(inputs)]


def _by_parameter(module, shapes: list) -> list:
    """Per-input `shapes` as torch.export matches them, to `forward`'s parameters: the inputs that
    fill a `*args` parameter are one tuple there."""
    import inspect  # noqa: PLC0415

    params = list(inspect.signature(module.forward).parameters.values())
    star = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return shapes if star is None else shapes[:star] + [tuple(shapes[star:])]


def unsupported_ops(program) -> list[str]:
    """Sorted names of the ops in `program` (an ExportedProgram, cond branches included) that neither TVM
    0.27's importer nor our CONVERTERS convert."""
    from torch import fx  # noqa: PLC0415
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter  # noqa: PLC0415

    known = set(ExportedProgramImporter().convert_map) | set(CONVERTERS)
    return sorted({node.target.__name__ for graph in program.graph_module.modules() if isinstance(graph, fx.GraphModule)
                   for node in graph.graph.nodes if node.op == "call_function"} - known)


def _views_as_reshapes(program):
    """`program` with its views as reshapes. A view recorded where the tensor was contiguous may not
    be one once ops before it are decomposed (GPT-2's heads merged after SDPA: decomposed, SDPA
    leaves other strides and the view raises); a reshape is a view where one exists, and TVM has no
    strides to keep."""
    import torch  # noqa: PLC0415

    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    program.graph_module.recompile()
    return program


def from_torch(module, *example, dynamic: dict | None = None) -> tvm.IRModule:
    """Export `module` (in eval mode) on `example` inputs and import it as a Relax module whose
    weights are constants. `dynamic`: {input index: {dim: spec}} for dims left symbolic, a spec being
    a name, (name, min, max) or a torch.export.Dim; e.g. {0: {1: ("seq", 1, 512)}} compiles once for
    every sequence length up to 512. Dims that share a name share their size.
    Raises ExportError where torch.export refuses the model and UnsupportedOperatorError naming every
    op TVM cannot import."""
    import torch  # noqa: PLC0415
    from tvm.relax.frontend.torch import from_exported_program  # noqa: PLC0415

    per_input = _dynamic_shapes(dynamic, len(example)) if dynamic else None
    shapes = _by_parameter(module, per_input) if dynamic else None
    try:
        program = torch.export.export(module.eval(), tuple(example), dynamic_shapes=shapes)
    except Exception as err:  # torch's message carries the fix (e.g. the Dim bounds to pass): keep all of it
        raise ExportError("torch.export could not export the model; PyTorch's message follows (Dim bounds it "
                          f"suggests go in dynamic= as (name, min, max) or as the Dim itself):\n{err}") from err
    program = _views_as_reshapes(program).run_decompositions()  # what from_exported_program would do
    missing = unsupported_ops(program)
    if missing:
        raise UnsupportedOperatorError(missing)
    mod = from_exported_program(program, keep_params_as_input=False, custom_convert_map=CONVERTERS,
                                run_ep_decomposition=False)
    return _with_bound_checks(_named_dims(mod, per_input), per_input) if per_input else mod


def _named_dims(mod: tvm.IRModule, per_input: list) -> tvm.IRModule:
    """`mod` whose symbolic dims carry the names `dynamic` gave them (torch.export names its own,
    `s27`), so that the dims a tuning run is measured at (`--dims seq=512`) and TVM's messages use
    the user's names. A dim whose name another symbolic dim already has, or that is no identifier
    (kernels take a symbolic size as an argument of that name), keeps torch's name."""
    main = mod["main"]
    sizes = [param.ty.shape.values if isinstance(param.ty, relax.TensorType) and param.ty.shape is not None else ()
             for param in main.params]
    renamed = {}
    for shape, dims in zip(sizes, per_input):
        for axis, dim in (dims or {}).items():
            size = shape[axis] if axis < len(shape) else None
            if isinstance(size, tvm.tirx.Var) and size.name != dim.__name__ and dim.__name__.isidentifier():
                renamed.setdefault(size.name, (size, dim.__name__))
    taken = {str(v) for shape in sizes for v in shape if isinstance(v, tvm.tirx.Var)} - set(renamed)
    renamed = {old: (var, new) for old, (var, new) in renamed.items() if new not in taken}
    if not renamed:
        return mod
    main = main.bind_symbolic_vars({var: tvm.tirx.Var(new, var.ty) for var, new in renamed.values()})
    bounds = {key: {renamed.get(name, (None, name))[1]: value for name, value in main.attrs[key].items()}
              for key in ("tir_var_lower_bound", "tir_var_upper_bound") if main.attrs and key in main.attrs}
    mod["main"] = main.with_attrs(bounds) if bounds else main
    return mod


def _with_bound_checks(mod: tvm.IRModule, per_input: list) -> tvm.IRModule:
    """`mod` whose main first checks each symbolic dim against the range declared for it (a Dim's
    min and max, or (name, min, max)): a length past it is an AssertionError naming the input, the
    dim and the range, before any kernel runs (a build assumes it: BERT's position table is read
    up to the declared length)."""
    main = mod["main"]
    params = [p for p in main.params if isinstance(p.ty, relax.TensorType)]
    checks = []
    for index, (param, dims) in enumerate(zip(params, per_input)):
        for axis, dim in (dims or {}).items():
            size = param.ty.shape.values[axis] if param.ty.shape is not None else None
            low, high = int(dim.min), int(dim.max) if dim.max < 2**62 else None
            if not isinstance(size, tvm.tirx.Var) or (low < 1 and high is None):
                continue
            bound = (f"[{low}, {high}]" if high is not None else f">= {low}")
            condition = size >= low if high is None else tvm.tirx.And(size >= low, size <= high)
            checks.append(relax.op.assert_op(
                relax.prim_value(condition), [relax.prim_value(size)],
                format=f"tvm_ext: input {index} dim {axis} ({dim.__name__!r}) is {{}}, outside the range {bound} "
                       "the model was built for (from_torch's dynamic=)"))
    if not checks:
        return mod
    bindings = [relax.VarBinding(relax.Var(f"bound_check{i}", relax.ObjectType()), check) for i, check in enumerate(checks)]
    body = relax.SeqExpr([relax.BindingBlock(bindings), *main.body.blocks], main.body.body)
    mod["main"] = relax.Function(main.params, body, main.ret_ty, is_pure=False, attrs=main.attrs)
    return mod
