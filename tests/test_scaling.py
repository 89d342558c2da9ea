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

import torchcast
from torchcast.headroom import headroom, power_of_two_scale
from torchcast.scaling import scale_for_amax

from torchcast._reference.cast import LOSSY_PAIRS

F32_MAX = Fraction(float(torch.finfo(torch.float32).max))
F32_TINY = Fraction(2) ** -149
FLOOR = Fraction(1e-12)


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


def next_float32_up(s):
    t = torch.tensor(s, dtype=torch.float32)
    return torch.nextafter(t, torch.tensor(math.inf)).item()


TARGETS = sorted({d for _, d in LOSSY_PAIRS}, key=str)


@pytest.mark.parametrize("src,dst", LOSSY_PAIRS, ids=str)
def test_amax_scales_are_the_largest_that_fit(src, dst):
    amax = amax_values(src)
    top = Fraction(float(torch.finfo(dst).max))
    scales = scale_for_amax(amax, dst)
    pow2 = scale_for_amax(amax, dst, power_of_two=True)
    assert scales.dtype == pow2.dtype == torch.float32
    for a, s, p in zip(amax.tolist(), scales.tolist(), pow2.tolist()):
        a = max(Fraction(a), FLOOR)
        s, p = Fraction(s), Fraction(p)
        assert math.frexp(float(p))[0] == 0.5, (a, p)
        if a * F32_TINY > top:  # no float32 scale fits: the smallest, overflow counted
            assert s == p == F32_TINY, (a, s, p)
            continue
        assert a * s <= top, (float(a), float(s))
        assert s == F32_MAX or a * Fraction(next_float32_up(float(s))) > top, (float(a), float(s))
        assert a * p <= top, (float(a), float(p))
        assert p == Fraction(2) ** 127 or a * 2 * p > top, (float(a), float(p))


@pytest.mark.parametrize("recipe", ["amax", "amax_pow2"])
@pytest.mark.parametrize("src,dst", LOSSY_PAIRS, ids=str)
def test_a_scaled_cast_of_its_amax_is_finite(src, dst, recipe):
    top = float(torch.finfo(dst).max)
    amax = amax_values(src)
    fits = amax.clamp(min=1e-12) * 2.0 ** -149 <= top
    for a in amax[fits][::5].tolist() + amax[fits][-3:].tolist():
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
    x = torch.tensor([1e300, 1.0], dtype=torch.float64)
    y = torchcast.safe_to(x, torch.float16, scale="amax", policy="ignore")
    assert torchcast.last_scale().item() == 2.0 ** -149
    assert torch.isinf(y[0]) and torchcast.last_stats().overflow == 1


@pytest.mark.parametrize("fmt", [torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                 torch.float8_e5m2])
def test_headroom_amax_is_the_cast_recipes_scale(fmt):
    g = np.random.default_rng(3)
    for amax_exp in (-1070, -300, -270, -40, 0, 10, 30, 300):
        x = torch.from_numpy(g.standard_normal(1000) * 2.0 ** amax_exp)
        h = torchcast.tensor_health(x)
        got = headroom(h, fmt, scale="amax")
        want = torchcast.scaling.amax_scale(x, fmt, power_of_two=True).item()
        assert got.scale == want == power_of_two_scale(h.amax, fmt)
        assert got.overflow == 0 or h.amax * 2.0 ** -149 > float(torch.finfo(fmt).max)


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
    from torchcast._reference import cast as cast_reference
    cast = torchcast.cast_with_stats if impl == "kernel" else cast_reference.cast_with_stats
    x = torch.tensor([float.fromhex("0x1.fffffcp+127"), 1.0])
    y, stats = cast(x, torch.bfloat16, scale=torch.tensor(0.5))
    s = torchcast.CastStats.from_values(stats.tolist(), torch.float32, torch.bfloat16)
    want = abs(Fraction(x[0].item()) - Fraction(y[0].float().item()) * 2)  # y / scale
    assert y[0].float().item() == 2.0 ** 127 and s.overflow == 0
    assert s.max_abs_err == float(want) and math.isfinite(s.sum_sq_err)
    # relative: that error over |x|, in float32 as the stats' other terms of a float32 x
    assert s.max_rel_err == (torch.tensor(float(want)) / x[0]).item()
