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


@pytest.mark.parametrize("command", [["-m", m] for m in MODULES] + [[s] for s in SCRIPTS], ids=str)
def test_help_works_without_a_gpu(command):
    done = _run(*command, "--help")
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.startswith("usage:")


def test_the_report_names_a_missing_results_file_in_one_line():
    done = _run("-m", "bench.report", "missing.json")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot read missing.json" in done.stderr.splitlines()[-1]
