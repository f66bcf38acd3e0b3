"""Tune a model's fused reduce subgraphs and write a tuning log (the CLI of tvm_ext.search.cli, also
installed as `tvm-ext-tune`); see --help."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_ext.search.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
