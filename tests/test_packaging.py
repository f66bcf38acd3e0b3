"""The wheel installs one top-level name, tvm_ext (the repository's schedules/ and search/ folders
become tvm_ext.schedules and tvm_ext.search), and that package builds a model from outside the
repository."""

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    isolation = ["--no-build-isolation"] if _has_setuptools() else []  # else pip fetches setuptools to build
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), *isolation, str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (found,) = out.glob("tvm_ext-*.whl")
    return found


def _has_setuptools() -> bool:
    try:
        import setuptools  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def test_the_wheel_installs_only_tvm_ext(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"tvm_ext"}
    for module in ("tvm_ext/schedules/wgmma_matmul.py", "tvm_ext/search/tuner.py", "tvm_ext/relax/reduce_fusion.py",
                   "tvm_ext/tir/narrowing.py", "tvm_ext/schedules/contracts.py"):
        assert module in names


def test_the_installed_package_builds_from_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = textwrap.dedent("""
        import numpy as np, tvm, tvm_ext
        from tvm import relax
        from tvm_ext.search.tasks import extract_tasks
        assert tvm_ext.__file__.startswith(SITE) and tvm_ext.schedules.__file__.startswith(SITE), tvm_ext.__file__
        x = relax.Var("x", relax.TensorType([4, 256], "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            bb.emit_func_output(relax.op.nn.softmax(x))
        mod = bb.get()
        assert [t.name for t in extract_tasks(mod, tvm_ext.parse_target("llvm"))] == ["softmax"]
        xs = np.random.rand(4, 256).astype("float32")
        out = tvm.runtime.vm.VirtualMachine(tvm_ext.build(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(xs)).numpy()
        e = np.exp(xs - xs.max(1, keepdims=True))
        assert np.allclose(out, e / e.sum(1, keepdims=True), atol=1e-6)
        print("ok")
    """).replace("SITE", repr(str(site)))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_the_wheel_declares_the_command_lines(wheel):
    (entry_points,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "tvm-ext-demo = tvm_ext.demo:main" in text and "tvm-ext-tune = tvm_ext.search.cli:main" in text


def _installed(wheel, tmp_path, code: str) -> subprocess.CompletedProcess:
    """`code` run from outside the repository with only the wheel's files on the path and no GPU."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})


def test_the_installed_demo_runs_its_model(wheel, tmp_path):
    done = _installed(wheel, tmp_path, "import sys; from tvm_ext.demo import main; sys.exit(main(['--out', 'o']))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "demo: all outputs match NumPy"
    assert (tmp_path / "o" / "transformer_norms_llvm.so").is_file()


def test_the_installed_tuner_names_what_needs_the_checkout(wheel, tmp_path):
    code = ("import sys; sys.argv[0] = 'tvm-ext-tune'; from tvm_ext.search.cli import main; "
            "sys.exit(main(['--model', 'suite', '--target', 'llvm', '--trials', '1', '--log', 'l.json']))")
    done = _installed(wheel, tmp_path, code)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip() == ("tvm-ext-tune: --model suite needs the tvm_ext repository checkout (bench.suite is "
                                   "not installed with the package): run from the checkout, or pass a .py file "
                                   "defining build_module()")
