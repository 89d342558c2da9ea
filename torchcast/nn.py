"""Module forms of torchcast's functions, for nn.Sequential and model code."""
from typing import Optional

import torch

from .cast import safe_to


class Cast(torch.nn.Module):
    """``torchcast.safe_to`` as a module: casts its input to ``dtype``,
    measuring the loss and applying ``policy`` to it on every call.

    Args:
        dtype (torch.dtype, optional): the desired dtype. Default: None, the
            active autocast dtype for the input's device at each call.
        policy (str, optional): "ignore", "record", "warn" or "raise", as in
            ``safe_to``. Default: None, the thread's policy at each call.
        rtol (float, optional): the largest relative error allowed, as in
            ``safe_to``.
        atol (float, optional): the largest absolute error allowed, as in
            ``safe_to``.
        name (str, optional): names the input in messages and track reports,
            as in ``safe_to``.

    Raises:
        TypeError: ``dtype`` is neither None nor a torch.dtype. The other
            arguments are checked at each call, by ``safe_to``.

    Example::

        >>> head = torch.nn.Sequential(torch.nn.Linear(64, 10),
        ...                            torchcast.nn.Cast(torch.float16, "raise"))
    """

    def __init__(self, dtype: Optional[torch.dtype] = None, policy: Optional[str] = None, *,
                 rtol: Optional[float] = None, atol: Optional[float] = None,
                 name: Optional[str] = None):
        super().__init__()
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"torchcast.nn.Cast: dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.policy = policy
        self.rtol = rtol
        self.atol = atol
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``safe_to(x, self.dtype, policy=self.policy, rtol=self.rtol,
        atol=self.atol, name=self.name)``.

        Args:
            x (Tensor): the input, as ``safe_to`` takes it.

        Returns:
            Tensor: x cast to ``self.dtype``.
        """
        return safe_to(x, self.dtype, policy=self.policy, rtol=self.rtol, atol=self.atol,
                       name=self.name)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, policy={self.policy}"
