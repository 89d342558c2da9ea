"""Dtype mistakes that are not casts: an op that fails because its operands'
dtypes differ, and an op that silently promotes its result to float64.

Both are found by the dispatch mode of track(all_casts=True) at no cost to
the ops that neither fail nor return float64:

- a failing op's RuntimeError whose message is of the dtype-mismatch family
  ("mat1 and mat2 must have the same dtype", "expected scalar type Float but
  found Double", ...) gets a note (``BaseException.add_note``, so the
  exception's type and message reach the program unchanged) naming the op,
  the module, each floating operand's dtype and shape, where each float64
  operand is held (the user's variables that refer to it, with their line),
  and the fix;
- an op whose result is float64 while its floating operands mix float64 with
  a narrower dtype is recorded as a site of origin ``promotion (op)``: the
  narrower operands were computed on in float64 (a float64 target promoting an
  MSE loss).
"""
import re
from types import FrameType
from typing import Any, Iterable, List, Optional

import torch

from .modules import current_module
from .sites import short_path, user_site

_MISMATCH = re.compile(
    r"same dtype|expected scalar type|should be the same|Found dtype|mixed dtype|"
    r"does not match weight dtype|expected .* dtype", re.IGNORECASE)
_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _tensors(args: Iterable[Any]) -> List[torch.Tensor]:
    """The tensors among args, and in their lists and tuples (one level)."""
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


def _holders(t: torch.Tensor, frame: Optional[FrameType]) -> List[str]:
    """The user's variables that refer to ``t``: "x (train.py:12)", innermost
    frame first."""
    names = []
    while frame is not None and len(names) < 3:
        site = user_site(frame, skip_own=True)
        if site is not None and site.file == frame.f_code.co_filename:
            for name, value in frame.f_locals.items():
                if value is t:
                    names.append(f"variable {name} of {frame.f_code.co_name} "
                                 f"({short_path(site.file)}:{site.line})")
        frame = frame.f_back
    return names


def mismatch_note(name: str, operands: Iterable[Any], frame: Optional[FrameType]) \
        -> Optional[str]:
    """The note for an op that failed on operands of several floating
    dtypes (None if they have one): the op, the module, each floating
    operand's dtype and shape and who holds it, and the fix.

    Args:
        name: the op ("aten::addmm").
        operands: its arguments.
        frame: the frame the op was called from.
    """
    floats = [t for t in _tensors(operands) if t.is_floating_point()]
    if len({t.dtype for t in floats}) < 2:
        return None
    module = current_module()
    site = user_site(frame, skip_own=True)
    where = f"{short_path(site.file)}:{site.line}" if site is not None else "?"
    if module:
        where += f", in module {module}"
    lines = [f"torchcast: {name} at {where} got operands of different dtypes:"]
    for t in floats:
        held = _holders(t, frame)
        lines.append(f"  {t.dtype} {tuple(t.shape)}" + (f", held by {', '.join(held)}"
                                                         if held else ""))
    wide = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
    narrow = min((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)
    fix = (f"fix: make the {wide} operand {narrow} where it is created "
           f"(torch.as_tensor(array, dtype={narrow}) for numpy data, "
           f"or .to({narrow}) once), or run the op under torch.autocast")
    if wide == torch.float64:
        fix += "; numpy arrays are float64 unless told otherwise"
    lines.append(fix)
    return "\n".join(lines)


def note_dtype_mismatch(error: BaseException, note: Optional[str]) -> None:
    """Adds ``note`` (mismatch_note's) to ``error`` if its message is one of
    the dtype-mismatch family, once per error (an op failing inside another
    is noted by the innermost).

    Args:
        error: what the op raised.
        note: the note, or None.
    """
    if note is None or not _MISMATCH.search(str(error)) or getattr(error, "_torchcast_noted",
                                                                    False):
        return
    error.add_note(note)
    error._torchcast_noted = True


def promoted_operands(args: tuple) -> Optional[torch.dtype]:
    """The narrower floating dtype of an op's operands when they mix it
    with float64 (the op's result being float64), else None."""
    narrow = None
    wide = False
    for t in _tensors(args):
        if t.dtype is torch.float64:
            wide = True
        elif t.dtype in _NARROW and t.dim() > 0:  # 0-d tensors do not promote
            narrow = t.dtype
    return narrow if wide else None


def op_name(func: Any) -> str:
    """The op's name without namespace and overload: ``mse_loss``."""
    return getattr(func, "_opname", None) or str(func)

