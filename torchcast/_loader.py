"""Finds what implements the torchcast ops: the compiled extension
torchcast._C, checked against the running torch first, or, in an install
built without it (TORCHCAST_NO_EXTENSION=1), nothing (the ops are then
defined from Python, in _python_ops.py)."""
from types import ModuleType
from typing import Optional

import torch

REBUILD = ("`pip install --no-build-isolation -e .` in the source checkout, or "
           "`pip install --no-build-isolation --force-reinstall --no-deps .` for a regular install")


def _minor(version: str) -> tuple:
    """(major, minor) of a torch version string such as '2.13.0+cpu'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version(built: str, running: str) -> None:
    """Raises ImportError when the extension was built against another torch
    minor version than the one running: its C++ symbols are tied to that
    version, and loading it anyway ends in an undefined symbol or a crash."""
    if _minor(built) != _minor(running):
        raise ImportError(
            f"torchcast's compiled extension was built against torch {built}, but torch "
            f"{running} is imported. The extension works only with the torch minor version it "
            f"was built with: rebuild it against this torch with {REBUILD}, or install "
            f"torch=={'.'.join(map(str, _minor(built)))}.* again.")


def load_extension() -> Optional[ModuleType]:
    """torchcast._C, or None for an install built without it."""
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(
            "torchcast is not built: torchcast/_build_info.py is missing. Install it with "
            "`pip install --no-build-isolation -e .` from the source tree (needs torch and "
            "ninja), or `TORCHCAST_NO_EXTENSION=1 pip install .` for the pure-PyTorch "
            "build.") from None
    if not _build_info.WITH_EXTENSION:
        return None
    check_torch_version(_build_info.TORCH_VERSION, torch.__version__)
    try:
        from . import _C
    except ImportError as e:
        raise ImportError(
            f"torchcast's compiled extension torchcast._C could not be loaded ({e}). "
            f"Rebuild it with {REBUILD} (needs torch and ninja; TORCHCAST_CUDA=1 for the "
            "CUDA kernels), or install with TORCHCAST_NO_EXTENSION=1 for the pure-PyTorch "
            "build.") from e
    return _C
