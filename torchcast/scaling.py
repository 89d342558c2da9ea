"""Per-tensor scales for scaled casts: ``y = round(x * scale)``, read back as
``y / scale``.

This is the convention of torchao's float8 training (its float8 tensor holds
``x * scale``, saturated, beside the scale) and of TransformerEngine's (which
keeps ``scale_inv``, the reciprocal, beside the data). ``torch._scaled_mm``
takes the dequantizing factors: pass ``scale.reciprocal()`` as its
``scale_a`` / ``scale_b``. The scale stays a float32 tensor on x's device:
nothing here reads it on the host.
"""
from typing import Optional, Union

import torch

from . import _ops
from .stats import STAT_FIELDS

_AMAX = STAT_FIELDS.index("amax")
# The recipes safe_to's ``scale=`` accepts by name.
RECIPES = ("amax", "amax_pow2")
# The smallest amax a scale is computed from (torchao's EPS): an all-zero x
# gets a large finite scale instead of inf.
_AMAX_FLOOR = 1e-12
_FLOAT32_MAX = torch.finfo(torch.float32).max


def amax_scale(x: torch.Tensor, dtype: torch.dtype, *, power_of_two: bool = False) -> torch.Tensor:
    """The per-tensor scale that maps x's largest finite magnitude onto
    ``dtype``'s largest finite value (the "dynamic" or "current" scaling of
    float8 recipes), computed on x's device without a host synchronization.

    Args:
        x (Tensor): a float64, float32, float16, bfloat16 or float8 tensor;
            NaN and +-inf are left out of its amax.
        dtype (torch.dtype): the floating target, e.g. torch.float8_e4m3fn.
        power_of_two (bool): round the scale down to a power of two, so that
            x * scale and y / scale are exact (no rounding but y's own).
            Default: False.

    Returns:
        Tensor: a 0-d float32 tensor on x's device: ``finfo(dtype).max /
        max(amax, 1e-12)`` (at most float32's largest value), rounded down
        to a power of two if asked.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"torchcast.amax_scale: dtype must be a floating torch.dtype, got {dtype!r}")
    # The amax of an exact cast's stats: one read of x on the CPU (bit
    # compares, csrc/cast_common.cpp), composite ops elsewhere.
    amax = _ops.exact_cast_stats(x)[_AMAX]
    # Clamped to float32's range: bfloat16's largest value over a tiny amax
    # would be inf.
    scale = (torch.finfo(dtype).max / amax.clamp(min=_AMAX_FLOOR)).clamp(max=_FLOAT32_MAX)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale.to(torch.float32)


def resolve_scale(x: torch.Tensor, dtype: torch.dtype,
                  scale: Union[None, str, torch.Tensor], where: str) -> Optional[torch.Tensor]:
    """safe_to's ``scale`` argument as a tensor (None: unscaled).

    Args:
        x, dtype: the cast.
        scale: None, a one-element float32 tensor (checked by the op), or a
            recipe name: "amax" (``amax_scale``) or "amax_pow2" (the same,
            rounded down to a power of two).
        where: the caller, for error messages.
    """
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    if isinstance(scale, str) and scale in RECIPES:
        return amax_scale(x, dtype, power_of_two=scale == "amax_pow2")
    raise ValueError(f"{where}: scale must be None, a one-element float32 tensor, or one of "
                     f"{', '.join(repr(r) for r in RECIPES)}; got {scale!r}")
