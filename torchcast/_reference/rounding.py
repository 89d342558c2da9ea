"""Narrowing float casts rounded once, NaNs included, as csrc/numerics.h
writes them: the y of cast_with_stats and the result of a float16/bfloat16
kahan_sum / kahan_mean."""
import torch

from ..formats import FLOAT8, format_of


def round_to_odd_float32(x):
    """float64 -> float32 rounded to odd (see csrc/numerics.h)."""
    f = x.to(torch.float32)
    back = f.to(torch.float64)
    bits = f.view(torch.int32)
    toward_zero = torch.where(back.abs() > x.abs(), bits - 1, bits)
    inexact = (back != x) & ~torch.isnan(f)
    return torch.where(inexact, toward_zero | 1, bits).view(torch.float32)


def _float32_nans(x):
    """float64 -> float32 of NaNs as numerics.h's float_from_double_nan: sign
    kept, quiet bit set, the top 23 payload bits (as x86 converts them)."""
    b = x.view(torch.int64)
    bits = ((b >> 32) & -(1 << 31)) | 0x7FC00000 | ((b >> 29) & 0x7FFFFF)
    return bits.to(torch.int32).view(torch.float32)


def _narrow_nans(f, dtype):
    """float32 -> float16/bfloat16 of NaNs as numerics.h: float16 keeps the
    sign and the top 10 mantissa bits, quieted; bfloat16 is always 0x7fc0."""
    u = f.view(torch.int32)
    if dtype == torch.float16:
        h = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
    else:
        h = torch.full_like(u, 0x7FC0)
    return (h - ((h & 0x8000) << 1)).to(torch.int16).view(dtype)


def widen_exact(x):
    """float16/bfloat16 x in float32 with NaN signs and payloads kept, as
    numerics.h widens them (torch's own x.float() makes every NaN 0x7fffffff;
    its x.to(float8) keeps the sign, as the kernels do)."""
    b = x.view(torch.int16).to(torch.int32)
    if x.dtype == torch.bfloat16:
        bits = b << 16
    else:
        bits = ((b & 0x8000) << 16) | 0x7F800000 | ((b & 0x3FF) << 13)
    f = x.float()
    return torch.where(torch.isnan(f), bits.view(torch.float32), f)




def _signed_largest(negative, dtype):
    big = torch.finfo(dtype).max
    return torch.where(negative, -big, big)


def _narrow(f, dtype, saturate):
    """float32 f rounded to a narrower dtype (float16, bfloat16, float8),
    numerics.h's bits: out-of-range values (+-inf included) are +-largest
    with saturate, else the format's overflow value (inf; NaN for e4m3fn,
    whose NaN is 0x7f with the sign)."""
    beyond = format_of(dtype).rounds_past_max(f.abs())  # False for NaN
    if dtype in FLOAT8:
        # torch saturates e4m3fn; its other roundings are numerics.h's. Both
        # formats' NaN is 0x7f with f's sign, and so is e4m3fn's overflow.
        y = f.to(dtype)
        u = f.view(torch.int32)
        nan_bits = (((u >> 24) & 0x80) | 0x7F).to(torch.uint8).view(dtype)
        nan = torch.isnan(f)
        if dtype == torch.float8_e4m3fn:
            nan = nan | beyond
        y = torch.where(nan, nan_bits, y)
    else:
        y = torch.where(torch.isnan(f), _narrow_nans(f, dtype), f.to(dtype))
    if saturate:
        y = torch.where(beyond, _signed_largest(f < 0, dtype).to(dtype), y)
    return y


