"""Moving a test's CPU input to the device under test without changing its layout."""
import torch


def on_device(x: torch.Tensor, device: str) -> torch.Tensor:
    """x's values on device with x's shape, strides and storage offset (a view
    of a copy of x's base, outside autograd), so that a kernel sees the layout
    the CPU op saw.

    Args:
        x: a CPU tensor, possibly a view.
        device: "cpu" (x itself is returned) or another device.

    Returns:
        x, or the same view of its base copied to device.
    """
    if device == "cpu":
        return x
    base = x if x._base is None else x._base
    return base.detach().to(device).as_strided(x.shape, x.stride(), x.storage_offset())
