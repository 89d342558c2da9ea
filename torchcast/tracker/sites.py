"""Where a cast comes from: the user's file:line (the innermost frame outside
torch and torchcast), and whether torchcast's own machinery did it (then it
is not the user's cast: safe_to records itself)."""
import os
from types import FrameType
from typing import Optional, Tuple

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The modules that cast on safe_to's and the ops' behalf, named by their
# first path component under the package so that a module turned into a
# package (_reference) stays covered. The rest of the package (the tracker,
# optim, reduce, demo, ...) is walked past, to the user's frame that called it.
_OWN_MODULES = frozenset(("cast.py", "_ops.py", "stats.py", "nn.py", "_reference"))
_USER, _SKIP, _OWN = 0, 1, 2
_file_kinds = {}


def _file_kind(filename: str) -> int:
    kind = _file_kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename)
        if path.startswith(_PKG_DIR):
            first = path[len(_PKG_DIR):].split(os.sep, 1)[0]
            kind = _OWN if first in _OWN_MODULES else _SKIP
        elif path.startswith(_TORCH_DIR) or filename.startswith("<frozen"):
            kind = _SKIP
        else:
            kind = _USER
        _file_kinds[filename] = kind
    return kind


def user_site(frame: Optional[FrameType], skip_own: bool) -> Optional[Tuple[str, int]]:
    """The (file, line) of the innermost user frame from ``frame`` outwards.

    Args:
        frame: the frame to start from (the caller of the tracker's hook).
        skip_own: look past torchcast's own modules (safe_to's records);
            otherwise a cast that one of them did is not the user's.

    Returns:
        (file, line); ("<no python frame>", 0) when no user frame is on the
        stack (the autograd engine's device threads); None when torchcast's
        own code did the cast and ``skip_own`` is false.
    """
    while frame is not None:
        kind = _file_kind(frame.f_code.co_filename)
        if kind == _USER:
            return frame.f_code.co_filename, frame.f_lineno
        if kind == _OWN and not skip_own:
            return None
        frame = frame.f_back
    return "<no python frame>", 0


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path