def _two_product_error(a, b):
    """The exact error a * b - fl(a * b) of float64 tensors, by Dekker's
    splitting (no fma in torch); exact where |a|, |b| < 2^995 and the
    product does not underflow (scaled_to_odd passes mantissas)."""
    def split(v):
        c = v * 134217729.0  # 2^27 + 1
        hi = c - (c - v)
        return hi, v - hi

    p = a * b
    ah, al = split(a)
    bh, bl = split(b)
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _sum_to_odd(x, y):
    """x + y rounded to odd, for float64 tensors: the nearest sum, its last
    bit set toward the exact one where inexact (TwoSum's error)."""
    s = x + y
    back = s - x
    err = (x - (s - back)) + (y - back)
    bits = s.view(torch.int64)
    toward = torch.where((err > 0) == (s > 0), bits + 1, bits - 1)
    inexact = (err != 0) & torch.isfinite(s) & ((bits & 1) == 0)
    return torch.where(inexact, toward, bits).view(torch.float64)


def fma(a, b, c):
    """a * b + c rounded once, as C's fmaf / fma (the Adam kernels'
    tc_fma), for float32 or float64 values (tensors, with Python floats
    that are values of their dtype). float32: the product is exact in
    float64 and the sum is rounded to odd there, so that rounding to float32
    is the one rounding. float64: Boldo and Melquiond's emulation, exact
    product (Dekker), TwoSum with c, the low parts summed to odd, one
    rounding; exact where _two_product_error is (no product underflow)."""
    t = next(x for x in (a, b, c) if isinstance(x, torch.Tensor))
    if t.device.type == "mps":  # no float64 there
        return a * b + c
    a, b, c = (torch.as_tensor(x, dtype=torch.float64, device=t.device) for x in (a, b, c))
    if t.dtype != torch.float64:
        return _sum_to_odd(a * b, c).to(torch.float32)
    uh = a * b
    ul = _two_product_error(*torch.broadcast_tensors(a, b))
    th = c + uh
    back = th - c
    tl = (c - (th - back)) + (uh - back)
    out = th + _sum_to_odd(tl, ul)
    return torch.where(torch.isfinite(uh) & torch.isfinite(th), out, uh + c)


def scaled_to_odd(x, scale):
    """x * scale rounded to odd in float64, as numerics.h's scaled_to_odd:
    exact for float32 and narrower x; for float64 x the product rounded to
    nearest, corrected by its exact error. scale: a one-element float32
    tensor (float64 for a float64 x)."""
    s = scale.reshape(()).to(torch.float64)
    if x.dtype != torch.float64:
        return (x if x.dtype == torch.float32 else widen_exact(x)).double() * s
    p = x * s
    # The error's sign from the mantissas' product (in [1/4, 1): exact
    # splitting whatever the exponents): p is that product times a power of
    # two wherever p is normal; where p is subnormal or zero, x * s lies
    # below every narrower format's half smallest value, and rounds to zero.
    mx, _ = torch.frexp(x)
    ms, _ = torch.frexp(s)
    e = torch.nan_to_num(_two_product_error(mx, ms.expand_as(mx)), nan=0.0, posinf=0.0,
                         neginf=0.0)
    bits = p.view(torch.int64)
    toward_zero = torch.where((e < 0) != (p < 0), bits - 1, bits)
    inexact = (e != 0) & torch.isfinite(p)
    return torch.where(inexact, (toward_zero | 1).view(torch.float64), p)


def correctly_rounded(x, dtype, saturate=False, scale=None):
    """x (or x * scale) rounded once to dtype, NaNs as the kernels write them
    (torch's own NaN bits depend on the device and, for bfloat16, on the
    layout); with saturate, values beyond dtype's range (+-inf included)
    become its +-largest finite value."""
    if scale is not None:
        x = scaled_to_odd(x, scale)  # float64, rounded to odd: one more rounding is exact
    if x.dtype == torch.float64:
        if dtype == torch.float32:
            y = torch.where(torch.isnan(x), _float32_nans(x), x.to(torch.float32))
            if saturate:
                beyond = ~torch.isnan(x) & torch.isinf(y)
                y = torch.where(beyond, _signed_largest(x < 0, torch.float32), y)
            return y
        f = torch.where(torch.isnan(x), _float32_nans(x), round_to_odd_float32(x))
    else:
        f = x if x.dtype == torch.float32 else widen_exact(x)
    return _narrow(f, dtype, saturate)
