"""What one op was given, as the non-finite watch's dispatch-mode route
reads it (nonfinite.py, mode.py): its arguments bound to its schema, the
inputs it writes to and their amax before it does, whether its inputs hold
NaN/inf (at once on the CPU, as a flag left on the device elsewhere), and
an origin's inputs as its record describes them.
"""
import math
from typing import Any, Dict, List, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten

from .. import _ops
from .nonfinite_origin import amax_of, floating_data
from .origin import InputInfo


def any_nonfinite(values: Sequence[Any]) -> bool:
    """Whether any floating tensor or Python float among ``values`` is non-finite
    (CPU tensors only)."""
    for v in values:
        if isinstance(v, float):
            if not math.isfinite(v):
                return True
        elif isinstance(v, torch.Tensor) and floating_data(v):
            if not _ops.finite(v):
                return True
    return False


def inputs_nonfinite(func, args: tuple, kwargs: dict,
                     before: Dict[str, Any]) -> Union[bool, torch.Tensor]:
    """Whether a mutating op's inputs hold NaN/inf, before it runs (out=
    arguments are results, whatever bits they hold; the inputs it writes to
    are judged by their amax in ``before``, written_before's, so that each is
    read once): a bool for CPU tensors, else a bool tensor on their device
    (no sync)."""
    values = tree_flatten([v for argument, v in bound(func, args, kwargs)
                           if not argument.is_out and argument.name not in before])[0]
    values += [amax for amaxes in before.values() for amax in amaxes if amax is not None]
    device = next((v.device for v in values
                   if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
    return any_nonfinite(values) if device is None else device_flag(values, device)


def bound(func, args: tuple, kwargs: dict):
    """(schema argument, value) for each argument the op was given."""
    arguments = func._schema.arguments
    yield from zip(arguments, args)
    by_name = {a.name: a for a in arguments[len(args):]}
    for name, value in kwargs.items():
        if name in by_name:
            yield by_name[name], value


def written(argument) -> bool:
    """Whether the op writes to this argument as an input (self of an
    in-place op), rather than as an out= result."""
    alias = argument.alias_info
    return alias is not None and alias.is_write and not argument.is_out


_STATS = ("running_mean", "running_var")
_writes_stats = {}  # id(op) -> writes_stats(op): OpOverload's __hash__ is Python code


def writes_stats(func) -> bool:
    """Whether the op writes a batch norm's running statistics without
    saying so in its schema (native_batch_norm's running_mean and
    running_var have no (a!)): when its ``training`` argument is true, or
    always where it has none (batch_norm_update_stats)."""
    found = _writes_stats.get(id(func))
    if found is None:
        schema = getattr(func, "_schema", None)
        found = _writes_stats[id(func)] = schema is not None and any(
            a.name in _STATS and not written(a) for a in schema.arguments)
    return found


def _writes(argument, training: bool) -> bool:
    return written(argument) or (training and argument.name in _STATS)


def written_before(func, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """The amax of each floating tensor (or tensor list) an in-place op is
    about to overwrite, by argument name (a training batch norm's running
    statistics among them, writes_stats): 0-d tensors on their devices (no
    sync), read when an origin is described."""
    given = list(bound(func, args, kwargs))
    training = writes_stats(func) and all(
        bool(value) for argument, value in given if argument.name == "training")
    before = {}
    for argument, value in given:
        if not _writes(argument, training):
            continue
        tensors = value if isinstance(value, (list, tuple)) else [value]
        before[argument.name] = [
            _ops.readable(t.detach()).abs().amax() if isinstance(t, torch.Tensor)
            and floating_data(t) else None for t in tensors]
    return before


def device_flag(values: Sequence[Any], device: torch.device) -> torch.Tensor:
    """A bool tensor on ``device``: whether any value is non-finite, without a sync."""
    flags = [~torch.isfinite(_ops.readable(v)).all() for v in values
             if isinstance(v, torch.Tensor) and floating_data(v)]
    scalar_bad = any(isinstance(v, float) and not math.isfinite(v) for v in values)
    flag = torch.stack([f.to(device) for f in flags]).any() if flags else \
        torch.zeros((), dtype=torch.bool, device=device)
    return flag | scalar_bad


def input_infos(func, args: tuple, kwargs: dict, before: Dict[str, Any]) -> List[InputInfo]:
    """An origin's floating inputs, as the op received them: an input it
    wrote to is described by its amax read before (``before``), out=
    arguments are left out (they are results)."""
    inputs = []
    for argument, value in bound(func, args, kwargs):
        if argument.is_out:
            continue
        tensors = value if isinstance(value, (list, tuple)) else [value]
        prior = before.get(argument.name) or [None] * len(tensors)
        for t, amax in zip(tensors, prior):
            if not (isinstance(t, torch.Tensor) and floating_data(t)):
                continue
            if amax is None:
                inputs.append(InputInfo(t.dtype, tuple(t.shape), amax_of(t)))
            else:
                inputs.append(InputInfo(t.dtype, tuple(t.shape), float(amax), overwritten=True))
    return inputs
