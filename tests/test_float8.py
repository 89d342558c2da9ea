"""Casts to float8_e4m3fn and float8_e5m2, and between float16 and bfloat16:
every pair rounded once (ties to even) against ml_dtypes, exhaustively where
the input space allows, the statistics against numpy, saturation, and what
torch's own x.to(float8) does."""
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import torchcast
from torchcast.stats import CastStats

from numpy_ref import FORMATS, LARGEST, round_to_format, stats_of_values, stats_reference, to_numpy64
from values import every_value

OP = torch.ops.torchcast.cast_with_stats
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
NP = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2,
      torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}
BITS = {1: torch.uint8, 2: torch.int16}


def to_numpy(t):
    """t's values as ml_dtypes/numpy values of its own dtype (bit for bit)."""
    if t.dtype in (torch.float32, torch.float64):
        return t.numpy()
    return t.view(BITS[t.itemsize]).numpy().view(NP[t.dtype])


def ml_round(values, dtype, saturate):
    """ml_dtypes' rounding of numpy values to dtype as float64, clamped to
    +-largest where it overflowed (to inf or NaN from a non-NaN value) when
    saturating."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = values.astype(NP[dtype]).astype(np.float64)
    if saturate:
        wide = values.astype(np.float64)
        beyond = ~np.isnan(wide) & ~np.isfinite(y)
        y = np.where(beyond, np.copysign(LARGEST[dtype], wide), y)
    return y


def ml_cast(x, dtype, saturate):
    """ml_round of tensor x's values."""
    return ml_round(to_numpy(x), dtype, saturate)


def assert_same_values(y, expected):
    got = y.double().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    ok = np.isnan(expected) | (got == expected) & (np.signbit(got) == np.signbit(expected))
    assert ok.all(), (np.nonzero(~ok)[0][:5], got[~ok][:5], expected[~ok][:5])


def assert_stats_match_numpy(s, x, dtype, saturate):
    ref = stats_reference(x, dtype, saturate)
    for name in ("numel", "nan", "inf", "inexact", "overflow", "saturated", "underflow",
                 "subnormal", "max_abs_err", "max_rel_err", "amax"):
        assert getattr(s, name) == ref[name], (name, getattr(s, name), ref[name])
    for name in ("sum_abs_err", "sum_sq_err", "sum_sq"):  # float64 sums on the CPU
        assert getattr(s, name) == pytest.approx(ref[name], rel=1e-6, abs=0), name


PAIRS_16 = [(src, dst) for src in (torch.float16, torch.bfloat16)
            for dst in FLOAT8 + ({torch.float16: torch.bfloat16}.get(src, torch.float16),)]


@pytest.mark.parametrize("saturate", [None, False, True])
@pytest.mark.parametrize("src,dst", PAIRS_16, ids=lambda d: str(d)[6:])
def test_every_16bit_input_rounds_once(src, dst, saturate):
    """All 2^16 float16/bfloat16 inputs against ml_dtypes, and the stats of
    the whole set against numpy."""
    x = every_value(src)
    y, stats = OP(x, dst, saturate=saturate)
    sat = dst == torch.float8_e4m3fn if saturate is None else saturate
    assert_same_values(y, ml_cast(x, dst, sat))
    assert_stats_match_numpy(CastStats.from_tensor(stats), x, dst, sat)
    yr, sr = torchcast._reference.cast.cast_with_stats(x, dst, saturate=saturate)
    assert torch.equal(y.view(BITS[y.itemsize]), yr.view(BITS[y.itemsize]))
    assert torch.equal(stats, sr)


@pytest.mark.parametrize("src,dst", PAIRS_16, ids=lambda d: str(d)[6:])
def test_default_is_bitwise_what_torch_does(src, dst):
    """saturate=None gives x.to(dtype)'s bits, NaN signs included, for every
    16-bit input (float16 <-> bfloat16 NaNs excepted: torch's bfloat16 NaN
    is 0x7fc0 here, as numerics.h writes it, so they agree too)."""
    x = every_value(src)
    y, _ = OP(x, dst)
    bits = BITS[y.itemsize]
    assert torch.equal(y.view(bits), x.to(dst).view(bits))


