"""Pure-PyTorch tensor_health: the fallback for devices without torchcast
kernels and the build without the extension, with the kernels' outputs
(csrc/health.h has the layout)."""

import torch

from ..formats import format_of

HEALTH_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                 torch.float8_e4m3fn, torch.float8_e5m2)
COLUMNS = 14
_FRACTION_BITS = 52  # float64's: every supported dtype's values are float64 values


def format_exponents(dtype: torch.dtype):
    """(fraction bits, exponent of the smallest normal, exponent of the
    largest finite value) of a floating dtype, from the formats table."""
    f = format_of(dtype)
    return f.mantissa_bits, 1 - f.bias, f.emax


def binade_range(dtype: torch.dtype):
    """(e_sub, e_max): the exponents of the smallest subnormal and of the
    largest finite value of ``dtype``, the first and last histogram rows."""
    fraction_bits, e_min, e_max = format_exponents(dtype)
    return e_min - fraction_bits, e_max


def check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in HEALTH_DTYPES:
        names = ", ".join(str(d) for d in HEALTH_DTYPES)
        raise TypeError(f"torchcast.tensor_health: x is {x.dtype}; supported dtypes: {names}")


def output_shapes(dtype: torch.dtype):
    e_sub, e_max = binade_range(dtype)
    return (5,), (e_max - e_sub + 1, COLUMNS), (2,)


def tensor_health(x: torch.Tensor):
    """(counts, hist, extrema) of x, as torch.ops.torchcast.tensor_health."""
    check_dtype(x)
    e_sub, e_max = binade_range(x.dtype)
    rows = e_max - e_sub + 1
    v = x.detach().reshape(-1).to(torch.float64)
    a = v.abs()
    finite = torch.isfinite(v)
    nonzero = finite & (a != 0)
    counts = torch.stack([torch.isnan(v).sum(), torch.isposinf(v).sum(), torch.isneginf(v).sum(),
                          (a == 0).sum(),
                          (nonzero & (a < torch.finfo(x.dtype).smallest_normal)).sum()])
    m = a[nonzero]
    mant, exp = torch.frexp(m)  # m = mant * 2^exp, mant in [0.5, 1): also for subnormals
    row = (exp.to(torch.int64) - 1) - e_sub
    # The fraction's 52 bits: 2 * mant - 1 in [0, 1) is exact, and so is its scaling.
    fbits = ((2 * mant - 1) * 2.0 ** _FRACTION_BITS).to(torch.int64)
    inverted = ~fbits & ((1 << _FRACTION_BITS) - 1)
    # leading ones = 52 - bit length of the inverted fraction (frexp's exponent)
    ones = _FRACTION_BITS - torch.frexp(inverted.to(torch.float64))[1].to(torch.int64)
    column = 1 + ones.clamp(max=11)
    top4_1101 = (fbits >> (_FRACTION_BITS - 4)) == 0b1101
    rest = fbits & ((1 << (_FRACTION_BITS - 4)) - 1)
    column = torch.where(top4_1101 & (rest != 0), 13, column)
    column = torch.where(fbits == 0, 0, column)
    hist = torch.bincount(row * COLUMNS + column, minlength=rows * COLUMNS).reshape(rows, COLUMNS)
    # Reductions of empty tensors raise: the identities stand in (0 for amax, inf for the min).
    amax = torch.cat([a[finite], a.new_zeros(1)]).max()
    low = torch.cat([m, m.new_full((1,), float("inf"))]).min()
    return counts, hist, torch.stack([amax, low])
