"""Where NaN/inf that no watched op made entered a track(nonfinite=...):
the block's data, a DataLoader worker's batch, a checkpoint's weights, a
literal, a tensor made before the track.

Both routes of the non-finite watch (csrc/cpu/nonfinite_watch.cpp and the
dispatch mode, nonfinite.py) know the storages the watched ops wrote NaN/inf
into. An op whose non-finite output came from a non-finite input they did
not make, or from a non-finite Python number, is where those entered (an
*entry*): this module says which argument, and what it held: a module's
parameter or buffer by name, the input of a running module, a tensor in
shared memory (a worker's batch), a Python number.
"""
import math
import weakref
from typing import Any, Iterable, List, Optional, Sequence

import torch

from .._inputs import PLAIN_TENSOR_TYPES
from .modules import running_calls


class KnownNonfinite:
    """The storages the watched ops wrote NaN/inf into (the dispatch mode's
    route; the C++ watch keeps its own): weak, so that a storage that dies
    leaves it."""

    def __init__(self):
        self.storages = weakref.WeakSet()

    def __bool__(self) -> bool:
        return bool(self.storages)

    def mark(self, tensors: Iterable[Any]) -> None:
        """Marks the storages of ``tensors`` (non-tensors are skipped)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and _has_storage(t):
                self.storages.add(t.untyped_storage())

    def contains(self, t: torch.Tensor) -> bool:
        """Whether a watched op wrote NaN/inf into ``t``'s storage."""
        return bool(self.storages) and _has_storage(t) and t.untyped_storage() in self.storages

    def any_of(self, tensors: Iterable[Any]) -> bool:
        """Whether one of ``tensors`` is known (non-tensors are skipped)."""
        return bool(self.storages) and any(
            isinstance(t, torch.Tensor) and self.contains(t) for t in tensors)


def _has_storage(t: torch.Tensor) -> bool:
    return type(t) in PLAIN_TENSOR_TYPES and t.layout == torch.strided


def nonfinite_number(value: Any) -> bool:
    """Whether ``value`` is a non-finite Python float: NaN/inf the program
    passes on purpose (``masked_fill(mask, -inf)``), not an entry."""
    return isinstance(value, float) and not math.isfinite(value)


def nonfinite_scalar_tensor(value: Any) -> bool:
    """Whether ``value`` is a plain 0-d floating tensor holding NaN/inf (a
    Python number made a tensor: ``scores[0] = -inf`` fills with one)."""
    return (isinstance(value, torch.Tensor) and type(value) in PLAIN_TENSOR_TYPES
            and value.dim() == 0 and value.is_floating_point()
            and not bool(torch.isfinite(value)))


def describe_entry(names: Sequence[str], values: Sequence[Any],
                   roots: Iterable[torch.nn.Module] = ()) -> str:
    """What brought NaN/inf into an op, e.g. "argument 'mat1': the input of
    Net (the top-level module)", one clause per argument.

    Args:
        names: the schema names of the arguments that brought them.
        values: their values, as the op received them (an argument the op
            wrote to: the tensor itself).
        roots: more modules whose parameters and buffers to look through
            (the top-level modules of the running step), beside the modules
            running now.
    """
    calls = running_calls()
    owners = [call.owner for call in calls if call.owner is not None]
    owners += [root for root in roots if root is not None]
    return "; ".join(f"argument '{name}': {_what(value, calls, owners)}"
                     for name, value in zip(names, values))


def _what(value: Any, calls: List[Any], owners: List[torch.nn.Module]) -> str:
    if isinstance(value, float):
        return f"the Python number {value}"
    tensors = value if isinstance(value, (list, tuple)) else [value]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return "a value of the program"
    t = tensors[0]
    named = _named_state(t, owners)
    if named is not None:
        return named
    shared = _has_storage(t) and t.untyped_storage().is_shared()
    for call in calls:  # outermost first: the block's data, as it entered the model
        if call.args is not None and any(_same_storage(t, a) for a in call.args
                                         if isinstance(a, torch.Tensor)):
            top = " (the top-level module)" if call.parent is None else ""
            return (f"the input of {call.path or 'a compiled module'}{top}"
                    + (", in shared memory: a DataLoader worker's batch?" if shared else ""))
    if t.dim() == 0 and type(t) in PLAIN_TENSOR_TYPES and t.is_floating_point():
        value = t.item()
        return (f"a 0-d tensor holding {value}, made from a Python number (an assignment such "
                f"as x[i] = {value}, or torch.tensor({value}))")
    if shared:
        return ("a tensor in shared memory: a DataLoader worker's batch, or another "
                "process's tensor")
    return ("a tensor no watched op made (the block's data, a literal, a checkpoint's values, "
            "or a tensor made before the track)")


def _named_state(t: torch.Tensor, owners: List[torch.nn.Module]) -> Optional[str]:
    """"the parameter fc1.weight of Net", or None."""
    seen = set()
    for owner in owners:
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        for kind, named in (("parameter", owner.named_parameters), ("buffer", owner.named_buffers)):
            for name, p in named():
                if _same_storage(t, p):
                    return f"the {kind} {name} of {type(owner).__name__}"
    return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a is b) or (_has_storage(a) and _has_storage(b)
                        and a.untyped_storage() is b.untyped_storage())