@pytest.mark.parametrize("src", [torch.float32, torch.float64])
@pytest.mark.parametrize("dst", FLOAT8, ids=str)
@pytest.mark.parametrize("saturate", [False, True])
def test_float8_values_midpoints_and_neighbours(src, dst, saturate):
    """Every float8 value, every midpoint between neighbours (the ties), and
    the adjacent src values on both sides of each, against ml_dtypes; the
    stats against numpy."""
    v = every_value(dst).double().numpy()
    v = np.unique(v[np.isfinite(v) & (v >= 0)])
    top = LARGEST[dst] + (LARGEST[dst] - v[-2]) / 2  # the tie above the largest value
    mids = np.concatenate([(v[1:] + v[:-1]) / 2, [top, 2 * top]])
    np_src = np.float32 if src == torch.float32 else np.float64
    pts = np.concatenate([v, mids]).astype(np_src)
    pts = np.concatenate([pts, np.nextafter(pts, np_src(np.inf)), np.nextafter(pts, np_src(0))])
    pts = np.concatenate([pts, -pts, [np.inf, -np.inf, np.nan]]).astype(np_src)
    x = torch.from_numpy(pts)
    y, stats = OP(x, dst, saturate=saturate)
    assert_same_values(y, ml_cast(x, dst, saturate))
    assert_stats_match_numpy(CastStats.from_tensor(stats), x, dst, saturate)


@pytest.mark.parametrize("src", [torch.float32, torch.float64])
@pytest.mark.parametrize("dst", FLOAT8, ids=str)
def test_wide_random_values(src, dst):
    g = torch.Generator().manual_seed(0)
    n = 1 << 18
    x = torch.randn(n, dtype=torch.float64, generator=g) * torch.exp2(
        torch.randint(-40, 40, (n,), generator=g).double())
    x = x.to(src)
    for sat in (False, True):
        y, stats = OP(x, dst, saturate=sat)
        assert_same_values(y, ml_cast(x, dst, sat))
        assert_stats_match_numpy(CastStats.from_tensor(stats), x, dst, sat)


def test_numpy_reference_agrees_with_ml_dtypes():
    """The numpy rounding the stats are checked against is itself right."""
    for dst in FLOAT8 + (torch.float16, torch.bfloat16):
        x = every_value(torch.float16 if dst != torch.float16 else torch.bfloat16)
        xs = to_numpy(x).astype(np.float64)
        ours = round_to_format(xs, dst)
        with np.errstate(over="ignore", invalid="ignore"):
            ml = to_numpy(x).astype(NP[dst]).astype(np.float64)
        assert np.array_equal(ours, ml, equal_nan=True)


# --- what torch does ------------------------------------------------------

def test_torch_saturates_e4m3fn_and_turns_inf_into_448():
    """torch's e4m3fn cast saturates: inf, and every value past 464 (the
    tie between 448 and the NaN code), become 448, where ml_dtypes and the
    format (no inf) give NaN. e5m2 keeps inf."""
    x = torch.tensor([math.inf, -math.inf, 464.0, 464.5, 480.0, 1e6])
    t = x.to(torch.float8_e4m3fn).float()
    assert t.tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, 448.0]
    with np.errstate(invalid="ignore", over="ignore"):
        ml = x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert ml[2] == 448 and np.isnan(ml[[0, 1, 3, 4, 5]]).all()
    y, stats = OP(x, torch.float8_e4m3fn)
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    s = CastStats.from_tensor(stats)
    assert (s.inf, s.saturated, s.overflow, s.inexact) == (2, 5, 0, 4)
    assert torch.isinf(x.to(torch.float8_e5m2).float()[:2]).all()


