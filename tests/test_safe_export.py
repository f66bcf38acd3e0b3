"""Exports are safe to load: `load` refuses a damaged file, or one built for a CPU or GPU this machine
lacks, with a Python error naming the file, before any of its native code runs (before: SIGBUS, SIGSEGV,
SIGILL); a failed `export` is an OSError and leaves the previous file as it was (before: LLVM ended the
process). Whatever could crash natively runs in a subprocess, so that a crash fails the test only."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import tvm

import tvm_ext
from bench.suite import relax_module
from conftest import CUDA_TARGET, has_gpu
from tvm_ext.runtime import manifest_trailer, read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (4, 8)

# Loads each file (arguments: device, path, device, path...) and runs softmax on ones (rows sum to 1: 4.0 in
# all) with TVM's runtime library only; a line a file: "ran | sum | warnings..." or "refused | type | ValueError? | message".
LOAD = r"""
import sys, warnings
import numpy as np
import tvm
import tvm_ext
from tvm_ext.runtime import read_manifest
for device, path in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            vm = tvm_ext.load(path, None if device == "default" else device)
            dev = tvm.device((read_manifest(path) or {}).get("device", "cpu"))
            out = vm["main"](tvm.runtime.tensor(np.ones(%r, "float32"), dev)).numpy()
        print("ran", float(out.sum()), *[str(w.message) for w in said], sep=" | ", flush=True)
    except Exception as err:
        print("refused", type(err).__name__, isinstance(err, ValueError), err, sep=" | ", flush=True)
