"""torchcast.block_cast against its pure-PyTorch reference (element and scale
bits, per-block facts, statistics), against numpy float64 / math.fsum for
the statistics and ml_dtypes for dequantize; layouts, ragged blocks, axes,
hypothesis shapes; the straight-through gradient, opcheck, torch.compile,
the fallback and the errors. tests/test_block_torchao.py compares with
torchao."""
import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import torchcast
from torchcast import _ops
from torchcast._reference import block_cast as reference
from torchcast.formats import BLOCK_FORMATS
from torchcast.stats import STAT_FIELDS

from devices import on_device

SOURCES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
MODES = [(f, m) for f, b in BLOCK_FORMATS.items() for m in b.scale_modes]
SUMS = ("sum_abs_err", "sum_sq_err", "sum_sq")


def heavy_tailed(shape, dtype, seed):
    """Normal values times e^(4 N(0, 1)): blocks whose amax spans many
    binades, elements far below their block's amax, a few past bfloat16's
    and float16's range (they become inf in those dtypes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (x * torch.exp(4 * torch.randn(shape, generator=g, dtype=torch.float64))).to(dtype)


def edge_rows(dtype):
    """Rows of 32 values at the formats' edges: signed zeros, inf, NaN,
    float32 subnormals, the e4m3/e5m2/e2m1 maxima and their overflow ties,
    element ties, values whose block scale clamps at 2^-127 and 2^127."""
    inf, nan = math.inf, math.nan
    rows = [
        [0.0, -0.0] * 16,
        [1.0, inf] + [0.5] * 30,
        [-inf, 3.0, 2.0 ** -149] + [1.0] * 29,
        [nan, 1.0, -2.0] + [0.25] * 29,
        [448.0, 464.0, 480.0, 465.0] + [1.5 + i / 64 for i in range(28)],
        [57344.0, 61440.0, 6.0, 7.0, 5.0, 0.75, 0.25, 2.5] + [3.5 - i / 16 for i in range(24)],
        [2.0 ** -120 * (1 + i / 32) for i in range(32)],
        [2.0 ** -130, 2.0 ** -140, -(2.0 ** -126)] + [2.0 ** -135] * 29,
        [3.0e38, -3.3e38] + [1.0e30 * i for i in range(30)],
        [1.0] + [2.0 ** -k for k in range(1, 32)],
    ]
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


def default_args(fmt, mode=None, block_size=None):
    b = BLOCK_FORMATS[fmt]
    return block_size or b.block_size, mode or b.scale_modes[0]


def assert_stats_equal(got, want, sums_rtol=1e-12):
    """Counts and maxima bit for bit; the float64 sums, added in another
    order, within sums_rtol."""
    got, want = got.cpu().tolist(), want.cpu().tolist()
    for name, a, b in zip(STAT_FIELDS, got, want):
        if name in SUMS:
            assert a == pytest.approx(b, rel=sums_rtol, abs=0), name
        else:
            assert a == b or (math.isnan(a) and math.isnan(b)), (name, a, b)


def assert_matches_reference(x, fmt, mode=None, block_size=None, axis=-1, tensor_scale=None):
    block_size, mode = default_args(fmt, mode, block_size)
    r = torchcast.block_cast(x, fmt, block_size=block_size, axis=axis, scale_mode=mode,
                             tensor_scale=tensor_scale)
    ts = r.tensor_scale.cpu() if r.tensor_scale is not None else None
    data, scales, stats, hist, counts = reference.block_cast(
        x.cpu().movedim(axis, -1), fmt, block_size, mode, ts)
    assert r.data.device == x.device and r.scales.device == x.device
    assert torch.equal(r.data.cpu().view(torch.uint8), data.movedim(-1, axis).view(torch.uint8))
    assert torch.equal(r.scales.cpu().view(torch.uint8),
                       scales.movedim(-1, axis).view(torch.uint8))
    assert torch.equal(r.scale_hist.cpu(), hist)
    assert torch.equal(r.block_counts.cpu(), counts)
    assert_stats_equal(r.stats_tensor, stats)
    return r


@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("fmt,mode", MODES)
def test_matches_reference(device, fmt, mode, dtype):
    x = torch.cat([edge_rows(dtype).reshape(-1), heavy_tailed(4096, dtype, seed=1)])
    assert_matches_reference(on_device(x.reshape(-1, 64), device), fmt, mode)


@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("fmt,mode", MODES)
def test_random_bit_patterns(device, fmt, mode, dtype):
    """Every class of value at once, NaN payloads and signs included: x's
    bits drawn uniformly, so that most blocks hold a NaN or an inf, and
    sparser draws (one element in 64 random bits, the rest small normals)."""
    g = torch.Generator().manual_seed(15)
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(ints)
    raw = torch.randint(info.min, info.max, (64, 96), generator=g, dtype=torch.int64)
    x = raw.to(ints).view(dtype)
    sparse = torch.randn(64, 96, generator=g).to(dtype)
    keep = torch.rand(64, 96, generator=g) < 1 / 64
    x = torch.cat([x, torch.where(keep, x, sparse)])
    assert_matches_reference(on_device(x, device), fmt, mode)


@pytest.mark.cuda_cases
@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_device_matches_cpu(device, fmt, dtype):
    x = heavy_tailed((64, 1000), dtype, seed=2)
    cpu = torchcast.block_cast(x, fmt)
    dev = torchcast.block_cast(x.to(device), fmt)
    for a, b in zip((cpu.data, cpu.scales, cpu.scale_hist, cpu.block_counts),
                    (dev.data, dev.scales, dev.scale_hist, dev.block_counts)):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.cpu().view(torch.uint8) if b.element_size() == 1 else b.cpu())
    assert_stats_equal(dev.stats_tensor, cpu.stats_tensor)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_ragged_blocks_axes_and_layouts(device, fmt, axis):
    x = heavy_tailed((5, 50, 7), torch.float32, seed=3)
    for block_size in (None, 4, 6):
        assert_matches_reference(on_device(x, device), fmt, block_size=block_size, axis=axis)
    xt = x.transpose(0, 2)
    r = assert_matches_reference(on_device(xt, device), fmt, axis=axis)
    n = xt.shape[axis]
    expected = list(xt.shape)
    expected[axis] = (n + 1) // 2 if BLOCK_FORMATS[fmt].packed else n
    assert list(r.data.shape) == expected
    assert r.scales.shape[axis] == -(-n // BLOCK_FORMATS[fmt].block_size)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_longer_than_the_row(device, fmt):
    """One block per row, scaled by the row's amax, whatever block_size says
    beyond the row's length (the reference allocates nothing for it)."""
    x = heavy_tailed((3, 10), torch.float32, seed=17)
    huge = assert_matches_reference(on_device(x, device), fmt, block_size=2**30)
    row = assert_matches_reference(on_device(x, device), fmt, block_size=10)
    assert torch.equal(huge.data.view(torch.uint8), row.data.view(torch.uint8))
    assert torch.equal(huge.scales.view(torch.uint8), row.scales.view(torch.uint8))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 32), (1,), (2, 1), (3, 17)])
