"""The fuzz suite that stays (issue 26): property-based tests (hypothesis) of
the public API over dtypes, shapes, strides, scales and special values, each
against an independent oracle: numpy float64 (tests/numpy_ref.py), ml_dtypes,
Fraction arithmetic and math.fsum, never torchcast's own _reference package.

Every test has a fixed seed (derandomize) and the same bounded example count,
read from one place: the environment variable TORCHCAST_FUZZ_EXAMPLES, else
100 in `pytest -q` and 400 in .ci/run's slow stage (TORCHCAST_TESTS=slow or
all: the file is a sweep, run in both). A release run goes longer:

    TORCHCAST_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py

A failure prints the shrunk, minimal example (the case's repr gives dtypes,
layout and every value in float.hex).
"""
import copy
import math
import os
import warnings
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import torchcast
from torchcast.optim import AdamW
from torchcast.plan import recipe_measure
from torchcast.stats import CastStats

from numpy_ref import (FORMATS, LARGEST, default_saturate, edge_values, min_normal,
                       round_to_format, stats_of_values, tensor_health_reference)

# --- settings: one example count, a fixed seed ------------------------------------

pytestmark = pytest.mark.sweep
EXAMPLES = int(os.environ.get("TORCHCAST_FUZZ_EXAMPLES") or (
    100 if os.environ.get("TORCHCAST_TESTS", "fast") == "fast" else 400))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- dtypes and exact decoding -----------------------------------------------------

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
FLOAT8 = (E4, E5)
# Every lossy (narrowing) pair cast_with_stats measures.
PAIRS = [(F64, d) for d in (F32, F16, BF16, E4, E5)] + [(F32, d) for d in (F16, BF16, E4, E5)] \
    + [(F16, d) for d in (BF16, E4, E5)] + [(BF16, d) for d in (F16, E4, E5)]
# dtype -> (numpy dtype of its values, unsigned and signed integer dtypes of its bits)
NP = {F64: (np.float64, np.uint64, torch.int64), F32: (np.float32, np.uint32, torch.int32),
      F16: (np.float16, np.uint16, torch.int16), BF16: (ml_dtypes.bfloat16, np.uint16, torch.int16),
      E4: (ml_dtypes.float8_e4m3fn, np.uint8, torch.uint8),
      E5: (ml_dtypes.float8_e5m2, np.uint8, torch.uint8)}
SIGNED = {np.uint64: np.int64, np.uint32: np.int32, np.uint16: np.int16, np.uint8: np.uint8}


def from_bits(bits, dtype):
    """A 1-d tensor of ``dtype`` holding the given unsigned bit patterns."""
    unsigned = NP[dtype][1]
    raw = np.asarray(bits, dtype=unsigned).view(SIGNED[unsigned])
    return torch.from_numpy(raw.copy()).view(dtype)


def to_bits(values, dtype):
    """The unsigned bit patterns of float64 ``values`` rounded to dtype by numpy/ml_dtypes."""
    np_dtype, unsigned, _ = NP[dtype]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np_dtype).view(unsigned)


def as64(t):
    """t's values in logical (C) order as numpy float64, decoded from the bits
    by numpy/ml_dtypes (no torch conversion involved)."""
    np_dtype, _, torch_int = NP[t.dtype]
    raw = t.detach().contiguous().reshape(-1).view(torch_int).numpy()
    with np.errstate(invalid="ignore"):
        return raw.view(np_dtype).astype(np.float64)


def hexes(values):
    return "[" + ", ".join(float(v).hex() for v in values) + "]"


# --- strategies ----------------------------------------------------------------------

_POOLS = {}


def edge_pool(src, dst, k=0):
    """Bit patterns of src values that sit on dst's edges once multiplied by
    2**k: numpy_ref.edge_values (zeros, inf, NaN, both formats' extremes, the
    overflow threshold, subnormals, rounding midpoints, each with neighbours),
    every float8 value and midpoint, src's own extremes and subnormals, and
    the src neighbours (bits +-1) of all of these (NaN payloads included)."""
    key = (src, dst, k)
    if key in _POOLS:
        return _POOLS[key]
    v = edge_values(F32 if src == F32 else F64, dst).double().numpy()
    if dst in FLOAT8:
        grid = np.unique(np.abs(as64(from_bits(np.arange(256), dst))))
        grid = grid[np.isfinite(grid)]
        v = np.concatenate([v, grid, (grid[1:] + grid[:-1]) / 2])
    with np.errstate(over="ignore"):
        v = np.ldexp(np.concatenate([v, -v]), -k)
    fi = ml_dtypes.finfo(NP[src][0])
    own = [0.0, float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal), 1.0,
           math.inf, math.nan]
    bits = np.concatenate([to_bits(v, src), to_bits(own + [-o for o in own], src)])
    mask = np.iinfo(NP[src][1]).max
    ints = {int(b) for b in bits}
    ints = np.array(sorted(ints | {(b + 1) & mask for b in ints} | {(b - 1) & mask for b in ints}),
                    dtype=NP[src][1])
    # Sorted into classes by where x * 2**k lands in dst, so that each class
    # is drawn as often as the others, however many values it holds.
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.ldexp(np.abs(as64(from_bits(ints, src))), k)
    classes = {"zero, inf, NaN": ~np.isfinite(a) | (a == 0),
               "beyond the largest": np.isfinite(a) & (a >= LARGEST[dst]),
               "top binade": (a < LARGEST[dst]) & (a >= LARGEST[dst] / 2),
               "subnormal in dst": (a > 0) & (a < min_normal(dst)),
               "normal": (a >= min_normal(dst)) & (a < LARGEST[dst] / 2)}
    _POOLS[key] = pool = [sorted(int(b) for b in ints[m]) for m in classes.values() if m.any()]
    return pool


# (exponent bits, fraction bits) of each format
FIELDS = {F64: (11, 52), F32: (8, 23), F16: (5, 10), BF16: (8, 7), E4: (4, 3), E5: (5, 2)}


def any_bits(dtype):
    """Any bit pattern of dtype, its exponent field uniform (every binade,
    inf and NaN alike), its sign and fraction drawn apart."""
    e, m = FIELDS[dtype]
    return st.builds(lambda sign, exp, frac: (sign << (e + m)) | (exp << m) | frac,
                     st.integers(0, 1), st.integers(0, 2 ** e - 1), st.integers(0, 2 ** m - 1))


def elements(src, pool):
    """One element's bit pattern: an edge value of one of the pool's classes,
    or any bits of src."""
    return st.one_of(*[st.sampled_from(values) for values in pool], any_bits(src))


class Case:
    """A drawn tensor and what to do with it; its repr is the example hypothesis prints."""

    def __init__(self, x, layout, **kw):
        self.x, self.layout = x, layout
        self.__dict__.update(kw)

    def __repr__(self):
        extra = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k not in ("x", "layout"))
        return (f"Case({extra}, layout={self.layout}, src={self.x.dtype}, shape={tuple(self.x.shape)}, "
                f"stride={self.x.stride()}, x={hexes(as64(self.x))})")


# Sizes per dim: 1-d past a few SIMD vectors and their tails.
SIZES = {1: list(range(1, 41)) + [63, 64, 65, 127, 128, 129, 200, 300], 2: list(range(1, 11)),
         3: list(range(1, 6))}
