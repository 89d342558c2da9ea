"""What casting a tensor to a narrower format would do, read from its health
histogram alone: the exact number of elements that would overflow, underflow
to zero, or land subnormal, for float16, bfloat16, float8_e4m3fn and
float8_e5m2, at a power-of-two scale.

Why exact: ``tensor_health``'s histogram counts each finite nonzero element
by its binade 2^e <= |x| < 2^(e+1) and by the leading bits of its fraction
f = |x|/2^e - 1 (torchcast/health.py has the columns). Multiplying by 2^k
moves binades and keeps fractions, and round-to-nearest-even to q fraction
bits carries an element up into the next binade exactly when the first q+1
bits of f are ones (the tie rounds up: the value below it is odd). So per
binade of the scaled value, with p the format's fraction bits and emin,
emax its normal exponents:

- above emax: overflow; at emax: the elements that round up past the
  largest finite value (float8_e4m3fn's largest is 1.110b x 2^8 = 448 and
  1.111b x 2^8 is NaN, so there every f above 0.1101b overflows; 0.1101b
  itself ties down to 448);
- emin..emax-1: normal;
- below emin, a subnormal binade keeps q = p - (emin - e) fraction bits:
  q >= 0: subnormal, except that in binade emin - 1 the elements rounding
  up become the smallest normal; q = -1 (half the smallest subnormal up to
  it): zero only for f = 0 (the tie rounds to even, zero); lower: zero.

A scale that is not a power of two moves elements across binade boundaries
at points the histogram does not keep, so only power-of-two scales are
accepted; ``scale="amax"`` is the scale ``safe_to(..., scale="amax_pow2")``
would use: the largest power of two ``s`` with ``amax * s`` at most the
format's largest finite value (torchao's power-of-two rounding of
``max / amax``; ``torchcast.scaling.scale_for_amax`` has the rule).
"""
import dataclasses
import math
from typing import Union

import numpy as np
import torch

from ._reference.health import format_exponents
from .formats import NARROW_TARGETS
from .scaling import scale_dtype_for, scale_for_amax

FORMATS = NARROW_TARGETS
# health.py's histogram columns: 0: f == 0; 1 + min(L, 11) for the number L
# of leading one bits of f; 13: f = 0.1101b... above 0.1101b (L = 2).
_COLUMN_L = np.array([0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2])


@dataclasses.dataclass(frozen=True)
class Headroom:
    """What a cast to ``dtype`` at ``scale`` does to ``numel`` elements.

    ``overflow``, ``underflow`` (nonzero to zero) and ``subnormal`` (nonzero
    results below the smallest normal) count finite source elements; the
    ``*_fraction`` properties divide by ``numel`` (zeros, NaN and inf
    included: they pass as they are)."""

    dtype: torch.dtype
    scale: float
    numel: int
    overflow: int
    underflow: int
    subnormal: int

    @property
    def overflow_fraction(self) -> float:
        return self.overflow / self.numel if self.numel else 0.0

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / self.numel if self.numel else 0.0

    @property
    def subnormal_fraction(self) -> float:
        return self.subnormal / self.numel if self.numel else 0.0


def _format(dtype):
    if dtype not in FORMATS:
        raise ValueError(f"torchcast headroom: the target must be one of "
                         f"{', '.join(str(f) for f in FORMATS)}, got {dtype}")
    return (*format_exponents(dtype), float(torch.finfo(dtype).max))


def power_of_two_scale(amax: float, dtype: torch.dtype,
                       source: torch.dtype = torch.float32) -> float:
    """The power-of-two scale ``safe_to(..., scale="amax_pow2")`` would use
    for this amax of a ``source`` tensor: the largest power of two ``s`` of
    its scale's dtype (up to 2^127 for float32 scales, 2^1023 for a float64
    source's) with ``amax * s <= dtype's largest finite value``
    (``torchcast.scaling.scale_for_amax``, the one home of the rule)."""
    _format(dtype)
    amax_t = torch.tensor(amax, dtype=torch.float64)
    return float(scale_for_amax(amax_t, dtype, power_of_two=True,
                                scale_dtype=scale_dtype_for(source)))


def headroom(health, dtype: torch.dtype, scale: Union[None, float, str] = None) -> Headroom:
    """The exact outcome of ``(x * scale).to(dtype)`` for the elements a
    TensorHealth counted (reads it: one sync).

    Args:
        health: a ``torchcast.TensorHealth`` (one tensor's, or merged).
        dtype: torch.float16, torch.bfloat16, torch.float8_e4m3fn or
            torch.float8_e5m2.
        scale: None (1), a power of two, or "amax": the power of two
            ``safe_to(..., scale="amax_pow2")`` would use, the largest with
            ``health.amax * scale <= finfo(dtype).max``.

    Returns:
        A Headroom with the counts.
    """
    p, emin, emax, top = _format(dtype)
    if scale is None:
        scale = 1.0
    elif scale == "amax":
        scale = power_of_two_scale(health.amax, dtype, health.dtype)
    elif isinstance(scale, str):
        raise ValueError(f"torchcast headroom: scale must be None, a power of two or 'amax', "
                         f"got {scale!r}")
    scale = float(scale)
    mant, exp = math.frexp(scale)
    if not (scale > 0 and mant == 0.5):
        raise ValueError(f"torchcast headroom: scale must be a power of two (the histogram "
                         f"keeps binades, which only such a scale maps onto binades), got {scale}")
    k = exp - 1
    hist = health.hist.cpu().numpy().astype(np.int64)  # [binades, 14]
    binades = np.asarray(health.binades, dtype=np.int64) + k
    numel = int(health.numel)

    def at_least(q):
        """Per binade: elements whose fraction has >= q leading ones."""
        return hist[:, _COLUMN_L >= q].sum(axis=1)

    overflow = int(hist[binades > emax].sum())
    at_top = binades == emax
    if dtype == torch.float8_e4m3fn:  # above 1.1101b x 2^8 (cols with L >= 3, and col 13)
        overflow += int(hist[at_top][:, 4:14].sum())
    else:
        overflow += int(at_least(p + 1)[at_top].sum())
    q = p - (emin - binades)  # fraction bits kept in each subnormal binade
    below = binades < emin
    underflow = int(hist[below & (q < -1)].sum()) + int(hist[below & (q == -1), 0].sum())
    subnormal = int(hist[below & (q == -1)].sum()) - int(hist[below & (q == -1), 0].sum())
    for i in np.nonzero(below & (q >= 0))[0]:
        row = hist[i]
        ups = int(row[_COLUMN_L >= q[i] + 1].sum())
        subnormal += int(row.sum()) - (ups if binades[i] == emin - 1 else 0)
    return Headroom(dtype, scale, numel, overflow, underflow, subnormal)
