"""Features: what the cost model sees of a candidate, from its knobs, the task's shape and the device.

Hand-made and cheap (no TIR built): the quantities the heuristics were tuned on, for every
strategy alike, so one model ranks candidates across strategies and transfers across shapes.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import tvm
from tvm import tirx
from tvm.target import Target

from tvm_ext.schedules import attention, conv2d, decode_attention, gemv, matmul, wgmma_matmul
from tvm_ext.schedules.few_row_matmul import VECTOR, weight_streaming_matmul
from tvm_ext.schedules.analysis import ReducePattern, at_sizes, const_int, match
from tvm_ext.schedules.contracts import WARP
from tvm_ext.schedules.device import Device, device_of
from tvm_ext.schedules.dispatch import STRATEGIES
from tvm_ext.schedules.rows import REGISTERS, cached_inputs, estimated_registers, row_bytes

NAMES = tuple(f"is_{name}" for name in STRATEGIES) + ("is_matmul", "is_conv2d") + (
    "log2_row_elements", "log2_rows", "log2_bytes", "reductions", "elementwise_epilogue", "symbolic",
    "threads", "log2_blocks", "waves", "sm_utilisation", "occupancy", "log2_bytes_per_thread", "vector_bytes",
    "staged", "staged_bytes_per_block", "log2_lanes_per_row",
    "log2_k_per_step", "pipeline_stages", "log2_warp_tile",  # these three: contractions only (0 otherwise)
    "tma_loads")  # wgmma matmuls only
# Names (and so meaning) of a logged feature vector: records of another schema are not trained on
SCHEMA = hashlib.sha1(",".join(NAMES).encode()).hexdigest()[:12]


def _launch(knobs: dict, rows: int, device: Device) -> tuple[int, int, int, int]:
    """(threads per block, blocks, lanes sharing a row, rows per block) of a candidate."""
    strategy = knobs["strategy"]
    if strategy == "warp_row":
        group, per_block = int(knobs["group"]), int(knobs["rows_per_block"])
        return group * per_block, math.ceil(rows / per_block), group, per_block
    if strategy == "block_row":
        return int(knobs["threads"]), rows, int(knobs["threads"]), 1
    if strategy in ("grid_reduce", "grid_sync"):
        threads, per_row = int(knobs["threads"]), int(knobs["blocks_per_row"])
        return threads, rows * per_row, threads * per_row, 1
    if strategy in ("column_reduce", "column_split"):  # column_reduce: one split of the rows
        cols, lanes, splits = int(knobs["cols"]), int(knobs["lanes"]), int(knobs.get("splits", 1))
        width = cols * int(knobs.get("vec", 1))  # columns of a block
        return cols * lanes, math.ceil(rows / width) * splits, lanes * splits, width
    return 1, max(1, rows // max(1, device.sm_count)), int(knobs.get("lanes", 1)), 1  # cpu_rows


def features(pattern: ReducePattern, knobs: dict, device: Device, dims: dict | None = None) -> np.ndarray:
    rows = at_sizes(pattern.row_count, dims)
    width = const_int(pattern.reduce_extent) or int(knobs.get("max_extent") or at_sizes(pattern.reduce_extent, dims))
    inputs = pattern.input_buffers()
    element_bytes = sum(pattern.dtype_bytes(b) for b in inputs) or 4
    threads, blocks, lanes, rows_per_block = _launch(knobs, rows, device)
    cached = cached_inputs(pattern)
    staged = bool(knobs.get("cache")) and bool(cached)
    staged_bytes = (row_bytes(pattern, cached) or 0) * rows_per_block if staged else 0
    registers = estimated_registers(pattern)
    if knobs.get("cache") == REGISTERS:  # a lane's share in its registers, none in shared memory
        registers, staged_bytes = registers + staged_bytes // (4 * threads), 0
    resident = device.resident_blocks(threads, registers, staged_bytes) if device.is_gpu else 1
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    strategy = [float(knobs["strategy"] == name) for name in STRATEGIES] + [0.0, 0.0]
    epilogue = pattern.epilogue is not None and pattern.epilogue.dom_kind() != "S" * pattern.num_spatial
    symbolic = const_int(pattern.row_count) is None or const_int(pattern.reduce_extent) is None
    values = strategy + [
        math.log2(width), math.log2(rows), math.log2(rows * width * element_bytes), len(pattern.reductions),
        float(epilogue), float(symbolic), threads, math.log2(blocks), waves, blocks / (math.ceil(waves) * slots),
        threads * resident / device.threads_per_sm if device.is_gpu else 1.0,
        math.log2(max(1.0, width / lanes * element_bytes)), int(knobs.get("vec", 1)) * element_bytes,
        float(staged), staged_bytes, math.log2(lanes), 0.0, 0.0, 0.0, 0.0]
    return np.asarray(values, dtype="float32")


def _extents(block, dims: dict | None) -> tuple[list[int], bool]:
    """A contraction block's loop extents, a symbolic one (a row count: one build for any sequence
    length) at `dims` (NOMINAL where not given), and whether one was."""
    extents = [iv.dom.extent for iv in block.iter_vars]
    return [at_sizes(e, dims) for e in extents], any(const_int(e) is None for e in extents)


def matmul_features(block, knobs: dict, epilogue: bool, device: Device, dims: dict | None = None) -> np.ndarray:
    """The same quantities for a tensor-core matmul candidate: each output is a row of K products
    reduced; its rows are the outputs (batch * M * N); the stage is the shared-memory operand tiles."""
    (*batch, m, n, k), symbolic = _extents(block, dims)
    item = matmul.operand_itemsize(block)
    bm, bn, bk, stages = (int(knobs[x]) for x in ("block_m", "block_n", "block_k", "stages"))
    outputs, threads = math.prod(batch) * m * n, bm // int(knobs["warp_m"]) * int(knobs["warp_n"]) * WARP
    blocks = outputs // (bm * bn)
    smem = matmul.shared_bytes(knobs, item, matmul.k_is_last(block))
    warp_tile = int(knobs["warp_m"]) * bn // int(knobs["warp_n"])
    registers = min(255, 40 + warp_tile // WARP)  # fp32 accumulators + ~40 (ptxas: 168 at 64 x 64)
    resident = device.resident_blocks(threads, registers, smem)
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    values = [0.0] * len(STRATEGIES) + [1.0, 0.0] + [
        math.log2(k), math.log2(outputs), math.log2(math.prod(batch) * (m * k + k * n) * item + outputs * 4), 1,
        float(epilogue), float(symbolic), threads, math.log2(blocks), waves, blocks / (math.ceil(waves) * slots),
        threads * resident / device.threads_per_sm, math.log2(bm * bn * 4 / threads), int(knobs["vec"]) * item,
        1.0, smem, 0.0, math.log2(bk), stages, math.log2(warp_tile), 0.0]
    return np.asarray(values, dtype="float32")


def wgmma_features(block, knobs: dict, epilogue: bool, device: Device, dims: dict | None = None) -> np.ndarray:
    """The same quantities for a wgmma matmul candidate (columns of the thread-level template's):
    a warpgroup per 64 rows, 64 of k per stage, a warp's tile 16 rows by block_n."""
    (*batch, m, n, k), symbolic = _extents(block, dims)
    bm, bn, stages = (int(knobs[x]) for x in ("block_m", "block_n", "stages"))
    outputs = math.prod(batch) * m * n
    threads = wgmma_matmul.block_threads(bm, bool(knobs.get("tma", 0)))
    blocks = wgmma_matmul.block_count(math.prod(batch), m, n, bm, bn)
    smem = stages * wgmma_matmul.stage_bytes(bm, bn)
    resident = device.resident_blocks(threads, min(255, 40 + bn // 2), smem)  # bn / 2 fp32 accumulators
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    values = [0.0] * len(STRATEGIES) + [1.0, 0.0] + [
        math.log2(k), math.log2(outputs), math.log2(math.prod(batch) * (m * k + k * n) * 2 + outputs * 4), 1,
        float(epilogue), float(symbolic), threads, math.log2(blocks), waves, blocks / (math.ceil(waves) * slots),
        threads * resident / device.threads_per_sm, math.log2(bm * bn * 4 / threads), 16,
        1.0, smem, 0.0, math.log2(wgmma_matmul.K_TILE), stages, math.log2(16 * bn), float(knobs.get("tma", 0))]
    return np.asarray(values, dtype="float32")


def conv2d_features(block, knobs: dict, epilogue: bool, device: Device) -> np.ndarray:
    """The same quantities for a direct-convolution candidate: each output reduces C x R x S
    products; the stage is a step's input window and weights; lanes per row, the threads along a
    row of pixels, each writing `xi` adjacent outputs; the pipeline stages, the virtual threads;
    the warp tile, a thread's channels x rows times a warp."""
    (n, f, y, x, c, r, s), symbolic = _extents(block, None)
    item = tvm.DataType(str(block.writes[0].source.dtype)).bits // 8
    k = {name: int(value) for name, value in knobs.items() if name != "strategy"}
    tile = conv2d.block_tile(knobs)
    threads, per_thread = k["tf"] * k["ty"] * k["tx"], math.prod(tile) // (k["tf"] * k["ty"] * k["tx"])
    blocks = n * f * y * x // math.prod(tile)
    smem = conv2d.shared_bytes(knobs, r, s, item)
    resident = device.resident_blocks(threads, min(255, 32 + per_thread), smem)
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    values = [0.0] * len(STRATEGIES) + [0.0, 1.0] + [
        math.log2(c * r * s), math.log2(n * f * y * x), math.log2((n * c * y * x + f * c * r * s + n * f * y * x) * item),
        1, float(epilogue), float(symbolic), threads, math.log2(blocks), waves, blocks / (math.ceil(waves) * slots),
        threads * resident / device.threads_per_sm, math.log2(per_thread), k["xi"] * item, 1.0, smem,
        math.log2(k["tx"]), math.log2(k["rc"]), k["vf"] * k["vy"] * k["vx"], math.log2(k["fi"] * k["yi"] * 32), 0.0]
    return np.asarray(values, dtype="float32")


def gemv_features(n: int, k: int, item: int, knobs: dict, epilogue: bool, device: Device) -> np.ndarray:
    """The same quantities for a GEMV candidate: n outputs, each a row of W (k long) reduced by a
    group of `split` warps; `unroll` steps of 16 bytes a row in flight; `rows` rows a group."""
    rows, warps, split, unroll = (int(knobs[x]) for x in gemv.KNOBS)
    threads, lanes = warps * 32, 32 * split
    blocks = -(-n // (warps // split * rows))
    registers = min(255, 32 + (rows + 1) * unroll * VECTOR * item // 4)  # the loads in flight, 4 bytes a register
    resident = device.resident_blocks(threads, registers, warps * rows * 4)
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    values = [0.0] * len(STRATEGIES) + [1.0, 0.0] + [
        math.log2(k), math.log2(n), math.log2((n * k + k) * item + n * 4), 1, float(epilogue), 0.0, threads,
        math.log2(blocks), waves, blocks / (math.ceil(waves) * slots), threads * resident / device.threads_per_sm,
        math.log2(rows * k * item / lanes), VECTOR * item, 0.0, warps * rows * 4, math.log2(lanes),
        math.log2(VECTOR * lanes), unroll, math.log2(rows), 0.0]
    return np.asarray(values, dtype="float32")


def attention_features(args: dict, knobs: dict, device: Device, symbolic: bool = False) -> np.ndarray:
    """The same quantities for a fused attention candidate, as a matmul's: each output row reduces
    seq_kv keys; the stage is Q's, P's and two stages of K's and V's tiles; k per step, the keys of
    a tile; a warp's tile, 16 query rows by the tile's keys. `symbolic`: built for any length (the
    sizes of `args` then NOMINAL's)."""
    batch, seq_q, seq_kv, dim = attention.sizes(args)
    threads, blocks, smem = attention.launch(args, knobs)
    block_n = int(knobs["block_n"])
    outputs = batch * seq_q * dim
    resident = device.resident_blocks(threads, min(255, 40 + block_n // 2 + dim // 2), smem)  # S and O accumulators
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    values = [0.0] * len(STRATEGIES) + [1.0, 0.0] + [
        math.log2(seq_kv * dim), math.log2(outputs), math.log2(batch * (2 * seq_q + 2 * seq_kv) * dim * 2), 2,
        float(args["mask"] is not None), float(symbolic), threads, math.log2(blocks), waves, blocks / (math.ceil(waves) * slots),
        threads * resident / device.threads_per_sm, math.log2(max(1, outputs * 4 // (blocks * threads))), 16,
        1.0, smem, 0.0, math.log2(block_n), 2, math.log2(16 * block_n), 0.0]
    return np.asarray(values, dtype="float32")


def decode_features(args: dict, knobs: dict, device: Device, symbolic: bool = False) -> np.ndarray:
    """The same quantities for a decoding step's partial kernel candidate: a block per (row, chunk)
    reduces its chunk's keys, a key's row over dim / 8 lanes, `unroll` keys a lane group in flight;
    the stage, each lane group's weighted values and state. `symbolic`: built for any size."""
    batch, seq_kv, dim = args["batch"], args["seq_kv"], args["dim"]
    threads, unroll, lanes = int(knobs["threads"]), int(knobs["unroll"]), dim // decode_attention.COPY_ELEMS
    blocks = batch * decode_attention.splits(batch, seq_kv, args["sm_count"])
    smem = threads // lanes * (dim + 2) * 4
    resident = device.resident_blocks(threads, 40 + 8 * unroll, smem)  # a K and a V vector per key in flight
    slots = max(1, device.sm_count * resident)
    waves = blocks / slots
    values = [0.0] * len(STRATEGIES) + [1.0, 0.0] + [
        math.log2(seq_kv * dim), math.log2(batch * dim), math.log2(4 * batch * seq_kv * dim), 2,
        0.0, float(symbolic), threads, math.log2(blocks), waves, blocks / (math.ceil(waves) * slots),
        threads * resident / device.threads_per_sm, math.log2(max(1, 4 * seq_kv * dim // (blocks * threads))), 16,
        1.0, smem, math.log2(lanes), math.log2(unroll), 1, math.log2(unroll * decode_attention.COPY_ELEMS), 0.0]
    return np.asarray(values, dtype="float32")


def candidate_features(func: tirx.PrimFunc, points: list[dict], target: Target, dims: dict | None = None) -> np.ndarray:
    """[len(points), len(NAMES)] features of the candidates `points` of one task, its symbolic sizes
    at `dims` (NOMINAL where not given: what the tuning run measures them at)."""
    if not points:
        return np.zeros((0, len(NAMES)))
    device = device_of(target)
    if points[0]["strategy"] in (matmul.NAME, wgmma_matmul.NAME):
        sch, block, epilogue = matmul.contraction(func, over_c=False)  # a gated epilogue too
        featurize = wgmma_features if points[0]["strategy"] == wgmma_matmul.NAME else matmul_features
        return np.stack([featurize(sch.get(block), knobs, bool(epilogue), device, dims) for knobs in points])
    if points[0]["strategy"] == gemv.NAME:
        block, folded, _, n, k = weight_streaming_matmul(func)
        item = matmul.operand_itemsize(block)
        return np.stack([gemv_features(n, k, item, knobs, folded.ivs is not None, device) for knobs in points])
    if points[0]["strategy"] == attention.NAME:
        args = attention.recipe(attention.at_lengths(func, dims or {}))
        symbolic = attention.any_length(attention.recipe(func))
        return np.stack([attention_features(args, knobs, device, symbolic) for knobs in points])
    if points[0]["strategy"] == decode_attention.NAME:
        args = decode_attention.recipe(decode_attention.at_lengths(func, dims or {}))
        symbolic = decode_attention.any_length(decode_attention.recipe(func))
        return np.stack([decode_features(args, knobs, device, symbolic) for knobs in points])
    if points[0]["strategy"] == conv2d.NAME:
        sch, _, block, epilogue = conv2d.convolution(func)
        return np.stack([conv2d_features(sch.get(block), knobs, bool(epilogue), device) for knobs in points])
    pattern = match(func)
    return np.stack([features(pattern, knobs, device, dims) for knobs in points])