MAX_BASE = 400  # elements drawn one by one for a tensor's storage, at most


@st.composite
def tensors(draw, dtype, element, transform=None):
    """A tensor of dtype whose storage elements are drawn by ``element`` (bit
    patterns; ``transform`` may then rewrite the list): 0-d, empty, 1-d, 2-d
    or 3-d; contiguous, transposed, sliced with steps and an offset, or
    expanded. Returns (tensor, layout name)."""
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 3]), label="ndim")
    shape = draw(st.lists(st.sampled_from(SIZES[ndim]) if ndim else st.just(1),
                          min_size=ndim, max_size=ndim), label="shape")
    if ndim and draw(st.integers(0, 9), label="empty if 0") == 0:
        shape[draw(st.integers(0, ndim - 1), label="empty axis")] = 0
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "expanded"])
                  if ndim else st.just("0-d"), label="layout")
    if layout == "transposed" and ndim < 2:
        layout = "contiguous"
    base_shape, view = list(shape), (lambda t: t)
    if layout == "transposed":
        base_shape = shape[::-1]
        view = lambda t: t.permute(*range(ndim - 1, -1, -1))  # noqa: E731
    elif layout == "sliced":
        steps = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim), label="steps")
        start = draw(st.integers(0, 2), label="start")
        if math.prod(n * s for n, s in zip(shape, steps)) > MAX_BASE:
            steps = [1] * ndim
        base_shape = [n * s for n, s in zip(shape, steps)]
        base_shape[0] += start
        view = lambda t: t[(slice(start, None, steps[0]),)  # noqa: E731
                           + tuple(slice(None, None, s) for s in steps[1:])][:shape[0]]
    elif layout == "expanded":
        axis = draw(st.integers(0, ndim - 1), label="expanded axis")
        base_shape[axis] = 1
        view = lambda t: t.expand(*shape)  # noqa: E731
    n = math.prod(base_shape)
    bits = draw(st.lists(element, min_size=n, max_size=n), label="bits")
    if transform is not None:
        bits = transform(draw, bits)
    x = view(from_bits(bits, dtype).reshape(base_shape))
    assert list(x.shape) == shape
    return x, layout


@st.composite
def cast_cases(draw, scaled=False):
    """A lossy pair, saturate (None, False, True; True for float8 targets
    only), the API (cast_with_stats or safe_to under "record"), a power-of-two
    scale exponent k (scaled) and x drawn around dst's edges (at 2**-k)."""
    src, dst = draw(st.sampled_from(PAIRS), label="pair")
    saturate = draw(st.sampled_from([None, False, True] if dst in FLOAT8 else [None, False]),
                    label="saturate")
    api = draw(st.sampled_from(["cast_with_stats", "safe_to"]), label="api")
    # k: mostly small; past +-100 the CPU leaves its AVX-512 float8 loop
    k = draw(st.sampled_from(list(range(-24, 25)) + [-126, -101, -100, 100, 101, 126]),
             label="k") if scaled else 0
    x, layout = draw(tensors(src, elements(src, edge_pool(src, dst, k))))
    return Case(x, layout, dst=dst, saturate=saturate, api=api, k=k)


# --- oracles ----------------------------------------------------------------------------

EXACT = ("numel", "nan", "inf", "inexact", "overflow", "saturated", "underflow", "subnormal",
         "max_abs_err", "max_rel_err", "amax")
SUMS = ("sum_abs_err", "sum_sq_err", "sum_sq")


def run_cast(case, scale=None):
    """(y, CastStats) from the API the case names."""
    x, dst = case.x, case.dst
    if case.api == "safe_to":
        y = torchcast.safe_to(x, dst, policy="record", scale=scale, saturate=case.saturate)
        return y, torchcast.last_stats()
    y, stats = torchcast.cast_with_stats(x, dst, scale=scale, saturate=case.saturate)
    return y, CastStats.from_tensor(stats, x.dtype, dst)


def assert_y(y, want, x):
    """y, decoded by ml_dtypes, equals the oracle's values: every bit of a
    number (sign of zero included); NaN where the oracle has NaN."""
    assert y.shape == x.shape and y.device == x.device
    got = as64(y)
    nan = np.isnan(want)
    bad = (np.isnan(got) != nan) | (~nan & ((got != want) | (np.signbit(got) != np.signbit(want))))
    i = np.nonzero(bad)[0][:5]
    assert not bad.any(), ("y differs from the oracle at", i.tolist(), "x", hexes(as64(x)[i]),
                           "got", hexes(got[i]), "oracle", hexes(want[i]))


def assert_stats(s, ref):
    """Counts, maxima and amax exactly; the sums within the documented 1e-6
    relative (plus each term's rounding below float32's subnormals), as
    tests/test_cast.py compares them; inf sums only past float32's range."""
    for f in ("overflow", "saturated", "underflow", "subnormal", "nan", "inf"):
        if ref[f] > 1:
            event(f"several {f}")
    n = ref["numel"]
    event(f"numel {'0' if not n else '1' if n == 1 else '<10' if n < 10 else '>=10'}")
    for f in EXACT:
        assert getattr(s, f) == ref[f], (f, "torchcast", getattr(s, f), "oracle", ref[f])
    for f in SUMS:
        got, exact = getattr(s, f), ref[f]
        if math.isinf(got):
            assert exact > 3.0e38, (f, "torchcast", got, "oracle", exact)
            continue
        assert abs(got - exact) <= 1e-6 * abs(exact) + s.numel * 2.0 ** -150, \
            (f, "torchcast", got, "oracle", exact)


def saturated_count(xs, dst, saturate, scaled_values=None):
    """Elements a saturating cast clamps: non-NaN x whose plain rounding is not finite."""
    if not saturate:
        return 0
    v = xs if scaled_values is None else scaled_values
    return int((~np.isnan(xs) & ~np.isfinite(round_to_format(v, dst))).sum())


def exact_round(x, s, dtype, saturate):
    """x * s (float64 x, float32 s, as Fractions: exact) rounded once to dtype,
    ties to even, with dtype's overflow (inf; NaN for e4m3fn) or saturation."""
    mant, emin, _ = FORMATS[dtype]
    if not math.isfinite(x):
        return float(round_to_format(np.array([x * s]), dtype, saturate)[0])
    q = abs(Fraction(x) * Fraction(s))
    if q == 0:
        return math.copysign(0.0, x)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    quantum = Fraction(2) ** (max(e, emin) - mant)
    n, r = divmod(q / quantum, 1)
    n = int(n) + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and int(n) % 2) else 0)
    v = n * quantum
    if v > LARGEST[dtype]:
        return math.copysign(LARGEST[dtype], x) if saturate else (
            math.nan if dtype == E4 else math.copysign(math.inf, x))
    return math.copysign(float(v), x)


