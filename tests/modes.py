"""Modes and a subclass that record what they are handed: the tests of the
C++ entries (torchcast._C.cast_with_stats, tensor_health) check that each op
still reaches them, as it does through torch.ops."""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class _Seen:
    """A mode that records each function or op it is handed, then runs it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _see(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class FunctionsSeen(_Seen, TorchFunctionMode):
    __torch_function__ = _Seen._see


class OpsSeen(_Seen, TorchDispatchMode):
    __torch_dispatch__ = _Seen._see


class LoggedTensor(torch.Tensor):
    """A subclass whose __torch_function__ records each function (``seen``)."""

    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs)
