"""Value sets the tests run kernels over."""
import torch


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16- or 8-bit floating dtype, in bit order."""
    if dtype.itemsize == 2:
        return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    raise ValueError(f"every_value: {dtype} has more bit patterns than a test should cast")
