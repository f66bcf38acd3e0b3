"""variance="tuned": the variance algorithm as a tuning knob. Each statistic is a task under
Welford and under two passes; a build takes, per fused function, the one its records found faster."""

import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import reference, relax_module
from tvm_ext import schedules
from tvm_ext.pipeline import choose_variants, fused_variants
from tvm_ext.records import Database, append_record
from tvm_ext.search.tasks import extract_tasks
from tvm_ext.search.tuner import tune_model

TARGET = tvm_ext.parse_target("llvm")
LN = ("layer_norm", [64, 256], "float32")


def variant_functions():
    """{algorithm: the fused LayerNorm PrimFunc} of the two variants."""
    welford, two_pass = fused_variants(relax_module(*LN), TARGET, variance="tuned")
    pick = lambda mod: next(f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))  # noqa: E731
    return {"welford": pick(welford), "two_pass": pick(two_pass)}


def test_each_statistic_is_a_task_per_algorithm_counted_once():
    (plain,) = extract_tasks(relax_module(*LN), TARGET)
    tasks = extract_tasks(relax_module(*LN), TARGET, variance="tuned")
    assert len({t.key for t in tasks}) == 2 and plain.key in {t.key for t in tasks}
    assert [t.weight for t in tasks] == [1, 1]
    # a function both variants share (a softmax has no statistic) stays one task of weight 1
    (softmax,) = extract_tasks(relax_module("softmax", [64, 256], "float32"), TARGET, variance="tuned")
    assert softmax.weight == 1


@pytest.mark.parametrize("faster", ["welford", "two_pass"])
def test_the_build_takes_the_algorithm_its_records_found_faster(tmp_path, faster, rng):
    funcs = variant_functions()
    assert not tvm_ffi.structural_equal(funcs["welford"], funcs["two_pass"])
    log = tmp_path / "ln.json"
    for algorithm, func in funcs.items():
        append_record(log, func, TARGET, "layer_norm", schedules.heuristic_knobs(func, TARGET),
                      us=5.0 if algorithm == faster else 10.0)
    chosen = choose_variants(fused_variants(relax_module(*LN), TARGET, variance="tuned"), TARGET, Database.load(log))
    (func,) = [f for _, f in chosen.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert tvm_ffi.structural_equal(func, funcs[faster])
    x, w, b = (rng.standard_normal(s).astype("float32") * 2 + 0.5 for s in ([64, 256], [256], [256]))
    vm = VirtualMachine(tvm_ext.build(relax_module(*LN), TARGET, database=str(log), variance="tuned"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b)]).numpy()
    np.testing.assert_allclose(out, reference("layer_norm", [x, w, b])[0], rtol=1e-4, atol=1e-4)


def test_without_a_record_for_both_the_welford_function_stays(tmp_path):
    funcs = variant_functions()
    log = tmp_path / "ln.json"
    append_record(log, funcs["two_pass"], TARGET, "layer_norm", schedules.heuristic_knobs(funcs["two_pass"], TARGET), 1.0)
    chosen = choose_variants(fused_variants(relax_module(*LN), TARGET, variance="tuned"), TARGET, Database.load(log))
    (func,) = [f for _, f in chosen.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert tvm_ffi.structural_equal(func, funcs["welford"])


def test_tuned_without_a_log_is_a_clear_error():
    with pytest.raises(ValueError, match='variance="tuned".*database'):
        tvm_ext.build(relax_module(*LN), TARGET, variance="tuned")


def test_the_tuner_measures_both_variants_and_the_build_reads_them(tmp_path, rng):
    log = tmp_path / "ln.json"
    reports = tune_model(relax_module(*LN), TARGET, trials=4, log=str(log), batch=2, progress=False, timeout=120,
                         variance="tuned")
    keys = {json.loads(line)["key"] for line in log.read_text().splitlines()}
    funcs = variant_functions()
    assert len(reports) == 2 and keys == {tvm_ext.records.task_key(f, TARGET) for f in funcs.values()}
    # rows far from zero (mean 300, std 1): Welford's error is about 5e-5 here, two passes' 3e-4, the
    # one-pass algorithm's 0.2
    x = (rng.standard_normal([64, 256]) + 300).astype("float32")
    w, b = (rng.standard_normal(s).astype("float32") for s in ([256], [256]))
    vm = VirtualMachine(tvm_ext.build(relax_module(*LN), TARGET, database=str(log), variance="tuned"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b)]).numpy()
    np.testing.assert_allclose(out, reference("layer_norm", [x, w, b])[0], rtol=1e-3, atol=1e-3)
