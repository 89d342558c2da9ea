"""The CPU cast_with_stats kernel's loops against torchcast/_reference/cast.py,
bit for bit, on data aimed at their edges: partial vectors and rows, chunk
boundaries, strided runs, NaN/inf/subnormal/overflow/underflow values, raw bit
patterns, and float64 values at or next to float16/bfloat16/float8 rounding
midpoints (where rounding to nearest float32 first would round twice). The
AVX-512 loop and the portable one (ATEN_CPU_CAPABILITY=default) must agree."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcast
from torchcast._reference import cast as cast_ref

PAIRS = cast_ref.LOSSY_PAIRS
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRS]
FLOAT8_PAIRS = [p for p in PAIRS if p[1].itemsize == 1]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
        torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}
OP = torch.ops.torchcast.cast_with_stats


def same(a, b):
    """Equal bits, NaN payloads and signs included."""
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def specials(src):
    fi = torch.finfo(src)
    v = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), fi.max, -fi.max, fi.tiny, fi.tiny / 3,
         65504.0, 65519.99, 65520.0, 65536.0, 6.1e-5, 6.0e-5, 3e-8, 2.9e-8, 1e-45, 1e-40, 3.4e38,
         3.5e38, 1e300, 1e-300]
    return torch.tensor(v, dtype=torch.float64).to(src)


def midpoints(n, g):
    """float64 values at, just below and just above float16, bfloat16 and
    float8 (e4m3, e5m2) rounding midpoints, across the normal and subnormal
    ranges."""
    mant = torch.tensor([10.0, 7.0, 3.0, 2.0], dtype=torch.float64)[
        torch.randint(0, 4, (n,), generator=g)]
    exp = torch.randint(-30, 16, (n,), generator=g).double()
    k = torch.floor(torch.rand(n, generator=g, dtype=torch.float64) * 2 ** mant)
    value = (1 + k / 2 ** mant) * 2 ** exp
    half = 2 ** (exp - mant - 1)
    nudge = torch.tensor([0.0, 2.0 ** -45, -2.0 ** -45, 2.0 ** -60, -2.0 ** -60], dtype=torch.float64)
    off = nudge[torch.randint(0, len(nudge), (n,), generator=g)] * 2 ** exp
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return sign * (value + half + off)


def data(n, src, kind, g):
    if kind == "normal":
        return torch.randn(n, dtype=torch.float64, generator=g).to(src)
    if kind == "wide":
        mag = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-100, 100, generator=g))
        return (mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).to(src)
    if kind == "bits":
        if src == torch.float64:
            return torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), dtype=torch.int64, generator=g).view(src)
        if src == torch.float32:
            return torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g).view(src)
        return torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int32, generator=g).to(torch.int16).view(src)
    if kind == "midpoints":
        return midpoints(n, g).to(src)
    x = torch.randn(n, dtype=torch.float64, generator=g).to(src)  # "specials": sprinkled
    sp = specials(src)
    idx = torch.randint(0, n, (max(1, n // 8),), generator=g)
    x[idx] = sp[torch.randint(0, len(sp), (len(idx),), generator=g)]
    return x


def check(x, dst, out=None):
    if out is None:
        y, s = OP(x, dst)
    else:
        y, s = out, OP.out(x, dst, out=out)
    yr, sr = cast_ref.cast_with_stats(x, dst, None if out is None else torch.empty_like(out))
    assert same(y, yr)
    assert same(s, sr), (s.tolist(), sr.tolist())


KINDS = ("normal", "wide", "bits", "midpoints", "specials")


@pytest.mark.parametrize("src,dst", FLOAT8_PAIRS, ids=[i for p, i in zip(PAIRS, PAIR_IDS) if p in FLOAT8_PAIRS])
@pytest.mark.parametrize("scale", [3.7] + [pytest.param(s, marks=pytest.mark.slow)
                                           for s in (2.0 ** -12, 448.0, 448.0 / 496.0)])
def test_scaled_float8_against_the_reference(src, dst, scale):
    g = torch.Generator().manual_seed(6)
    for n in (15, 16, 17, 513, 65536 + 300):
        for kind in KINDS:
            x = data(n, src, kind, g)
            for saturate in (False, True):
                y, s = OP(x, dst, torch.tensor(scale), saturate=saturate)
                yr, sr = cast_ref.cast_with_stats(x, dst, saturate=saturate, scale=torch.tensor(scale))
                assert same(y, yr) and same(s, sr), (kind, n, saturate)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_hypothesis_float8_saturate_and_scale(draws):
    """float8 targets with every saturate mode and scales that take the
    vector path (halfway points of 448 / 496 included) or not (a float64
    source's, 1e35), on random sizes, steps and kinds of data, against the
    reference bit for bit."""
    src, dst = draws.draw(st.sampled_from(FLOAT8_PAIRS), label="pair")
    n = draws.draw(st.integers(1, 3000), label="n")
    step = draws.draw(st.integers(1, 3), label="step")
    kind = draws.draw(st.sampled_from(KINDS), label="kind")
    seed = draws.draw(st.integers(0, 2 ** 31), label="seed")
    saturate = draws.draw(st.sampled_from([None, False, True]), label="saturate")
    scale = draws.draw(st.sampled_from([None, 1.0, 448 / 496, 2.0 ** -7, 3.7, 1e-3, 1e35]), label="scale")
    x = data(n * step, src, kind, torch.Generator().manual_seed(seed))[::step]
    s = None if scale is None else torch.tensor(scale)
    y, stats = OP(x, dst, s, saturate=saturate)
    yr, sr = cast_ref.cast_with_stats(x, dst, saturate=saturate, scale=s)
    assert same(y, yr) and same(stats, sr)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_sizes_across_vector_row_and_chunk_edges(src, dst):
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 8, 15, 16, 17, 255, 257, 511, 513, 2051, 65536 + 300):
        for kind in KINDS:
            check(data(n, src, kind, g), dst)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_layouts(src, dst):
    g = torch.Generator().manual_seed(2)
    base = data(257 * 301, src, "specials", g).view(257, 301)
    for x in (base[:, 1:], base[1:].reshape(-1)[3:], base[::2], base[:, ::3], base.t(),
              base[:40].unsqueeze(0).expand(2, 40, 301)):
        check(x, dst)
        check(x, dst, out=torch.empty(x.shape, dtype=dst))
    check(base, dst, out=torch.empty(301, 257, dtype=dst).t())


def test_double_rounding_screen_is_exact():
    # float64 -> float16 against numpy, which rounds once, on values that a
    # round-to-nearest float32 step would push onto a midpoint.
    g = torch.Generator().manual_seed(3)
    x = torch.cat([midpoints(200_000, g), specials(torch.float64)])
    y, _ = OP(x, torch.float16)
    with np.errstate(over="ignore"):
        ref = torch.from_numpy(x.numpy().astype(np.float16))
    assert same(y, ref)
    check(x, torch.float16)
    check(x, torch.bfloat16)


def test_thread_count_determinism_all_pairs():
    g = torch.Generator().manual_seed(4)
    before = torch.get_num_threads()
    try:
        for src, dst in PAIRS:
            x = torch.cat([data(150_000, src, kind, g) for kind in KINDS])
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results.append(OP(x, dst))
            assert same(results[0][0], results[1][0]) and same(results[0][1], results[1][1])
    finally:
        torch.set_num_threads(before)


def test_portable_loop_matches_avx512(tmp_path):
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU has no AVX-512 (or ATen does not use it): only the portable loop runs here")
    g = torch.Generator().manual_seed(5)
    cases = []
    # float8 targets take the AVX-512 loop when saturating and scaled too
    # (a scale past 2^100 takes the portable one on both sides).
    scales = [None, torch.tensor(3.7), torch.tensor(2.0 ** -12), torch.tensor(1e35)]
    for src, dst in PAIRS:
        x = torch.cat([data(20_000 + 17 * i, src, kind, g) for i, kind in enumerate(KINDS)])
        options = ([(sat, scale) for sat in (None, False, True) for scale in scales]
                   if dst.itemsize == 1 else [(None, None)])
        for saturate, scale in options:
            cases.append((x, dst, saturate, scale))
            cases.append((x.view(-1)[5:].view(-1, 5)[:, 1:4], dst, saturate, scale))  # strided
    torch.save(cases, tmp_path / "cases.pt")
    script = textwrap.dedent("""
        import sys, torch, torchcast
        cases = torch.load(sys.argv[1])
        assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
        torch.save([torch.ops.torchcast.cast_with_stats(x, d, c, saturate=s) for x, d, s, c in cases],
                   sys.argv[2])
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(torchcast.__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True)
    portable = torch.load(tmp_path / "out.pt")
    for (x, dst, saturate, scale), (y, s) in zip(cases, portable):
        y2, s2 = OP(x, dst, scale, saturate=saturate)
        assert same(y, y2) and same(s, s2), (x.dtype, dst, saturate, scale)
