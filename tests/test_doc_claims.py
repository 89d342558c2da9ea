"""The docs' sentences that state a numeric rule, quoted from the doc files
and checked against the code (issue 40 item 4), so that the two cannot drift
apart: a doc that changes its sentence stops matching its quote here, and
code that breaks the rule fails the check.

docs/scaling.md: the amax scales (a float32 scale exact, a float64 one
within half a float64 ulp of top, powers of two exact); docs/formats.md:
which sources give torchao's bits, and the NVFP4 float64 example;
docs/reduce.md: kahan_sum's error bound in terms of the condition number."""
import math
import os
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

import torchcast
from torchcast.formats import BLOCK_FORMATS

from reduce_common import chain_length, ulp

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def quoted(doc, text):
    """text, which the doc must hold word for word (whitespace and line
    breaks aside)."""
    with open(os.path.join(DOCS, doc), encoding="utf-8") as f:
        body = " ".join(f.read().split())
    assert " ".join(text.split()) in body, f"docs/{doc} no longer says: {text}"
    return text


# --- docs/scaling.md -------------------------------------------------------------------

SCALING_FLOAT32 = ("`safe_to(x, dtype, scale=\"amax\")`, `amax_scale(x, dtype)`, float32, float16, "
                   "bfloat16 and float8 x | the largest float32 `s` with `a * s <= top`, exactly")
SCALING_FLOAT64 = ("the same, float64 x | `top / a` rounded to the nearest float64 (at most "
                   "float64's largest), one step down where `a * s`, rounded to float64, exceeds "
                   "`top`; so `a * s <= top * (1 + 2^-53)`, which every narrower format rounds "
                   "to `top`")
SCALING_POW2 = ("the largest power of two `s` of the scale's dtype (up to 2^127 for float32, "
                "2^1023 for float64) with `a * s <= top`, exactly")
SCALING_FLOOR = "`m` the scale dtype's smallest positive value and `a = max(amax, m)`"

TARGETS = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def amaxes(src, seed):
    """A source's amax values: zero, its extremes and neighbours, and 300
    random ones over its whole exponent range, as float64."""
    info = torch.finfo(src)
    lo, hi = math.log2(info.smallest_normal * info.eps), math.log2(info.max)
    g = np.random.default_rng(seed)
    v = np.exp2(g.uniform(lo, hi, 300)) * g.uniform(1, 2, 300)
    v = np.concatenate([v, [0.0, info.max, info.smallest_normal, info.smallest_normal * info.eps,
                            1.0, 448.0, 57344.0, 65504.0]])
    t = torch.from_numpy(v).to(src).double()
    return [a for a in t.tolist() if math.isfinite(a)]


@pytest.mark.parametrize("src", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=str)
def test_scaling_md_amax_scales(src):
    quoted("scaling.md", SCALING_FLOOR)
    rule = quoted("scaling.md", SCALING_FLOAT64 if src == torch.float64 else SCALING_FLOAT32)
    quoted("scaling.md", SCALING_POW2)
    scale_dtype = torch.float64 if src == torch.float64 else torch.float32
    info = torch.finfo(scale_dtype)
    smallest, e_max = info.smallest_normal * info.eps, 1023 if src == torch.float64 else 127
    for dst in (d for d in TARGETS if torch.finfo(d).bits < torch.finfo(src).bits
                or (d != src and torch.finfo(d).bits == 16 == torch.finfo(src).bits)):
        top = Fraction(torch.finfo(dst).max)
        for amax in amaxes(src, seed=torch.finfo(dst).bits):
            x = torch.tensor([amax, -amax / 2], dtype=torch.float64).to(src)
            s = torchcast.scaling.amax_scale(x, dst)
            p = torchcast.scaling.amax_scale(x, dst, power_of_two=True)
            assert s.dtype == p.dtype == scale_dtype, rule
            a, sv, pv = max(Fraction(amax), Fraction(smallest)), Fraction(s.item()), Fraction(p.item())
            if src == torch.float64:
                nearest = float(top / a) if top / a <= Fraction(info.max) else info.max
                stepped = float(a) * nearest > top
                assert s.item() == (math.nextafter(nearest, 0) if stepped else nearest), rule
                assert a * sv <= top * (1 + Fraction(2) ** -53), rule
            else:
                up = torch.nextafter(s, torch.tensor(math.inf)).item()
                assert a * sv <= top and (s.item() == info.max or a * Fraction(up) > top), \
                    (rule, amax, dst)
            assert math.frexp(p.item())[0] == 0.5 and a * pv <= top, (SCALING_POW2, amax, dst)
            assert pv == Fraction(2) ** e_max or a * 2 * pv > top, (SCALING_POW2, amax, dst)


# --- docs/formats.md -------------------------------------------------------------------

FORMATS_SOURCES = ("float16 gives torchao's bits for `x.float()` (widening is exact). float64 "
                   "holding float32 values gives them in every MX mode")
