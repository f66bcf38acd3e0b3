"""The direct-convolution template: what it takes, what it refuses, the kernel it writes, the GPU."""

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_ext
from bench.conv import conv_func, relax_conv
from bench.spelled import main_module
from conftest import CUDA_TARGET
from tvm_ext.schedules import conv2d, dispatch
from tvm_ext.introspect import cuda_source


def conv_scale_residual_relu(n, c, h, w):
    """relu(conv(x) * s + x): the folded-BN ResNet block's second half, one fused function."""
    params = [relax.Var("x", relax.TensorType((n, c, h, w), "float32")),
              relax.Var("k", relax.TensorType((c, c, 3, 3), "float32")),
              relax.Var("s", relax.TensorType((1, c, 1, 1), "float32"))]
    op = relax.op
    return main_module(lambda bb, x, k, s: op.nn.relu(op.add(op.multiply(op.nn.conv2d(x, k, padding=1), s), x)),
                       params)


def test_a_convolution_is_matched_with_its_padding_and_epilogue():
    sch, pads, conv, epilogue = conv2d.convolution(conv_func(2, 16, 8, 8, 32))
    assert [sch.get(b).name_hint for b in pads] == ["pad_temp"] and sch.get(conv).name_hint == "conv2d_nchw"
    assert epilogue == []
    fused = tvm_ext.pipeline.fused_module(conv_scale_residual_relu(2, 16, 8, 8), tvm_ext.parse_target(CUDA_TARGET))
    func = next(f for gv, f in fused.functions_items() if "conv2d" in gv.name_hint)
    assert len(conv2d.convolution(func)[3]) == 3  # multiply, add, relu
    assert dispatch.contraction_template(func) is conv2d


def test_a_matmul_or_a_reduction_is_not_a_convolution():
    from bench.matmul import template_func  # noqa: PLC0415

    assert conv2d.convolution(template_func(64, 64, 64)) is None
    x = relax.Var("x", relax.TensorType((8, 64), "float32"))
    mod = relax.transform.LegalizeOps()(main_module(lambda bb, x: relax.op.sum(x, axis=[1]), [x]))
    assert conv2d.convolution(next(f for gv, f in mod.functions_items() if gv.name_hint != "main")) is None


def test_tiles_that_do_not_divide_the_image_are_refused():
    func = conv_func(1, 16, 28, 28, 64)
    assert conv2d.apply(func, conv2d.tiling_knobs(1, 8, 4, 1, 2, 4, 1, 4, 2, 4)) is None  # 8-pixel tiles of 28
    knobs, _ = conv2d.heuristic(func)
    assert 28 % (knobs["vy"] * knobs["ty"] * knobs["yi"]) == 0 and 28 % (knobs["vx"] * knobs["tx"] * knobs["xi"]) == 0
    assert conv2d.heuristic(conv_func(1, 16, 13, 13, 64)) is None  # no tiling divides 13: dlight keeps it


def test_every_grid_tiling_fits_its_limits():
    func = conv_func(32, 256, 56, 56, 256)
    grid = conv2d.knob_space(func)
    assert len(grid) > 1000
    for k in grid[::97]:
        threads = k["tf"] * k["ty"] * k["tx"]
        window = k["rc"] * (k["vy"] * k["ty"] * k["yi"] + 2) * (k["vx"] * k["tx"] * k["xi"] + 2)
        weights = k["vf"] * k["tf"] * k["fi"] * k["rc"] * 9
        assert 64 <= threads <= 512 and (window + weights) * 4 <= 48 * 1024
        assert conv2d.apply(func, k) is not None


def test_the_pipeline_writes_one_kernel_with_the_window_in_shared_memory_and_the_epilogue_fused():
    source = cuda_source(tvm_ext.build(conv_scale_residual_relu(2, 32, 56, 56), CUDA_TARGET))
    kernels = [line for line in source.splitlines() if line.startswith('extern "C" __global__') and "{" in line]
    assert len(kernels) == 1 and "conv2d_multiply_add_relu" in kernels[0]
    knobs = conv2d.tiling_knobs(*conv2d.TILINGS[0])
    assert f"__launch_bounds__({knobs['tf'] * knobs['ty'] * knobs['tx']})" in kernels[0]
    assert "__shared__" in source and "pad_temp_shared" in source and "k_shared" in source
    assert "max(" in source  # the ReLU, applied as the tile is written out


def test_a_strided_convolution_builds_too():
    x = relax.Var("x", relax.TensorType((2, 16, 56, 56), "float32"))
    k = relax.Var("k", relax.TensorType((32, 16, 3, 3), "float32"))
    mod = main_module(lambda bb, x, k: relax.op.nn.conv2d(x, k, strides=2, padding=1), [x, k])
    source = cuda_source(tvm_ext.build(mod, CUDA_TARGET))
    assert "pad_temp_shared" in source


ACTIVATIONS = ["SiLU", "Hardswish", "GELU"]  # the first two read the convolution's output twice


