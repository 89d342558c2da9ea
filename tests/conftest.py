import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # numpy_ref and other test helpers

settings.register_profile("torchcast", deadline=None, print_blob=True)
settings.load_profile("torchcast")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda_cases: cases written for the CUDA kernels (sizes past a block, a chunk, "
        "a warp run; layouts; the GPU's autocast, compile and backward); the device fixture "
        "runs them on CUDA only")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    """The device a test runs its op on. The references stay on the CPU; off
    the CPU the op's results must also equal the CPU op's, bit for bit.

    Cases marked cuda_cases are skipped on the CPU, which keeps its own cases
    and its time; they pass there too, should they ever be wanted."""
    if request.param == "cpu" and request.node.get_closest_marker("cuda_cases"):
        pytest.skip("a case written for the CUDA kernels; the CPU runs its own cases")
    return request.param
