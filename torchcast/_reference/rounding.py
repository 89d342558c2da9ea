"""Narrowing float casts rounded once, NaNs included, as csrc/numerics.h
writes them: the y of cast_with_stats and the result of a float16/bfloat16
kahan_sum / kahan_mean."""
import torch


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


def correctly_rounded(x, dtype):
    """x rounded once to dtype, NaNs as the kernels write them (torch's own
    NaN bits depend on the device and, for bfloat16, on the layout)."""
    if x.dtype == torch.float64:
        if dtype == torch.float32:
            return torch.where(torch.isnan(x), _float32_nans(x), x.to(torch.float32))
        f = torch.where(torch.isnan(x), _float32_nans(x), round_to_odd_float32(x))
    else:
        f = x
    return torch.where(torch.isnan(f), _narrow_nans(f, dtype), f.to(dtype))