def test_torch_rounds_float64_to_float8_twice():
    """torch converts float64 to float8 through float32, rounding twice: a
    value just above a float8 midpoint (by less than half a float32 ulp)
    lands on the midpoint, which then rounds to even. cast_with_stats rounds
    once, as ml_dtypes does. Random data rarely hits this: 2^18 wide-range
    values find no case."""
    for dst, v in ((torch.float8_e4m3fn, 1.0625), (torch.float8_e5m2, 1.125)):
        x = torch.tensor([v + 2.0 ** -30, -(v + 2.0 ** -30)], dtype=torch.float64)
        once = x.numpy().astype(NP[dst]).astype(np.float64)
        assert x.to(dst).double().abs().tolist() == [1.0, 1.0] != np.abs(once).tolist()
        y, _ = OP(x, dst)
        assert y.double().numpy().tolist() == once.tolist()
        g = torch.Generator().manual_seed(1)
        r = torch.randn(1 << 18, dtype=torch.float64, generator=g) * torch.exp2(
            torch.randint(-12, 12, (1 << 18,), generator=g).double())
        assert torch.equal(OP(r, dst)[0].view(torch.uint8), r.to(dst).view(torch.uint8))


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", FLOAT8, ids=str)
def test_torch_single_rounding_sources_agree_with_ml_dtypes(src, dst):
    """From float32, bfloat16 and float16 torch rounds once, like ml_dtypes,
    except for e4m3fn's saturation."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1 << 20, generator=g) * torch.exp2(
        torch.randint(-20, 20, (1 << 20,), generator=g).float())).to(src)
    assert_same_values(x.to(dst), ml_cast(x, dst, saturate=dst == torch.float8_e4m3fn))


# --- saturate, errors, autograd, compile ----------------------------------

def test_saturate_clamps_and_counts():
    x = torch.tensor([1e5, -1e5, 60000.0, math.inf, -math.inf, math.nan, 1.0])
    y, stats = OP(x, torch.float8_e5m2, saturate=True)
    assert y.float().tolist()[:5] == [57344.0, -57344.0, 57344.0, 57344.0, -57344.0]
    s = CastStats.from_tensor(stats)
    assert (s.saturated, s.overflow, s.inf, s.nan) == (4, 0, 2, 1)  # 60000 rounds to 57344
    assert s.max_abs_err == 1e5 - 57344 and s.amax == 1e5
    y, stats = OP(x, torch.float8_e4m3fn, saturate=False)
    assert torch.isnan(y.float()[:5]).all()
    s = CastStats.from_tensor(stats)
    assert (s.saturated, s.overflow, s.inf) == (0, 3, 2)


def test_every_element_overflowed_reads_inf_not_zero():
    x = torch.tensor([1e6, -1e6, math.nan, math.inf])
    s = CastStats.from_tensor(OP(x, torch.float8_e5m2)[1])
    assert s.overflow == 2 and s.max_abs_err == math.inf and s.max_rel_err == math.inf
    assert "all overflowed" in str(s)
    s = CastStats.from_tensor(OP(torch.tensor([1e6, 1.0]), torch.float8_e5m2)[1])
    assert s.max_abs_err == 0 and "1 overflowed" in str(s)


def test_saturate_argument_checked():
    x = torch.ones(3)
    with pytest.raises(TypeError, match="saturate must be a bool"):
        torchcast.cast_with_stats(x, torch.float8_e4m3fn, saturate=1)
    with pytest.raises(TypeError, match="saturate applies to floating targets"):
        torchcast.safe_to(x, torch.int32, saturate=True)


def test_safe_to_flags_inf_saturated_to_448():
    x = torch.tensor([1.0, math.inf])
    with pytest.warns(torchcast.PrecisionWarning, match=r"1 saturated to ±448 \(1 of them ±inf\)"):
        y = torchcast.safe_to(x, torch.float8_e4m3fn, policy="warn")
    assert y.float().tolist() == [1.0, 448.0]


@pytest.mark.parametrize("dst", FLOAT8, ids=str)
def test_float8_gradient_is_identity(dst):
    """d y / d x is the identity (saturated elements too, as for x.to), in
    x's dtype."""
    x = torch.tensor([0.3, -2.0, 1e6], dtype=torch.float64, requires_grad=True)
    y, _ = OP(x, dst)
    (y.double() * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.tolist() == [1.0, 2.0, 3.0]


def test_float8_out_compiles():
    x = torch.randn(33, 7, dtype=torch.float64) * 1e3

    def f(x, out):
        return torch.ops.torchcast.cast_with_stats.out(x, torch.float8_e4m3fn, out=out)

    eager = torch.empty(33, 7, dtype=torch.float8_e4m3fn)
    compiled = torch.empty(33, 7, dtype=torch.float8_e4m3fn)
    s_eager = f(x, eager)
    s_compiled = torch.compile(f, fullgraph=True, dynamic=True)(x, compiled)
    assert torch.equal(s_eager, s_compiled)
    assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8))


