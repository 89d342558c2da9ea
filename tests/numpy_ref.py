"""Independent references in numpy float64: correct rounding to a binary
format by scaling and np.round (half to even), and the cast statistics."""
import math

import numpy as np
import torch

from torchcast.formats import FLOAT_RANK, FORMATS as TABLE

# (explicit mantissa bits, minimum normal exponent, maximum exponent), and the
# largest finite value, of every target: torchcast/formats.py's table (which
# tests/test_formats.py checks against torch.finfo and ml_dtypes). OCP's
# e4m3fn spends the top mantissa code of its top binade on NaN: its largest
# value is 448, not 480, and it has no inf (overflow is NaN).
FORMATS = {f.dtype: (f.mantissa_bits, 1 - f.bias, f.emax)
           for f in TABLE.values() if f.dtype in FLOAT_RANK and f.dtype != torch.float64}
LARGEST = {dtype: TABLE[str(dtype).replace("torch.", "")].max for dtype in FORMATS}


def default_saturate(dtype):
    """What x.to(dtype) does: torch saturates float8_e4m3fn only."""
    return dtype == torch.float8_e4m3fn


@np.errstate(over="ignore", invalid="ignore")
def round_to_format(x, dtype, saturate=False):
    """Rounds float64 values to the nearest value of dtype, ties to even, once
    (with an unbounded exponent, then overflow as the format has it: inf, or
    NaN for e4m3fn); with saturate, values beyond the range (inf included)
    become +-largest instead."""
    mant, emin, emax = FORMATS[dtype]
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    finite = np.isfinite(ax) & (ax > 0)
    _, e = np.frexp(np.where(finite, ax, 1.0))  # ax = m * 2**e, m in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(e - 1, emin) - mant)
    y = np.round(ax / quantum) * quantum
    beyond = ~np.isnan(x) & ((y > LARGEST[dtype]) | np.isinf(x))
    overflow = np.nan if dtype == torch.float8_e4m3fn else np.inf
    y = np.where(finite, y, ax)
    y = np.where(beyond, LARGEST[dtype] if saturate else overflow, y)
    return np.copysign(y, x)


def to_numpy64(t):
    return t.detach().cpu().to(torch.float64).numpy()


def min_normal(dtype):
    return 2.0 ** FORMATS[dtype][1]


@np.errstate(over="ignore", invalid="ignore")
def stats_of_values(xs, ys, src_dtype, tiny, saturated=0):
    """Exact statistics of "xs became ys" (numpy float64 arrays; src_dtype
    is x's torch dtype, tiny the smallest normal of y's dtype), per
    CastStats' definitions.

    Errors are computed in float64 (exact for differences of a value and its
    rounding) and rounded to the type the kernel computes them in, float64
    for float64 sources and float32 otherwise (float16 and bfloat16 inputs
    are widened to float32): only a saturated value's error can change.
    max_rel_err is divided in that type too. ``saturated``: how many
    elements were clamped (the caller knows which)."""
    x_finite, y_finite = np.isfinite(xs), np.isfinite(ys)
    measured = x_finite & y_finite
    np_src = np.float64 if src_dtype == torch.float64 else np.float32
    err = np.where(measured, np.abs(xs - ys), 0.0).astype(np_src).astype(np.float64)
    rel = np.zeros_like(err)
    nz = measured & (xs != 0)
    rel[nz] = err[nz].astype(np_src) / np.abs(xs[nz]).astype(np_src)
    overflow = int((x_finite & ~y_finite).sum())
    nan, inf = int(np.isnan(xs).sum()), int(np.isinf(xs).sum())
    all_overflowed = overflow > 0 and overflow == xs.size - nan - inf
    return {
        "numel": xs.size,
        "nan": nan,
        "inf": inf,
        "inexact": int((x_finite & (ys != xs)).sum()),
        "overflow": overflow,
        "saturated": saturated,
        "underflow": int(((xs != 0) & ~np.isnan(xs) & (ys == 0)).sum()),
        "subnormal": int(((ys != 0) & (np.abs(ys) < tiny)).sum()),
        "max_abs_err": math.inf if all_overflowed else float(err.max()) if err.size else 0.0,
        "max_rel_err": math.inf if all_overflowed else float(rel.max()) if rel.size else 0.0,
        "amax": float(np.abs(xs[x_finite]).max()) if x_finite.any() else 0.0,
        "sum_abs_err": _fsum(err),
        "sum_sq_err": _fsum(err * err),
        "sum_sq": _fsum(np.where(measured, xs * xs, 0.0)),
    }


