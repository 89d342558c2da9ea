"""The scale rules of torchcast/scaling.py (docs/scaling.md), checked exactly
with fractions.Fraction: a scale chosen from an amax makes that amax fit, for
every source dtype and narrower target, over every binade of the source and
the values next to each format's largest; and the scales a user passes are
refused where they would lose every element silently."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import torchcast
from torchcast import _ops
from torchcast.headroom import headroom, power_of_two_scale
from torchcast.scaling import scale_for_amax

from torchcast._reference import cast as cast_reference
from torchcast._reference.cast import LOSSY_PAIRS

from cast_common import bits
from modes import OpsSeen
from numpy_ref import round_to_format

F32_MAX = Fraction(float(torch.finfo(torch.float32).max))
F32_TINY = Fraction(2) ** -149
# A scale's dtype: its largest value and its powers of two's exponents.
SCALE_RANGE = {torch.float32: (float(torch.finfo(torch.float32).max), -149, 127),
               torch.float64: (float(torch.finfo(torch.float64).max), -1074, 1023)}


def amax_values(src):
    """Every binade of src's finite range at its first, second and last
    values, and the neighbours of every narrower format's largest value
    scaled by powers of two within src's range, as float64."""
    info = torch.finfo(src)
    mant = info.eps  # one ulp of 1.0
    lo = int(math.log2(info.smallest_normal)) - int(-math.log2(mant))
    hi = math.frexp(info.max)[1] - 1
    e = np.arange(lo, hi + 1)
    values = [np.zeros(1), np.ldexp(1.0, e), np.ldexp(1.0 + mant, e), np.ldexp(2.0 - mant, e)]
    k = np.arange(lo - 8, hi + 1, 3)
    with np.errstate(over="ignore"):
        for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                  torch.float8_e5m2):
            t = np.ldexp(float(torch.finfo(d).max), k)
            values += [t, np.nextafter(t, np.inf), np.nextafter(t, 0)]
    v = torch.from_numpy(np.concatenate(values))
    v = v[torch.isfinite(v) & (v >= 0)].to(src)
    return torch.unique(v[torch.isfinite(v)].to(torch.float64))


def next_up(s, dtype):
    t = torch.tensor(s, dtype=dtype)
    return torch.nextafter(t, torch.tensor(math.inf, dtype=dtype)).item()


TARGETS = sorted({d for _, d in LOSSY_PAIRS}, key=str)


@pytest.mark.parametrize("src,dst", LOSSY_PAIRS, ids=str)
def test_amax_scales_are_the_largest_that_fit(src, dst):
    """docs/scaling.md's rule, with a = max(amax, m), m the scale dtype's
    smallest positive value: a float32 scale (float32 and narrower sources) is the
    largest float32 with a * s <= top, exactly; a float64 scale (float64
    sources) is top / a rounded to the nearest float64, one step down where
    a * s rounded to float64 exceeds top, so a * s <= top (1 + 2^-53); a
    power of two, the largest with a * s <= top, exactly. Both from the
    device path (scale_for_amax) and the CPU's host path (amax_scale), equal."""
    amax = amax_values(src)
    top = Fraction(float(torch.finfo(dst).max))
    scale_dtype = torchcast.scaling.scale_dtype_for(src)
    largest, e_min, e_max = SCALE_RANGE[scale_dtype]
    scales = scale_for_amax(amax, dst, scale_dtype=scale_dtype)
    pow2 = scale_for_amax(amax, dst, power_of_two=True, scale_dtype=scale_dtype)
    assert scales.dtype == pow2.dtype == scale_dtype
    for a, s, p in zip(amax.tolist(), scales.tolist(), pow2.tolist()):
        x = torch.tensor([a, -a / 3], dtype=torch.float64).to(src)
        assert torchcast.scaling.amax_scale(x, dst).item() == s, ("host path", a)
        assert torchcast.scaling.amax_scale(x, dst, power_of_two=True).item() == p, a
        a = max(Fraction(a), Fraction(2) ** e_min)
        s, p = Fraction(s), Fraction(p)
        assert math.frexp(float(p))[0] == 0.5, (a, p)
        if scale_dtype == torch.float32:
            assert a * s <= top, (float(a), float(s))
            assert s == F32_MAX or a * Fraction(next_up(float(s), scale_dtype)) > top, \
                (float(a), float(s))
        else:
            nearest = float(top / a) if top / a <= Fraction(largest) else largest
            stepped = float(a) * nearest > top  # the product rounded to float64
            assert float(s) == (math.nextafter(nearest, 0) if stepped else nearest), \
                (float(a), float(s))
            assert a * s <= top * (1 + Fraction(2) ** -53), (float(a), float(s))
        assert a * p <= top, (float(a), float(p))
        assert p == Fraction(2) ** e_max or a * 2 * p > top, (float(a), float(p))
        assert p >= Fraction(2) ** e_min


