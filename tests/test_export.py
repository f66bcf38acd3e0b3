"""Export, then load and run in a fresh process that never imports the compiler side of the project."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import tvm_ext
from bench.suite import relax_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Loads tvm_ext/runtime.py by path (not `import tvm_ext`), with TVM's runtime-only library
# (TVM_USE_RUNTIME_LIB=1): neither the project's compiler side nor libtvm_compiler is loaded.
DEPLOY = r"""
import importlib.util, sys
import numpy as np
import tvm
spec = importlib.util.spec_from_file_location("deploy_runtime", sys.argv[1])
runtime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runtime)
dev = tvm.device(sys.argv[5])
vm = runtime.load(sys.argv[2], dev)
out = vm["main"](tvm.runtime.tensor(np.load(sys.argv[3]), dev)).numpy()
np.save(sys.argv[4], out)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("tvm_ext", "schedules", "search", "xgboost"))
compiler = "libtvm_compiler" in open("/proc/self/maps").read()
print("leaked", leaked, "compiler library loaded", compiler)
"""


def deploy_round_trip(tmp_path, rng, target, device, env, shape=(7, 300), dims=("n", 300)):
    """Build a softmax over `dims`, export, run it on `shape` here and in a fresh process; returns its stdout."""
    so = tvm_ext.export(tvm_ext.build(relax_module("softmax", list(dims), "float32"), target), tmp_path / "sm.so")
    x = rng.standard_normal(shape).astype("float32")
    dev = tvm.device(device)
    expected = VirtualMachine(tvm.runtime.load_module(so), dev)["main"](tvm.runtime.tensor(x, dev)).numpy()
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run([sys.executable, "-c", DEPLOY, os.path.join(ROOT, "tvm_ext", "runtime.py"), so,
                           str(tmp_path / "x.npy"), str(tmp_path / "out.npy"), device],
                          cwd=tmp_path, env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected)
    np.testing.assert_allclose(expected, np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-5)
    return proc.stdout


def test_export_then_fresh_runtime_only_process_gives_same_numbers(tmp_path, rng):
    out = deploy_round_trip(tmp_path, rng, "llvm", "cpu", {"TVM_USE_RUNTIME_LIB": "1"})
    assert "leaked [] compiler library loaded False" in out


# `import tvm_ext` itself where TVM's runtime library alone is loaded: load runs the export, build says why not.
RUNTIME_ONLY_PACKAGE = r"""
import sys
import numpy as np
import tvm
import tvm_ext
out = tvm_ext.load(sys.argv[1], "cpu")["main"](tvm.runtime.tensor(np.load(sys.argv[2])))
np.save(sys.argv[3], out.numpy())
try:
    tvm_ext.build
except ImportError as err:
    print("build:", err)
print("compiler library loaded", "libtvm_compiler" in open("/proc/self/maps").read())
"""


def test_the_package_imports_with_the_runtime_library_only(tmp_path, rng):
    so = tvm_ext.export(tvm_ext.build(relax_module("softmax", [7, 300], "float32"), "llvm"), tmp_path / "sm.so")
    x = rng.standard_normal((7, 300)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_PACKAGE, so, str(tmp_path / "x.npy"),
                           str(tmp_path / "out.npy")], cwd=ROOT, env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), np.exp(x) / np.exp(x).sum(-1, keepdims=True), rtol=1e-5)
    assert "build: tvm_ext.build needs TVM's compiler" in proc.stdout and "TVM_USE_RUNTIME_LIB=1" in proc.stdout
    assert "compiler library loaded False" in proc.stdout


@pytest.mark.gpu
def test_cuda_export_runs_in_a_fresh_process_without_the_project(tmp_path, rng):
    out = deploy_round_trip(tmp_path, rng, "cuda", "cuda", {})
    assert "leaked []" in out


@pytest.mark.gpu
def test_exported_cooperative_kernel_keeps_its_launch_and_header(tmp_path, rng):
    # 4 static rows of 262144: grid_sync, one cooperative launch with <cooperative_groups.h>
    so = tvm_ext.build(relax_module("softmax", [4, 262144], "float32"), "cuda")
    assert "cooperative_groups::this_grid().sync();" in tvm_ext.cuda_source(so)
    out = deploy_round_trip(tmp_path, rng, "cuda", "cuda", {}, shape=(4, 262144), dims=(4, 262144))
    assert "leaked []" in out


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 77, 300])
def test_example_model_on_gpu(rows, rng):
    from examples.transformer_norms import build_module, inputs, reference  # noqa: PLC0415

    vm = VirtualMachine(tvm_ext.build(build_module(), "cuda"), tvm.cuda(0))
    arrays = inputs(rows, rng)
    outs = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in arrays])
    for out, ref in zip(outs, reference(*arrays)):
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_load_and_export_name_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.so"):
        tvm_ext.load(tmp_path / "missing.so")
    ex = tvm_ext.build(relax_module("row_sum", [4, 8], "float32"), "llvm")
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        tvm_ext.export(ex, tmp_path / "no_such_dir" / "m.so")
    with pytest.raises(ValueError, match="must end in .so"):
        tvm_ext.export(ex, tmp_path / "m.tar")