def _fsum(terms):
    """math.fsum of nonnegative terms; inf where the exact sum exceeds the
    float64 range (fsum raises there)."""
    try:
        return math.fsum(terms.tolist())
    except OverflowError:
        return math.inf


def stats_reference(x, dtype, saturate=None):
    """Exact statistics of casting tensor x to dtype, correctly rounded (the
    rounded values under "y"); saturate None: as x.to(dtype)."""
    saturate = default_saturate(dtype) if saturate is None else saturate
    xs = to_numpy64(x).ravel()
    y = round_to_format(xs, dtype, saturate)
    saturated = 0
    if saturate:
        saturated = int((~np.isnan(xs) & ~np.isfinite(round_to_format(xs, dtype))).sum())
    return {**stats_of_values(xs, y, x.dtype, min_normal(dtype), saturated), "y": y}


@np.errstate(over="ignore")
def edge_values(src, dst):
    """Edge values of src for a cast to dst: zeros, infinities, NaN, the
    extremes of both formats, and values just below, at and just above the
    rounding midpoints and the overflow threshold of dst."""
    np_src = np.float32 if src == torch.float32 else np.float64
    mant, emin, emax = FORMATS[dst]
    big = LARGEST[dst]
    ulp_top = 2.0 ** (emax - mant)
    tiny = 2.0 ** emin
    sub = 2.0 ** (emin - mant)
    anchors = [
        0.0, 1.0, 1.5, 3.0, 1.0 / 3.0, math.pi,
        big, big + ulp_top / 2, big + ulp_top / 4, 2.0 ** (emax + 1),
        tiny, tiny - sub / 2, sub, sub / 2, sub * 1.5, sub / 4, sub * 3,
        1.0 + 2.0 ** -(mant + 1), 1.0 + 3 * 2.0 ** -(mant + 1), 2.0 - 2.0 ** -(mant + 1),
        65519.99999999999, 65520.0, 65504.0,
    ]
    finfo = np.finfo(np_src)
    out = [np.inf, np.nan, float(finfo.max), float(finfo.tiny), float(finfo.smallest_subnormal)]
    for a in anchors:
        v = np_src(a)
        if not np.isfinite(v):
            continue
        out += [float(v), float(np.nextafter(v, np_src(0))), float(np.nextafter(v, np_src(np.inf)))]
    vals = np.array(out, dtype=np.float64)
    vals = np.concatenate([vals, -vals])
    return torch.from_numpy(vals.astype(np_src))


def _fraction_column(f):
    """health.h's column of fractions f in [0, 1) (float64, exact), found by
    reading f's binary digits one doubling at a time."""
    ones = np.zeros(f.shape, dtype=np.int64)
    still = np.ones(f.shape, dtype=bool)
    g = f.copy()
    digits = []
    for _ in range(12):
        g = g * 2
        bit = g >= 1
        g = np.where(bit, g - 1, g)
        digits.append(bit)
        still &= bit
        ones += still
    top4_1101 = digits[0] & digits[1] & ~digits[2] & digits[3]
    # the rest after four digits: what the fraction holds beyond 0.1101b
    rest = f - 0.8125
    column = 1 + np.minimum(ones, 11)
    column = np.where(top4_1101 & (rest > 0), 13, column)
    return np.where(f == 0, 0, column)


def tensor_health_reference(values, dtype):
    """(counts, hist, extrema) of tensor_health for ``values`` (numpy float64,
    each exactly a value of torch dtype ``dtype``), from numpy's frexp."""
    import ml_dtypes
    fi = ml_dtypes.finfo({torch.float64: np.float64, torch.float32: np.float32,
                          torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
                          torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
                          torch.float8_e5m2: ml_dtypes.float8_e5m2}[dtype])
    e_sub, e_max = fi.minexp - fi.nmant, fi.maxexp - 1
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    a = np.abs(v)
    finite = np.isfinite(v)
    nonzero = finite & (a != 0)
    counts = [int(np.isnan(v).sum()), int(np.isposinf(v).sum()), int(np.isneginf(v).sum()),
              int((a == 0).sum()), int((nonzero & (a < float(fi.smallest_normal))).sum())]
    m = a[nonzero]
    mant, exp = np.frexp(m)
    e = exp.astype(np.int64) - 1
    column = _fraction_column(2 * mant - 1)
    hist = np.zeros((e_max - e_sub + 1, 14), dtype=np.int64)
    np.add.at(hist, (e - e_sub, column), 1)
    amax = float(a[finite].max()) if finite.any() else 0.0
    low = float(m.min()) if m.size else math.inf
    return counts, hist, [amax, low]