@pytest.mark.parametrize("recipe", ["amax", "amax_pow2"])
@pytest.mark.parametrize("src,dst", LOSSY_PAIRS, ids=str)
def test_a_scaled_cast_of_its_amax_is_finite(src, dst, recipe):
    top = float(torch.finfo(dst).max)
    amax = amax_values(src)
    for a in amax[::5].tolist() + amax[-3:].tolist():
        x = torch.tensor([a, -a, a / 3, 0.0, math.inf], dtype=torch.float64).to(src)
        y = torchcast.safe_to(x, dst, scale=recipe, policy="ignore")
        stats = torchcast.last_stats()
        assert torch.isfinite(y[:4].float()).all(), (a, y, torchcast.last_scale())
        assert stats.overflow == 0 and stats.inf == 1, (a, stats)


def test_the_float64_amax_that_overflowed_float32():
    x = torch.tensor([float.fromhex("0x1.7f22d330b13d2p+61"), 1.0], dtype=torch.float64)
    for recipe in ("amax", "amax_pow2"):
        y = torchcast.safe_to(x, torch.float32, scale=recipe, policy="raise")
        assert torch.isfinite(y).all()
        assert y[0].item() <= torch.finfo(torch.float32).max


def test_an_amax_no_float32_scale_can_fit_is_counted():
    """scale_for_amax with a float32 scale and a float64 amax past top *
    2^149 gives the smallest float32; a cast with it counts the overflow.
    (The amax recipes give a float64 x a float64 scale, which fits.)"""
    x = torch.tensor([1e300, 1.0], dtype=torch.float64)
    scale = scale_for_amax(torch.tensor(1e300, dtype=torch.float64), torch.float16)
    assert scale.dtype == torch.float32 and scale.item() == 2.0 ** -149
    y, stats = torchcast.cast_with_stats(x, torch.float16, scale=scale)
    assert torch.isinf(y[0]) and stats[4].item() == 1