def test_empty_and_small(device, fmt, shape):
    x = heavy_tailed(shape, torch.float32, seed=4)
    r = assert_matches_reference(on_device(x, device), fmt)
    assert r.stats.numel == x.numel() and r.blocks == r.scales.numel()


@settings(max_examples=40)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       fmt=st.sampled_from(sorted(BLOCK_FORMATS)), half_block=st.integers(1, 20),
       dtype=st.sampled_from(SOURCES), data=st.data())
def test_hypothesis_shapes(shape, seed, fmt, half_block, dtype, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    mode = data.draw(st.sampled_from(BLOCK_FORMATS[fmt].scale_modes))
    x = heavy_tailed(shape, dtype, seed)
    assert_matches_reference(x, fmt, mode, block_size=2 * half_block, axis=axis)


@pytest.mark.skipif(not _ops.WITH_EXTENSION,
                    reason="the build without the extension sums with torch.sum, whose order "
                           "follows the thread count (docs/formats.md)")
def test_thread_count_does_not_change_the_result():
    x = heavy_tailed((300, 1024), torch.float32, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torchcast.block_cast(x, "mxfp8_e4m3")
        torch.set_num_threads(max(2, threads))
        many = torchcast.block_cast(x, "mxfp8_e4m3")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.stats_tensor.view(torch.int64), many.stats_tensor.view(torch.int64))
    assert torch.equal(one.data.view(torch.uint8), many.data.view(torch.uint8))


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason="compares the compiled kernel's two loops")
def test_vector_and_portable_loops_agree(tmp_path):
    """The AVX-512 loop (float32 and 16-bit sources, where the CPU has it)
    and the portable one (ATEN_CPU_CAPABILITY=default) give the same bits,
    counts and maxima, and sums within rounding, on edge rows, heavy tails,
    random bit patterns, ragged blocks and NVFP4 tensor scales whose
    multiplier overflows or flushes to zero."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ints = torch.int32 if dtype == torch.float32 else torch.int16
        info = torch.iinfo(ints)
        bits = torch.randint(info.min, info.max, (40, 96), generator=g).to(ints).view(dtype)
        x = torch.cat([edge_rows(dtype).reshape(-1, 64), heavy_tailed((300, 64), dtype, seed=2),
                       bits.reshape(-1, 64)])
        for fmt, mode in MODES:
            scales = [None] if not BLOCK_FORMATS[fmt].tensor_scale else \
                [torch.tensor([t]) for t in (1.0, 1e-45, 1e-30, 3e38)]
            for ts in scales:
                cases.append((x, fmt, mode, 32, ts))
                cases.append((x[:, :50], fmt, mode, 20, ts))  # ragged: blocks of 20, 20, 10
    torch.save(cases, tmp_path / "cases.pt")
    script = textwrap.dedent("""
        import sys, torch, torchcast
        assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
        out = []
        for x, fmt, mode, block, ts in torch.load(sys.argv[1]):
            r = torchcast.block_cast(x, fmt, block_size=block, scale_mode=mode, tensor_scale=ts)
            out.append((r.data, r.scales, r.stats_tensor, r.scale_hist, r.block_counts))
        torch.save(out, sys.argv[2])
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(torchcast.__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True)
    for (x, fmt, mode, block, ts), (data, scales, stats, hist, counts) in zip(
            cases, torch.load(tmp_path / "out.pt")):
        r = torchcast.block_cast(x, fmt, block_size=block, scale_mode=mode, tensor_scale=ts)
        where = (x.dtype, fmt, mode, block, ts)
        assert torch.equal(r.data.view(torch.uint8), data.view(torch.uint8)), where
        assert torch.equal(r.scales.view(torch.uint8), scales.view(torch.uint8)), where
        assert torch.equal(r.scale_hist, hist) and torch.equal(r.block_counts, counts), where
        assert_stats_equal(r.stats_tensor, stats)