def _conv_activation(name: str, dtype: str):
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Conv2d(32, 64, 3, padding=1), getattr(torch.nn, name)()).eval()
    return module.to(getattr(torch, dtype)), torch.randn(2, 32, 16, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_an_activation_that_reads_its_input_twice_is_fused_into_the_convolution(name):
    """x * sigmoid(x) (EfficientNet), x * clip(x + 3) / 6 (MobileNet): the template inlined each
    epilogue block into the one before, which a block with two readers cannot be; TVM's default
    took these convolutions, with a warning."""
    module, x = _conv_activation(name, "float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tvm_ext.FallbackWarning)
        source = cuda_source(tvm_ext.build(tvm_ext.from_torch(module, x.half()), CUDA_TARGET))
    kernels = [line for line in source.splitlines() if line.startswith('extern "C" __global__') and "{" in line]
    assert len(kernels) == 1 and "pad_temp_shared" in source  # ours, the activation in the same kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_convolutions_with_activations_match_pytorch_on_the_gpu(name, dtype):
    torch = pytest.importorskip("torch")
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    module, x = _conv_activation(name, dtype)
    x = x.to(getattr(torch, dtype))
    executable = tvm_ext.build(tvm_ext.from_torch(module, x), "cuda")
    assert "pad_temp_shared" in cuda_source(executable)
    got = VirtualMachine(executable, tvm.cuda())["main"](tvm.runtime.tensor(x.numpy(), tvm.cuda()))
    got = (got[0] if not hasattr(got, "numpy") else got).numpy().astype("float32")
    with torch.no_grad():
        want = module.float()(x.float()).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-2 if dtype == "float16" else 1e-4, atol=1e-2 if dtype == "float16" else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 64, 56, 56, 64), (2, 32, 28, 28, 64), (1, 16, 7, 7, 32)])
def test_convolutions_are_right_on_the_gpu(shape, rng):
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415

    n, c, h, w, f = shape
    x, k = rng.standard_normal((n, c, h, w)).astype("float32"), rng.standard_normal((f, c, 3, 3)).astype("float32")
    executable = tvm_ext.build(relax_conv(*shape), "cuda")
    assert "pad_temp_shared" in cuda_source(executable)  # ours, not dlight's
    dev = tvm.cuda()
    got = VirtualMachine(executable, dev)["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(k, dev)).numpy()
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = sum(np.einsum("nchw,fc->nfhw", pad[:, :, r:r + h, q:q + w], k[:, :, r, q]) for r in range(3) for q in range(3))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.gpu
def test_every_tiling_is_right_on_the_gpu(rng):
    shape = (2, 64, 56, 56, 64)
    func = conv_func(*shape)
    x, k = rng.standard_normal(shape[:4]).astype("float32"), rng.standard_normal((64, 64, 3, 3)).astype("float32")
    dev = tvm.cuda()
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = sum(np.einsum("nchw,fc->nfhw", pad[:, :, r:r + 56, q:q + 56], k[:, :, r, q]) for r in range(3) for q in range(3))
    for tiling in conv2d.TILINGS:
        sch = conv2d.apply(func, conv2d.tiling_knobs(*tiling))
        lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=tvm_ext.parse_target("cuda"))
        out = tvm.runtime.empty(want.shape, "float32", dev)
        lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(k, dev), out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=str(tiling))


def test_the_tuner_sees_convolutions_with_the_heuristic_point_first():
    from tvm_ext.search.features import NAMES, candidate_features  # noqa: PLC0415
    from tvm_ext.search.space import knob_space  # noqa: PLC0415
    from tvm_ext.search.tasks import extract_tasks  # noqa: PLC0415

    target = tvm_ext.parse_target(CUDA_TARGET)
    tasks = extract_tasks(conv_scale_residual_relu(4, 64, 56, 56), target)
    assert [t.name for t in tasks] == ["fused_conv2d_multiply_add_relu"]
    points = knob_space(tasks[0].func, target)
    assert points[0] == conv2d.heuristic(tasks[0].func)[0] and len(points) > 100
    x = candidate_features(tasks[0].func, points[:50], target)
    assert x.shape == (50, len(NAMES)) and np.isfinite(x).all()
    assert (x[:, NAMES.index("is_conv2d")] == 1).all() and (x[:, NAMES.index("is_matmul")] == 0).all()
    assert len(set(map(tuple, x))) == 50  # every candidate looks different to the cost model


def test_the_cpu_reference_of_a_convolution_is_right(rng):
    from tvm_ext.search.check import references  # noqa: PLC0415

    n, c, h, w, f = 2, 16, 9, 9, 8
    (ref,) = references(conv_func(n, c, h, w, f))
    lib = tvm.compile(ref.with_attr("global_symbol", "main"), target="llvm")
    x, k = rng.standard_normal((n, c, h, w)).astype("float32"), rng.standard_normal((f, c, 3, 3)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((n, f, h, w), "float32"))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(k), out)
    pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = sum(np.einsum("nchw,fc->nfhw", pad[:, :, r:r + h, q:q + w], k[:, :, r, q]) for r in range(3) for q in range(3))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)