@pytest.mark.parametrize("recipe", ["amax", "amax_pow2"])
@pytest.mark.parametrize("dst", [torch.float32, torch.float16, torch.bfloat16,
                                 torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("amax", [2.55e52, 1e300, 2.0 ** -180, 1e-13], ids=str)
def test_float64_amax_beyond_float32_scales(amax, dst, recipe):
    """Issue 40 item 2: a float64 x whose amax lies where no float32 scale
    reaches (2.55e52 to float16: a scale of about 2.6e-48; 2^-180: one
    above 2^128) overflowed (counted) or flushed to zeros. Its amax
    recipes now give a float64 scale: amax casts to within a rounding of
    the format's largest value, nothing overflows, and a value a third of
    amax survives."""
    x = torch.tensor([amax, -amax / 3, 0.0], dtype=torch.float64)
    y = torchcast.safe_to(x, dst, scale=recipe, policy="raise")
    s, stats = torchcast.last_scale(), torchcast.last_stats()
    top = float(torch.finfo(dst).max)
    assert s.dtype == torch.float64
    assert stats.overflow == stats.saturated == 0
    yv = y.double()
    assert top / 4 < yv[0].item() <= top, (yv, s)  # [top / 2, top] before y's rounding
    assert yv[1].item() < 0 and yv[2].item() == 0
    # y / s reads x back (relative error of dst's rounding)
    assert abs(Fraction(yv[0].item()) / Fraction(s.item()) / Fraction(amax) - 1) < Fraction(1, 4)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_the_cpus_amax_scale_is_one_tensor_made(src):
    """Issue 40 item 6: amax_scale took about ten small float64 ops on the
    CPU (35-42 µs for a 2^12 safe_to(scale="amax")). There the amax is on
    the host already: the rule runs on one Python float and makes one
    tensor (x with a NaN: the stats' amax read too), which a dispatch mode
    sees as such; the result is the device path's (scale_for_amax)."""
    x = (torch.randn(4096, dtype=torch.float64) * 3).to(src)
    with OpsSeen() as mode:
        s = torchcast.scaling.amax_scale(x, torch.float8_e4m3fn)
    seen = [str(op) for op in mode.seen]
    if _ops.WITH_EXTENSION:
        assert seen == ["aten.lift_fresh.default"]
    else:  # the amax read by torch ops (_python_ops.py), then the one tensor
        assert seen[-1] == "aten.lift_fresh.default" and seen.count(seen[-1]) == 1, seen
    amax = x.abs().amax().double()
    assert torch.equal(s, scale_for_amax(amax, torch.float8_e4m3fn,
                                         scale_dtype=torchcast.scaling.scale_dtype_for(src)))
    x[7] = math.nan
    with OpsSeen() as mode:
        s = torchcast.scaling.amax_scale(x, torch.float8_e4m3fn, power_of_two=True)
    assert str(mode.seen[-1]) == "aten.lift_fresh.default"
    if _ops.WITH_EXTENSION:
        assert len(mode.seen) <= 4
    assert torch.equal(s, scale_for_amax(amax, torch.float8_e4m3fn, power_of_two=True,
                                         scale_dtype=torchcast.scaling.scale_dtype_for(src)))


def test_amax_scaling_of_a_wrapper_subclass():
    """A traceable wrapper subclass (TwoTensor; DTensor alike) has no data of
    its own: its amax is read through its own dispatch, per inner tensor
    (the C++ read of x's bits crashed the process on it)."""
    a, b = torch.randn(8) * 3, torch.randn(8) * 1e-3
    y = torchcast.safe_to(TwoTensor(a, b), torch.float8_e4m3fn, scale="amax", policy="ignore")
    scale = torchcast.last_scale()
    assert isinstance(y, TwoTensor) and isinstance(scale, TwoTensor)
    assert torch.equal(scale.a, torchcast.scaling.amax_scale(a, torch.float8_e4m3fn))
    assert torch.equal(scale.b, torchcast.scaling.amax_scale(b, torch.float8_e4m3fn))
    assert torch.equal(bits(y.a), bits(torchcast.safe_to(a, torch.float8_e4m3fn, scale="amax")))


@pytest.mark.parametrize("impl", ["kernel", "out", "reference"])
@pytest.mark.parametrize("dst", [torch.float32, torch.float16, torch.bfloat16,
                                 torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_float64_scale_of_a_float64_x(dst, impl):
    """The op takes a float64 scale for a float64 x (outside float32's range
    here): y = x * scale rounded once (a power of two: the product exact in
    float64, rounded by numpy_ref), the stats y / scale against x, as the
    reference measures them; a float32 scale of a float64 x reads the same
    as its float64 copy."""
    def cast(x, scale):
        if impl == "reference":
            return cast_reference.cast_with_stats(x, dst, scale=scale)
        if impl == "out":
            out = torch.empty_like(x, dtype=dst)
            return out, torchcast.cast_with_stats(x, dst, scale=scale, out=out)[1]
        return torchcast.cast_with_stats(x, dst, scale=scale)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, generator=g, dtype=torch.float64) * 2.0 ** 600
    x[:4] = torch.tensor([0.0, -0.0, math.inf, math.nan])
    for scale in (2.0 ** -600, 3.0 * 2.0 ** -602):
        y, stats = cast(x, torch.tensor(scale, dtype=torch.float64))
        _, ref = cast_reference.cast_with_stats(x, dst, scale=torch.tensor(scale,
                                                                           dtype=torch.float64))
        assert torch.equal(stats[:11], ref[:11]), scale  # counts, maxima, amax
        assert torch.allclose(stats[11:], ref[11:], rtol=1e-12), scale
        if scale == 2.0 ** -600:
            want = round_to_format(x.numpy() * scale, dst, saturate=dst == torch.float8_e4m3fn)
            got = y.double().numpy()
            assert np.array_equal(got, want, equal_nan=True)
    x32s = torch.tensor(0.75)
    y32, s32 = cast(x * 2.0 ** -600, x32s)
    y64, s64 = cast(x * 2.0 ** -600, x32s.double())
    assert torch.equal(bits(y32), bits(y64)) and torch.equal(s32, s64)


@pytest.mark.parametrize("fmt", [torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                 torch.float8_e5m2])
def test_headroom_amax_is_the_cast_recipes_scale(fmt):
    g = np.random.default_rng(3)
    for amax_exp in (-1070, -300, -270, -40, 0, 10, 30, 300):
        x = torch.from_numpy(g.standard_normal(1000) * 2.0 ** amax_exp)
        h = torchcast.tensor_health(x)
        got = headroom(h, fmt, scale="amax")
        want = torchcast.scaling.amax_scale(x, fmt, power_of_two=True).item()
        assert got.scale == want == power_of_two_scale(h.amax, fmt, torch.float64)
        assert got.overflow == 0


def test_reports_of_tiny_float64_modules_are_written(tmp_path):
    model = torch.nn.Linear(4, 4).double()
    with torch.no_grad():
        model.weight.mul_(1e-280)
        model.bias.zero_()
    with torchcast.track(health=True) as report:
        model(torch.full((2, 4), 1e-20, dtype=torch.float64))
    table = report.headroom(torch.bfloat16, scale="amax")
    assert str(table)
    back = type(report).from_json(report.to_json())
    assert str(back.headroom(torch.bfloat16, scale="amax")) == str(table)
    report.to_html(str(tmp_path / "r.html"))


BAD_SCALES = [0.0, -0.0, -1.0, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("value", BAD_SCALES, ids=str)
def test_a_scale_that_is_not_positive_and_finite_is_refused(value):
    x = torch.ones(100)
    scale = torch.tensor(value)
    out = torch.full((100,), 7.0, dtype=torch.float16)
    with pytest.raises(ValueError, match="scale must be positive and finite.*amax_scale"):
        torchcast.cast_with_stats(x, torch.float16, scale=scale)
    with pytest.raises(ValueError, match="positive and finite"):
        torchcast.safe_to(x, torch.float16, scale=scale, policy="ignore")
    with pytest.raises(ValueError, match="positive and finite"):
        torchcast.cast_with_stats(x, torch.float16, scale=scale, out=out)
    assert (out == 7).all()  # nothing written


def test_a_lost_element_never_reads_as_a_zero_error():
    x = torch.linspace(1, 2, 100)
    torchcast.safe_to(x, torch.float16, scale=torch.tensor(2.0 ** -149), policy="ignore")
    stats = torchcast.last_stats()
    assert stats.underflow == 100 and stats.max_abs_err == 2.0 and stats.max_rel_err == 1.0


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_a_read_back_past_float32s_range_has_a_finite_error(impl):
    # y is finite, y / scale overflows float32 (x near float32's largest,
    # scale < 1): the error is |x - y / scale|, exactly, not inf.
    cast = torchcast.cast_with_stats if impl == "kernel" else cast_reference.cast_with_stats
    x = torch.tensor([float.fromhex("0x1.fffffcp+127"), 1.0])
    y, stats = cast(x, torch.bfloat16, scale=torch.tensor(0.5))
    s = torchcast.CastStats.from_values(stats.tolist(), torch.float32, torch.bfloat16)
    want = abs(Fraction(x[0].item()) - Fraction(y[0].float().item()) * 2)  # y / scale
    assert y[0].float().item() == 2.0 ** 127 and s.overflow == 0
    assert s.max_abs_err == float(want) and math.isfinite(s.sum_sq_err)
    # relative: that error over |x|, in float32 as the stats' other terms of a float32 x
    assert s.max_rel_err == (torch.tensor(float(want)) / x[0]).item()
