"""Every command line of the project answers --help on a machine without a GPU, and a bad
argument to the report is one line of usage error, not a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")
                 if "__main__" in p.read_text() and p.stem != "__init__")
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.py"))


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


# Runs each command line given to it as `python -m MODULE --help` or `python SCRIPT --help` would,
# one after the other in this one interpreter (an interpreter start and TVM's import a command took
# most of a minute in all); prints, per command, its exit code and whether it printed a usage.
_EACH_HELP = """
import contextlib, io, runpy, sys
for command in sys.argv[1:]:
    out, sys.argv = io.StringIO(), [command, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            if command.endswith(".py"):
                runpy.run_path(command, run_name="__main__")
            else:
                runpy.run_module(command, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code or 0
    except BaseException as err:
        code = repr(err)
    print(command, code, out.getvalue().startswith("usage:"), sep="|", flush=True)
"""


def test_every_command_line_answers_help_without_a_gpu():
    commands = MODULES + SCRIPTS
    assert len(commands) >= 10 and "scripts/tune.py" in commands
    done = _run("-c", _EACH_HELP, *commands)
    assert done.returncode == 0, done.stderr[-500:]
    answers = dict(line.split("|", 1) for line in done.stdout.splitlines() if line.count("|") == 2)
    assert answers == {command: "0|True" for command in commands}, done.stderr[-500:]


def test_the_report_names_a_missing_results_file_in_one_line():
    done = _run("-m", "bench.report", "missing.json")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot read missing.json" in done.stderr.splitlines()[-1]


def test_a_target_that_is_not_json_is_one_line(tmp_path):
    done = _run("scripts/tune.py", "--model", "suite:ln-8192x4096-f16", "--target", "{bad", "--trials", "2",
                "--log", str(tmp_path / "t.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["tune.py: --target '{bad' is not valid JSON: Expecting property name "
                                                "enclosed in double quotes at column 2"]


def test_a_cuda_target_without_a_gpu_is_refused_before_any_work(tmp_path):
    done = _run("scripts/tune.py", "--model", "suite:ln-8192x4096-f16", "--target", '{"kind": "cuda", "arch": "sm_90a"}',
                "--trials", "2", "--log", str(tmp_path / "t.json"))
    assert done.returncode == 2 and "no CUDA GPU is visible to measure on" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "t.json").exists()


def test_a_run_where_no_candidate_could_be_measured_exits_non_zero_and_says_why(tmp_path):
    done = _run("scripts/tune.py", "--model", "suite:rms-8192x4096-bf16", "--target", "llvm", "--trials", "2",
                "--timeout", "0.001", "--log", str(tmp_path / "t.json"))
    assert done.returncode == 1, done.stderr[-500:]
    assert done.stderr.splitlines()[-1] == "tune.py: no candidate could be measured; the first failure: timed out after 0.001 s"


def test_the_report_sums_up_the_static_cases_against_copy_and_torch_compile():
    from bench.report import markdown  # noqa: PLC0415

    rows = [{"case": "a", "impl": "ours", "us": 10.0, "gbps": 2000.0, "max_abs_err": 0.0, "n": None},
            {"case": "a", "impl": "torch_compile", "us": 20.0, "gbps": 1000.0, "n": None},
            {"case": "a", "impl": "copy", "us": 5.0, "gbps": 4000.0, "n": None},
            {"case": "b", "impl": "ours", "us": 40.0, "gbps": 500.0, "max_abs_err": 0.0, "n": None},
            {"case": "b", "impl": "torch_compile", "us": 20.0, "gbps": 1000.0, "n": None},
            {"case": "b", "impl": "copy", "us": 20.0, "gbps": 1000.0, "n": None},
            {"case": "c", "impl": "ours", "us": 1.0, "gbps": 1.0, "max_abs_err": 0.0, "n": {"n": 1}}]
    table = markdown({"device": "GPU", "date": "today", "torch": "t", "tvm": "v", "copy_gbps": 4000.0, "rows": rows})
    assert "| a | 10.0 | 2000 | 1000 | 4000 | 2.00x | - | 50% | 50% |" in table
    assert table.rstrip().splitlines()[-1] == ("2 static cases: ours 25% of copy (geometric mean); 50% of the same-size "
                                               "copy; 1.00x torch.compile, 1 of 2 at 1.0x or more.")


def test_the_report_gives_device_and_wall_ratios_where_wall_times_were_taken():
    from bench.report import markdown  # noqa: PLC0415

    rows = [{"case": "a", "impl": "ours", "us": 10.0, "wall_us": 30.0, "gbps": 2000.0, "max_abs_err": 0.0, "n": None},
            {"case": "a", "impl": "torch_compile", "us": 20.0, "wall_us": 15.0, "gbps": 1000.0, "n": None}]
    table = markdown({"device": "GPU", "date": "today", "torch": "t", "tvm": "v", "copy_gbps": 4000.0, "rows": rows})
    assert "| vs torch.compile | vs torch.compile, wall | vs dlight |" in table
    assert "| a | 10.0 | 2000 | 1000 | 2.00x | 0.50x | - |" in table


def test_tuning_writes_a_report_picture_and_exports_a_metaschedule_database(tmp_path):
    model = tmp_path / "small.py"
    model.write_text("from bench.suite import relax_module\n\n\ndef build_module():\n"
                     "    return relax_module('softmax', [64, 256], 'float32')\n")
    done = _run("scripts/tune.py", "--model", str(model), "--target", "llvm", "--trials", "2", "--log",
                str(tmp_path / "t.json"), "--export-metaschedule", str(tmp_path / "ms"))
    assert done.returncode == 0, done.stderr[-500:]
    assert f"MetaSchedule database in {tmp_path / 'ms'}: 1 task(s) exported (softmax)" in done.stdout
    assert f"report: {tmp_path / 't.report.png'}" in done.stdout
    assert (tmp_path / "t.report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tvm.s_tir.meta_schedule.database import JSONDatabase  # noqa: PLC0415

    db = JSONDatabase(path_workload=str(tmp_path / "ms" / "database_workload.json"),
                      path_tuning_record=str(tmp_path / "ms" / "database_tuning_record.json"))
    assert len(db.get_all_tuning_records()) == 1