def scaled_reference(x, dst, saturate, s, power_of_two):
    """(y, stats) of round(x * s) measured as y / s against x. y: the exact
    product rounded once (numpy float64 where the product is exact: a
    power-of-two s or a source of at most 24 bits; Fraction otherwise).
    The errors are |x - y / s| over finite x with finite y (CastStats'
    definition): y / s exact in float64 for a power of two, the nearest
    float64 to the Fraction otherwise. Overflow, underflow and subnormal are
    y's. For a scale that is not a power of two the kernel rounds y / s
    once in its working type (float64 for float64 x, else float32) before
    it subtracts: "inexact" counts that back != x, as documented, and the
    errors are compared with tolerance (approx_fields)."""
    xs = as64(x)
    if power_of_two or x.dtype != F64:
        with np.errstate(over="ignore", invalid="ignore"):
            prod = xs * s
        y = round_to_format(prod, dst, saturate)
        sat = saturated_count(xs, dst, saturate, prod)
    else:
        y = np.array([exact_round(v, s, dst, saturate) for v in xs.tolist()], dtype=np.float64)
        sat = 0 if not saturate else int(sum(
            not math.isnan(v) and not math.isfinite(exact_round(v, s, dst, False))
            for v in xs.tolist()))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if power_of_two:
            back = y / s
        else:
            back = np.array([float(Fraction(v) / Fraction(s)) if math.isfinite(v) else v
                             for v in y.tolist()], dtype=np.float64)
    ref = stats_of_values(xs, back, x.dtype, min_normal(dst), sat)
    finite_x = np.isfinite(xs)
    past = finite_x & np.isfinite(y) & ~np.isfinite(back)
    if past.any():  # y / s past float64's range: the errors of those elements, exactly
        measured = finite_x & np.isfinite(y)
        err = np.array([float(abs(Fraction(v) - Fraction(w) / Fraction(s))) if m else 0.0
                        for v, w, m in zip(xs.tolist(), y.tolist(), measured.tolist())])
        nz = measured & (xs != 0)
        rel = np.where(nz, err / np.where(nz, np.abs(xs), 1.0), 0.0)
        ref.update(max_abs_err=float(err.max()), max_rel_err=float(rel.max()),
                   sum_abs_err=math.fsum(err), sum_sq_err=math.fsum(err * err),
                   sum_sq=math.fsum(np.where(measured, xs * xs, 0.0)))
    ref["overflow"] = int((finite_x & ~np.isfinite(y)).sum())
    ref["underflow"] = int(((xs != 0) & ~np.isnan(xs) & (y == 0)).sum())
    ref["subnormal"] = int(((y != 0) & (np.abs(y) < min_normal(dst))).sum())
    if not power_of_two:
        wide = np.float64 if x.dtype == F64 else np.float32
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            kernel_back = (y.astype(wide) / wide(s)).astype(np.float64)
        ref["inexact"] = int((finite_x & (kernel_back != xs)).sum())
    return y, ref


def approx_fields(s, ref, x):
    """The errors of a scaled cast whose y / s the kernel rounds before it
    subtracts (a scale that is not a power of two): within that rounding, an
    ulp of its working type at amax per element, of the exact errors."""
    eps = 2.0 ** -52 if x.dtype == F64 else 2.0 ** -23
    amax, n = ref["amax"], max(ref["numel"], 1)
    tol = {"max_abs_err": 2.0 ** -20 * ref["max_abs_err"] + eps * amax,
           "max_rel_err": 2.0 ** -20 * ref["max_rel_err"] + 2 * eps,
           "sum_abs_err": 1e-6 * ref["sum_abs_err"] + n * eps * amax,
           "sum_sq_err": 1e-6 * ref["sum_sq_err"] + n * (2 * ref["max_abs_err"] + eps * amax) * eps * amax,
           "sum_sq": 1e-6 * ref["sum_sq"]}
    for f, t in tol.items():
        got = getattr(s, f)
        assert got == ref[f] or abs(got - ref[f]) <= t, (f, "torchcast", got, "oracle", ref[f], "tolerance", t)


# --- 1. casts --------------------------------------------------------------------------

@FUZZ
@given(cast_cases())
def test_cast_rounds_once_and_measures_exactly(case):
    """cast_with_stats / safe_to(policy="record") against numpy float64:
    y is x correctly rounded (numpy_ref.round_to_format: scaling and
    np.round, ties to even; saturation as asked) bit for bit, and every stat
    is numpy_ref.stats_of_values of x and that y (math.fsum sums)."""
    x, dst = case.x, case.dst
    saturate = default_saturate(dst) if case.saturate is None else case.saturate
    xs = as64(x)
    want = round_to_format(xs, dst, saturate)
    y, s = run_cast(case)
    assert y.dtype == dst
    assert_y(y, want, x)
    assert_stats(s, stats_of_values(xs, want, x.dtype, min_normal(dst),
                                    saturated_count(xs, dst, saturate)))


@FUZZ
@given(cast_cases(scaled=True))
def test_power_of_two_scaled_cast(case):
    """scale=torch.tensor(2.0**k): y is x * 2**k (exact in float64) rounded
    once by numpy_ref.round_to_format; the stats measure y / 2**k (exact)
    against x: numpy_ref.stats_of_values, y's own overflow, underflow and
    subnormal counts."""
    x, dst = case.x, case.dst
    saturate = default_saturate(dst) if case.saturate is None else case.saturate
    y, s = run_cast(case, scale=torch.tensor(2.0 ** case.k))
    want, ref = scaled_reference(x, dst, saturate, 2.0 ** case.k, power_of_two=True)
    assert y.dtype == dst
    assert_y(y, want, x)
    assert_stats(s, ref)


def near_largest():
    """float64 values at or next to a format's largest finite value, times a
    power of two."""
    tops = list(LARGEST.values())
    return st.builds(lambda top, j, ulps, sign: sign * float(np.nextafter(
        top * 2.0 ** j, math.inf if ulps > 0 else 0.0)) if ulps else sign * top * 2.0 ** j,
        st.sampled_from(tops), st.integers(-40, 40), st.sampled_from([-1, 0, 1]),
        st.sampled_from([1.0, -1.0]))


def magnitudes(dtype):
    """Positive finite values of dtype over its whole exponent range, its
    edges as often as its middle (issue 40: tiny and huge magnitudes): 2^e
    times a mantissa in [1, 2), e drawn from the lowest binades (subnormals
    included), the highest, or any; rounded to dtype (at most its largest)."""
    fi = ml_dtypes.finfo(NP[dtype][0])
    lo = math.frexp(float(fi.smallest_subnormal))[1] - 1
    hi = math.frexp(float(fi.max))[1] - 1
    exponent = st.one_of(st.integers(lo, lo + 12), st.integers(hi - 12, hi), st.integers(lo, hi))

    def value(e, m):
        v = as64(from_bits(to_bits([min(math.ldexp(m, e), float(fi.max))], dtype), dtype))[0]
        return v if v > 0 else float(fi.smallest_subnormal)
    return st.builds(value, exponent, st.floats(1, 2, exclude_max=True))