def _decode(r):
    """What r's elements and scales stand for, decoded with ml_dtypes in
    float64 (an independent reading of the bits)."""
    fmt = BLOCK_FORMATS[r.format]
    data = r.data.movedim(r.axis, -1).cpu().contiguous().view(torch.uint8).numpy()
    n = r.source.shape[r.axis]
    if fmt.packed:
        codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)[..., :n]
        elements = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    else:
        elements = data.view(getattr(ml_dtypes, fmt.element.name)).astype(np.float64)
    scale_bits = r.scales.movedim(r.axis, -1).cpu().contiguous().view(torch.uint8).numpy()
    scale_dtype = ml_dtypes.float8_e8m0fnu if fmt.scale.name == "float8_e8m0fnu" else \
        ml_dtypes.float8_e4m3fn
    scales = scale_bits.view(scale_dtype).astype(np.float64)
    if r.tensor_scale is not None:
        scales = scales * float(r.tensor_scale)
    scales = np.repeat(scales, r.block_size, axis=-1)[..., :n]
    return np.moveaxis(elements * scales, -1, r.axis)


@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("fmt,mode", MODES)
def test_stats_and_dequantize_against_numpy(fmt, mode, dtype):
    x = torch.cat([edge_rows(dtype).reshape(-1), heavy_tailed(2048, dtype, seed=6)]).reshape(-1, 64)
    r = torchcast.block_cast(x, fmt, scale_mode=mode)
    y = _decode(r)
    assert np.array_equal(r.dequantize(torch.float64).numpy(), y, equal_nan=True)
    xv = reference.widen_exact(x).double().numpy() if dtype in (torch.float16, torch.bfloat16) \
        else x.double().numpy()
    finite, measured = np.isfinite(xv), np.isfinite(xv) & np.isfinite(y)
    err = np.where(measured, np.abs(xv - y), 0.0)
    s = r.stats
    assert (s.numel, s.nan, s.inf) == (xv.size, np.isnan(xv).sum(), np.isinf(xv).sum())
    assert s.inexact == (finite & (y != xv)).sum()
    assert s.overflow == (finite & ~np.isfinite(y)).sum()
    assert s.underflow == ((xv != 0) & ~np.isnan(xv) & (y == 0)).sum()
    assert s.max_abs_err == err.max()
    assert s.max_rel_err == np.where(measured & (xv != 0), err / np.abs(np.where(xv == 0, 1, xv)),
                                     0).max()
    assert s.amax == np.where(finite, np.abs(xv), 0).max()
    assert s.sum_abs_err == pytest.approx(math.fsum(err.ravel()), rel=1e-12)
    assert s.sum_sq_err == pytest.approx(math.fsum((err * err).ravel()), rel=1e-12)
    assert s.sum_sq == pytest.approx(math.fsum(np.where(measured, xv * xv, 0).ravel()), rel=1e-12)


