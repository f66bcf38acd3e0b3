"""PyTorch models in: `torch.export` then TVM 0.27's `from_exported_program`, with errors a user can act on.

PyTorch is imported here only when called (it is an optional extra: deployment needs none of it).
"""

from __future__ import annotations

import re

import tvm
from tvm import relax


class UnsupportedOperatorError(ValueError):
    """The model uses PyTorch ops that TVM's frontend cannot convert; `ops` names them."""

    def __init__(self, ops: list[str]):
        self.ops = ops
        super().__init__(f"TVM 0.27's PyTorch frontend cannot import the op(s) {', '.join(ops)}: rewrite those "
                         "parts of the model with supported ops, or keep them outside the compiled module")


def _rounded(importer, dtype: str, product, bias):
    """A matmul's float32 product (PyTorch accumulates in float32 too) rounded to the inputs' dtype,
    then the bias in that dtype."""
    bb = importer.block_builder
    out = bb.emit(product)
    if dtype != "float32":
        out = bb.emit(relax.op.astype(out, dtype))
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


CONVERTERS = {"linear.default": _linear, "addmm.default": _addmm, "matmul.default": _matmul, "mm.default": _matmul,
              "bmm.default": _matmul}


def from_torch(module, *example, dynamic: dict | None = None) -> tvm.IRModule:
    """Export `module` (in eval mode) on `example` inputs and import it as a Relax module whose
    weights are constants. `dynamic`: {input index: {dim: name}} for dims left symbolic, e.g.
    {0: {1: "seq"}} compiles once for every sequence length."""
    import torch  # noqa: PLC0415
    from tvm.relax.frontend.torch import from_exported_program  # noqa: PLC0415

    shapes = None
    if dynamic:
        dims = {}
        shapes = [{d: dims.setdefault(name, torch.export.Dim(name)) for d, name in dynamic.get(i, {}).items()} or None
                  for i in range(len(example))]
    program = torch.export.export(module.eval(), tuple(example), dynamic_shapes=shapes)
    try:
        return from_exported_program(program, keep_params_as_input=False, custom_convert_map=CONVERTERS)
    except AssertionError as err:  # the frontend's way to say "unsupported": "Unsupported function types [...]"
        found = re.search(r"Unsupported function types \[(.*)\]", str(err))
        if found is None:
            raise
        raise UnsupportedOperatorError(re.findall(r"'([^']+)'", found.group(1))) from None