def test_tracker_measures_float8_and_flags_inf_to_448():
    x = torch.tensor([1.0, 500.0, math.inf, 2.0 ** -12])
    with torchcast.track(all_casts=True) as report:
        x.to(torch.float8_e4m3fn)
        x.to(torch.float8_e5m2)
        x.to(torch.float8_e5m2).to(torch.bfloat16)
    rows = {(r.src_dtype, r.dtype): r for r in report.records}
    e4 = rows[(torch.float32, torch.float8_e4m3fn)].stats
    assert (e4.saturated, e4.inf, e4.underflow) == (2, 1, 1)
    e5 = rows[(torch.float32, torch.float8_e5m2)].stats
    assert (e5.saturated, e5.inf, e5.overflow) == (0, 1, 0) and e5.inexact == 1
    widen = rows[(torch.float8_e5m2, torch.bfloat16)].stats
    assert widen.inexact == 0 and widen.inf == 1
    assert "2 saturated (1 of them ±inf)" in rows[(torch.float32, torch.float8_e4m3fn)].violations()
    assert "saturated (1 of them ±inf)" in report.table()


# --- scaled casts -----------------------------------------------------------

def exact_round(q, dtype, saturate):
    """The correct rounding (ties to even) of the exact rational q to dtype,
    from Fraction arithmetic alone: an independent reference for scaled
    casts of float64 x, whose products float64 cannot hold."""
    mant, emin, _ = FORMATS[dtype]
    if q == 0:
        return 0.0
    a = abs(q)
    e = math.frexp(float(a))[1] - 1  # float(a) may round up to 2^(e+1): fixed below
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - mant)
    n, r = divmod(a / quantum, 1)
    n = int(n) + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and int(n) % 2) else 0)
    v = float(n * quantum)
    if v > LARGEST[dtype]:
        v = LARGEST[dtype] if saturate else (math.nan if dtype == torch.float8_e4m3fn else math.inf)
    return math.copysign(v, q)


@pytest.mark.parametrize("dst", FLOAT8 + (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("scale", [3.7, 0.001, 1 / 3, 2.0 ** -7, 1e10])
def test_scaled_float64_rounds_the_exact_product_once(dst, scale):
    """float64 x * a float32 scale, rounded once: against Fraction arithmetic
    on values whose float64 product lands on or next to a rounding midpoint
    (where rounding the product to float64 first would be wrong)."""
    from fractions import Fraction
    s = torch.tensor(scale, dtype=torch.float32)
    sf = Fraction(s.item())
    mant, emin, _ = FORMATS[dst]
    g = np.random.default_rng(7)
    grid = every_value(torch.float8_e5m2).double().numpy()  # a spread of magnitudes
    grid = grid[np.isfinite(grid) & (grid > 0)]
    mids = []
    for v in g.choice(grid, 64) * 2.0 ** g.integers(-4, 5, 64):
        e = math.frexp(v)[1] - 1
        mid = v + 2.0 ** (max(e, emin) - mant - 1)  # a midpoint of dst at v's binade
        x = float(Fraction(mid) / sf)  # x * scale within a float64 rounding of the midpoint
        mids += [x, np.nextafter(x, math.inf), np.nextafter(x, -math.inf)]
    x = torch.tensor(mids + [-m for m in mids], dtype=torch.float64)
    for saturate in (False, True):
        y, _ = OP(x, dst, scale=s, saturate=saturate)
        expected = np.array([exact_round(Fraction(v) * sf, dst, saturate) for v in x.tolist()])
        assert_same_values(y, expected)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", FLOAT8, ids=str)
def test_scaled_narrow_sources_match_ml_dtypes_on_the_exact_product(src, dst):
    """float32 and 16-bit x times a float32 scale is exact in float64, where
    ml_dtypes rounds it once: every 16-bit value, or random float32 ones.
    448 / 496 (amax_scale's for a bfloat16 amax of 496) puts hundreds of
    bfloat16 products' nearest float32 exactly halfway between two float8
    values while the exact product is not."""
    if src == torch.float32:
        x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3)) * 50
    else:
        x = every_value(src)
    for scale in (0.37, 2.0 ** -5, 11.0, 448 / 496):
        s = torch.tensor(scale, dtype=torch.float32)
        exact = (to_numpy(x).astype(np.float64) * np.float64(s.item()))
        for sat in (False, True):
            y, _ = OP(x, dst, scale=s, saturate=sat)
            assert_same_values(y, ml_round(exact, dst, sat))


