"""An example model: the norm and softmax traffic of a transformer block, with a symbolic row count
(the model of the demo, tvm_ext.demo)."""

from tvm_ext.demo import HIDDEN, build_module, inputs, reference  # noqa: F401
