"""Reference and check: what a task's outputs must be (TVM's unscheduled CPU build of it, on seeded
inputs) and whether a candidate's outputs are within dtype-derived bounds of it, row by row."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad, TensorRegion
from tvm.ir.prim.expr import Cast
from tvm.script import tirx as T

from tvm_ext.schedules import attention, conv2d, decode_attention, matmul
from tvm_ext.schedules.analysis import at_sizes, multiply_accumulate
from tvm_ext.schedules.contracts import NOMINAL

CHECK_CHUNK = 1 << 20  # elements compared per thread at a time (fits in cache)

logger = logging.getLogger(__name__)


def _concrete(shape, dims: dict) -> list[int]:
    """A buffer shape with symbolic dims set to `dims` (NOMINAL where not given)."""
    return [at_sizes(d, dims) for d in shape]


def symbolic_names(func) -> set[str]:
    """Names of `func`'s symbolic dims (in a parameter's shape, or a scalar parameter)."""
    shapes = [p.ty.shape if hasattr(p.ty, "shape") else [p] for p in func.params]
    return {v.name for shape in shapes for d in shape if not isinstance(d, (int, tirx.IntImm))
            for v in tirx.analysis.undefined_vars(d)}


def measured_dims(func, dims: dict | None = None) -> dict:
    """{name: size} of each symbolic dim of `func` as a tuning run measures it: `dims`'s, else NOMINAL."""
    return {name: int((dims or {}).get(name, NOMINAL)) for name in sorted(symbolic_names(func))}


def measured(func, dims: dict | None = None):
    """`func` as its candidates are built and timed: a kernel that takes a symbolic size as a
    scalar argument (a fused attention or a decoding step's partial kernel built for any size)
    made at the sizes `dims` gives (NOMINAL where none); any other as it is (its symbolic dims are
    read from the tensors passed)."""
    written = next((t for t in (attention, decode_attention) if t.recipe(func) is not None), None)
    return func if written is None else written.at_lengths(func, dims or {})


def task_bytes(func, dims: dict | None = None) -> int:
    """Bytes of every parameter buffer: what must cross memory at least once."""
    return sum(int(np.prod(_concrete(p.shape, dims or {}))) * tvm.DataType(str(p.ty.dtype)).bits // 8
               for p in func.params)


def task_flops(func, dims: dict | None = None) -> int:
    """Floating-point operations of a task's tensor-core work: 2 x the multiply-adds of its block
    `c += cast(a) * cast(b)` over two low-precision tensors (a matmul's or a convolution's); 0 for
    tasks without one (norms, softmax, sums); a fused attention's QK^T and PV."""
    if (made := attention.recipe(func)) is not None:
        return attention.flops(made)
    blocks = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append), order="pre")
    for block in blocks:
        loads = multiply_accumulate(block.body)
        if loads and not loads[0].source.same_as(loads[1].source):
            return 2 * int(np.prod(_concrete([iv.dom.extent for iv in block.iter_vars], dims or {})))
    return 0


