"""Where a cast comes from: the user's file:line (the innermost frame outside
torch, torchcast and the libraries), the library frame it came through (the
innermost frame outside torch and torchcast, when that is a library's), and
whether torchcast's own machinery did it (then it is not the user's cast:
safe_to records itself).

Libraries are the files under site-packages / dist-packages and the standard
library (sysconfig's purelib, platlib, stdlib and platstdlib), or the
directories given to ``set_library_dirs``."""
import os
import sysconfig
from types import FrameType
from typing import Iterable, Iterator, NamedTuple, Optional, Tuple

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The modules that cast on safe_to's and the ops' behalf, named by their
# first path component under the package so that a module turned into a
# package (_reference) stays covered. The rest of the package (the tracker,
# optim, reduce, demo, ...) is walked past, to the user's frame that called it.
_OWN_MODULES = frozenset(("cast.py", "_ops.py", "stats.py", "nn.py", "_reference"))
_USER, _SKIP, _OWN, _LIBRARY = 0, 1, 2, 3
# Code no one wrote: frozen imports, and torch.fx's generated graph code
# (a compiled graph run by the "eager" and "aot_eager" backends).
_GENERATED = ("<frozen", "<eval_with_key>")
_file_kinds = {}


def _default_library_dirs():
    paths = sysconfig.get_paths()
    dirs = [paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths]
    return _longest_first(dirs)


def _longest_first(dirs):
    """Directories as prefixes, the longest first: a path is shortened by the
    innermost library directory that holds it (site-packages lies inside the
    standard library's directory)."""
    return tuple(sorted({os.path.abspath(d).rstrip(os.sep) + os.sep for d in dirs},
                        key=lambda d: (-len(d), d)))


_library_dirs = _default_library_dirs()


class Site(NamedTuple):
    """Where a cast was made."""

    file: str  # the user's file (innermost frame outside torch, torchcast and libraries)
    line: int
    via: Optional[str]  # "path:line" of the library frame the cast came through, or None


def library_dirs() -> Tuple[str, ...]:
    """The directories whose files are library code, not the user's."""
    return _library_dirs


def set_library_dirs(dirs: Iterable[str]) -> Tuple[str, ...]:
    """Sets which directories hold library code: a cast made there is
    attributed to the innermost user frame that called it, with the library
    frame shown as ``via``.

    Args:
        dirs: directories (default: ``sysconfig``'s site-packages and
            standard library). Pass ``library_dirs()`` plus your own to add
            one, ``()`` to treat every file as the user's.

    Returns:
        The previous directories, to restore them.
    """
    global _library_dirs
    previous = _library_dirs
    _library_dirs = _longest_first(dirs)
    _file_kinds.clear()
    return previous


def _file_kind(filename: str) -> int:
    kind = _file_kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename)
        if path.startswith(_PKG_DIR):
            first = path[len(_PKG_DIR):].split(os.sep, 1)[0]
            kind = _OWN if first in _OWN_MODULES else _SKIP
        elif path.startswith(_TORCH_DIR) or filename.startswith(_GENERATED):
            kind = _SKIP
        elif path.startswith(_library_dirs):
            kind = _LIBRARY
        else:
            kind = _USER
        _file_kinds[filename] = kind
    return kind


def frames_from(frame: Optional[FrameType]) -> Iterator[Tuple[str, int]]:
    """(file, line) of ``frame`` and each frame that called it, innermost first."""
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back


def user_site(frame: Optional[FrameType], skip_own: bool) -> Optional[Site]:
    """The innermost user frame from ``frame`` outwards, and the library frame
    between it and the cast.

    Args:
        frame: the frame to start from (the caller of the tracker's hook).
        skip_own: look past torchcast's own modules (safe_to's records);
            otherwise a cast that one of them did is not the user's.

    Returns:
        The Site; ("<no python frame>", 0) when no user or library frame is
        on the stack (the autograd engine's device threads), the outermost
        library frame when only library frames are; None when torchcast's
        own code did the cast and ``skip_own`` is false.
    """
    return site_of(frames_from(frame), skip_own)


def site_of(frames: Iterable[Tuple[str, int]], skip_own: bool) -> Optional[Site]:
    """``user_site`` for a call stack given as (file, line) pairs, innermost
    first (a compiled graph's recorded stack, then the frames running it)."""
    library = None
    for filename, lineno in frames:
        kind = _file_kind(filename)
        if kind == _USER:
            via = f"{short_path(library[0])}:{library[1]}" if library else None
            return Site(filename, lineno, via)
        if kind == _LIBRARY:
            if library is None:
                library = (filename, lineno)
            outermost = (filename, lineno)
        elif kind == _OWN and not skip_own:
            return None
    if library is not None:
        return Site(outermost[0], outermost[1],
                    None if outermost == library else f"{short_path(library[0])}:{library[1]}")
    return Site("<no python frame>", 0, None)


# torch's dispatcher plumbing in Python (OpOverload.__call__ and redispatch,
# Python kernels, modes): frames that pass an op along, not calls that ask for one.
_DISPATCH_FILES = tuple(os.path.join(_TORCH_DIR, p) for p in (
    "_ops.py", "_library" + os.sep, os.path.join("utils", "_python_dispatch.py")))


_plumbing = {}


def outside_torchcast(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame from ``frame`` outwards that is neither
    torchcast's nor torch's dispatcher plumbing (the code whose call reached
    the tracker: the user's, a library's or torch's own Python code)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        plumbing = _plumbing.get(filename)
        if plumbing is None:
            path = os.path.abspath(filename)
            plumbing = _plumbing[filename] = path.startswith((_PKG_DIR,) + _DISPATCH_FILES)
        if not plumbing:
            return frame
        frame = frame.f_back
    return None


def short_path(path: str) -> str:
    """``path`` relative to the library directory that holds it
    (``transformers/modeling_utils.py``), else to the working directory when
    it lies below it, else as it is."""
    absolute = os.path.abspath(path)
    for d in _library_dirs:
        if absolute.startswith(d):
            return absolute[len(d):]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path
