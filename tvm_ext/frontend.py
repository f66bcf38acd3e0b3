"""PyTorch models in: `torch.export` then TVM 0.27's `from_exported_program`, with errors a user can act on.

PyTorch is imported here only when called (it is an optional extra: deployment needs none of it).
"""

from __future__ import annotations

import re

import tvm


class UnsupportedOperatorError(ValueError):
    """The model uses PyTorch ops that TVM's frontend cannot convert; `ops` names them."""

    def __init__(self, ops: list[str]):
        self.ops = ops
        super().__init__(f"TVM 0.27's PyTorch frontend cannot import the op(s) {', '.join(ops)}: rewrite those "
                         "parts of the model with supported ops, or keep them outside the compiled module")


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
        return from_exported_program(program, keep_params_as_input=False)
    except AssertionError as err:  # the frontend's way to say "unsupported": "Unsupported function types [...]"
        found = re.search(r"Unsupported function types \[(.*)\]", str(err))
        if found is None:
            raise
        raise UnsupportedOperatorError(re.findall(r"'([^']+)'", found.group(1))) from None
