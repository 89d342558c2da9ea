"""Per-tensor scales for scaled casts: ``y = round(x * scale)``, read back as
``y / scale``.

This is the convention of torchao's float8 training (its float8 tensor holds
``x * scale``, saturated, beside the scale) and of TransformerEngine's (which
keeps ``scale_inv``, the reciprocal, beside the data). ``torch._scaled_mm``
takes the dequantizing factors: pass ``scale.reciprocal()`` as its
``scale_a`` / ``scale_b``. The scale is a float32 tensor (float64 for a
float64 x) on x's device: on a device nothing here reads it on the host.
"""
import math
from typing import Optional, Union

import numpy as np
import torch

from . import _ops
from ._inputs import plain_dense
from .stats import STAT_FIELDS

_AMAX = STAT_FIELDS.index("amax")
# The recipes safe_to's ``scale=`` accepts by name.
RECIPES = ("amax", "amax_pow2")


class _ScaleType:
    """A scale's floating type: its largest and smallest positive values and
    the exponent range of its powers of two."""

    def __init__(self, dtype: torch.dtype):
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.largest = float(info.max)
        self.smallest = float(info.smallest_normal) * float(info.eps)  # its least subnormal
        self.exp_min = math.frexp(self.smallest)[1] - 1
        self.exp_max = math.frexp(self.largest)[1] - 1


_SCALE_TYPES = {torch.float32: _ScaleType(torch.float32), torch.float64: _ScaleType(torch.float64)}


def scale_dtype_for(source: torch.dtype) -> torch.dtype:
    """The dtype of the scale an amax recipe gives a ``source`` tensor:
    float64 for float64 sources (their amax can lie beyond where any float32
    scale reaches: above top * 2^149, below top / 2^128), float32 for the
    others (the float32 of torchao's and torch._scaled_mm's scales)."""
    return torch.float64 if source == torch.float64 else torch.float32


def _float32_nearest(v: float) -> float:
    return float(np.float32(v))


def _float32_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(0)))


def _host_scale(amax: float, top: float, power_of_two: bool, t: _ScaleType) -> float:
    """scale_for_amax's rule on one Python float (see there); _device_scale
    states it again in tensor operations, equal on every amax
    (tests/test_scaling.py)."""
    a = max(amax, t.smallest)
    q = min(max(top / a, t.smallest), t.largest)
    if power_of_two:
        k = min(max(math.frexp(q)[1] - 1, t.exp_min), t.exp_max)
        if k < t.exp_max and a * math.ldexp(1.0, k + 1) <= top:
            k += 1
        if k > t.exp_min and a * math.ldexp(1.0, k) > top:
            k -= 1
        return math.ldexp(1.0, k)
    wide = t.dtype == torch.float64
    s = q if wide else _float32_nearest(q)
    if a * s > top and s > t.smallest:
        s = math.nextafter(s, 0.0) if wide else _float32_down(s)
    return s


def _device_scale(amax: torch.Tensor, top: float, power_of_two: bool,
                  t: _ScaleType) -> torch.Tensor:
    """_host_scale's rule elementwise, on amax's device, traceable."""
    a = amax.to(torch.float64).clamp(min=t.smallest)
    # A tensor top: torch computes number / tensor as number * (1 / tensor),
    # which rounds twice.
    q = (a.new_full((), top) / a).clamp(t.smallest, t.largest)
    if power_of_two:
        two = torch.tensor(2.0, dtype=torch.float64, device=a.device)
        # frexp(q) = m * 2^e with m in [0.5, 1): 2^(e - 1) is the answer
        # unless the quotient's rounding crossed a power of two; a * 2^k is
        # exact, so the two corrections decide exactly.
        k = (torch.frexp(q).exponent - 1).clamp(t.exp_min, t.exp_max)
        k = k + ((k < t.exp_max) & (a * two.pow(k + 1) <= top)).to(k.dtype)
        k = k - ((k > t.exp_min) & (a * two.pow(k) > top)).to(k.dtype)
        return two.pow(k).to(t.dtype)
    s = q.to(t.dtype)
    over = (s.to(torch.float64) * a > top) & (s > t.smallest)
    return torch.where(over, torch.nextafter(s, torch.zeros_like(s)), s)


