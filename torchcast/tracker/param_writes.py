"""track(nonfinite="raise") and updates written by hand: stopping before a
parameter is written.

An optimizer's ``step()`` is seen through torch's step hooks, and "raise"
stops before it when the gradients it would read hold NaN/inf (reach.py).
A loop that updates by hand (``p.data.add_(p.grad, alpha=-lr)``, the default
of pytorch/examples' word_language_model) has no such hook. So when a
backward returns with NaN/inf in the gradients of the step's parameters
while an origin is undecided, reach.py enters a ``ParamWriteGuard``: a
dispatch mode that sees the ops that follow and raises before the first one
that writes into a parameter's storage. It is entered only then (a healthy
step never pays for it), and left at the next boundary of the step (a
top-level module's output, the next backward, an optimizer's step, the
track's exit): a step that writes no parameter (a GradScaler that skips
its step on overflowed gradients) is not stopped. A dispatch mode the
program enters after it and leaves before that boundary would take it off
torch's stack of modes in its place (they are a stack): not seen in the
loops this was written for.
"""
from typing import Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ParamWriteGuard(TorchDispatchMode):
    """Raises ``error(op name)`` before an op writes into the storage of one
    of ``params`` (where it gives None, lets the op and those after run).

    Args:
        params: the parameters to keep unwritten.
        error: gives the exception to raise, or None, from the writing op's
            name ("aten::add_").
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 error: Callable[[str], Optional[BaseException]]):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params
                         if type(p) in (torch.Tensor, torch.nn.Parameter)
                         and p.layout == torch.strided}
        self.storages.discard(0)
        self.error = error
        self.entered = False

    @classmethod
    def ignore_compile_internals(cls):
        return True  # (compiled code stays compiled: the guard only reads schemas)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for argument, value in zip(schema.arguments, list(args) + [
                    kwargs.get(a.name) for a in schema.arguments[len(args):]]):
                alias = argument.alias_info
                if alias is None or not alias.is_write:
                    continue
                tensors = value if isinstance(value, (list, tuple)) else [value]
                if self.storages and any(
                        isinstance(t, torch.Tensor) and t.layout == torch.strided
                        and t.untyped_storage().data_ptr() in self.storages for t in tensors):
                    error = self.error(f"{func.namespace}::{func._opname}")
                    self.storages = set()  # once
                    if error is not None:
                        raise error
        return func(*args, **kwargs)

    def enter(self) -> None:
        """Enters the guard (once)."""
        if not self.entered:
            self.__enter__()
            self.entered = True

    def leave(self) -> None:
        """Leaves it, if entered."""
        if self.entered:
            self.entered = False
            self.__exit__(None, None, None)
