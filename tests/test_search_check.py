"""The tuner's output check: a zeroed, constant, doubled or 14%-off output of a softmax, a norm or a
sum fails at every width and dtype, every output of a multi-output function is checked, and
correct results with the rounding of a float32-accumulated kernel pass."""

import functools

import numpy as np
import pytest
import tvm

import tvm_ext
from bench import spelled
from bench.suite import random_inputs, reference, relax_module
from helpers import NP_DTYPE
from tvm_ext.search.check import check_outputs, output_bounds, output_count
from tvm_ext.search.measure import Measurer
from tvm_ext.search.tasks import extract_tasks
from test_search_measure import output_zeroing_builder, zeroing_builder

CASES = [  # (op, shape, dtype): softmax rows of 1024, 4096 and 262144, norms, row, column and full sums
    ("softmax", [4, 1024], "float16"), ("softmax", [4, 4096], "float16"), ("softmax", [4, 4096], "bfloat16"),
    ("softmax", [2, 262144], "float32"), ("softmax", [2, 32768], "float16"),
    ("layer_norm", [4, 1024], "float16"), ("layer_norm", [4, 5120], "bfloat16"), ("layer_norm", [4, 768], "float32"),
    ("rms_norm", [4, 4096], "bfloat16"), ("rms_norm", [4, 32768], "bfloat16"), ("rms_norm", [4, 1024], "float16"),
    ("row_sum", [16, 4096], "float32"), ("row_sum", [256, 4096], "float16"), ("col_sum", [4096, 64], "float32"),
    ("full_sum", [1 << 18], "float32"), ("bn_stats", [8, 16, 14, 14], "float32"),
]
WRONG = {
    "zeros": lambda want: np.zeros_like(want),
    "constant": lambda want: np.broadcast_to(want.mean(-1, keepdims=True), want.shape),  # the row's mean
    "doubled": lambda want: 2 * want,
    "x1.14": lambda want: 1.14 * want,
}
F32_EPS = 2.0 ** -23


