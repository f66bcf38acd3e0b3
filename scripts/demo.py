"""The main job: compile the example model with tvm_ext, export it, load it back, check it (the CLI
of tvm_ext.demo, also installed as `tvm-ext-demo`); see --help."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_ext.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