@st.composite
def amax_cases(draw):
    """A lossy pair, a recipe ("amax" or "amax_pow2"), saturate, and x whose
    largest finite magnitude is drawn over src's whole range (any float: many
    binades and mantissas, or a format's largest value or a neighbour,
    times a power of two), with smaller values, zeros, inf and NaN."""
    src, dst = draw(st.sampled_from(PAIRS), label="pair")
    recipe = draw(st.sampled_from(["amax", "amax_pow2"]), label="recipe")
    saturate = draw(st.sampled_from([None, False, True] if dst in FLOAT8 else [None, False]),
                    label="saturate")
    fi = ml_dtypes.finfo(NP[src][0])
    big = draw(st.one_of(st.floats(float(fi.smallest_subnormal), float(fi.max)),
                         near_largest(), magnitudes(src)), label="amax")
    amax = as64(from_bits(to_bits([big], src), src))[0]
    if not (math.isfinite(amax) and amax != 0):
        amax = float(fi.max) if abs(big) > 1 else float(fi.smallest_subnormal)
    fractions = draw(st.lists(st.one_of(st.floats(-1, 1), st.sampled_from(
        [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan])), max_size=12), label="others")
    values = [amax] + [f * amax if abs(f) <= 1 else f for f in fractions]
    order = draw(st.permutations(range(len(values))), label="order")
    x = from_bits(to_bits([values[i] for i in order], src), src)
    return Case(x, "contiguous", dst=dst, saturate=saturate, api="safe_to", recipe=recipe)


# A scale's dtype: (numpy type, smallest positive, largest exponent of a power of two).
SCALE_TYPES = {torch.float32: (np.float32, 2.0 ** -149, 127),
               torch.float64: (np.float64, 2.0 ** -1074, 1023)}


def documented_scale(amax, dst, power_of_two, src):
    """docs/scaling.md's rule, in Fraction arithmetic: a float64 scale for a
    float64 src, else float32; with a = max(amax, m), m the scale's smallest
    positive value, and top = finfo(dst).max: a float32 scale is the largest
    float32 with a * s <= top; a float64 one is top / a rounded to the
    nearest float64 (at most its largest), one step down where a * s
    rounded to float64 exceeds top; a power of two the largest of the
    scale's dtype with a * s <= top."""
    kind, smallest, e_max = SCALE_TYPES[F64 if src == F64 else F32]
    a, top = Fraction(max(amax, smallest)), Fraction(LARGEST[dst])
    if power_of_two:
        k = e_max
        while a * Fraction(2) ** k > top:
            k -= 1
        return 2.0 ** k
    largest = float(np.finfo(kind).max)
    if kind is np.float64:
        s = float(top / a) if top / a <= Fraction(largest) else largest
        return math.nextafter(s, 0) if float(a) * s > top else s
    s = np.float32(min(float(top / a), largest))
    while a * Fraction(float(s)) > top:
        s = np.nextafter(s, np.float32(0))
    while s < largest and a * Fraction(float(np.nextafter(s, np.float32(np.inf)))) <= top:
        s = np.nextafter(s, np.float32(np.inf))
    return float(s)


def amax_of(xs):
    finite = xs[np.isfinite(xs)]
    return float(np.abs(finite).max()) if finite.size else 0.0


@FUZZ
@given(amax_cases())
def test_amax_recipes_round_the_exact_product(case):
    """safe_to(scale="amax"/"amax_pow2"): the scale is docs/scaling.md's
    (Fraction arithmetic); with it, y is the exact product x * s (Fraction
    arithmetic for float64 x) rounded once, and the stats measure y / s
    against x (numpy_ref.stats_of_values; the errors of a scale that is not
    a power of two within the kernel's rounding of y / s)."""
    x, dst = case.x, case.dst
    saturate = default_saturate(dst) if case.saturate is None else case.saturate
    y, s = run_cast(case, scale=case.recipe)
    scale = torchcast.last_scale()
    scale_dtype = F64 if x.dtype == F64 else F32
    assert scale is not None and scale.dtype == scale_dtype and scale.numel() == 1
    sv = float(scale)
    want_scale = documented_scale(amax_of(as64(x)), dst, case.recipe == "amax_pow2", x.dtype)
    assert sv == want_scale, ("scale", sv.hex(), "docs/scaling.md", want_scale.hex())
    power_of_two = math.frexp(sv)[0] == 0.5
    want, ref = scaled_reference(x, dst, saturate, sv, power_of_two)
    assert_y(y, want, x)
    if power_of_two:
        assert_stats(s, ref)
    else:
        for f in EXACT[:8] + ("amax",):
            assert getattr(s, f) == ref[f], (f, "torchcast", getattr(s, f), "oracle", ref[f])
        approx_fields(s, ref, x)


@FUZZ
@given(amax_cases())
def test_amax_scale_never_overflows(case):
    """Issue 26 item 1, issue 40 item 2: a scale chosen so that amax fits
    makes amax fit, at any magnitude (a float64 x gets a float64 scale). The
    oracle is the definition: no overflow counted, no finite element
    saturated (only +-inf may be), and y finite wherever x is finite; and
    amax reaches the format's top binade (amax * s >= top / 2, so y >= top
    / 2 rounded down), unless the scale is its dtype's largest."""
    x, dst = case.x, case.dst
    saturate = default_saturate(dst) if case.saturate is None else case.saturate
    y, s = run_cast(case, scale=case.recipe)
    xs, ys = as64(x), as64(y)
    amax, scale = amax_of(xs), float(torchcast.last_scale())
    top = Fraction(LARGEST[dst])
    kind, _, e_max = SCALE_TYPES[F64 if x.dtype == F64 else F32]
    largest = 2.0 ** e_max if case.recipe == "amax_pow2" else float(np.finfo(kind).max)
    if amax > 0 and scale != largest:
        assert Fraction(amax) * Fraction(scale) >= top / 2, ("amax does not reach the top",
                                                              amax.hex(), "scale", scale.hex())
        i = int(np.argmax(np.where(np.isfinite(xs), np.abs(xs), -1)))
        assert abs(ys[i]) >= float(round_to_format(np.array([float(top) / 2]), dst)[0]) / 2, (
            "amax cast to", ys[i], "x", xs[i])
    n_inf = int(np.isinf(xs).sum())
    lost = np.isfinite(xs) & ~np.isfinite(ys)
    assert not lost.any(), ("finite x became", hexes(ys[lost]), "x", hexes(xs[lost]),
                            "amax", amax.hex(), "scale", scale.hex())
    assert s.overflow == 0, ("overflow", s.overflow)
    assert s.saturated == (n_inf if saturate else 0), ("saturated", s.saturated, "inf in x", n_inf,
                                                       "amax", amax.hex(), "scale", scale.hex())


# --- 2. tensor_health and headroom ---------------------------------------------------

HEALTH_DTYPES = [F64, F32, F16, BF16, E4, E5]
HEADROOM = {F16: np.float16, BF16: ml_dtypes.bfloat16, E4: ml_dtypes.float8_e4m3fn,
            E5: ml_dtypes.float8_e5m2}


@st.composite
def health_cases(draw):
    """x of any dtype tensor_health takes, drawn around the edges of a
    headroom format at a power-of-two scale 2**k (or "amax")."""
    src = draw(st.sampled_from(HEALTH_DTYPES), label="src")
    fmt = draw(st.sampled_from(list(HEADROOM)), label="format")
    # k so that fmt's range, moved by 2**-k, lies in src's (or near it)
    src_fi, fmt_fi = ml_dtypes.finfo(NP[src][0]), ml_dtypes.finfo(NP[fmt][0])
    lo = math.ceil(math.log2(float(fmt_fi.max)) - math.log2(float(src_fi.max)))
    hi = math.floor(math.log2(float(fmt_fi.smallest_subnormal))
                    - math.log2(float(src_fi.smallest_subnormal)))
    k = draw(st.sampled_from(["amax", "top", "bottom", "any"]), label="scale")
    if k == "top":  # src's largest values land next to fmt's
        k = lo + draw(st.integers(-3, 3), label="k - top")
    elif k == "bottom":  # src's smallest values land next to fmt's
        k = hi + draw(st.integers(-3, 3), label="k - bottom")
    elif k == "any":
        k = draw(st.integers(min(lo, hi) - 3, max(lo, hi) + 3), label="k")
    if k != "amax":
        k = max(-120, min(k, 120))
    pool_k = 0 if k == "amax" else k
    pool = edge_pool(src, fmt, pool_k) if src != fmt else edge_pool(src, E4 if fmt != E4 else E5, pool_k)
    x, layout = draw(tensors(src, elements(src, pool)))
    return Case(x, layout, fmt=fmt, k=k)


