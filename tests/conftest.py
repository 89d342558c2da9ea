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


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    """The device a test runs its op on. The references stay on the CPU; off
    the CPU the op's results must also equal the CPU op's, bit for bit."""
    return request.param