def in_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` in `dtype`; bfloat16 by truncating float32 bits (ml_dtypes' own conversion
    takes seconds on a large tensor; exact for values bfloat16 holds)."""
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(dtype)
    return values.astype(dtype)


SEEDED_BITS = {"float16": 12, "bfloat16": 9, "float8_e4m3fn": 5, "float8_e5m2": 4}  # hash bits a value keeps: exact in
# its dtype (24 for float32 and float64)
HASH_MIX = (0x9E3779B9, 0x7FEB352D, 0x846CA68B)  # the seed's multiplier, then lowbias32's two multipliers


def seeded_bits(dtype: str) -> int:
    return SEEDED_BITS.get(dtype, 24)


def seed_mix(seed: int) -> int:
    """What `seed` is xor-ed into each element's index as (also the server kernel's `mix` argument)."""
    return (seed + 1) * HASH_MIX[0] & 0xFFFFFFFF


def seeded(shape, dtype: str, seed: int) -> np.ndarray:
    """Values in [-2, 2) made from each element's flat index and `seed` by a 32-bit integer hash
    (lowbias32), each exact in `dtype`: a server makes the same ones with remote_check's `seeded`
    kernel instead of receiving them."""
    n, bits = int(np.prod(shape)), seeded_bits(dtype)
    x = np.arange(n, dtype=np.uint32) ^ np.uint32(seed_mix(seed))
    for shift, multiplier in ((16, HASH_MIX[1]), (15, HASH_MIX[2])):
        x ^= x >> np.uint32(shift)
        x *= np.uint32(multiplier)
    x ^= x >> np.uint32(16)
    steps = (x >> np.uint32(32 - bits)).astype(np.int32) - np.int32(1 << (bits - 1))
    return in_dtype(steps.astype(np.float32) * np.float32(2.0 ** (2 - bits)), dtype).reshape(shape)


def output_count(func) -> int:
    """How many of `func`'s parameters are outputs: the trailing ones it stores to (call_tir passes
    the outputs last; add + RMSNorm writes the residual sum and the norm); one for a fused attention,
    whose stores go through flat views of its parameters."""
    if attention.recipe(func) is not None:
        return 1
    stored = []
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda st: stored.append(st.buffer)), order="pre")
    written = [any(p.same_as(b) for b in stored) for p in func.params]
    if True not in written:
        raise ValueError("the task's function writes none of its parameters: it has no output to check")
    return len(written) - written.index(True)


def input_seeds(func) -> list[int | None]:
    """Per input parameter of `func`, the seed its values are made from, or None: zeros."""
    inputs = len(func.params) - output_count(func)
    return [i if "float" in str(p.ty.dtype) else None for i, p in enumerate(func.params[:inputs])]


def _arrays(func, dims: dict) -> list[np.ndarray]:
    """Seeded inputs (zeros where they are not floating point) and zeroed outputs for every
    parameter buffer of `func`."""
    seeds = input_seeds(func)
    arrays = []
    for i, param in enumerate(func.params):
        shape, dtype = _concrete(param.shape, dims), str(param.ty.dtype)
        seed = seeds[i] if i < len(seeds) else None
        arrays.append(np.zeros(shape, dtype) if seed is None else seeded(shape, dtype, seed))
    return arrays


def _float32_inputs(func, params=None):
    """`func` with its bfloat16 inputs (or the inputs `params`, where they are only read through a
    cast to float32) read as float32 buffers, for the CPU reference: there TVM 0.27's bf16
    legalization computes reductions with several outputs (Welford) wrongly (error 17.7 on a bf16
    LayerNorm; 0.03 this way), and fp16 matmul operands are converted in software, element by element."""
    inputs = func.params[:len(func.params) - output_count(func)]
    params = params if params is not None else [p for p in inputs if str(p.ty.dtype) == "bfloat16"]
    remap = {i: tirx.decl_buffer(p.shape, "float32", p.name) for i, p in enumerate(inputs)
             if any(p.same_as(q) for q in params)}
    if not remap:
        return func

    def new_of(buffer):
        return next((remap[i] for i in remap if func.params[i].same_as(buffer)), None)

    def cast(node):
        new = new_of(node.value.source) if isinstance(node.value, TensorLoad) and str(node.ty.dtype) == "float32" else None
        return node if new is None else tirx.BufferLoad(new, node.value.indices)

    def region(node):
        new = new_of(node.source)
        return node if new is None else tirx.BufferRegion(new, node.region)

    body = tvm_ffi.structural_map(func.body, [(Cast, cast), (TensorRegion, region)])
    return tirx.PrimFunc([remap.get(i, p) for i, p in enumerate(func.params)], body, func.ret_type, func.attrs)


_FLOAT32 = re.compile(r"\bfloat32(x\d+)?\b")  # the scalar type and its vectors (float32x4)
_BUFFER_CALL = re.compile(r"\b(?:sblock_alloc_buffer|alloc_buffer|decl_buffer|match_buffer|Buffer)\(")


def _call_args(text: str, start: int) -> tuple[list[str], int]:
    """The arguments of the call whose "(" ends just before `start` (split at its top-level commas),
    and where its ")" is."""
    depth, i, args, begin = 1, start, [], start
    while True:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return [a.strip() for a in args + [text[begin:i]] if a.strip()], i
        if text[i] == "," and depth == 1:
            args.append(text[begin:i])
            begin = i + 1
        i += 1


def _with_buffer_dtypes(text: str) -> str:
    """TVMScript `text` with the float32 that the printer leaves implicit in a buffer's declaration
    (`T.sblock_alloc_buffer((256,))`) written out."""
    pieces, last = [], 0
    for found in _BUFFER_CALL.finditer(text):
        args, close = _call_args(text, found.end())
        positional = [a for a in args if not re.match(r"\w+\s*=", a)]
        if len(positional) < 2 and not any(re.match(r"dtype\s*=", a) for a in args):
            pieces += [text[last:close], ', dtype="float32"']
            last = close
    return "".join(pieces) + text[last:]


def in_float64(func) -> tirx.PrimFunc:
    """`func` with every float32 value (buffers, temporaries, constants, casts) in float64, for a
    reference whose long float32 sums would otherwise be the least exact part of the check (a
    sequential float32 sum of 401408 values near zero is off by 5e-5; a candidate's tree sum by
    about 1e-6). Other types stay: float16 arithmetic that the task does is the task's. `func`
    itself where it has no float32 or its promoted text does not parse (logged)."""
    text = func.script()
    if not _FLOAT32.search(text):
        return func
    promoted = _FLOAT32.sub(lambda m: "float64" + (m.group(1) or ""), _with_buffer_dtypes(text))
    try:
        return tvm.script.from_source(promoted)
    except Exception as err:  # noqa: BLE001 - any parse failure keeps the float32 reference
        logger.warning("reference kept in float32: its float64 form does not parse (%s)", str(err).splitlines()[0])
        return func


REFERENCE_LANES = 16  # float32 columns per vector in a matmul reference


def references(func) -> list[tirx.PrimFunc]:
    """What computes the task's reference on the CPU: `func` unscheduled with its float32 work in
    float64 (in_float64), then `func` as it is, in float32 summed in order, whose distance from the
    first is what a correct float32 candidate may be off (output_bounds); or for a matmul, its
    operands read as float32 and its loops parallel over rows and vectorised over columns (the
    unscheduled form of a large fp16 Linear is too slow on a CPU to serve as a reference)."""
    if (made := attention.recipe(func)) is not None:
        return [_attention_reference(made)]
    if (made := decode_attention.recipe(func)) is not None:
        return [_decode_reference(made)]
    convolution = conv2d.convolution(func)
    if convolution is not None:
        return [_conv2d_reference(convolution)]
    found = matmul.contraction(func, over_c=False)  # the epilogue blocks stay plain loops
    operands = [x.source for x in multiply_accumulate(found[0].get(found[1]).body)] if found else []
    if not operands or "float" not in str(operands[0].dtype):
        in_order = _float32_inputs(func)
        exact = in_float64(in_order)
        return [exact] if exact is in_order else [exact, in_order]
    sch, block, _ = found
    *batch, i, j, k = sch.get_loops(block)
    sch.reorder(i, k, j)
    sch.parallel(sch.fuse(*batch, i))
    if int(sch.get(j).extent) % REFERENCE_LANES == 0:
        sch.vectorize(sch.split(j, [None, REFERENCE_LANES])[1])
    return [_float32_inputs(sch.mod["main"], operands)]


def _conv2d_reference(convolution) -> tirx.PrimFunc:
    """A convolution for the CPU reference: parallel over images and output channels, the padding
    computed per image and channel, each tap a vectorised pass over an output row (the unscheduled
    32 x 256 x 56 x 56 layer would take minutes)."""
    sch, pads, block, _ = convolution
    n, f, y, x, c, r, s = sch.get_loops(block)
    sch.reorder(n, f, c, r, s, y, x)
    outer = sch.fuse(n, f)
    sch.parallel(outer)
    for pad in pads:
        sch.compute_at(pad, outer)
    sch.vectorize(x)
    return sch.mod["main"]


def _attention_reference(args: dict) -> tirx.PrimFunc:
    """softmax(Q K^T * scale [+ mask]) V in float64 for the CPU, a query row per parallel
    iteration, reading and writing the kernel's parameters through its views (a causal mask leaves
    the keys past the row out; a row with no key left is 0 with `empty_rows_zero`, else NaN)."""
    batch, seq_q, seq_kv, dim = attention.sizes(args)
    views = attention.operands(batch, seq_q, seq_kv, dim, args["given"])
    (q_at, k_at, v_at, out_at) = (views[name][1].element for name in attention.OPERANDS)
    shapes = [views[name][0] for name in attention.OPERANDS]
    dtype, scale, causal, mask = args["dtype"], args["scale"], args["causal"], args["mask"]
    m_shape, m_at, m_dtype = (mask[0], mask[1].element, mask[2]) if mask else ((1,), None, "float16")
    flat = [int(np.prod(shape)) for shape in shapes]
    masked, zero_empty = mask is not None, bool(args["empty_rows_zero"])

    @T.prim_func(check_well_formed=False)
    def reference(q_in: T.Buffer(shapes[0], dtype), k_in: T.Buffer(shapes[1], dtype), v_in: T.Buffer(shapes[2], dtype),
                  m_in: T.Buffer(m_shape, m_dtype), out_in: T.Buffer(shapes[3], dtype)):
        q = T.decl_buffer((flat[0],), dtype, data=q_in.data)
        k = T.decl_buffer((flat[1],), dtype, data=k_in.data)
        v = T.decl_buffer((flat[2],), dtype, data=v_in.data)
        out = T.decl_buffer((flat[3],), dtype, data=out_in.data)
        if masked:
            m = T.decl_buffer((int(np.prod(m_shape)),), m_dtype, data=m_in.data)
        for row in T.parallel(batch * seq_q):
            scores = T.alloc_buffer((seq_kv,), "float64")
            acc = T.alloc_buffer((3,), "float64")  # a score or output element, the row's maximum, its sum
            b, i = T.meta_var((row // seq_q, row % seq_q))
            acc[1] = T.float64(-np.inf)
            for j in range(seq_kv):
                acc[0] = T.float64(0)
                for d in range(dim):
                    acc[0] = acc[0] + T.Cast("float64", q[q_at(b, i, d)]) * T.Cast("float64", k[k_at(b, j, d)])
                acc[0] = acc[0] * T.float64(scale)
                if masked:
                    acc[0] = acc[0] + T.Cast("float64", m[m_at(b, i, j)])
                if causal:
                    acc[0] = T.if_then_else(j > i, T.float64(-np.inf), acc[0])
                scores[j] = acc[0]
                acc[1] = T.max(acc[1], acc[0])
            acc[2] = T.float64(0)
            for j in range(seq_kv):
                scores[j] = T.exp(scores[j] - acc[1])
                acc[2] = acc[2] + scores[j]
            for d in range(dim):
                acc[0] = T.float64(0)
                for j in range(seq_kv):
                    acc[0] = acc[0] + scores[j] * T.Cast("float64", v[v_at(b, j, d)])
                if zero_empty:
                    out[out_at(b, i, d)] = T.Cast(dtype, T.if_then_else(acc[1] == T.float64(-np.inf), T.float64(0),
                                                                        acc[0] / acc[2]))
                else:
                    out[out_at(b, i, d)] = T.Cast(dtype, acc[0] / acc[2])

    params = list(reference.params)
    return tirx.PrimFunc(params[:3] + (params[3:4] if masked else []) + params[4:], reference.body)


def _run_on_cpu(ref, arrays: list, outputs: int) -> list[np.ndarray]:
    """The outputs of `ref` built for the CPU and run once on `arrays` (cast to its parameters' types)."""
    lib = tvm.compile(tvm.IRModule({"main": ref.with_attr("global_symbol", "main")}), target="llvm")
    args = [tvm.runtime.tensor(a.astype(str(p.ty.dtype), copy=False)) for a, p in zip(arrays, ref.params)]
    lib["main"](*args)
    return [a.numpy() for a in args[-outputs:]]


def reference_arrays(func, dims: dict, path: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(seeded inputs and the reference's outputs for every parameter of `func`, the outputs summed
    in order in float32 where the reference has such a form, else []): built for the CPU and run
    once, and saved at `path` so that a replaced runner reloads it (runners measuring at once take
    turns: the first computes it, the others wait and load it)."""
    outputs, dtypes = output_count(func), [str(p.ty.dtype) for p in func.params]
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            with np.load(path) as saved:  # bfloat16 comes back as raw 2-byte records: view it again
                return ([saved[f"a{i}"].view(d) for i, d in enumerate(dtypes)],
                        [saved[f"o{i}"].view(d) for i, d in enumerate(dtypes[-outputs:]) if f"o{i}" in saved])
        arrays = _arrays(func, dims)
        results = [[a.astype(d) for a, d in zip(_run_on_cpu(ref, arrays, outputs), dtypes[-outputs:])]
                   for ref in references(func)]
        arrays[-outputs:] = results[0]
        in_order = results[1] if len(results) > 1 else []
        np.savez(path + ".tmp.npz", **{f"a{i}": a for i, a in enumerate(arrays)},
                 **{f"o{i}": a for i, a in enumerate(in_order)})
        os.replace(path + ".tmp.npz", path)
        return arrays, in_order


def _decode_reference(args: dict) -> tirx.PrimFunc:
    """A decoding step's partial kernel in float64 for the CPU: each (row, chunk)'s softmax state over
    its keys, the chunks cut as the kernel cuts them (decode_attention.splits): the maximum score
    in log2 units, the sum and the weighted values under it; NaN in the workspace's chunks past the
    row's (the kernel leaves them as they were: a runner's poison); a grown cache is the
    concatenation of its past and new rows. Reads through the kernel's operand views."""
    batch, seq_kv, dim = args["batch"], args["seq_kv"], args["dim"]
    views = attention.operands(batch, 1, seq_kv, dim, args["given"])
    dtype, given, grown = str(args["dtype"]), args["given"], args["grown"]
    n_splits = decode_attention.splits(batch, seq_kv, args["sm_count"])
    chunk, scale = -(-seq_kv // n_splits), float(args["scale"]) * decode_attention.LOG2E
    values_shape, state_shape = decode_attention.workspace_shapes(batch, dim)
    (q_shape, q_view), (k_shape, k_view), (v_shape, v_view) = (views[name] for name in ("q", "k", "v"))
    past = {name: given[f"{name}_past"][0] if name in grown else views[name][0] for name in ("k", "v")}
    new = {name: given[f"{name}_new"][0] if name in grown else (1,) for name in ("k", "v")}
    whole = {name: views[name][0] for name in ("k", "v")}
    grow_k, grow_v = "k" in grown, "v" in grown
    size = lambda shape: int(np.prod(shape))  # noqa: E731

    def read(name, past_buf, new_buf, at):
        """Element `at` (flat, of the operand's tensor) of K or V: of a grown cache, from its past or new rows."""
        if name not in grown:
            return past_buf[at]
        axis = grown[name]
        before, added, inner = past[name][axis], new[name][axis], size(past[name][axis + 1:])
        outer, pos, i = at // ((before + added) * inner), at // inner % (before + added), at % inner
        return T.if_then_else(pos < before, past_buf[(outer * before + pos) * inner + i],
                              new_buf[(outer * added + pos - before) * inner + i])

    read_k, read_v = (functools.partial(read, name) for name in ("k", "v"))  # TVMScript: no string subscripts
    (k_past, v_past), (k_added, v_added), (k_whole, v_whole) = ((d["k"], d["v"]) for d in (past, new, whole))

    @T.prim_func(check_well_formed=False)
    def reference(q_in: T.Buffer(q_shape, dtype), k_in: T.Buffer(k_past, dtype), k_new_in: T.Buffer(k_added, dtype),
                  v_in: T.Buffer(v_past, dtype), v_new_in: T.Buffer(v_added, dtype),
                  ws: T.Buffer(values_shape, "float32"), ml: T.Buffer(state_shape, "float32"),
                  k_out: T.Buffer(k_whole, dtype), v_out: T.Buffer(v_whole, dtype)):
        q = T.decl_buffer((size(q_shape),), dtype, data=q_in.data)
        k = T.decl_buffer((size(k_past),), dtype, data=k_in.data)
        k_new = T.decl_buffer((size(k_added),), dtype, data=k_new_in.data)
        v = T.decl_buffer((size(v_past),), dtype, data=v_in.data)
        v_new = T.decl_buffer((size(v_added),), dtype, data=v_new_in.data)
        k_grown = T.decl_buffer((size(k_whole),), dtype, data=k_out.data)
        v_grown = T.decl_buffer((size(v_whole),), dtype, data=v_out.data)
        for row in T.parallel(batch):
            scores = T.alloc_buffer((chunk,), "float64")
            acc = T.alloc_buffer((3,), "float64")  # a score or weighted value, the chunk's maximum, its sum
            for c in range(decode_attention.MAX_SPLITS):
                if c < n_splits:
                    acc[1] = T.float64(decode_attention.MASKED)
                    for j in range(T.min(chunk, seq_kv - c * chunk)):
                        acc[0] = T.float64(0)
                        for d in range(dim):
                            acc[0] = acc[0] + T.Cast("float64", q[q_view.element(row, 0, d)]) * T.Cast(
                                "float64", read_k(k, k_new, k_view.element(row, c * chunk + j, d)))
                        scores[j] = acc[0] * T.float64(scale)
                        acc[1] = T.max(acc[1], scores[j])
                    acc[2] = T.float64(0)
                    for j in range(T.min(chunk, seq_kv - c * chunk)):
                        scores[j] = T.exp2(scores[j] - acc[1])
                        acc[2] = acc[2] + scores[j]
                    for d in range(dim):
                        acc[0] = T.float64(0)
                        for j in range(T.min(chunk, seq_kv - c * chunk)):
                            acc[0] = acc[0] + scores[j] * T.Cast(
                                "float64", read_v(v, v_new, v_view.element(row, c * chunk + j, d)))
                        ws[row, c, d] = T.Cast("float32", acc[0])
                    ml[row, c, 0] = T.Cast("float32", acc[1])
                    ml[row, c, 1] = T.Cast("float32", acc[2])
                else:
                    for d in range(dim):
                        ws[row, c, d] = T.float32(np.nan)
                    ml[row, c, 0] = T.float32(np.nan)
                    ml[row, c, 1] = T.float32(np.nan)
        if grow_k:
            for at in T.parallel(size(k_whole)):
                k_grown[at] = read_k(k, k_new, at)
        if grow_v:
            for at in T.parallel(size(v_whole)):
                v_grown[at] = read_v(v, v_new, at)

    p = reference.params  # as the partial kernel's: the new rows and grown caches of the operands grown
    keep = [p[0], p[1], *p[2:3] * grow_k, p[3], *p[4:5] * grow_v, p[5], p[6], *p[7:8] * grow_k, *p[8:9] * grow_v]
    dropped = {*("k_new", "k_grown") * (not grow_k), *("v_new", "v_grown") * (not grow_v)}  # and their flat views
    body = tirx.SeqStmt([x for x in reference.body.seq if not (isinstance(x, tirx.DeclBuffer) and x.buffer.name in dropped)])
    return tirx.PrimFunc(keep, body)


ELEMENT_ULPS = 8  # one element may be off by this many ulps of the output dtype at its row's largest value
MASS_ULPS = 2  # a row's errors may add up to this many ulps of its summed magnitude
FLOAT32_TOLERANCE = 1e-3  # float32's floor on both: its errors are a candidate's long float32 sums, not rounding
NOISE = 2.0 ** -16  # of the tensor's largest |value|: any element may be off by this much (see output_bounds)
IN_ORDER_SLACK = 2.0  # a row may be off by this many times the in-order float32 sum's error (see output_bounds)


def tolerances(dtype: str) -> tuple[float, float]:
    """(element, mass) tolerances of an output dtype, relative to a row's largest and summed |value|:
    float16 0.0078 and 0.002, bfloat16 0.0625 and 0.0156, float32 0.001 and 0.001; 0 for integers
    (exact). A correct candidate differs from the reference by about one rounding of the output
    (measured on the suite: under 0.5 ulp per element, 0.2-0.5 ulp summed) plus, in float32, the
    error of its long float32 sums against the float64 reference; a row 14% off, doubled, constant
    or zeroed is off by far more."""
    if "float" not in dtype:
        return 0.0, 0.0
    eps = float(ml_dtypes.finfo(np.dtype(dtype)).eps)
    return max(ELEMENT_ULPS * eps, FLOAT32_TOLERANCE), max(MASS_ULPS * eps, FLOAT32_TOLERANCE)


def _rows(shape) -> tuple[int, int]:
    """(rows, width) an output is checked by: rows along its last axis where it has two or more
    axes longer than 1 (a norm's or a softmax's rows), else one row holding the whole tensor (a sum)."""
    long_axes, size = [d for d in shape if d != 1], int(np.prod(shape))
    width = long_axes[-1] if len(long_axes) >= 2 else size
    return (size // width, width) if width else (0, 0)


@dataclass
class Output:
    """What one output of a task must be: the reference by rows, and each row's error bounds."""
    name: str
    dtype: str
    want: np.ndarray  # float32, (rows, width); zero where the reference is NaN or infinite
    special: np.ndarray  # flat positions where the reference is NaN or infinite ...
    special_want: np.ndarray  # ... and its values there, which a candidate must repeat
    element_bound: np.ndarray  # per row: the largest |got - want| of one element
    mass_bound: np.ndarray  # per row: the largest sum of |got - want|


def output_bounds(want: np.ndarray, dtype: str, name: str, in_order: np.ndarray | None = None) -> Output:
    """An Output for reference `want` of an output of `dtype`: per row, |got - want| <= element x
    the row's largest |want| for every element, and sum |got - want| <= mass x sum |want| (see
    tolerances), but never less than NOISE of the tensor's largest |want| per element: a value the
    reference cancels to zero (a ReLU'd row) keeps a candidate's float32 accumulation noise. Where
    `in_order` (the task summed in order in float32) is given, a row may also be off by IN_ORDER_SLACK
    times as much as it is: a float32 mean of 10^5 values near zero is off by 1e-5 in order, far
    more than 0.001 of the mean, and a candidate summing in float32 is as right as that."""
    element, mass = tolerances(dtype)
    flat = want.astype("float32").reshape(_rows(want.shape))
    special = np.flatnonzero(~np.isfinite(flat))
    special_want = flat.reshape(-1)[special]
    flat.reshape(-1)[special] = 0
    magnitude = np.abs(flat)
    noise = NOISE * float(magnitude.max(initial=0))
    out = Output(name, dtype, flat, special, special_want, np.maximum(element * magnitude.max(-1, initial=0), noise),
                 np.maximum(mass * magnitude.sum(-1), noise * flat.shape[1]))
    if in_order is not None:
        in_order = in_order.reshape(flat.shape).astype("float32")
        in_order.reshape(-1)[special] = 0
        largest, summed = (np.nan_to_num(e, nan=0.0, posinf=0.0) for e in _row_errors(in_order, out))
        out.element_bound = np.maximum(out.element_bound, IN_ORDER_SLACK * largest)
        out.mass_bound = np.maximum(out.mass_bound, IN_ORDER_SLACK * summed)
    return out


def _row_errors(got: np.ndarray, out: Output) -> tuple[np.ndarray, np.ndarray]:
    """(largest, summed) |got - want| of each row (NaN where got is NaN at a finite reference).
    Compared in cache-sized chunks over threads: whole-array numpy expressions spill every
    temporary to memory and dominate a large candidate's check."""
    rows, width = out.want.shape
    if not rows:
        return np.zeros(0, "float32"), np.zeros(0, "float32")
    step = max(1, CHECK_CHUNK // width)

    def errors(start: int) -> tuple:
        part = got[start:start + step].astype("float32")
        np.subtract(part, out.want[start:start + step], out=part)
        np.abs(part, out=part)
        return part.max(-1, initial=0), part.sum(-1)

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(errors, range(0, rows, step)))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _mismatch(got: np.ndarray, out: Output) -> str | None:
    """What is wrong with `got` as output `out`, or None when it is within the bounds."""
    got = got.reshape(out.want.shape)
    if out.special.size:  # NaN where the reference has NaN, the same infinity where it has one
        there = got.reshape(-1)[out.special].astype("float32")
        same = (np.isnan(there) & np.isnan(out.special_want)) | (there == out.special_want)
        if not same.all():
            i = int(np.argmin(same))
            return f"element {int(out.special[i])} is {there[i]} where the reference has {out.special_want[i]}"
        got = got.copy()
        got.reshape(-1)[out.special] = 0
    largest, summed = _row_errors(got, out)
    where = f"of {len(largest)} rows of {out.want.shape[1]}" if len(largest) > 1 else "(one row: the whole tensor)"
    bad = np.flatnonzero(~(largest <= out.element_bound))
    if bad.size:
        r = int(bad[0])
        return (f"row {r} {where}: an element is off by {largest[r]:.3g}, more than {out.element_bound[r]:.3g} "
                f"({tolerances(out.dtype)[0]:.3g} of the row's largest |value|); {bad.size} row(s) so")
    bad = np.flatnonzero(~(summed <= out.mass_bound))
    if bad.size:
        r = int(bad[0])
        return (f"row {r} {where}: errors sum to {summed[r]:.3g}, more than {out.mass_bound[r]:.3g} "
                f"({tolerances(out.dtype)[1]:.3g} of the row's summed |value|); {bad.size} row(s) so")
    return None


def check_outputs(got: list, outputs: list) -> None:
    """Raise unless every output is within its bounds (see output_bounds), naming the first that is not."""
    for i, (value, out) in enumerate(zip(got, outputs, strict=True)):
        problem = _mismatch(value, out)
        if problem:
            raise ValueError(f"wrong result: output {i} ({out.name}, {out.dtype}): {problem}")