@FUZZ
@given(health_cases())
def test_tensor_health_counts(case):
    """tensor_health against numpy_ref.tensor_health_reference (frexp and the
    fraction's digits, values decoded by ml_dtypes): NaN, +-inf, zero and
    subnormal counts, the histogram bin by bin (its total: the finite nonzero
    elements), amax and the smallest nonzero magnitude, numel."""
    x = case.x
    h = torchcast.tensor_health(x)
    xs = as64(x)
    counts, hist, extrema = tensor_health_reference(xs, x.dtype)
    assert h.counts.tolist() == counts, ("counts [nan, +inf, -inf, zero, subnormal]",
                                          h.counts.tolist(), "oracle", counts)
    assert np.array_equal(h.hist.numpy(), hist), "histogram differs"
    assert int(h.hist.sum()) == int((np.isfinite(xs) & (xs != 0)).sum())
    assert h.extrema.tolist() == extrema, ("[amax, min_nonzero]", h.extrema.tolist(), extrema)
    v = h.read()
    assert v.numel == x.numel() and v.amax == extrema[0]


@FUZZ
@given(health_cases())
def test_headroom_predicts_the_real_cast(case):
    """headroom(tensor_health(x), fmt, scale) against really casting
    x * scale (float64, exact) with numpy (float16) or ml_dtypes (bfloat16,
    float8), both rounding once: overflow (finite x whose cast is inf or
    NaN), underflow (nonzero x whose cast is 0), subnormal (nonzero results
    below the smallest normal). With scale="amax" also: nothing overflows."""
    x, fmt = case.x, case.fmt
    health = torchcast.tensor_health(x)
    got = torchcast.headroom.headroom(health, fmt, scale="amax" if case.k == "amax" else 2.0 ** case.k)
    scale = got.scale if case.k == "amax" else 2.0 ** case.k
    xs = as64(x)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (xs * scale).astype(HEADROOM[fmt]).astype(np.float64)
    finite = np.isfinite(xs)
    want = (int((finite & ~np.isfinite(y)).sum()),
            int((finite & (xs != 0) & (y == 0)).sum()),
            int((np.isfinite(y) & (y != 0) & (np.abs(y) < min_normal(fmt))).sum()))
    assert (got.overflow, got.underflow, got.subnormal) == want, (
        "(overflow, underflow, subnormal) at scale", scale, (got.overflow, got.underflow,
                                                             got.subnormal), "real cast", want)
    for name, count in zip(("overflow", "underflow", "subnormal"), want):
        if count:
            event(f"{case.fmt}: {name}")
    assert got.numel == x.numel()
    if case.k == "amax":  # docs/scaling.md: amax fits (a float64 x: a float64 scale)
        assert math.frexp(scale)[0] == 0.5
        assert got.overflow == 0, ("amax", health.amax, "scale", scale)


# --- 3. kahan_sum / kahan_mean ---------------------------------------------------------

REDUCE_DTYPES = [F32, F16, BF16, F64]
U32, U64 = 2.0 ** -24, 2.0 ** -53


def ulp(v, dtype):
    """Spacing of dtype at |v| (as tests/test_reduce.py)."""
    fi = torch.finfo(dtype)
    a = np.abs(np.asarray(v, dtype=np.float64))
    with np.errstate(divide="ignore"):
        return np.exp2(np.floor(np.log2(np.maximum(a, fi.tiny)))) * fi.eps


@st.composite
def reduce_cases(draw):
    """x of a floating dtype in any layout, values sign * (1 + f) * 2**e over
    a drawn span of binades (wide spans give huge condition numbers), in
    two thirds of the cases with the negatives of half of the storage's elements
    in another order (a sum that cancels down to what is left), and in a
    quarter of them zeros, subnormals, +-inf and NaN now and then; a dim
    (None, (), an int or a tuple of distinct dims, negative allowed),
    keepdim, and an output dtype (None or any floating dtype)."""
    dtype = draw(st.sampled_from(REDUCE_DTYPES), label="dtype")
    fi = torch.finfo(dtype)
    top = 990 if dtype == F64 else int(math.log2(fi.max))
    low = draw(st.integers(int(math.log2(fi.tiny)) - 3, top), label="lowest binade")
    high = min(top, low + draw(st.sampled_from([0, 1, 4, 12, 24, 40, 60]), label="binades"))
    value = st.builds(lambda sgn, f, e: sgn * (1 + f) * 2.0 ** e, st.sampled_from([1.0, -1.0]),
                      st.floats(0, 1, exclude_max=True), st.integers(low, high))
    if draw(st.integers(0, 3), label="specials if 0") == 0:
        specials = st.sampled_from([0.0, -0.0, fi.tiny / 2, math.inf, -math.inf, math.nan])
        value = st.tuples(st.integers(0, 29), value, specials).map(
            lambda t: t[2] if t[0] == 0 else t[1])
    element = value.map(lambda v: int(to_bits([v], dtype)[0]))
    sign = 1 << (fi.bits - 1)

    def cancel(draw, bits):
        half = len(bits) // 2
        order = draw(st.permutations(range(half)), label="cancelling order")
        return bits[:half] + [bits[i] ^ sign for i in order] + bits[2 * half:]

    cancelling = draw(st.integers(0, 2), label="cancel if > 0") > 0
    x, layout = draw(tensors(dtype, element, cancel if cancelling else None))
    nd = x.dim()
    kind = draw(st.sampled_from(["None", "()", "int", "int", "tuple", "tuple"]), label="dim kind")
    if kind == "None":
        dim = None
    elif kind == "()":
        dim = ()
    elif kind == "int" or nd == 0:
        d = draw(st.integers(0, max(nd, 1) - 1), label="dim")
        dim = d - max(nd, 1) if draw(st.booleans(), label="negative") else d
    else:
        ds = draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True),
                  label="dims")
        dim = tuple(d - nd if draw(st.booleans(), label="negative") else d for d in ds)
    return Case(x, layout, dim=dim, keepdim=draw(st.booleans(), label="keepdim"),
                out_dtype=draw(st.sampled_from([None] * 4 + REDUCE_DTYPES), label="dtype="),
                mean=draw(st.booleans(), label="mean"))


def fsum_rows(x, dim):
    """The float64 values each output reduces: one row per output, in the
    output's C order (numpy)."""
    a = as64(x).reshape(tuple(x.shape))
    nd = x.dim()
    if dim is None or dim == () or nd == 0:
        axes = list(range(nd))
    else:
        axes = sorted({d % nd for d in ((dim,) if isinstance(dim, int) else dim)})
    keep = [i for i in range(nd) if i not in axes]
    n_out = math.prod(a.shape[i] for i in keep)
    n_red = math.prod(a.shape[i] for i in axes)
    return np.transpose(a, keep + axes).reshape(n_out, n_red)