def test_block_facts():
    x = torch.ones(4, 32)
    x[0, 5] = 480.0            # floor: scale 2^0, 480 rounds past 448 -> saturates
    x[1, 0] = 2.0 ** 20        # scale 2^12: the rest (1.0) become 2^-12, below e4m3's 2^-9
    x[2, 7] = math.nan         # a NaN scale
    r = torchcast.block_cast(x, "mxfp8_e4m3")
    assert (r.blocks, r.saturated_blocks, r.underflow_blocks, r.nan_blocks) == (4, 1, 1, 1)
    assert r.stats.saturated == 1 and r.stats.underflow == 31
    assert r.stats.overflow == 31  # the NaN block's finite elements read back NaN
    # Scales: 2^(8-8) for row 0, 2^(20-8) for row 1, NaN, 2^(0-8) for row 3.
    assert r.scale_distribution() == {127: 1, 127 + 12: 1, 255: 1, 127 - 8: 1}


def test_nvfp4_default_tensor_scale():
    x = heavy_tailed((4, 64), torch.float32, seed=7)
    r = torchcast.block_cast(x, "nvfp4")
    assert r.tensor_scale.dtype == torch.float32
    assert r.tensor_scale == x.abs().amax() / (448.0 * 6.0)
    for special in (torch.zeros(2, 16), torch.full((2, 16), math.inf),
                    torch.full((1, 16), math.nan)):
        assert torchcast.block_cast(special, "nvfp4").tensor_scale == 1.0
    # amax / 2688 underflows float32: the smallest positive float32.
    tiny = torch.full((1, 16), 2.0 ** -140)
    assert torchcast.block_cast(tiny, "nvfp4").tensor_scale == 2.0 ** -149
    assert torchcast.block_cast(tiny.double() / 2 ** 20, "nvfp4").tensor_scale == 2.0 ** -149


# e2m1's non-negative values, decoded by ml_dtypes.
E2M1_GRID = sorted({abs(float(v)) for v in np.arange(16, dtype=np.uint8)
                    .view(ml_dtypes.float4_e2m1fn).astype(np.float64)})


