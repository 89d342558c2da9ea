"""Module forms of torchcast's functions, for nn.Sequential and model code."""
import torch

from .cast import safe_to


class Cast(torch.nn.Module):
    """``safe_to(x, dtype, policy=policy)`` as a module; dtype=None follows autocast."""

    def __init__(self, dtype=None, policy=None, *, rtol=None, atol=None, name=None):
        super().__init__()
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"torchcast.nn.Cast: dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.policy = policy
        self.rtol = rtol
        self.atol = atol
        self.name = name

    def forward(self, x):
        return safe_to(x, self.dtype, policy=self.policy, rtol=self.rtol, atol=self.atol,
                       name=self.name)

    def extra_repr(self):
        return f"dtype={self.dtype}, policy={self.policy}"
