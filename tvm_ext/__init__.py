"""tvm_ext: fused reduce subgraphs (norms, softmax, statistics) at memory bandwidth on TVM.

`import tvm_ext` registers the Relax pipeline "tvm_ext", the TIR pipeline of the same name and
the Welford reducers (so that a process that only schedules, e.g. a tuner's worker, has them).
"""

from .api import build, export
from .fallback import FallbackWarning
from .frontend import ExportError, UnsupportedOperatorError, from_torch
from .introspect import cuda_kernels, cuda_source, first_divergent_call, trace_calls
from .passes import register_tir_pass, unregister_tir_pass
from .pipeline import PIPELINE, register, tvm_ext_pipeline
from .runtime import load
from .target import parse_target
from . import welford

register()
welford.register()

__all__ = ["PIPELINE", "ExportError", "FallbackWarning", "UnsupportedOperatorError", "build", "cuda_kernels", "cuda_source", "export", "first_divergent_call", "from_torch", "load",
           "parse_target", "register_tir_pass", "trace_calls", "tvm_ext_pipeline", "unregister_tir_pass"]
__version__ = "0.1.0"
