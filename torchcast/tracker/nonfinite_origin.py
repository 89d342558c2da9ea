"""What carries a non-finite origin (origin.py) to the program: the error and
the warning, and the note that says whether the op's dtype was the problem
(the op run again on wider inputs). nonfinite.py finds the origins.
"""
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .._inputs import PLAIN_TENSOR_TYPES
from .._ops import readable, torch_all_finite
from ..stats import short_dtype_name
from .diagnose import op_name
from .own import unwatched
from .origin import NonFiniteOrigin

_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
          torch.float8_e4m3fn: torch.float32, torch.float8_e5m2: torch.float32,
          torch.float8_e4m3fnuz: torch.float32, torch.float8_e5m2fnuz: torch.float32,
          torch.float32: torch.float64}


class NonFiniteWarning(UserWarning):
    """An op made NaN or ±inf from finite inputs (``track(nonfinite="warn")``)."""


class NonFiniteError(RuntimeError):
    """The origin (or entry) whose NaN/inf reached the outputs, the loss or
    the gradients (``track(nonfinite="raise")``), or the first op that made
    or received NaN or ±inf (``"raise_at_op"``). ``origin`` is its
    NonFiniteOrigin; its fields are also attributes of the error
    (``error.op``, ``error.module``, ``error.reached_at``).

    Args:
        origin: the origin.
        detail: a sentence added to the origin's description.
    """

    def __init__(self, origin: NonFiniteOrigin, detail: str = ""):
        super().__init__(origin.describe() + (f" {detail}" if detail else ""))
        self.origin = origin

    def __getattr__(self, name):
        if name == "origin":
            raise AttributeError(name)
        return getattr(self.origin, name)


def floating_data(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor with floating (or complex) values to read."""
    return type(t) in PLAIN_TENSOR_TYPES and (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def amax_of(t: torch.Tensor) -> float:
    """The largest |t| (0 for an empty t); one read."""
    return float(readable(t.detach()).abs().max()) if t.numel() else 0.0


def wider_note(func, args: tuple, kwargs: dict, out: torch.Tensor,
               overwritten: bool = False) -> str:
    """What the op ``func`` gives when its inputs of ``out``'s narrow
    floating dtype are widened (a sentence for NonFiniteOrigin.note);
    ``overwritten``: the op wrote to one of its inputs, whose values before
    it are gone."""
    dtype = out.dtype
    wider = _WIDER.get(dtype)
    if wider is None:
        return ""
    narrow, wide = short_dtype_name(dtype), short_dtype_name(wider)
    name = op_name(func)
    if name in ("_to_copy", "copy_", "copy"):
        src = args[1] if name != "_to_copy" else args[0]
        return (f"A cast to {narrow} of values up to {amax_of(src):.4g}; "
                f"{narrow}'s largest finite value is {torch.finfo(dtype).max:.6g}.")
    if overwritten:
        return (f"The op wrote over its input, so it is not run again in {wide}; "
                f"{narrow}'s largest finite value is {torch.finfo(dtype).max:.6g}.")

    def widen(a):
        if isinstance(a, torch.Tensor) and a.dtype == dtype:
            return a.detach().to(wider)
        return a
    try:
        # The tracker's own work: no dispatch mode (track(all_casts=True)'s
        # records, the program's own) sees the widening casts or the rerun,
        # nor the kernels of its direct route.
        with torch.no_grad(), _disable_current_modes(), unwatched():
            again = func(*tree_map(widen, args), **tree_map(widen, kwargs))
    except Exception:  # the op may not take the wider dtype: then there is nothing to tell
        return ""
    again = [t for t in tree_flatten(again)[0] if isinstance(t, torch.Tensor) and floating_data(t)]
    if not again or any(t.dtype == dtype for t in again):
        return ""
    if all(torch_all_finite(t) for t in again):
        amax = max(amax_of(t) for t in again)
        limit = torch.finfo(dtype).max
        if amax > limit:
            return (f"In {wide} the result is finite with amax {amax:.4g}, above "
                    f"{narrow}'s largest {limit:.6g}: {narrow}'s range overflowed.")
        return (f"In {wide} the result is finite (amax {amax:.4g}): an intermediate "
                f"inside the op overflowed {narrow}.")
    with torch.no_grad():
        infinite = any(bool(torch.isinf(readable(t)).any()) for t in again)
        undefined = any(bool(torch.isnan(readable(t)).any()) for t in again)
    causes = []
    if infinite:
        causes.append("±inf where the value is infinite or beyond "
                      f"{wide}'s range as well (log(0), x/0, exp of a large number)")
    if undefined:
        causes.append("NaN where it is undefined (a log or sqrt of a negative number, 0/0, "
                      "inf - inf)")
    return (f"The result is non-finite in {wide} too, so {narrow}'s range is not the cause: "
            f"{' and '.join(causes)}.")