def scale_for_amax(amax: torch.Tensor, dtype: torch.dtype, *, power_of_two: bool = False,
                   scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scale that maps ``amax`` onto ``dtype``'s largest finite value,
    elementwise, on amax's device (no host synchronization).

    The rule (docs/scaling.md): with ``top = finfo(dtype).max`` and ``a =
    max(amax, m)``, m the smallest positive ``scale_dtype`` (so that a zero
    amax gets the largest scale), the scale is ``top / a`` rounded to the
    nearest ``scale_dtype`` within its finite range, one step down where
    ``a * s``, rounded to float64, exceeds top. For a float32 scale and an
    amax that is a float32 (every amax of a float32 or narrower tensor) that
    product is exact: s is the largest float32 with ``a * s <= top``. For a
    float64 scale ``a * s`` may exceed top by half a float64 ulp, which
    every narrower format rounds to top. A power of two (``power_of_two``):
    the largest power of two of ``scale_dtype`` with ``a * s <= top``,
    exactly. Where no scale fits (a float64 amax above ``top * 2^149`` with
    a float32 scale) the scale is the smallest, and the cast counts the
    overflow.

    The power-of-two rule is the one of per-tensor float8 recipes (torchao's
    rounding of ``top / amax`` down to a power of two). A scale twice as large
    can still keep amax finite when ``a * 2s`` rounds down to ``top``; no
    per-tensor recipe uses it (the OCP MX block rule does).

    Args:
        amax (Tensor): float64 (or narrower) magnitudes, finite, >= 0.
        dtype (torch.dtype): the floating target.
        power_of_two (bool): a power of two. Default: False.
        scale_dtype (torch.dtype): torch.float32 (default) or torch.float64
            (``scale_dtype_for`` a float64 source).

    Returns:
        Tensor: scales of amax's shape and ``scale_dtype``, on amax's device.
    """
    if scale_dtype not in _SCALE_TYPES:
        raise TypeError(f"torchcast.scaling.scale_for_amax: scale_dtype must be torch.float32 or "
                        f"torch.float64, got {scale_dtype!r}")
    return _device_scale(amax, float(torch.finfo(dtype).max), power_of_two,
                         _SCALE_TYPES[scale_dtype])


def amax_scale(x: torch.Tensor, dtype: torch.dtype, *, power_of_two: bool = False) -> torch.Tensor:
    """The per-tensor scale that maps x's largest finite magnitude onto
    ``dtype``'s largest finite value (the "dynamic" or "current" scaling of
    float8 recipes), without a host synchronization on a device.

    Args:
        x (Tensor): a float64, float32, float16, bfloat16 or float8 tensor;
            NaN and +-inf are left out of its amax.
        dtype (torch.dtype): the floating target, e.g. torch.float8_e4m3fn.
        power_of_two (bool): a power of two, so that x * scale and y / scale
            are exact (no rounding but y's own). Default: False.

    Returns:
        Tensor: a 0-d tensor on x's device, ``scale_for_amax(amax, dtype,
        scale_dtype=scale_dtype_for(x.dtype))``: float32, or float64 for a
        float64 x.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"torchcast.amax_scale: dtype must be a floating torch.dtype, got {dtype!r}")
    t = _SCALE_TYPES[scale_dtype_for(x.dtype)]
    top = float(torch.finfo(dtype).max)
    if x.is_cpu and not torch.compiler.is_compiling() and plain_dense(x):
        # On the CPU the amax is on the host already: the rule in Python
        # floats, one tensor made, instead of a dozen 0-d tensor ops (a
        # wrapper subclass, whose data its own dispatch reads, takes those).
        amax = _ops.all_finite_amax(x)
        if amax is None:  # NaN or inf in x: the finite elements' amax
            amax = _ops.exact_cast_stats(x)[_AMAX].item()
        return torch.tensor(_host_scale(amax, top, power_of_two, t), dtype=t.dtype)
    # The amax of an exact cast's stats: one read of x (bit compares,
    # csrc/cast_common.cpp), composite ops elsewhere.
    amax = _ops.exact_cast_stats(x)[_AMAX]
    return _device_scale(amax, top, power_of_two, t)


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