def assert_nearest_nvfp4(r):
    """Every element of an NVFP4 cast stands for a value nearest x on its
    block's grid (e2m1's values times the block scale times the tensor
    scale, read with ml_dtypes), in exact arithmetic, zeros for zeros."""
    x = r.source.detach().cpu().double().reshape(-1, r.source.shape[-1]).numpy()
    y = _decode(r).reshape(x.shape)
    scales = r.scales.cpu().contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    t = Fraction(float(r.tensor_scale))
    for row, (xs, ys) in enumerate(zip(x, y)):
        for i, (xv, yv) in enumerate(zip(xs, ys)):
            unit = Fraction(float(scales.reshape(len(x), -1)[row, i // r.block_size])) * t
            grid = [Fraction(g) * unit for g in E2M1_GRID]
            best = min(abs(abs(Fraction(xv)) - g) for g in grid)
            assert abs(Fraction(xv) - Fraction(yv)) == best, (row, i, xv, yv)
            assert (yv == 0) or np.sign(yv) == np.sign(xv), (row, i, xv, yv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nvfp4_tiny_tensor_keeps_its_zeros(device, dtype):
    """Issue 40 item 1: amax below about 7.9e-36 makes the default tensor
    scale t so small that 1 / t overflows float32; the elements were
    multiplied by inf (zeros came back nonzero, the rest saturated to +-6).
    Now each element is the nearest grid value, as for moderate tensors."""
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(1, 16) * 1e-36
    x[0, 7] = 0
    x = x.to(dtype)
    r = assert_matches_reference(on_device(x, device), "nvfp4")
    y = r.dequantize(torch.float64).cpu()
    assert y[0, 7].item() == 0.0
    assert r.stats.saturated == 0 and r.stats.nan == 0 and r.stats.overflow == 0
    assert r.stats.sqnr_db > 18, r.stats.sqnr_db  # 20.4 dB is a normal tensor's
    assert_nearest_nvfp4(r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_small_blocks_beside_a_tiny_amax(device, dtype):
    """A tiny tensor's blocks of much smaller values: their e4m3 scale clamps
    at 2^-6 and (1 / t) / s overflows float32 although 1 / t does not; and
    values whose amax / (448 * 6) underflows float32 (the default tensor
    scale is then 2^-149, not 1.0, which flushed them all)."""
    rows = torch.zeros(3, 32, dtype=torch.float64)
    rows[0, :16] = torch.linspace(-1, 1, 16) * 1e-34
    rows[0, 16:] = torch.linspace(-1, 1, 16) * 3e-40
    rows[1, :] = torch.linspace(-1, 1, 32) * 1e-40
    rows[1, 5] = 0.0
    # bfloat16's subnormals end at 2^-133, float32's at 2^-149
    bottom = 2.0 ** (-133 if dtype == torch.bfloat16 else -149)
    tiny = torch.tensor([[71.0, -64.0, 0.0, 50.0] * 4], dtype=torch.float64) * bottom
    for x in (rows.to(dtype), tiny.to(dtype)):
        r = assert_matches_reference(on_device(x, device), "nvfp4")
        assert r.stats.saturated == 0 and r.stats.nan == 0 and r.stats.overflow == 0
        assert r.tensor_scale.item() > 0 and r.tensor_scale.item() != 1.0
        assert_nearest_nvfp4(r)
        assert (r.dequantize(torch.float64)[x == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_straight_through_gradient(dtype):
    x = heavy_tailed((3, 64), dtype, seed=8).requires_grad_()
    g = heavy_tailed((3, 64), torch.float32, seed=9)
    y = torchcast.block_cast(x, "mxfp4").dequantize()
    assert y.requires_grad
    (grad,) = torch.autograd.grad(y, x, g)
    assert grad.dtype == dtype and torch.equal(grad, g.to(dtype))
    # The Jacobian is the identity; gradcheck's finite differences do not
    # apply (a quantizer is piecewise constant), so it is checked whole.
    x64 = heavy_tailed((2, 16), torch.float64, seed=10)
    jac = torch.autograd.functional.jacobian(
        lambda t: torchcast.block_cast(t, "nvfp4").dequantize(torch.float64), x64)
    assert torch.equal(jac.reshape(32, 32), torch.eye(32, dtype=torch.float64))
    with torch.no_grad():
        assert not torchcast.block_cast(x, "mxfp4").dequantize().requires_grad
    # gradcheck and gradgradcheck of the straight-through Function itself,
    # where y is x (its forward then is the identity, whose derivative the
    # Function claims).
    t = heavy_tailed((3, 8), torch.float64, seed=16).requires_grad_()
    same = lambda v: _ops.straight_through(v, v.detach())  # noqa: E731
    assert torch.autograd.gradcheck(same, (t,))
    assert torch.autograd.gradgradcheck(same, (t,))


@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("fmt,mode", MODES)
def test_opcheck(device, fmt, mode, dtype):
    x = on_device(heavy_tailed((3, 40), dtype, seed=11), device)
    ts = torch.tensor(0.01, device=x.device) if BLOCK_FORMATS[fmt].tensor_scale else None
    torch.library.opcheck(torch.ops.torchcast.block_cast.default, (x, fmt, 16, mode, ts))
    torch.library.opcheck(torch.ops.torchcast.block_cast.default, (x.t(), fmt, 2, mode, ts))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_compiles_fullgraph(fmt, dynamic):
    # One code object for every case: start each from an empty cache, so the
    # cases' recompilations do not add up to dynamo's limit.
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=dynamic)
    def f(x):
        r = torchcast.block_cast(x, fmt, axis=0)
        return r.dequantize(), r.stats_tensor, r.scales

    for rows in (64, 70, 33):  # whole blocks, then ragged ones (recompiled or symbolic)
        x = heavy_tailed((rows, 6), torch.float32, seed=12)
        want = torchcast.block_cast(x, fmt, axis=0)
        y, stats, scales = f(x)
        assert torch.equal(y, want.dequantize())
        assert torch.equal(stats, want.stats_tensor)
        assert torch.equal(scales.view(torch.uint8), want.scales.view(torch.uint8))


def test_fallback_warns_and_matches(monkeypatch):
    x = heavy_tailed((4, 96), torch.float32, seed=13)
    want = torchcast.block_cast(x, "mxfp8_e5m2", scale_mode="rceil")
    monkeypatch.setattr(_ops, "_KERNELS", frozenset())
    monkeypatch.setattr(_ops, "_warned_fallback", set())
    with pytest.warns(RuntimeWarning, match="no compiled kernels"):
        got = torchcast.block_cast(x, "mxfp8_e5m2", scale_mode="rceil")
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert_stats_equal(got.stats_tensor, want.stats_tensor)


@pytest.mark.parametrize("call,error,match", [
    (lambda x: torchcast.block_cast(x, "mxfp6"), ValueError, "unknown format 'mxfp6'"),
    (lambda x: torchcast.block_cast(x, "mxfp8_e4m3", scale_mode="round"), ValueError,
     "unknown scale_mode 'round'.*'floor'"),
    (lambda x: torchcast.block_cast(x, "nvfp4", scale_mode="floor"), ValueError,
     "nvfp4 has one scale rule, 'amax'"),
    (lambda x: torchcast.block_cast(x, "mxfp4", block_size=5), ValueError,
     "block_size is 5; expected a positive even number"),
    (lambda x: torchcast.block_cast(x, "mxfp8_e4m3", block_size=0), ValueError,
     "block_size is 0"),
    (lambda x: torchcast.block_cast(x, "mxfp8_e4m3", block_size=2**31), ValueError,
     "block_size is 2147483648; expected a positive number up to 2\\^31 - 1"),
    (lambda x: torchcast.block_cast(x, "mxfp8_e4m3", tensor_scale=torch.tensor(1.0)), ValueError,
     "tensor_scale is only for nvfp4"),
    (lambda x: torchcast.block_cast(x, "nvfp4", tensor_scale=torch.tensor([1.0, 2.0])),
     ValueError, "one-element torch.float32 tensor"),
    *[(lambda x, t=t: torchcast.block_cast(x, "nvfp4", tensor_scale=torch.tensor([t])),
       ValueError, f"tensor_scale must be positive and finite.*; got {t:g}")
      for t in (0.0, -1.0, math.inf, math.nan)],
    (lambda x: torchcast.block_cast(x.int(), "mxfp8_e4m3"), TypeError,
     "x is torch.int32; expected torch.float64, float32, float16 or bfloat16"),
    (lambda x: torchcast.block_cast(x[0, 0], "mxfp8_e4m3"), ValueError, "x is 0-d"),
    (lambda x: torchcast.block_cast(x, "mxfp8_e4m3", axis=2), ValueError,
     "axis 2 is out of range"),
    (lambda x: torchcast.block_cast(x, "mxfp4").dequantize(torch.int32), TypeError,
     "dtype must be a floating dtype, got torch.int32"),
])
@pytest.mark.parametrize("kernel", ["compiled", "reference"])
def test_errors_name_the_problem(monkeypatch, call, error, match, kernel):
    """The same errors from the kernels' checks and from the reference's
    (the fallback's, and the fake kernel's under torch.compile)."""
    if kernel == "reference":
        monkeypatch.setattr(_ops, "_KERNELS", frozenset())
        monkeypatch.setattr(_ops, "_warned_fallback", {"cpu"})
    with pytest.raises(error, match=match):
        call(torch.ones(2, 32))


def test_result_reads_as_cast_stats():
    r = torchcast.block_cast(heavy_tailed((4, 64), torch.bfloat16, seed=14), "mxfp4")
    s = r.stats
    assert (s.src_dtype, s.dtype) == (torch.bfloat16, torch.float4_e2m1fn_x2)
    assert s.numel == 256 and s.sqnr_db == pytest.approx(
        10 * math.log10(s.sum_sq / s.sum_sq_err))