@pytest.mark.parametrize("dst", FLOAT8, ids=str)
def test_scaled_products_next_to_halfway_points(dst):
    """float32 x = m / scale (rounded) for every halfway point m between
    float8 values: the float32 nearest to x * scale is often m itself while
    the exact product is not, and rounding that float32 to nearest even goes
    the wrong way for about half of those. Against ml_dtypes on the exact
    product, over 40 scales."""
    values = np.unique(np.abs(to_numpy(every_value(dst)).astype(np.float64)))
    values = values[np.isfinite(values)]
    mids = (values[1:] + values[:-1]) / 2
    mids = np.concatenate([mids, -mids])
    tricky = 0
    for scale in np.random.default_rng(4).uniform(0.1, 10, 40).astype(np.float32):
        x = torch.from_numpy((mids / np.float64(scale)).astype(np.float32))
        exact = x.double().numpy() * np.float64(scale)
        nearest = (x * torch.tensor(scale)).double().numpy()
        tricky += int(((nearest == mids) & (exact != mids)).sum())
        for sat in (False, True):
            y, _ = OP(x, dst, scale=torch.tensor(scale), saturate=sat)
            assert_same_values(y, ml_round(exact, dst, sat))
    assert tricky > 1000


@pytest.mark.parametrize("src", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dst", FLOAT8, ids=str)
def test_scaled_stats_are_exact_for_power_of_two_scales(src, dst):
    """With a power-of-two scale, x * scale and y / scale are exact: the
    stats of the scaled cast equal numpy's of casting x * scale, measured
    against x (errors divided by the scale)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(50_000, dtype=torch.float64, generator=g) * torch.exp2(
        torch.randint(-12, 12, (50_000,), generator=g).double())).to(src)
    x[::997] = math.inf
    x[::1009] = math.nan
    for k in (-3, 0, 6):
        s = torch.tensor(2.0 ** k)
        for sat in (False, True):
            _, stats = OP(x, dst, scale=s, saturate=sat)
            got = CastStats.from_tensor(stats)
            ref = stats_reference((x.double() * 2.0 ** k), dst, sat)
            xs = to_numpy64(x)
            ys = ref["y"] / 2.0 ** k  # y / scale: exact
            want = stats_of_values(xs, ys, src, 0.0, ref["saturated"])
            for name in ("numel", "nan", "inf", "inexact", "overflow", "saturated", "underflow",
                         "max_abs_err", "max_rel_err", "amax"):
                assert getattr(got, name) == want[name], (k, sat, name)
            assert (got.subnormal, got.underflow) == (ref["subnormal"], ref["underflow"])
            for name in ("sum_abs_err", "sum_sq_err", "sum_sq"):
                assert getattr(got, name) == pytest.approx(want[name], rel=1e-6, abs=1e-300)


def test_scaled_cast_gradient_is_scale_times_incoming():
    x = torch.tensor([0.3, -2.0, 1e6], dtype=torch.float64, requires_grad=True)
    s = torch.tensor(0.25)
    y, _ = OP(x, torch.float8_e4m3fn, scale=s)
    (y.double() * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.tolist() == [0.25, 0.5, 0.75]
    xh = x.detach().half().requires_grad_()
    y, _ = torchcast.cast_with_stats(xh, torch.float8_e5m2, scale=s)
    y.float().sum().backward()
    assert xh.grad.dtype == torch.float16 and xh.grad.tolist() == [0.25] * 3


def test_scaled_cast_opcheck_and_compile():
    x = torch.randn(33, 7) * 100
    s = torch.tensor(1.5)
    torch.library.opcheck(OP.default, (x, torch.float16, s))
    torch.library.opcheck(OP.default, (x, torch.float8_e4m3fn, s),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def f(x, s):
        return torch.ops.torchcast.cast_with_stats(x, torch.float8_e4m3fn, s)

    y1, s1 = f(x, s)
    y2, s2 = torch.compile(f, fullgraph=True, dynamic=True)(x, s)
    assert torch.equal(s1, s2) and torch.equal(y1.view(torch.uint8), y2.view(torch.uint8))


@pytest.mark.parametrize("bad, match", [
    (torch.tensor(2.0, dtype=torch.float64), "one-element float32"),
    (torch.ones(2), "one-element float32"),
    (torch.tensor(2.0, device="meta"), "scale is on meta but x is on cpu"),
])
def test_bad_scales_named_with_the_fix(bad, match):
    x = torch.ones(4)
    for cast in (OP, torchcast._reference.cast.cast_with_stats):
        with pytest.raises(RuntimeError, match=match):
            cast(x, torch.float8_e4m3fn, scale=bad)
    with pytest.raises(RuntimeError, match="scale applies to lossy casts"):
        OP(x, torch.float64, scale=torch.tensor(2.0))
    out = torch.full((4,), 7.0, dtype=torch.float16)
    with pytest.raises(RuntimeError):
        OP.out(x, torch.float16, bad, out=out)
    assert (out == 7).all()  # nothing written


def test_safe_to_amax_scaling():
    """scale="amax" maps x's largest finite magnitude onto 448 (computed on
    the device: no host read), "amax_pow2" onto the power of two below; the
    scale comes back from last_scale(), and y / scale reads x back."""
    x = torch.randn(1000, dtype=torch.float32) * 3
    x[5] = math.inf
    amax = x[torch.isfinite(x)].abs().max()
    y = torchcast.safe_to(x, torch.float8_e4m3fn, scale="amax", policy="ignore")
    s = torchcast.last_scale()
    assert s.dtype == torch.float32 and s.shape == ()
    # The largest float32 that keeps amax * s within 448 (docs/scaling.md).
    up = torch.nextafter(s, torch.tensor(math.inf))
    assert Fraction(amax.item()) * Fraction(s.item()) <= 448 < Fraction(amax.item()) * Fraction(up.item())
    assert y.float()[torch.isfinite(x)].abs().max().item() == 448.0
    assert torchcast.last_stats().amax == amax.item() and torchcast.last_stats().saturated == 1
    y2 = torchcast.safe_to(x, torch.float8_e4m3fn, scale="amax_pow2", policy="ignore")
    s2 = torchcast.last_scale()
    assert math.log2(s2.item()).is_integer() and s2.item() <= s.item() < 2 * s2.item()
    # torchao's composite recipe (amax, scale, multiply, saturating cast) gives the same bits
    # where the product is exact: a power-of-two scale.
    assert torch.equal(y2.view(torch.uint8), (x * s2).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(torchcast.scaling.amax_scale(x, torch.float8_e4m3fn, power_of_two=True), s2)
    # A zero amax gets the largest scale, finite.
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        tiny = torchcast.scaling.amax_scale(torch.zeros(3), dtype)
        assert tiny.item() == torch.finfo(torch.float32).max
    torchcast.safe_to(x, torch.float16, policy="ignore")
    assert torchcast.last_scale() is None
    compiled = torch.compile(lambda t: torchcast.safe_to(t, torch.float8_e4m3fn, scale="amax"),
                             fullgraph=True)
    assert torch.equal(compiled(x).view(torch.uint8), y.view(torch.uint8))
    with pytest.raises(ValueError, match="'amax', 'amax_pow2'"):
        torchcast.safe_to(x, torch.float8_e4m3fn, scale="max")
    with pytest.raises(TypeError, match="scale applies to floating targets"):
        torchcast.safe_to(x, torch.int8, scale="amax")


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dst", FLOAT8 + (torch.float16, torch.bfloat16), ids=str)
def test_headroom_predicts_the_scaled_cast(src, dst):
    """report.headroom's prediction from a histogram (tensor_health) and the
    scaled cast itself count the same overflows, underflows and subnormals:
    both follow the format's rounding (ties to even, e4m3fn's 464 -> 448)."""
    if src == dst:
        return
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(40_000, dtype=torch.float64, generator=g) * torch.exp2(
        torch.randint(-30, 30, (40_000,), generator=g).double())).to(src)
    health = torchcast.tensor_health(x)
    for k in (-4, 0, 5):
        predicted = torchcast.headroom.headroom(health, dst, 2.0 ** k)
        s = CastStats.from_tensor(OP(x, dst, torch.tensor(2.0 ** k), saturate=False)[1])
        assert (predicted.overflow, predicted.underflow, predicted.subnormal) == \
            (s.overflow, s.underflow, s.subnormal), k