def exact_sum(row):
    """math.fsum of a row, with torch.sum's special values: NaN for a NaN or
    inf - inf, +-inf for an infinity."""
    if np.isnan(row).any() or (np.isposinf(row).any() and np.isneginf(row).any()):
        return math.nan
    if np.isinf(row).any():
        return float(row[np.isinf(row)][0])
    return math.fsum(row.tolist())


@FUZZ
@given(reduce_cases())
def test_kahan_sum_and_mean_against_fsum(case):
    """kahan_sum / kahan_mean against math.fsum of each output's elements
    (divided by the count for a mean), with tests/test_reduce.py's bound:
    one ulp of the result dtype plus the accumulation term (float32
    compensated: 4 n u32^2 sum|x|; float64, also under dtype=torch.float64:
    2 n u64 sum|x|). torch.sum's shape and dtype; docs/reduce.md's special
    values: NaN, +-inf, sums past the accumulator's range inf, results past
    the result dtype's range inf; the mean of nothing NaN."""
    x = case.x
    fn = torchcast.kahan_mean if case.mean else torchcast.kahan_sum
    got = fn(x, case.dim, case.keepdim, dtype=case.out_dtype)
    out_dtype = case.out_dtype or x.dtype
    assert got.dtype == out_dtype
    like = torch.zeros(x.shape, dtype=torch.float64).sum(dim=case.dim, keepdim=case.keepdim)
    assert got.shape == like.shape, (tuple(got.shape), "torch.sum", tuple(like.shape))
    rows = fsum_rows(x, case.dim)
    g = as64(got)
    wide = x.dtype == F64 or out_dtype == F64
    acc_max = torch.finfo(F64 if wide else F32).max
    out_max = float(torch.finfo(out_dtype).max)
    for i, row in enumerate(rows):
        n = row.size
        exact = exact_sum(row)
        want = (exact / n if n else math.nan) if case.mean else exact
        finite = row[np.isfinite(row)]
        abs_sum = math.fsum(np.abs(finite).tolist())
        if abs_sum > acc_max / 2:  # a partial sum may pass the accumulator's range: inf, or NaN
            event("accumulator overflow possible")
            if math.isnan(g[i]) or math.isinf(g[i]):
                continue
        if math.isnan(want):
            assert math.isnan(g[i]), (i, "torchcast", g[i], "oracle: NaN")
            continue
        if math.isinf(want):
            assert g[i] == want, (i, "torchcast", g[i], "oracle", want)
            continue
        acc = 2 * n * U64 * abs_sum if wide else 4 * max(n, 1) * U32 ** 2 * abs_sum
        if case.mean:
            acc /= n
        acc += 2 * U64 * abs(want)  # the division of a mean, and fsum's rounding
        if math.isinf(g[i]):  # the accumulated value, within acc of want, rounded past out_dtype's range
            assert (want + acc if g[i] > 0 else -(want - acc)) > out_max, \
                (i, "torchcast", g[i], "oracle", want, "bound", acc)
            continue
        tol = float(ulp(want, out_dtype)) + acc
        assert abs(g[i] - want) <= tol, (i, "torchcast", float(g[i]).hex(), "oracle", want.hex(),
                                         "tol", tol)


# --- 4. the optimizer's validation ------------------------------------------------------

def bits_equal(a, b):
    """Bit-identical tensors (NaN payloads included); meta tensors by metadata."""
    if a.device.type == "meta" or b.device.type == "meta":
        return (a.device, a.dtype, a.shape, a.stride()) == (b.device, b.dtype, b.shape, b.stride())
    if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
        return False
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a.contiguous().view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                       b.contiguous().view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))


