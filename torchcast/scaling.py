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
AMAX_FLOOR = 1e-12
# A scale is a float32: it lies in [2^-149, float32's largest value].
_SCALE_MAX = torch.finfo(torch.float32).max
_SCALE_MIN = 2.0 ** -149
_EXP_MIN, _EXP_MAX = -149, 127


def scale_for_amax(amax: torch.Tensor, dtype: torch.dtype, *,
                   power_of_two: bool = False) -> torch.Tensor:
    """The float32 scale that maps ``amax`` onto ``dtype``'s largest finite
    value, elementwise, on amax's device (no host synchronization).

    The rule, for every source and target dtype: with ``a = max(amax,
    1e-12)`` and ``top = finfo(dtype).max``, the scale is the largest float32
    ``s`` (the largest power of two, if ``power_of_two``) with ``a * s <=
    top``, exactly, so that amax and everything below it cast finite. Where no
    float32 scale can do that (a float64 amax above ``top * 2^149``), the
    scale is the smallest one, 2^-149, and the cast counts the overflow.

    The power-of-two rule is the one of per-tensor float8 recipes (torchao's
    rounding of ``top / amax`` down to a power of two). A scale twice as large
    can still keep amax finite when ``a * 2s`` rounds down to ``top``; no
    per-tensor recipe uses it (the OCP MX block rule does).

    Args:
        amax (Tensor): float64 (or narrower) magnitudes, finite, >= 0.
        dtype (torch.dtype): the floating target.
        power_of_two (bool): a power of two. Default: False.

    Returns:
        Tensor: float32 scales of amax's shape, on amax's device.
    """
    top = float(torch.finfo(dtype).max)
    a = amax.to(torch.float64).clamp(min=AMAX_FLOOR)
    if power_of_two:
        two = torch.tensor(2.0, dtype=torch.float64, device=a.device)
        # frexp(top / a) = m * 2^e with m in [0.5, 1): 2^(e - 1) is the
        # answer unless the quotient's rounding crossed a power of two; a * 2^k
        # is exact, so the two corrections decide exactly.
        k = (torch.frexp(top / a).exponent - 1).clamp(_EXP_MIN, _EXP_MAX)
        k = k + ((k < _EXP_MAX) & (a * two.pow(k + 1) <= top)).to(k.dtype)
        k = k - ((k > _EXP_MIN) & (a * two.pow(k) > top)).to(k.dtype)
        return two.pow(k).to(torch.float32)
    s = (top / a).clamp(_SCALE_MIN, _SCALE_MAX).to(torch.float32)
    # Rounding top / a to float64, then to float32, can land above it: one
    # float32 step down then fits (a float32 times a float32 amax is exact in
    # float64; for a float64 amax, a product within float64's rounding of
    # top still rounds to top in every narrower target).
    over = (s.to(torch.float64) * a > top) & (s > _SCALE_MIN)
    return torch.where(over, torch.nextafter(s, torch.zeros_like(s)), s)


def amax_scale(x: torch.Tensor, dtype: torch.dtype, *, power_of_two: bool = False) -> torch.Tensor:
    """The per-tensor scale that maps x's largest finite magnitude onto
    ``dtype``'s largest finite value (the "dynamic" or "current" scaling of
    float8 recipes), computed on x's device without a host synchronization.

    Args:
        x (Tensor): a float64, float32, float16, bfloat16 or float8 tensor;
            NaN and +-inf are left out of its amax.
        dtype (torch.dtype): the floating target, e.g. torch.float8_e4m3fn.
        power_of_two (bool): a power of two, so that x * scale and y / scale
            are exact (no rounding but y's own). Default: False.

    Returns:
        Tensor: a 0-d float32 tensor on x's device, ``scale_for_amax(amax,
        dtype)``: the largest float32 (or power of two) ``s`` with
        ``max(amax, 1e-12) * s <= finfo(dtype).max``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"torchcast.amax_scale: dtype must be a floating torch.dtype, got {dtype!r}")
    # The amax of an exact cast's stats: one read of x on the CPU (bit
    # compares, csrc/cast_common.cpp), composite ops elsewhere.
    amax = _ops.exact_cast_stats(x)[_AMAX]
    return scale_for_amax(amax, dtype, power_of_two=power_of_two)


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