""" % (SHAPE,)


def load_each(*files) -> list[list[str]]:
    """What LOAD printed for each file (a path, or (path, device) to name the device), split at ' | '; the
    subprocess must exit cleanly."""
    pairs = [file if isinstance(file, tuple) else (file, "default") for file in files]
    args = [str(arg) for path, device in pairs for arg in (device, path)]
    proc = subprocess.run([sys.executable, "-c", LOAD, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"))
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    lines = [line.split(" | ") for line in proc.stdout.splitlines()]
    assert len(lines) == len(files), proc.stdout
    return lines


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """An llvm softmax export and its bytes."""
    path = tmp_path_factory.mktemp("good") / "softmax.so"
    tvm_ext.export(tvm_ext.build(relax_module("softmax", list(SHAPE), "float32"), "llvm"), path)
    return path, path.read_bytes()


def with_manifest(tmp_path, good, name, **changes):
    """A copy of the good export whose manifest has `changes` (its size and sha256 still right)."""
    path, data = good
    manifest = read_manifest(str(path))
    library = data[:manifest.pop("manifest_offset")]
    out = tmp_path / name
    out.write_bytes(library + manifest_trailer({**manifest, **changes}))
    return out


def test_export_records_a_manifest_that_load_checks(good):
    """The manifest after the library: its size and sha256, device, CPU flags, target, versions."""
    path, data = good
    manifest = read_manifest(str(path))
    size = manifest["size"]
    assert manifest["manifest_offset"] == size and 0 < size < len(data)
    assert manifest["sha256"] == hashlib.sha256(data[:size]).hexdigest()
    assert (manifest["device"], manifest["cuda_arch"], manifest["cpu_features"]) == ("cpu", None, [])
    assert manifest["tvm"] == tvm.__version__ and manifest["tvm_ext"] == tvm_ext.__version__
    assert json.loads(manifest["target"])["kind"] == "llvm"


def test_damaged_exports_are_refused_naming_the_file_and_old_ones_load_with_one_warning(tmp_path, good):
    """Truncated (SIGBUS in dlopen before) and flipped (SIGSEGV) exports are refused; without a manifest (an
    older export) the library's ELF headers still catch a truncation, and an intact one runs with a warning."""
    path, data = good
    size = read_manifest(str(path))["size"]
    flipped = bytearray(data)
    for i in range(size // 2, size // 2 + 16):  # inside the library: code or tables
        flipped[i] ^= 0xFF
    files = {"intact.so": data, "truncated.so": data[:size // 2], "flipped.so": bytes(flipped),
             "old.so": data[:size], "old_truncated.so": data[:size - 100]}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    intact, truncated, flipped, old, old_truncated = load_each(*[tmp_path / name for name in files])
    assert intact == ["ran", "4.0"]
    for said, name, what in [(truncated, "truncated.so", "is truncated"), (flipped, "flipped.so", "is corrupted: its sha256"),
                             (old_truncated, "old_truncated.so", "is truncated")]:
        assert said[:3] == ["refused", "UnloadableExportError", "True"], said
        assert name in said[3] and what in said[3], said
    assert old[:2] == ["ran", "4.0"] and len(old) == 3 and "has no manifest" in old[2], old


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="CPU flags are read from /proc/cpuinfo")
def test_export_for_cpu_features_this_host_lacks_is_refused(tmp_path, good):
    """A manifest claiming a CPU flag no CPU has is refused, naming it; a sapphirerapids build records its
    AVX-512 flags and is refused on a host without AVX512-FP16 (SIGILL on the first call before)."""
    foreign = with_manifest(tmp_path, good, "foreign.so", cpu_features=["avx2_but_from_the_future"])
    spr = tvm_ext.export(tvm_ext.build(relax_module("softmax", list(SHAPE), "float32"),
                                       {"kind": "llvm", "mcpu": "sapphirerapids", "mattr": ["-amx-tile"]}),
                         tmp_path / "spr.so")
    needs = read_manifest(spr)["cpu_features"]
    assert needs == ["avx2", "avx512_bf16", "avx512_fp16", "avx512f"]  # -mattr=-amx-tile took AMX out
    host_has_fp16 = "avx512_fp16" in open("/proc/cpuinfo").read()
    said_foreign, said_spr = load_each(foreign, spr)
    assert said_foreign[:3] == ["refused", "UnloadableExportError", "True"]
    assert "foreign.so" in said_foreign[3] and "lacks: avx2_but_from_the_future" in said_foreign[3]
    if host_has_fp16:
        assert said_spr == ["ran", "4.0"]
    else:
        assert said_spr[0] == "refused" and "avx512_fp16" in said_spr[3] and "sapphirerapids" in said_spr[3]


@pytest.mark.skipif(has_gpu(), reason="checks loading onto a GPU that is not there")
def test_load_on_a_gpu_that_is_not_there_fails_at_load(tmp_path, good):
    """Before, load(path, "cuda") succeeded and the first call failed; a CUDA export loaded on the CPU."""
    cuda_export = tvm_ext.export(tvm_ext.build(relax_module("softmax", list(SHAPE), "float32"), CUDA_TARGET),
                                 tmp_path / "cuda.so")
    assert (read_manifest(cuda_export)["device"], read_manifest(cuda_export)["cuda_arch"]) == ("cuda", "sm_90")
    llvm_on_cuda, by_default, on_cpu = load_each((good[0], "cuda"), cuda_export, (cuda_export, "cpu"))
    for said in (llvm_on_cuda, by_default):
        assert said[:3] == ["refused", "UnloadableExportError", "True"] and "on cuda:0: no such device" in said[3]
    assert "cuda.so" in by_default[3] and "softmax.so" in llvm_on_cuda[3]
    assert on_cpu[0] == "refused" and "cuda.so' was built for cuda, not for device cpu:0" in on_cpu[3]


@pytest.mark.gpu
def test_cuda_export_loads_on_its_gpu_and_not_on_an_older_one(tmp_path):
    """The manifest records this GPU's arch; an export claiming a newer one, or loaded on the CPU, is refused."""
    so = tvm_ext.export(tvm_ext.build(relax_module("softmax", list(SHAPE), "float32"), "cuda"), tmp_path / "gpu.so")
    manifest = read_manifest(so)
    assert manifest["device"] == "cuda" and manifest["cuda_arch"] == str(tvm_ext.parse_target("cuda").attrs["arch"])
    newer = with_manifest(tmp_path, (so, open(so, "rb").read()), "newer.so", cuda_arch="sm_120")
    ran, refused, on_cpu = load_each(so, newer, (so, "cpu"))
    assert ran == ["ran", "4.0"]
    assert refused[0] == "refused" and "built for sm_120" in refused[3] and "compute capability" in refused[3]
    assert on_cpu[0] == "refused" and "built for cuda, not for device cpu:0" in on_cpu[3]


# Exports softmax to sys.argv[1], then (after `limit` is applied) a LayerNorm over it; prints the error, whether
# the first export is intact and still runs (and what the directory holds), then exports to sys.argv[2].
FAILED_EXPORT = r"""
import os, resource, signal, sys
import numpy as np
import tvm
import tvm_ext
from bench.suite import relax_module
path = sys.argv[1]
tvm_ext.export(tvm_ext.build(relax_module("softmax", [4, 8], "float32"), "llvm"), path)
before = open(path, "rb").read()
bigger = tvm_ext.build(relax_module("layer_norm", [64, 1024], "float32"), "llvm")
%s
try:
    tvm_ext.export(bigger, path)
    print("exported")
except OSError as err:
    print("OSError", err.errno, err)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.getrlimit(resource.RLIMIT_FSIZE)[1],) * 2)
out = tvm_ext.load(path)["main"](tvm.runtime.tensor(np.ones((4, 8), "float32"))).numpy()
print("kept", open(path, "rb").read() == before, float(out.sum()), sorted(os.listdir(os.path.dirname(path))))
tvm_ext.load(tvm_ext.export(bigger, sys.argv[2]))
print("exported elsewhere")
"""


def failed_export(path, elsewhere, limit: str, env=None) -> list[str]:
    """FAILED_EXPORT's lines, run in a subprocess with `limit` (Python statements) and `env`."""
    proc = subprocess.run([sys.executable, "-c", FAILED_EXPORT % limit, str(path), str(elsewhere)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout.splitlines()


def test_export_that_cannot_write_is_an_os_error_and_keeps_the_previous_file(tmp_path):
    """A write limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes LLVM's object write fail, as a full disk does."""
    (tmp_path / "a").mkdir()
    said = failed_export(tmp_path / "a" / "m.so", tmp_path / "b.so",
                         "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                         "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))")
    assert said[0].startswith("OSError") and "could not export to" in said[0] and "m.so" in said[0], said
    assert said[1:] == ["kept True 4.0 ['m.so']", "exported elsewhere"], said  # no temporary files left either


@pytest.fixture
def tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only), unmounted after the test."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_is_an_os_error_and_a_full_temporary_directory_does_not_matter(tmpfs, tmp_path):
    """The tmpfs is filled after the first export; it is also TMPDIR, where the export beside it must not write."""
    fill = f"open({str(tmpfs / 'fill')!r}, 'wb').write(bytes(shutil.disk_usage({str(tmpfs)!r}).free))"
    said = failed_export(tmpfs / "m.so", tmp_path / "ok.so", f"import shutil\n{fill}", env={"TMPDIR": str(tmpfs)})
    assert said[0].startswith("OSError 28 ") and "m.so" in said[0] and "No space left on device" in said[0], said
    assert said[1:] == ["kept True 4.0 ['fill', 'm.so']", "exported elsewhere"], said