def clone_value(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return {k: clone_value(w) for k, w in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(clone_value(w) for w in v)
    return copy.copy(v)


def same_value(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bits_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def snapshot(opt):
    """Clones of everything a step, a load or a seeding could change: every
    param (by identity and value), every state entry, the groups' options."""
    groups = [([id(p) for p in g["params"]], {k: clone_value(v) for k, v in g.items() if k != "params"})
              for g in opt.param_groups]
    params = {id(p): p.detach().clone() for g in opt.param_groups for p in g["params"]}
    state = {id(p): clone_value(s) for p, s in opt.state.items()}
    return groups, params, state


def assert_unchanged(opt, before, what):
    groups, params, state = snapshot(opt)
    b_groups, b_params, b_state = before
    assert [g[0] for g in groups] == [g[0] for g in b_groups], (what, "param groups changed")
    for (_, now), (_, was) in zip(groups, b_groups):
        assert same_value(now, was), (what, "group options changed", now, was)
    for pid, was in b_params.items():
        assert bits_equal(params[pid], was), (what, "a param changed")
    assert set(state) == set(b_state), (what, "params with state changed")
    for pid, was in b_state.items():
        assert same_value(state[pid], was), (what, "a state changed", state[pid], was)


OPT_DTYPES = [F32, BF16, F16, F64]
SHAPES = [(3,), (2, 3), (4,)]
BAD_VALUES = [math.nan, -1.0, math.inf, "0.01", True, None, [0.1], torch.tensor([1e-3, 1e-3]),
              torch.tensor(math.nan)]


def other_shape(shape):
    return (shape[0] + 1,) + tuple(shape[1:])


def break_something(data, opt, params):
    """One random change a user (or a bad checkpoint) could make before a step."""
    what = data.draw(st.sampled_from([
        "grad shape", "grad dtype", "grad sparse", "grad none", "grad nan", "hyperparameter",
        "betas", "state shape", "state dtype", "state meta", "state none", "state list",
        "state expanded", "step dtype", "step meta", "state not a dict", "state key dropped",
        "expanded param"]), label="break")
    p = data.draw(st.sampled_from(params), label="param index")
    gi = data.draw(st.integers(0, len(opt.param_groups) - 1), label="group")
    group = opt.param_groups[gi]
    if what == "grad shape":
        p.grad = torch.zeros_like(p)
        p.grad.data = torch.randn(other_shape(p.shape)).to(p.dtype)
    elif what == "grad dtype":
        p.grad_dtype = None  # torch >= 2.9 allows a grad of another dtype once asked to
        p.grad = torch.randn(p.shape, dtype=data.draw(st.sampled_from(
            [d for d in OPT_DTYPES if d != p.dtype]), label="grad dtype"))
    elif what == "grad sparse":
        p.grad = torch.randn(p.shape).to(p.dtype).to_sparse()
    elif what == "grad none":
        p.grad = None
    elif what == "grad nan":
        p.grad = torch.full_like(p, math.nan)
    elif what == "hyperparameter":
        key = data.draw(st.sampled_from(["lr", "eps", "weight_decay"]), label="key")
        group[key] = data.draw(st.sampled_from(BAD_VALUES), label="value")
    elif what == "betas":
        group["betas"] = data.draw(st.sampled_from(
            [(math.nan, 0.999), (0.9, 1.0), (0.9, -0.1), (0.9,), 0.9, (0.9, "0.999"),
             (torch.tensor(0.9), torch.tensor([0.9, 0.9]))]), label="betas")
    elif p in opt.state and isinstance(opt.state[p], dict) and opt.state[p]:
        state = opt.state[p]
        key = data.draw(st.sampled_from(sorted(k for k in state if k != "step") or ["exp_avg"]),
                        label="state key")
        t = state.get(key)
        like = t if isinstance(t, torch.Tensor) else torch.zeros(p.shape)
        if what == "state shape":
            state[key] = torch.zeros(other_shape(p.shape), dtype=like.dtype)
        elif what == "state dtype":
            state[key] = like.to(torch.float64 if like.dtype != torch.float64 else torch.float16)
        elif what == "state meta":
            state[key] = like.to("meta")
        elif what == "state none":
            state[key] = None
        elif what == "state list":
            state[key] = like.tolist()
        elif what == "state expanded":
            state[key] = like.reshape(-1)[:1].expand(p.shape)
        elif what == "step dtype":
            state["step"] = torch.tensor(1, dtype=data.draw(st.sampled_from(
                [torch.int64, torch.float16, torch.bfloat16]), label="step dtype"))
        elif what == "step meta":
            state["step"] = torch.tensor(1.0, device="meta")
        elif what == "state not a dict":
            opt.state[p] = "a string"
        elif what == "state key dropped":
            del state[key]
    elif what == "expanded param":
        q = torch.nn.Parameter(torch.randn(1).expand(4))
        q.grad = torch.randn(4)
        group["params"].append(q)


def broken_state_dict(data, opt, params):
    """A state dict of this optimizer (taken now), then broken one way."""
    sd = copy.deepcopy(opt.state_dict())
    what = data.draw(st.sampled_from([
        "state shape", "state dtype", "state none", "state string", "unknown key", "missing key",
        "step string", "group count", "group size", "lr string", "lr nan", "remainder on float32",
        "intact"]), label="state dict break")
    states = [s for s in sd["state"].values() if isinstance(s, dict)
              and all(isinstance(s.get(k), torch.Tensor) for k in ("exp_avg", "exp_avg_sq"))]
    if what in ("state shape", "state dtype", "state none", "unknown key", "missing key",
                "step string") and not states:
        what = "lr nan"
    gi = data.draw(st.integers(0, len(sd["param_groups"]) - 1), label="group")
    if states:
        s = data.draw(st.sampled_from(states), label="state")
    if what == "state shape":
        s["exp_avg"] = torch.zeros(other_shape(tuple(s["exp_avg"].shape)))
    elif what == "state dtype":
        s["exp_avg_sq"] = s["exp_avg_sq"].to(torch.int64)
    elif what == "state none":
        s["exp_avg"] = None
    elif what == "state string":
        pid = data.draw(st.sampled_from(sorted(sd["param_groups"][gi]["params"])), label="param id")
        sd["state"][pid] = "a string"
    elif what == "unknown key":
        s["momentum_buffer"] = torch.zeros(1)
    elif what == "missing key":
        del s["exp_avg_sq"]
    elif what == "step string":
        s["step"] = "3"
    elif what == "group count":
        sd["param_groups"].append(copy.deepcopy(sd["param_groups"][gi]))
    elif what == "group size":
        sd["param_groups"][gi]["params"] = sd["param_groups"][gi]["params"][:-1] or [12345]
        if len(opt.param_groups[gi]["params"]) == 1:
            sd["param_groups"][gi]["params"] = [0, 12345]
    elif what == "lr string":
        sd["param_groups"][gi]["lr"] = "0.01"
    elif what == "lr nan":
        sd["param_groups"][gi]["lr"] = math.nan
    elif what == "remainder on float32":
        sd["param_groups"][gi]["compensation"] = "remainder"
        sd["param_groups"][gi]["compensated"] = True
    return sd


@FUZZ
@given(st.data())
def test_adamw_that_raises_changes_nothing(data):
    """torchcast.optim.AdamW with randomly broken inputs: grads of the wrong
    shape, dtype or layout, bad hyperparameters (NaN, negative, strings,
    bools, tensors of two elements), states of the wrong shape, dtype,
    device, type or layout, step counts of another dtype or device, an
    overlapping param, then a step, a load_state_dict of a broken (or
    intact) state dict, a seed_compensation with a wrong weight, or an
    add_param_group of a param already there. The oracle is the promise
    ("a step that raises changes no param, state or step count"): each
    either succeeds or raises a RuntimeError, TypeError or ValueError, and
    then every param, every state tensor (step counts included) and every
    group option is bit-identical to clones taken before."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
    n = data.draw(st.integers(1, 4), label="params")
    dtypes = [data.draw(st.sampled_from(OPT_DTYPES), label="dtype") for _ in range(n)]
    shapes = [data.draw(st.sampled_from(SHAPES), label="shape") for _ in range(n)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(shapes, dtypes)]
    split = data.draw(st.integers(0, n - 1), label="split") if n > 1 else 0
    groups = [{"params": params[:split or n]}] + (
        [{"params": params[split:], "lr": 0.01, "amsgrad": True}] if split else [])
    opt = AdamW(groups, state_dtype=data.draw(st.sampled_from([None, torch.bfloat16]),
                                              label="state_dtype"),
                amsgrad=data.draw(st.booleans(), label="amsgrad"))
    for _ in range(data.draw(st.integers(0, 2), label="good steps")):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    action = data.draw(st.sampled_from(["step", "step", "load_state_dict", "seed_compensation",
                                        "add_param_group"]), label="action")
    for _ in range(data.draw(st.integers(0 if action != "step" else 1, 2), label="breaks")):
        break_something(data, opt, params)
    if action == "load_state_dict":
        sd = broken_state_dict(data, opt, params)
        call = lambda: opt.load_state_dict(sd)  # noqa: E731
    elif action == "seed_compensation":
        all_params = [p for g in opt.param_groups for p in g["params"]]
        weights = [torch.randn(p.shape, generator=gen) for p in all_params]
        bad = data.draw(st.sampled_from(["shape", "count", "none", "none"]), label="weights")
        i = data.draw(st.integers(0, len(weights) - 1), label="weight index")
        if bad == "shape":
            weights[i] = torch.randn(other_shape(tuple(weights[i].shape)))
        elif bad == "count":
            weights = weights[:i] if i else weights + [torch.randn(3)]
        call = lambda: opt.seed_compensation(weights)  # noqa: E731
    elif action == "add_param_group":
        new = torch.nn.Parameter(torch.randn(3))
        again = data.draw(st.sampled_from([[]] + [[p] for p in params]), label="repeated param")
        extra = data.draw(st.sampled_from([{}, {"lr": math.nan}, {"compensation": "remainder"}]),
                          label="options")
        call = lambda: opt.add_param_group({"params": [new] + again, **extra})  # noqa: E731
    else:
        call = opt.step
    before = snapshot(opt)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
    except (RuntimeError, TypeError, ValueError) as e:
        event(f"{action} raised {type(e).__name__}")
        assert_unchanged(opt, before, f"{action} raised {type(e).__name__}: {e}")
    else:
        event(f"{action} succeeded")


# --- 5. NVFP4 and the precision plan at magnitudes' edges (issue 40) ----------------------

E2M1_VALUES = sorted({abs(float(v)) for v in np.arange(16, dtype=np.uint8)
                      .view(ml_dtypes.float4_e2m1fn).astype(np.float64)})


def fractions_of_amax():
    """What x holds beside its amax: fractions of it in [-1, 1], zeros, and
    values 2^-j smaller (blocks far below the tensor's amax)."""
    return st.one_of(st.floats(-1, 1), st.sampled_from([0.0, -0.0, 1.0, -1.0]),
                     st.builds(lambda j, f: f * 2.0 ** -j, st.integers(1, 80), st.floats(-1, 1)))


@st.composite
def nvfp4_cases(draw):
    """x of any block_cast source, 1 to 3 rows of 1 to 40 elements, its
    amax drawn over the dtype's whole range (tiny and huge), the rest
    fractions of it; cast to NVFP4 with the default tensor scale."""
    src = draw(st.sampled_from([F64, F32, F16, BF16]), label="src")
    amax = draw(magnitudes(src), label="amax")
    rows, n = draw(st.integers(1, 3), label="rows"), draw(st.sampled_from([1, 2, 15, 16, 17, 40]))
    values = [f * amax for f in draw(st.lists(fractions_of_amax(), min_size=rows * n,
                                              max_size=rows * n), label="fractions")]
    values[draw(st.integers(0, rows * n - 1), label="amax at")] = amax
    return Case(from_bits(to_bits(values, src), src).reshape(rows, n), "contiguous")


def nvfp4_block_scale(block_amax, t, src):
    """torchao's NVFP4 block scale, as docs/formats.md states it: e4m3(clamp(
    (amax / 6) / t, 2^-6, 448)), each operation in float32 (float64 for a
    float64 source), the e4m3 rounding by ml_dtypes."""
    w = np.float64 if src == F64 else np.float32
    scaled = float((w(block_amax) / w(6)) / w(t))
    scaled = min(max(scaled, 2.0 ** -6), 448.0)
    return float(np.array([scaled]).astype(w).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)[0])


def e2m1_nearest(v):
    """|v| (a float64) rounded to e2m1's grid, ties to the even code,
    clamped at 6; and whether it rounded past 6 (at 7 and above)."""
    a = Fraction(abs(v)) if math.isfinite(v) else Fraction(10)
    best = min(range(len(E2M1_VALUES)), key=lambda i: (abs(a - Fraction(E2M1_VALUES[i])), i % 2))
    return E2M1_VALUES[best], a >= 7


@FUZZ
@given(nvfp4_cases())
def test_nvfp4_elements_at_any_magnitude(case):
    """block_cast(x, "nvfp4") with the default tensor scale t (amax / 2688,
    at least 2^-149) follows docs/formats.md's arithmetic at every
    magnitude: each block scale is e4m3(clamp((amax / 6) / t)) (numpy
    float32, float64 for float64 x; ml_dtypes' e4m3 rounding), and each
    element, decoded by ml_dtypes, is x * ((1 / t) / s) in that type (in
    float64 where float32's multiplier overflows) rounded to e2m1, ties to
    even, clamped at 6; zeros stay zeros; saturated counts the elements
    rounded past 6. Issue 40 item 1: below amax 7.9e-36 the multiplier was
    inf and every element became +-6, zeros NaN's code."""
    x = case.x
    r = torchcast.block_cast(x, "nvfp4")
    xs = as64(x).reshape(x.shape)
    t = float(r.tensor_scale)
    data = r.data.contiguous().view(torch.uint8).numpy()
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(x.shape[0], -1)[:, :x.shape[1]]
    elements = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scales = r.scales.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    saturated = 0
    for i, row in enumerate(xs):
        for b in range(0, len(row), 16):
            block = row[b:b + 16]
            s = float(scales[i, b // 16].astype(np.float64))
            assert s == nvfp4_block_scale(float(np.abs(block).max()), t, x.dtype), (
                "block scale", i, b, s, "docs/formats.md", hexes(block), "t", t)
            w = np.float64 if x.dtype == F64 else np.float32
            with np.errstate(over="ignore"):
                m = (w(1) / w(t)) / w(s)
            if not np.isfinite(m):  # float32's multiplier overflows: float64's
                w, m = np.float64, (1 / t) / s
            for j, v in enumerate(block):
                want, past = e2m1_nearest(float(w(v) * m))
                e = elements[i, b + j]
                assert abs(e) == want and (e == 0 or (e < 0) == (v < 0)), (
                    "element", hexes([v]), "became", e, "docs/formats.md", want, "t", t, "s", s)
                saturated += past
    assert r.stats.saturated == saturated
    assert r.stats.nan == 0 and r.stats.overflow == 0


@st.composite
def plan_cases(draw):
    """A small 2-D tensor (up to 4 x 16: one element is a large fraction of
    it) of a dtype the plan casts from, its amax over float32's whole range
    (an amax whose float32 scale rounds up by an ulp among them), a float8
    recipe and a role."""
    src = draw(st.sampled_from([F32, BF16, F16]), label="src")
    rows, cols = draw(st.integers(1, 4), label="rows"), draw(st.integers(1, 16), label="cols")
    amax = draw(st.one_of(magnitudes(src), st.floats(0.1, 1000)), label="amax")
    values = [f * amax for f in draw(st.lists(fractions_of_amax(), min_size=rows * cols,
                                              max_size=rows * cols), label="fractions")]
    values[draw(st.integers(0, rows * cols - 1), label="amax at")] = amax
    x = from_bits(to_bits(values, src), src).reshape(rows, cols)
    recipe = draw(st.sampled_from(["tensorwise", "rowwise"]), label="recipe")
    return Case(x, "contiguous", recipe=recipe, role=draw(st.sampled_from(["input", "grad_output"])))


def plan_saturated(x, dtype, dim, power_of_two):
    """The elements torchao's scaled float8 cast clamps that rounding would
    have taken past the format's largest: the scale as torchao computes it
    (float64 max / amax, floored at 1e-12, in float32; a power of two below
    it), x * scale in float32 (numpy), rounded by numpy_ref."""
    x32 = x.float()
    mag = torch.where(torch.isfinite(x32), x32.abs(), torch.zeros_like(x32))
    amax = mag.amax() if dim is None else mag.amax(dim=dim, keepdim=True)
    scale = (float(torch.finfo(dtype).max) / amax.double().clamp(min=1e-12)).float()
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (x32.numpy() * scale.numpy()).astype(np.float64)
    finite = np.isfinite(x32.numpy())
    return int((finite & ~np.isfinite(round_to_format(np.abs(scaled), dtype))).sum())


@FUZZ
@given(plan_cases())
def test_plan_saturation_is_the_casts(case):
    """precision_plan's float8 measure counts saturated what the cast
    saturates (plan_saturated's oracle), and amax scaling saturates nothing
    of a finite tensor. Issue 40 item 3: it counted |x * s| > max in
    float32, so an amax whose scale rounded up by an ulp (448.00003) was
    "saturated", 1 of 64 elements of a 4 x 16 input."""
    x, recipe = case.x, case.recipe
    dtype = {"input": E4, "grad_output": E5 if recipe == "tensorwise" else E4}[case.role]
    m = recipe_measure(x, recipe, case.role)
    dims = (None,) if recipe == "tensorwise" else (-1, 0)
    want = sum(plan_saturated(x, dtype, d, recipe == "rowwise") for d in dims)
    assert m.saturated == want, ("saturated", m.saturated, "cast", want)
    assert want == 0, ("amax scaling saturated", want)
