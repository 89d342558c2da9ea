"""headroom: the outcome of a scaled cast read from a health histogram,
against actually casting (ml_dtypes for bfloat16 and float8, numpy for
float16: both round float64 once, to nearest even), on every value of each
format, every midpoint between neighbours (the ties), their float64
neighbours, and random wide-range data, at several power-of-two scales."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import torchcast
from torchcast.headroom import FORMATS, headroom, power_of_two_scale

NUMPY = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
         torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


def cast_outcome(x64, fmt, scale):
    """(overflow, underflow, subnormal) of casting x64 * scale to fmt, counted on
    the cast's result."""
    scaled = x64 * scale  # exact: a power of two, inside float64's range here
    with np.errstate(over="ignore", invalid="ignore"):
        y = scaled.astype(NUMPY[fmt]).astype(np.float64)
    finite = np.isfinite(scaled)
    smallest_normal = float(ml_dtypes.finfo(NUMPY[fmt]).smallest_normal)
    overflow = int((finite & ~np.isfinite(y)).sum())
    underflow = int((finite & (scaled != 0) & (y == 0)).sum())
    subnormal = int((np.isfinite(y) & (y != 0) & (np.abs(y) < smallest_normal)).sum())
    return overflow, underflow, subnormal


def boundary_values(fmt):
    """Every finite value of fmt, the midpoints between neighbours (and between
    0 and the smallest subnormal, and past the largest value), and the float64
    neighbours of each midpoint, both signs."""
    ml = NUMPY[fmt]
    bits = np.arange(2 ** (8 * np.dtype(ml).itemsize), dtype=np.uint64)
    values = bits.astype({1: np.uint8, 2: np.uint16}[np.dtype(ml).itemsize]).view(ml)
    with np.errstate(invalid="ignore"):  # NaN patterns
        v = np.unique(np.abs(values.astype(np.float64)))
    v = v[np.isfinite(v)]
    top = v[-1] + (v[-1] - v[-2])  # the next value past the largest, were there one
    v = np.concatenate([v, [top, 2 * top]])
    mid = (v[:-1] + v[1:]) / 2
    near = np.concatenate([np.nextafter(mid, 0), np.nextafter(mid, np.inf)])
    out = np.concatenate([v, mid, near])
    return np.concatenate([out, -out])


def health_of(x64, src):
    return torchcast.tensor_health(torch.from_numpy(x64).to(src))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [0, -3, 4, 17])
def test_every_boundary_at_power_of_two_scales(fmt, k):
    x = boundary_values(fmt) * 2.0 ** -k  # so that the scaled values sit on the boundaries
    got = headroom(health_of(x, torch.float64), fmt, scale=2.0 ** k)
    assert (got.overflow, got.underflow, got.subnormal) == cast_outcome(x, fmt, 2.0 ** k)
    assert got.numel == x.size and got.scale == 2.0 ** k
    assert got.overflow > 0 and got.underflow > 0 and got.subnormal > 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_narrower_sources(fmt, src):
    x = boundary_values(fmt)
    x = x[torch.from_numpy(x).to(src).double().numpy() == x]  # the values src holds exactly
    for k in (0, -2, 3):
        x_k = (torch.from_numpy(x * 2.0 ** -k).to(src)).double().numpy()
        got = headroom(health_of(x_k, src), fmt, scale=2.0 ** k)
        assert (got.overflow, got.underflow, got.subnormal) == cast_outcome(x_k, fmt, 2.0 ** k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_wide_range_data(fmt):
    g = np.random.default_rng(0)
    x = g.standard_normal(300_000) * np.exp2(g.integers(-40, 40, 300_000).astype(np.float64))
    x = x.astype(np.float32).astype(np.float64)
    for k in (-6, 0, 9):
        got = headroom(health_of(x, torch.float32), fmt, scale=2.0 ** k)
        assert (got.overflow, got.underflow, got.subnormal) == cast_outcome(x, fmt, 2.0 ** k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_amax_scale_is_the_largest_power_of_two_that_fits(fmt):
    limit = torch.finfo(fmt).max
    for amax in (1.0, 3.0, 448.0, 449.0, 1e-6, 7e4, 123.456, float(torch.finfo(fmt).max)):
        s = power_of_two_scale(amax, fmt)
        assert math.frexp(s)[0] == 0.5
        assert amax * s <= limit and (s == 2.0 ** 127 or limit < amax * s * 2)
    x = np.array([0.0, 3.0, -2.5e3, 1e-3, 7.25])
    got = headroom(health_of(x, torch.float32), fmt, scale="amax")
    assert got.overflow == 0 and got.scale == power_of_two_scale(2.5e3, fmt)
    assert (got.overflow, got.underflow, got.subnormal) == cast_outcome(x, fmt, got.scale)


def test_arguments_are_checked():
    h = torchcast.tensor_health(torch.ones(3))
    with pytest.raises(ValueError, match="power of two"):
        headroom(h, torch.float16, scale=3.0)
    with pytest.raises(ValueError, match="must be one of"):
        headroom(h, torch.float32)
    with pytest.raises(ValueError, match="'amax'"):
        headroom(h, torch.float16, scale="max")