FORMATS_NVFP4_64 = ("NVFP4 computes in float64 for float64 sources, so its block scale `(amax / "
                    "6) / t` and its elements `x * ((1 / t) / s)` can round one step away from "
                    "float32's: `x[0] = 6144.0009765625`, `x[16] = 524288.0625` (two blocks) give "
                    "the first block the scale 5.5 from float64, 5.0 from float32 and torchao")


def float32_corpus():
    """float32 rows of 64 at the edges (zeros, inf, NaN, subnormals, the
    formats' maxima and ties, tiny and huge binades), heavy tails and random
    bit patterns."""
    g = torch.Generator().manual_seed(11)
    edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 2.0 ** -149, 2.0 ** -126,
                          448.0, 464.0, 480.0, 57344.0, 61440.0, 6.0, 7.0, 3.0e38, 1e-38,
                          6144.0009765625, 524288.0625] * 4)[:64]
    heavy = torch.randn(64 * 40, generator=g) * torch.exp(6 * torch.randn(64 * 40, generator=g))
    tiny = torch.randn(64 * 8, generator=g) * 1e-38
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (64 * 40,), generator=g,
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([edges, heavy, tiny, bits]).reshape(-1, 64)


def same_cast(a, b):
    return (torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)))


def test_formats_md_sources():
    quoted("formats.md", FORMATS_SOURCES)
    x32 = float32_corpus()
    x16 = x32.to(torch.float16)
    for fmt, b in BLOCK_FORMATS.items():
        for mode in b.scale_modes:
            assert same_cast(torchcast.block_cast(x16, fmt, scale_mode=mode),
                             torchcast.block_cast(x16.float(), fmt, scale_mode=mode)), (fmt, mode)
            if not b.tensor_scale:  # every MX mode: float64 gives float32's bits
                assert same_cast(torchcast.block_cast(x32.double(), fmt, scale_mode=mode),
                                 torchcast.block_cast(x32, fmt, scale_mode=mode)), (fmt, mode)


def test_formats_md_nvfp4_float64_example():
    quoted("formats.md", FORMATS_NVFP4_64)
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, 0], x[0, 16] = 6144.0009765625, 524288.0625
    wide, narrow = torchcast.block_cast(x, "nvfp4"), torchcast.block_cast(x.float(), "nvfp4")
    assert wide.tensor_scale == narrow.tensor_scale
    assert wide.scales[0, 0].float().item() == 5.5 and narrow.scales[0, 0].float().item() == 5.0


# --- docs/reduce.md --------------------------------------------------------------------

REDUCE_BOUND = ("The result differs from the exact sum S by at most 2 ulp(S) + 4·L·u²·Σ|x| (u = "
                "2^-24, L the longest chain of compensated additions of the order below: 166 up "
                "to 2^20 elements, 228 at 2^28), so by at most 3 ulp while the condition number "
                "Σ|x| / |S| is at most 1 / (4·L·u), about 25,000")
U = 2.0 ** -24


def conditioned(n, cond, g):
    """n float32 values whose sum's condition number is about cond: random
    values, their negatives in another order, and a small remainder."""
    half = (n - 64) // 2
    v = torch.randn(half, generator=g) * torch.exp2(torch.randint(-20, 21, (half,), generator=g))
    rest = torch.rand(64, generator=g)
    rest = rest * float(2 * v.abs().double().sum() / cond / rest.double().sum())
    x = torch.cat([v, -v[torch.randperm(half, generator=g)], rest])
    return x[torch.randperm(n, generator=g)]


def test_reduce_md_error_bound():
    quoted("reduce.md", REDUCE_BOUND)
    assert chain_length(2 ** 20) == 166 and chain_length(2 ** 28) == 228
    assert 24_000 <= 1 / (4 * 166 * U) <= 26_000
    n = 1 << 18
    g = torch.Generator().manual_seed(12)
    seen = []
    for cond in (1.0, 1e3, 2e4, 1e7, 1e9, 5e10, 1e13, 1e15):
        x = torch.rand(n, generator=g) if cond == 1.0 else conditioned(n, cond, g)
        values = x.double().tolist()
        exact = math.fsum(values)
        abs_sum = math.fsum(abs(v) for v in values)
        got = torchcast.kahan_sum(x).item()
        err = abs(Fraction(got) - Fraction(exact))  # fsum is exact to half a float64 ulp
        u_s = float(ulp(exact, torch.float32))
        bound = 2 * u_s + 4 * chain_length(n) * U * U * abs_sum
        assert err <= Fraction(bound) + Fraction(abs(exact)) * 2 ** -53, (cond, float(err), bound)
        if abs_sum / abs(exact) <= 1 / (4 * chain_length(n) * U):
            assert err <= 3 * u_s, (cond, float(err) / u_s)
        seen.append(abs_sum / abs(exact))
    assert min(seen) < 2 and max(seen) > 1e13  # the data spans the conditions named