def _round(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(NP_DTYPE[dtype])


def _case(op: str, shape: list, dtype: str, rng):
    """(reference outputs as the task writes them, the exact float64 ones) for inputs in `dtype`."""
    inputs = [_round(x, dtype).astype("float64") for x in random_inputs(op, shape, rng)]
    exact = reference(op, inputs)
    return [_round(e, dtype) for e in exact], exact


def _accumulated(exact: np.ndarray, dtype: str, rng) -> np.ndarray:
    """`exact` as a float32-accumulated kernel writes it: each row off by the error of a float32 sum
    of its width (4 sqrt(width) ulps, one sign), each element by 4 float32 ulps more, then rounded to
    `dtype`: 16-bit results then differ from the reference by a rounding flip here and there."""
    width = exact.shape[-1] if exact.ndim > 1 else max(exact.size, 1)
    row = 1 + 4 * F32_EPS * np.sqrt(width)
    return _round(exact * row * (1 + 4 * F32_EPS * rng.standard_normal(exact.shape)), dtype)


def _bounds(wants: list, dtype: str) -> list:
    return [output_bounds(w, dtype, f"out{i}") for i, w in enumerate(wants)]


@pytest.mark.parametrize("op,shape,dtype", CASES)
def test_correct_results_at_fp16_bf16_fp32_rounding_pass(op, shape, dtype, rng):
    wants, exact = _case(op, shape, dtype, rng)
    got = [_accumulated(e, dtype, rng) for e in exact]
    assert any((g != w).any() for g, w in zip(got, wants))  # the rounding differs somewhere
    check_outputs(got, _bounds(wants, dtype))


@pytest.mark.parametrize("kind", sorted(WRONG))
@pytest.mark.parametrize("op,shape,dtype", CASES)
def test_zeroed_constant_doubled_and_14_percent_off_outputs_fail(op, shape, dtype, kind, rng):
    wants, _ = _case(op, shape, dtype, rng)
    for i in range(len(wants)):  # each output wrong in turn, the others right
        if kind == "constant" and wants[i].size == 1:
            continue  # a scalar is its own constant
        got = list(wants)
        got[i] = _round(WRONG[kind](wants[i].astype("float64")), dtype)
        with pytest.raises(ValueError, match=rf"wrong result: output {i} \(out{i}, {dtype}\): "):
            check_outputs(got, _bounds(wants, dtype))


def test_the_bound_of_a_wide_fp16_softmax_row_is_below_its_probabilities(rng):
    """The old bound (2e-2 absolute for fp16) exceeded every probability of a 4096-wide row, so
    zeros passed; the new one is a fraction of the row's largest value and of its sum."""
    (want,), _ = _case("softmax", [2, 4096], "float16", rng)
    (out,) = _bounds([want], "float16")
    assert np.all(out.element_bound < 1e-2 * np.abs(want.astype("float32")).max(-1))
    assert np.all(out.mass_bound == pytest.approx(2 * 2.0 ** -10 * want.astype("float32").sum(-1), rel=1e-3))
    with pytest.raises(ValueError, match=r"row 0 of 2 rows of 4096: an element is off by 0.0\d+, more than "
                                         r"\S+ \(0.00781 of the row's largest \|value\|\); 2 row\(s\) so"):
        check_outputs([np.zeros_like(want)], [out])


def test_a_row_within_the_element_bound_but_off_in_sum_fails(rng):
    """0.6% too large everywhere (a lost partial of one block in 160) passes the fp16 element bound
    (0.78% of the row's largest value) but not the sum bound (0.2%)."""
    (want,), _ = _case("softmax", [3, 4096], "float16", rng)
    got = want.copy()
    got[1] = _round(want[1].astype("float64") * 1.006, "float16")
    with pytest.raises(ValueError, match=r"row 1 of 3 rows of 4096: errors sum to \S+, more than \S+ "
                                         r"\(0.00195 of the row's summed \|value\|\); 1 row\(s\) so"):
        check_outputs([got], _bounds([want], "float16"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_nan_and_inf_must_be_where_the_reference_has_them(dtype, rng):
    (want,), _ = _case("layer_norm", [4, 256], dtype, rng)
    want[1, 7], want[2, 9] = np.nan, -np.inf
    bounds = _bounds([want], dtype)
    check_outputs([want.copy()], bounds)
    for pos, value, message in [((1, 7), 0.0, r"element 263 is 0.0 where the reference has nan"),
                                ((2, 9), np.inf, r"element 521 is inf where the reference has -inf"),
                                ((3, 3), np.nan, r"row 3 of 4 rows of 256: an element is off by nan")]:
        got = want.copy()
        got[pos] = value
        with pytest.raises(ValueError, match=message):
            check_outputs([got], bounds)


def test_a_row_the_reference_cancels_to_zero_admits_the_tensors_rounding_noise():
    """A ReLU'd row that is all zero in the reference and 1e-5 in the candidate, in a tensor of
    values near 1: allowed (2^-10 of the tensor's scale); 1e-2 is not."""
    want = np.ones((3, 8), "float32")
    want[1] = 0
    got = want.copy()
    got[1, 2] = 1e-5
    check_outputs([got], _bounds([want], "float32"))
    got[1, 2] = 1e-2
    with pytest.raises(ValueError, match="row 1 of 3 rows of 8: an element is off by 0.01"):
        check_outputs([got], _bounds([want], "float32"))


def test_integer_outputs_must_be_exact():
    want = np.arange(12, dtype="int32").reshape(3, 4)
    check_outputs([want.copy()], _bounds([want], "int32"))
    got = want.copy()
    got[2, 1] += 1
    with pytest.raises(ValueError, match=r"row 2 of 3 rows of 4: an element is off by 1, more than 0"):
        check_outputs([got], _bounds([want], "int32"))


TARGET = tvm_ext.parse_target("llvm")


def _task(mod):
    (task,) = extract_tasks(mod, TARGET)
    return task


def test_both_outputs_of_add_rms_norm_are_checked_and_tvms_own_builds_pass(tmp_path):
    """A candidate that zeroes the residual sum (the first output) got a latency before; now it is
    an error naming that output, and one zeroing the norm names the second. Our heuristic's
    candidate and TVM's plain builds (fp16 add + RMSNorm, bf16 RMSNorm, fp16 softmax) pass."""
    fused = _task(spelled.module("add_rms_norm", [16, 1024], "float16"))
    assert output_count(fused.func) == 2
    plain = [fused, _task(relax_module("rms_norm", [8, 4096], "bfloat16")),
             _task(relax_module("softmax", [8, 4096], "float16"))]
    with Measurer(TARGET, builders=1, timeout=120) as measurer:
        (good,) = measurer.measure(fused.func, [{"strategy": "cpu_rows", "lanes": 16}])
        measurer.builder = functools.partial(output_zeroing_builder, -2)
        (residual,) = measurer.measure(fused.func, [{"strategy": "cpu_rows", "lanes": 16}])
        measurer.builder = zeroing_builder
        (norm,) = measurer.measure(fused.func, [{"strategy": "cpu_rows", "lanes": 16}])
        theirs = []
        for i, task in enumerate(plain):
            lib = tvm.compile(tvm.IRModule({"main": task.func.with_attr("global_symbol", "main")}), target=TARGET)
            lib.export_library(str(tmp_path / f"tvm{i}.so"))
            theirs.append(measurer.time_library(task.func, str(tmp_path / f"tvm{i}.so")))
    assert good.error is None and good.best_us > 0
    assert residual.us == [] and "wrong result: output 0 (T_add_intermediate_1_2, float16)" in residual.error
    assert norm.us == [] and "wrong result: output 1 (T_multiply_intermediate_1, float16)" in norm.error
    assert [r.error for r in theirs] == [None, None, None] and all(r.best_us > 0 for r in theirs)


def test_long_float32_sums_near_zero_are_checked_against_float64(tmp_path):
    """Batch statistics over 100352 values a channel (means near 0.003): the reference is float64's
    to 1e-9, where summed in order in float32 it is 1e-5 off (more than 0.001 of a mean, which
    rejected every candidate when that was the reference); the CPU candidates, which sum in float32,
    pass within twice the in-order error; a mean 14% off or zeroed fails."""
    from tvm_ext.search.check import reference_arrays  # noqa: PLC0415

    task = _task(relax_module("bn_stats", [32, 16, 56, 56], "float32"))
    (x, mean, variance), in_order = reference_arrays(task.func, {}, str(tmp_path / "reference.npz"))
    exact = x.astype("float64")
    assert np.abs(mean - exact.mean(axis=(0, 2, 3))).max() < 1e-9
    assert np.abs(variance / exact.var(axis=(0, 2, 3)) - 1).max() < 1e-6
    assert np.abs(in_order[0] - exact.mean(axis=(0, 2, 3))).max() > 0.001 * np.abs(mean).max()
    with Measurer(TARGET, builders=1, timeout=120) as measurer:
        results = measurer.measure(task.func, [{"strategy": "cpu_rows", "lanes": 1}, {"strategy": "cpu_rows", "lanes": 16}])
    assert [r.error for r in results] == [None, None]
    bounds = [output_bounds(w, "float32", name, o) for w, name, o in zip((mean, variance), ("mean", "var"), in_order)]
    for wrong in (1.14 * mean, np.zeros_like(mean)):
        with pytest.raises(ValueError, match="output 0 \\(mean, float32\\)"):
            check_outputs([wrong, variance], bounds)


def _reference_in_a_runner(func_json: str, path: str) -> list:
    from tvm_ext.search.check import reference_arrays  # noqa: PLC0415

    arrays, in_order = reference_arrays(tvm.ir.load_json(func_json), {}, path)
    return [a.tobytes() for a in arrays + in_order]


def test_runners_that_need_one_reference_at_once_take_turns(tmp_path):
    """Two runners (two RPC servers) start on a task together: one computes the reference, the
    other waits and loads it; neither fails on the other's files."""
    import multiprocessing  # noqa: PLC0415

    (task,) = extract_tasks(relax_module("softmax", [512, 2000], "float32"), tvm_ext.parse_target("llvm"))
    path = str(tmp_path / "reference.npz")
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.starmap(_reference_in_a_runner, [(tvm.ir.save_json(task.func), path)] * 3)
    assert results[0] == results[1] == results[2] and len(results[0]) == 3  # input, output, in-order output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference.npz", "reference.npz.lock"]
