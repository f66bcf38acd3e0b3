import os
import sys

import numpy as np
import pytest
import tvm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/ for the suite

CUDA_TARGET = {"kind": "cuda", "arch": "sm_90"}


def has_gpu() -> bool:
    return tvm.cuda(0).exist


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
