"""What the templates here and tvm_ext's graph rewrites and TIR passes must agree on, in one place
that both import: PrimFunc attributes and placeholders a template writes and the pipeline reads,
the layout of a gated MLP's joint weight, the operand types with tensor cores, the masks and views
the attention kernel takes, and the wgmma tile that joined linears are sized for."""

from __future__ import annotations

import tvm

ZEROED_INPUTS = "tvm_ext.zeroed_inputs"  # PrimFunc attr: [(shape, dtype)] of inputs the caller passes zero-filled
# PrimFunc attr: (name of the symbolic row width, lanes): the kernel takes that width as a count of
# `lanes`-element vectors, a scalar parameter before its outputs, which its call site passes
# (width // lanes) after the inputs
WIDTH_IN_VECTORS = "tvm_ext.width_in_vectors"
# block annotation: a per-row value a reduction shifts its elements by (Welford's pivot, the row's
# first element); analysis.match can keep its block apart from the reduction it feeds
PIVOT = "tvm_ext.pivot"
GRID_SYNC = "cooperative_groups::this_grid().sync"  # a grid barrier, printed by CUDA codegen as a call

NOMINAL = 4096  # a symbolic size where none is given: what a tuning run measures it at, what features take

GATE_RUN = 8  # columns: a gated product's joint weight alternates runs of this many gate and up rows

WARP = 32  # lanes of the matmul template's warp tile, the loop tir/tensorize.py matches
WIDER = {"float16": "float32", "bfloat16": "float32", "int8": "int32"}  # input dtype -> accumulator dtype
TENSOR_CORE_DTYPES = ("float16", "int8")  # operands TVM 0.27 has 16x16x16 WMMA intrinsics for (no bf16)
WGMMA_TYPES = {"float16": "f16", "bfloat16": "bf16"}  # operands the wgmma template takes -> wgmma's name for them

MASK_FLOOR = -1.0e29  # attention: finite mask values at or above this stay above the kernel's MASKED
MASK_DTYPES = ("float16", "float32")  # attention: mask dtypes the kernel reads
COPY_ELEMS = 8  # attention: fp16 elements of one 16-byte cp.async, the unit-stride run a view needs

WIDE_TILE = (128, 256)  # the wgmma tile a block alone on its SM takes (wgmma_matmul.PREFERENCE's first)...
WIDE_TILE_WAVES = 1.9  # ...where it gives this many waves of blocks


def extern_name(expr) -> str | None:
    """The function name of a `call_extern` (a template's placeholders, CUDA builtins); else None."""
    if isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "tirx.call_extern":
        return str(expr.args[0].value)
    return None


def gate_column(j, half: int):
    """C's column holding half `half` (0 the gate, 1 the up projection) of a gated output's column
    j: the joint weight's rows alternate runs of GATE_RUN of each (tvm_ext/relax/gated_linears.py), so
    both halves of a column lie in the same thread's accumulators, 4 registers apart."""
    return j // GATE_RUN * 2 * GATE_RUN + half * GATE_RUN + j % GATE_RUN
