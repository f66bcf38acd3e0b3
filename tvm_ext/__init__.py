"""tvm_ext: fused reduce subgraphs (norms, softmax, statistics) at memory bandwidth on TVM.

`import tvm_ext` registers the Relax and TIR pipelines "tvm_ext" and the Welford reducers (so a
process that only schedules, e.g. a tuner's worker, has them). With TVM's runtime library alone
(`TVM_USE_RUNTIME_LIB=1`) it offers only what runs an export: `load` and the introspection helpers."""

import os

# The repository keeps the schedule templates and the tuner in top-level folders, installed as
# tvm_ext.schedules and tvm_ext.search (pyproject's package-dir); a source checkout used without
# installing (PYTHONPATH=.) finds them the same way through this package's path.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_CHECKOUT, "schedules", "__init__.py")):
    __path__.append(_CHECKOUT)  # noqa: F821  (a package's __path__)

import tvm  # noqa: E402

__version__ = "0.1.0"  # before the imports: export records it (api.py)

from .introspect import cuda_kernels, cuda_source, first_divergent_call, trace_calls  # noqa: E402
from .runtime import UnloadableExportError, load  # noqa: E402

_RUNTIME = ["UnloadableExportError", "cuda_kernels", "cuda_source", "first_divergent_call", "load", "trace_calls"]
_COMPILER = ["PIPELINE", "ExportError", "FallbackWarning", "UnsupportedOperatorError", "build", "export", "from_torch",
             "parse_target", "register_tir_pass", "tvm_ext_pipeline", "unregister_tir_pass"]

if getattr(tvm.base, "_RUNTIME_ONLY", False):  # no compiler to drive: what builds is not imported
    __all__ = _RUNTIME

    def __getattr__(name):
        if name in _COMPILER:
            raise ImportError(f"tvm_ext.{name} needs TVM's compiler, and this process loaded TVM's runtime library "
                              "only (TVM_USE_RUNTIME_LIB=1): unset it to build")
        raise AttributeError(f"module 'tvm_ext' has no attribute {name!r}")
else:
    from .api import build, export
    from .fallback import FallbackWarning
    from .frontend import ExportError, UnsupportedOperatorError, from_torch
    from .tir import register_tir_pass, unregister_tir_pass
    from .pipeline import PIPELINE, register, tvm_ext_pipeline
    from .target import parse_target
    from .relax import online_softmax, welford

    register()
    welford.register()
    online_softmax.register()
    __all__ = sorted(_RUNTIME + _COMPILER)
