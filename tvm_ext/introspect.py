"""Look inside a built executable: the generated CUDA source and its kernels."""

from __future__ import annotations

import re

import tvm

_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(')


def _modules(mod, kind):
    found = [mod] if mod.kind == kind else []
    for sub in mod.imports:
        found += _modules(sub, kind)
    return found


def cuda_source(executable) -> str:
    """All CUDA C++ the executable carries ("" for a CPU build)."""
    return "\n".join(m.inspect_source("cuda") for m in _modules(executable.mod, "cuda"))


def cuda_kernels(executable) -> list[str]:
    """Names of the device kernels, each once (the source declares then defines each)."""
    return sorted(set(_KERNEL.findall(cuda_source(executable))))


def trace_calls(executable, device, *inputs) -> list[tuple[str, list]]:
    """Run `executable`'s main on `device` and record, after every VM call, its name and every
    tensor argument as numpy (a kernel's outputs are its last arguments): a build to compare
    call by call with another (`first_divergent_call`)."""
    from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415 (introspection only)

    calls = []

    def instrument(func, name, before_run, ret_value, *args):
        if not before_run:
            calls.append((str(name), [a.numpy() for a in args if hasattr(a, "numpy")]))
        return 0

    vm = VirtualMachine(executable, device)
    vm.set_instrument(instrument)
    vm["main"](*[tvm.runtime.tensor(x, device) for x in inputs])
    return calls


def first_divergent_call(trace: list, reference: list, rtol: float = 1e-3, atol: float = 1e-3) -> str | None:
    """The first call of `trace` whose tensors differ from `reference`'s call at the same position
    (NaN where the reference has none counts), described in one line; None when all agree."""
    import numpy as np  # noqa: PLC0415

    for index, ((name, got), (ref_name, want)) in enumerate(zip(trace, reference)):
        if name != ref_name or len(got) != len(want):
            return f"call {index}: {name} vs {ref_name} in the reference: the builds run different programs"
        for arg, (g, w) in enumerate(zip(got, want)):
            g, w = g.astype("float64"), w.astype("float64")
            if g.shape != w.shape or not np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
                nan = int(np.isnan(g).sum() - np.isnan(w).sum()) if g.shape == w.shape else 0
                return f"call {index}: {name}, argument {arg}: differs ({nan} more NaN than the reference)"
    return None
