"""cast_with_stats and safe_to against independent numpy float64 references,
on every device: off the CPU, y and stats must also be bit-identical to the
CPU op on the same data and layout."""
import math
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import torchcast
from torchcast import _ops
from torchcast._reference import cast as cast_ref
from torchcast.stats import STAT_FIELDS, CastStats

from cast_common import SUM_FIELDS, assert_same, bits, sample
from devices import on_device
from modes import FunctionsSeen, LoggedTensor, OpsSeen
from numpy_ref import edge_values, round_to_format, stats_reference, to_numpy64

op = torch.ops.torchcast.cast_with_stats
PAIRS = cast_ref.LOSSY_PAIRS
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRS]
EXACT_FIELDS = ("numel", "nan", "inexact", "overflow", "underflow", "subnormal",
                "max_abs_err", "max_rel_err")


def op_stats(x, dtype, device="cpu"):
    """The op on x's data and layout moved to device, stats as CastStats; off
    the CPU, checked bit for bit against the CPU op on x."""
    y, stats = op(on_device(x, device), dtype)
    if device != "cpu":
        assert_same(op(x, dtype), (y, stats), x.dtype)
    return y, CastStats.from_tensor(stats, x.dtype, dtype)


def assert_matches_reference(x, dtype, y, s):
    ref = stats_reference(x, dtype)
    got_y = to_numpy64(y).ravel()
    np.testing.assert_array_equal(got_y, ref["y"])  # NaN == NaN here
    for f in EXACT_FIELDS:
        assert getattr(s, f) == ref[f], (f, getattr(s, f), ref[f])
    for f in SUM_FIELDS:
        exact = ref[f]
        if math.isinf(getattr(s, f)):  # float32 accumulators overflow past 3.4e38
            assert exact > 3.0e38, (f, exact)
            continue
        # float32 accumulation: 1e-6 relative, plus each term's rounding to
        # float32, at most half the smallest subnormal once below its range.
        tol = 1e-6 * abs(exact) + s.numel * 2.0 ** -150
        assert abs(getattr(s, f) - exact) <= tol, (f, getattr(s, f), exact)


def wide_random(n, src, seed=0):
    g = np.random.default_rng(seed)
    mag = np.exp(g.uniform(-60, 60, n)) * g.choice([-1.0, 1.0], n)
    return torch.from_numpy(mag).to(src)


# --- rounding -----------------------------------------------------------------

@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_edge_values_exact(device, src, dst):
    x = edge_values(src, dst)
    y, s = op_stats(x, dst, device)
    assert_matches_reference(x, dst, y, s)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_random_wide_range_exact(device, src, dst):
    x = wide_random(100_003, src)
    y, s = op_stats(x, dst, device)
    assert_matches_reference(x, dst, y, s)


# Every element count where the chunk/lane mapping changes behaviour: empty,
# a partial first step, exactly one step of lanes (512 for float32, 256 for
# float64 on CUDA), a partial chunk, one chunk (2^16), a chunk plus a tail,
# several chunks with a ragged last step.
SIZES = (0, 1, 7, 255, 256, 257, 511, 512, 513, 4099, 65535, 65536, 65537,
         200003, 3 * 65536 + 1001, 300001, (1 << 20) + 17)


@pytest.mark.cuda_cases
@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_every_class_of_value_at_every_size(device, src, dst, n):
    x = sample(n, src, seed=n)
    y, s = op_stats(x, dst, device)
    assert_matches_reference(x, dst, y, s)
    # Signed zeros keep their sign (NaNs need not: bfloat16 NaNs are all 0x7FC0).
    got, want = to_numpy64(y), round_to_format(to_numpy64(x), dst)
    number = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got)[number], np.signbit(want)[number])


def test_float64_to_float16_matches_numpy_bits():
    x = torch.cat([wide_random(1 << 20, torch.float64, 1) * 1e-35, edge_values(torch.float64, torch.float16)])
    y, _ = op_stats(x, torch.float16)
    with np.errstate(over="ignore"):
        ref = x.numpy().astype(np.float16)  # numpy rounds float64 -> float16 once
    np.testing.assert_array_equal(y.view(torch.int16).numpy()[~np.isnan(ref)],
                                  ref.view(np.int16)[~np.isnan(ref)])
    assert torch.isnan(y).numpy().tolist() == np.isnan(ref).tolist()


@pytest.mark.parametrize("src,dst", [(torch.float64, torch.float32), (torch.float32, torch.float16),
                                     (torch.float32, torch.bfloat16)])
def test_single_rounding_pairs_bit_identical_to_torch(src, dst):
    x = torch.cat([wide_random(1 << 18, src, 2), edge_values(src, dst)])
    y, _ = op_stats(x, dst)
    ref = x.to(dst)
    finite = ~torch.isnan(ref)
    bits = torch.int32 if dst == torch.float32 else torch.int16
    assert torch.equal(y[finite].view(bits), ref[finite].view(bits))
    assert torch.equal(torch.isnan(y), torch.isnan(ref))


# Values where rounding float64 -> float32 -> dst differs from rounding once.
# float16: just below the overflow threshold 65520 (correct: 65504, twice: inf),
# and just above the tie between 1 and 1 + 2^-10 (correct: 1 + 2^-10; through
# float32 it becomes the tie itself, which rounds to even: 1).
# bfloat16: just below the midpoint between 1 + 2^-7 and 1 + 2^-6 (correct:
# 1 + 2^-7), and just above the tie between 1 and 1 + 2^-7 (correct: 1 + 2^-7).
DOUBLE_ROUNDING = {
    torch.float16: (65519.99999999999, 1 + 2 ** -11 + 2 ** -40),
    torch.bfloat16: (1.0 + 2.0 ** -7 + 2.0 ** -8 - 2.0 ** -40, 1 + 2 ** -8 + 2 ** -35),
}


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_torch_float64_cast_rounds_twice_ours_once(device, dst):
    # The fact README states: torch's float64 -> float16/bfloat16 goes through
    # float32 and rounds twice; torchcast rounds once.
    for v in DOUBLE_ROUNDING[dst]:
        x = torch.tensor([v], dtype=torch.float64, device=device)
        correct = round_to_format(np.array([v]), dst)[0]
        twice = float(x.to(dst)[0])
        ours = float(torchcast.safe_to(x, dst, policy="ignore")[0])
        assert ours == correct
        assert twice != correct
    # and on many values just below rounding midpoints, torch differs often
    g = np.random.default_rng(3)
    mant = 10 if dst == torch.float16 else 7
    base = np.ldexp(1.0 + g.integers(0, 2 ** mant, 20000) / 2 ** mant, g.integers(-10, 10, 20000))
    below_mid = base + np.ldexp(1.0, np.frexp(base)[1] - 1 - mant - 1) * (1 - 2.0 ** -30)
    xs = torch.from_numpy(below_mid).to(device)
    ref = round_to_format(below_mid, dst)
    assert np.array_equal(to_numpy64(torchcast.safe_to(xs, dst, policy="ignore")), ref)
    wrong = (to_numpy64(xs.to(dst)) != ref).mean()
    assert wrong > 0.4  # about half of them


# --- statistics -------------------------------------------------------------

@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2),
                                   pytest.param((0, 1 << 20), marks=pytest.mark.cuda_cases),
                                   (1,), (7, 13), (70001,)])
def test_shapes(device, src, dst, shape):
    x = (torch.randn(shape, dtype=torch.float64) * 1e3).to(src)
    y, s = op_stats(x, dst, device)
    assert y.shape == x.shape and y.dtype == dst
    assert_matches_reference(x, dst, y, s)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_non_contiguous_layouts(device, src, dst):
    base = (torch.randn(301, 257, dtype=torch.float64) * 300).to(src)
    for x in (base.t(), base[::3, 1::2], base[:, 5], base.unsqueeze(0).expand(3, 301, 257),
              base[1:].view(-1)[1:]):
        y, s = op_stats(x, dst, device)
        assert y.stride() == torch.empty_like(x, dtype=dst).stride()
        assert_matches_reference(x, dst, y, s)
        _, ref_stats = cast_ref.cast_with_stats(on_device(x, device), dst)
        assert torch.equal(op(on_device(x, device), dst)[1], ref_stats)


# Views of a base of the given shape, with the strides, offsets and
# memory formats that take a kernel off its contiguous path.
LAYOUTS = {
    "transposed": ((300, 257), lambda t: t.t()),
    "step_slice": ((64, 1000), lambda t: t[:, ::3]),
    "offset_1": ((70001,), lambda t: t[1:]),
    "offset_1_2d": ((130, 513), lambda t: t[1:, 1:]),
    "expanded": ((1, 5000), lambda t: t.expand(7, 5000)),
    "channels_last": ((2, 3, 37, 41), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "3d_strided": ((8, 300, 70), lambda t: t[::2, 5:, ::7]),
    "permuted": ((5, 6, 700), lambda t: t.permute(2, 0, 1)[1:]),
    "rows_offset_9": ((4, 65536 + 9), lambda t: t[:, 9:]),
}


@pytest.mark.cuda_cases
@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(device, src, dst, layout):
    shape, view = LAYOUTS[layout]
    x = view(sample(math.prod(shape), src, seed=3).reshape(shape))
    y, s = op_stats(x, dst, device)
    assert y.stride() == torch.empty_like(x, dtype=dst).stride()
    assert_matches_reference(x, dst, y, s)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_out_variant(device, src, dst):
    x = (torch.randn(500, 300, dtype=torch.float64) * 100).to(src)
    out = torch.empty(300, 500, dtype=dst, device=device).t()  # a non-contiguous destination
    stats = op.out(on_device(x, device), dst, out=out)
    assert_matches_reference(x, dst, out, CastStats.from_tensor(stats, src, dst))
    y2, _ = torchcast.cast_with_stats(on_device(x, device), dst,
                                      out=torch.empty(500, 300, dtype=dst, device=device))
    assert np.array_equal(to_numpy64(y2), to_numpy64(out))


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason="the C++ entry is the compiled extension's")
@pytest.mark.parametrize("scaled", [False, True])
def test_out_takes_the_cpp_entry(monkeypatch, scaled):
    """Issue 40 item 6: cast_with_stats(x, dt, out=y) went through torch.ops
    (argument boxing: 1.6x the allocating call at 2^12); it now takes the
    C++ entry, as the allocating call does: the same y and stats, y is out,
    and torch.ops' path (_ops._cast) is never reached. Under a
    TorchFunctionMode the entry declines and torch.ops answers, the mode
    seeing the op."""
    x = sample(4096, torch.float32, seed=12)
    scale = torch.tensor(0.5) if scaled else None
    y, stats = torchcast.cast_with_stats(x, torch.float8_e4m3fn, scale=scale)

    def boxed(*args):
        raise AssertionError("cast_with_stats(out=) went through torch.ops")
    with monkeypatch.context() as m:
        m.setattr(_ops, "_cast", boxed)
        out = torch.empty_like(y)
        got, got_stats = torchcast.cast_with_stats(x, torch.float8_e4m3fn, scale=scale, out=out)
    assert got is out and torch.equal(bits(out), bits(y)) and torch.equal(got_stats, stats)
    with FunctionsSeen() as mode:
        out2 = torch.empty_like(y)
        got2, stats2 = torchcast.cast_with_stats(x, torch.float8_e4m3fn, scale=scale, out=out2)
    assert got2 is out2 and torch.equal(bits(out2), bits(y)) and torch.equal(stats2, stats)
    assert _ops._ops.cast_with_stats.out in mode.seen


def make_out(layout, shape, dtype, device):
    """An output tensor of the given shape: contiguous, a transpose, or at storage offset 1."""
    if layout == "contiguous":
        return torch.empty(shape, dtype=dtype, device=device)
    if layout == "transposed":
        return torch.empty(shape[::-1], dtype=dtype, device=device).t()
    return torch.empty(math.prod(shape) + 1, dtype=dtype, device=device)[1:].view(shape)


@pytest.mark.cuda_cases
@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("out_layout", ["contiguous", "transposed", "offset_1"])
def test_out_layouts(device, src, dst, out_layout):
    x = sample(300 * 217, src, seed=11).reshape(300, 217)
    out = make_out(out_layout, (300, 217), dst, device)
    stats = op.out(on_device(x, device), dst, out=out)
    if device != "cpu":
        out_cpu = make_out(out_layout, (300, 217), dst, "cpu")
        assert_same((out_cpu, op.out(x, dst, out=out_cpu)), (out, stats), src)
    assert_matches_reference(x, dst, out, CastStats.from_tensor(stats, src, dst))


def test_out_variant_bad_outputs(device):
    x = torch.randn(4, 5, device=device)
    with pytest.raises(RuntimeError, match="out has dtype torch.float32 but the cast is to torch.float16"):
        op.out(x, torch.float16, out=torch.empty(4, 5, device=device))
    with pytest.raises(RuntimeError, match="out has dtype torch.bfloat16 but the cast is to torch.float16"):
        op.out(x, torch.float16, out=torch.empty(4, 5, dtype=torch.bfloat16, device=device))
    with pytest.raises(RuntimeError, match=r"out has shape \[5, 4\] but x has shape \[4, 5\]"):
        op.out(x, torch.float16, out=torch.empty(5, 4, dtype=torch.float16, device=device))


def test_thread_count_determinism():
    x = wide_random(3_000_017, torch.float64, 5)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.torchcast.cast_with_stats(x, torch.bfloat16)[1])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_sum_beats_naive_float32():
    # Many error terms of very different sizes: a plain float32 running sum
    # drifts, the kernel's lane sums stay within 1e-6 of math.fsum.
    g = np.random.default_rng(7)
    x = torch.from_numpy(np.exp(g.uniform(-8, 8, 1 << 22)).astype(np.float32))
    _, s = op_stats(x, torch.bfloat16)
    err = np.abs(x.numpy().astype(np.float64) - to_numpy64(x.to(torch.bfloat16)))
    exact = math.fsum(err.tolist())
    naive = float(np.cumsum(err.astype(np.float32), dtype=np.float32)[-1])
    ours_rel = abs(s.sum_abs_err - exact) / exact
    naive_rel = abs(naive - exact) / exact
    assert ours_rel < 1e-6
    assert naive_rel > 100 * ours_rel


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
                                     (torch.bfloat16, torch.float8_e4m3fn)], ids=str)
def test_sums_hold_any_square(device, src, dst):
    """|x| from 1e-30 to 3e38, whose squares leave float32's range from
    ~1.8e19 on (and e4m3fn's saturated errors with them). The CPU sums in
    float64: within 1e-6 of math.fsum and a finite SQNR. CUDA sums in
    compensated float32 (memory-bound on GPUs with slow float64): there the
    sums past float32's range read inf."""
    g = np.random.default_rng(3)
    mags = 10.0 ** g.uniform(-30, 38.5, 4096)
    x = torch.from_numpy(mags * g.choice([-1.0, 1.0], mags.size)).to(src)
    y, s = op_stats(x, dst, device)
    ref = stats_reference(x, dst)
    assert ref["sum_sq"] > 1e70
    for name in SUM_FIELDS:
        if device == "cpu" or ref[name] <= torch.finfo(torch.float32).max:
            assert getattr(s, name) == pytest.approx(ref[name], rel=1e-6, abs=0), name
        else:
            assert getattr(s, name) == math.inf, name
    if device == "cpu":
        assert math.isfinite(s.sqnr_db)


@pytest.mark.slow
def test_sum_within_1e6_of_fsum_at_2_24():
    x = wide_random(1 << 24, torch.float32, 11) * 1e-20
    _, s = op_stats(x, torch.float16)
    ref = stats_reference(x, torch.float16)
    assert abs(s.sum_abs_err - ref["sum_abs_err"]) <= 1e-6 * ref["sum_abs_err"]


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason=(
    "checks the compiled kernel's 64-bit indexing; the pure-PyTorch build materializes float64 "
    "intermediates of the expanded input (over 16 GB at 2^31 elements)"))
@pytest.mark.slow
@pytest.mark.xdist_group("over-2-31-elements")
@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16),
                                     (torch.float16, torch.float8_e4m3fn)])
def test_more_than_2_31_elements(src, dst):
    n = (1 << 31) + 5
    x = torch.tensor([1.0 + 2.0 ** -10], dtype=src).expand(n)  # one element of input
    y, stats = torch.ops.torchcast.cast_with_stats(x, dst)
    s = CastStats.from_tensor(stats)
    assert s.numel == n and s.inexact == n and y.numel() == n and s.amax == 1.0 + 2.0 ** -10
    assert float(y[-1]) == 1.0 and float(y[n // 2]) == 1.0
    assert s.max_abs_err == 2.0 ** -10
    assert abs(s.sum_abs_err - n * 2.0 ** -10) <= 1e-6 * n * 2.0 ** -10
    del y


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float64), (torch.float16, torch.float32),
                                     (torch.bfloat16, torch.float64), (torch.float32, torch.float32),
                                     (torch.float16, torch.float16),
                                     pytest.param(torch.float64, torch.float64,
                                                  marks=pytest.mark.cuda_cases)])
@pytest.mark.parametrize("shape", [(10, 3), pytest.param((70001,), marks=pytest.mark.cuda_cases)])
def test_exact_casts_zero_loss_and_copy(device, src, dst, shape):
    """An exact cast loses nothing; its stats are numel, the NaN it carries
    (a NaN gradient widened for the optimizer is still news) and amax; in
    every layout (a strided x is measured through its dense y)."""
    base = torch.randn(shape).to(src)
    base.view(-1)[::7] = math.nan
    base.view(-1)[3] = math.inf
    views = [base, base[::3], base[1:].t() if base.dim() == 2 else base[5:].view(-1, 4)[:, 1:3]]
    for x in views:
        y, s = op_stats(x, dst, device)
        x = on_device(x, device)
        assert y.data_ptr() != x.data_ptr()
        assert torch.equal(y.isnan(), x.isnan())
        assert torch.equal(y.nan_to_num(), x.to(dst).nan_to_num())
        ref = x.double().cpu().numpy()
        amax = float(np.abs(ref[np.isfinite(ref)]).max())
        assert s == CastStats(src, dst, numel=x.numel(), nan=int(np.isnan(ref).sum()),
                              inf=int(np.isinf(ref).sum()), amax=amax)
        assert torch.equal(cast_ref.cast_with_stats(x.cpu(), dst)[1], op(x.cpu(), dst)[1])


@pytest.mark.parametrize("src,dst", [(torch.int32, torch.float32),
                                     (torch.float8_e4m3fn, torch.float8_e5m2),
                                     (torch.float8_e5m2, torch.float8_e4m3fn), (torch.float32, torch.int64),
                                     (torch.complex64, torch.float32), (torch.bool, torch.float16)])
def test_unsupported_pairs_name_both_dtypes(device, src, dst):
    x = torch.zeros(3, dtype=src, device=device)
    with pytest.raises(TypeError) as err:
        torch.ops.torchcast.cast_with_stats(x, dst)
    msg = str(err.value)
    assert str(src) in msg and str(dst) in msg and "float16<->bfloat16" in msg


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_opcheck(device, src, dst):
    x = (torch.randn(33, 7, dtype=torch.float64) * 1e3).to(src).to(device)
    torch.library.opcheck(op.default, (x, dst))
    torch.library.opcheck(op.default, (x.t(), dst))
    # Two of opcheck's tests do arithmetic on y that torch has no float8
    # kernels for: the AOT test backpropagates through it (sum) and compares
    # a mutated out, the schema test compares a mutated out (mul). The other
    # pairs run them on the same schema; tests/test_float8.py compiles the
    # float8 out= variant and checks the backward.
    float8 = dst.itemsize == 1
    grad_tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    grad_tests += () if float8 else ("test_aot_dispatch_dynamic",)
    out_tests = ("test_autograd_registration", "test_faketensor")
    out_tests += () if float8 else ("test_aot_dispatch_dynamic", "test_schema")
    torch.library.opcheck(op.default, (x.clone().requires_grad_(), dst), test_utils=grad_tests)
    torch.library.opcheck(op.default, (x.t().requires_grad_(), dst), test_utils=grad_tests)
    torch.library.opcheck(op.out, (x, dst), {"out": torch.empty(33, 7, dtype=dst, device=device)},
                          test_utils=out_tests)
    torch.library.opcheck(op.default, (x, dst), {"saturate": True})
    # In range: e4m3fn's overflow is NaN, and opcheck compares with NaN != NaN.
    torch.library.opcheck(op.default, (x / 1e3, dst), {"saturate": False})


def test_opcheck_same_dtype_returns_copy():
    x = torch.randn(5, 4)
    torch.library.opcheck(torch.ops.torchcast.cast_with_stats.default, (x, torch.float32))


def test_meta_tensors_use_the_fake_kernel():
    x = torch.empty(4, 5, dtype=torch.float64, device="meta")
    y, stats = torch.ops.torchcast.cast_with_stats(x, torch.float16)
    assert y.device.type == "meta" and y.shape == (4, 5) and stats.shape == (len(STAT_FIELDS),)


# --- hypothesis: random shapes, strides and pairs -------------------------------

@st.composite
def strided_inputs(draw):
    src, dst = draw(st.sampled_from(PAIRS))
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 9)) for _ in range(ndim)]
    steps = [draw(st.integers(1, 3)) for _ in range(ndim)]
    big = [s * k for s, k in zip(shape, steps)]
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e5, 1e40]))
    seed = draw(st.integers(0, 2 ** 31))
    data = torch.from_numpy(np.asarray(np.random.default_rng(seed).standard_normal(big) * scale)).to(src)
    x = data[tuple(slice(None, None, k) for k in steps)]
    if ndim >= 2 and draw(st.booleans()):
        x = x.transpose(0, ndim - 1)
    return x, dst


def assert_op_matches_references(x, dst, device):
    """y and stats against numpy, and the stats bit for bit against the
    kernel's order restated in PyTorch."""
    y, s = op_stats(x, dst, device)
    assert_matches_reference(x, dst, y, s)
    _, ref_stats = cast_ref.cast_with_stats(on_device(x, device), dst)
    assert torch.equal(op(on_device(x, device), dst)[1], ref_stats)


# The device fixture is a string, the same for every example.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(strided_inputs())
def test_hypothesis_against_references(device, case):
    assert_op_matches_references(*case, device)


@st.composite
def permuted_views(draw):
    """Every class of value, in up to 4 dims: a base sliced with steps and
    offsets in each dim, then permuted."""
    src, dst = draw(st.sampled_from(PAIRS), label="pair")
    ndim = draw(st.integers(1, 4), label="ndim")
    shape = draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim), label="shape")
    steps = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim), label="steps")
    starts = draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim), label="starts")
    perm = draw(st.permutations(range(ndim)), label="perm")
    full = [sh * sp + s for sh, sp, s in zip(shape, steps, starts)]
    assume(math.prod(full) <= 1 << 20)
    base = sample(math.prod(full), src, seed=len(full)).reshape(full)
    x = base[tuple(slice(s, None, sp) for s, sp in zip(starts, steps))].permute(*perm)
    return x, dst


@pytest.mark.cuda_cases
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(permuted_views())
def test_permuted_views_against_references(device, case):
    assert_op_matches_references(*case, device)


# --- safe_to --------------------------------------------------------------------

def test_safe_to_gradient_flows_in_source_dtype(device):
    x = torch.randn(6, dtype=torch.float64, device=device, requires_grad=True)
    y = torchcast.safe_to(x, torch.float32, policy="ignore")
    (y * torch.arange(6.0, device=device)).sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.device == x.device
    assert torch.equal(x.grad, torch.arange(6.0, dtype=torch.float64, device=device))


@pytest.mark.cuda_cases
def test_op_gradient_flows_in_source_dtype(device):
    x = torch.randn(1000, dtype=torch.float64, device=device, requires_grad=True)
    y, _ = op(x, torch.float16)
    (y.float() * 2).sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.device == x.device
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_gradcheck_and_double_backward():
    x = torch.rand(5, dtype=torch.float64, requires_grad=True) + 0.5
    f32 = lambda t: torchcast.safe_to(t, torch.float32, policy="ignore").to(torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(f32, (x,), eps=1e-3, atol=1e-3)
    assert torch.autograd.gradgradcheck(f32, (x,), eps=1e-3, atol=1e-3)
    same = lambda t: torch.ops.torchcast.cast_with_stats(t, torch.float64)[0] ** 2  # noqa: E731
    assert torch.autograd.gradcheck(same, (x,))
    assert torch.autograd.gradgradcheck(same, (x,))
    # double backward through a low-precision cast: d/dx of (d/dx sum(y^2)) = 2
    x2 = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    y = torchcast.safe_to(x2, torch.bfloat16, policy="ignore")
    (g,) = torch.autograd.grad((y.float() ** 2).sum(), x2, create_graph=True)
    assert torch.equal(g, torch.tensor([3.0, -4.0], dtype=torch.float64))
    (gg,) = torch.autograd.grad(g.sum(), x2)
    assert torch.equal(gg, torch.tensor([2.0, 2.0], dtype=torch.float64))


def test_policy_warn_raise_record_ignore():
    x = torch.tensor([1.0, 1e6, 1e-9], dtype=torch.float64)
    with pytest.warns(torchcast.PrecisionWarning, match=r"1 overflowed to inf, 1 underflowed"):
        torchcast.safe_to(x, torch.float16, policy="warn")
    with pytest.raises(torchcast.PrecisionLossError, match=r"safe_to\(weights\).*torch.float64 to torch.float16") as e:
        torchcast.safe_to(x, torch.float16, policy="raise", name="weights")
    assert e.value.stats.overflow == 1 and e.value.stats.underflow == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchcast.safe_to(x, torch.float16, policy="ignore")
        y = torchcast.safe_to(x, torch.float16, policy="record")
    assert torchcast.last_stats().overflow == 1
    assert torch.equal(y, torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float16))


def test_ordinary_rounding_is_no_violation_but_rtol_atol_are():
    x = torch.tensor([1.0 / 3.0, 2.0 / 3.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchcast.safe_to(x, torch.float16, policy="raise")
    with pytest.raises(torchcast.PrecisionLossError, match=r"2 broke rtol=1e-05"):
        torchcast.safe_to(x, torch.float16, policy="raise", rtol=1e-5)
    with pytest.raises(torchcast.PrecisionLossError, match=r"1 broke atol=0.0001"):
        torchcast.safe_to(x, torch.float16, policy="raise", atol=1e-4)


def test_set_policy_and_block_policy_are_per_thread():
    previous = torchcast.set_policy("raise")
    try:
        x = torch.tensor([1e6], dtype=torch.float64)
        seen = {}

        def worker():
            with torchcast.policy("ignore"):
                torchcast.safe_to(x, torch.float16)
                seen["worker"] = torchcast.get_policy()

        with torchcast.policy("record"):
            t = threading.Thread(target=worker)
            t.start()
            t.join()
            assert torchcast.get_policy() == "record"
            torchcast.safe_to(x, torch.float16)
        assert seen["worker"] == "ignore"
        with pytest.raises(torchcast.PrecisionLossError):
            torchcast.safe_to(x, torch.float16)
    finally:
        torchcast.set_policy(previous)
    with pytest.raises(ValueError, match="unknown policy"):
        torchcast.set_policy("loud")


def test_last_stats_is_per_thread_and_lazy():
    x = torch.tensor([1.0, 1e6], dtype=torch.float64)
    torchcast.safe_to(x, torch.float16, policy="record")
    from torchcast import cast as cast_module
    pending = cast_module._local.last
    assert pending._value is None and isinstance(pending.tensor, torch.Tensor)
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("s", torchcast.last_stats()))
    t.start()
    t.join()
    assert other["s"] is None
    assert torchcast.last_stats().overflow == 1


def test_grad_cut_to_integer_is_a_violation():
    x = torch.tensor([1.7, -2.2], requires_grad=True)
    with pytest.raises(torchcast.PrecisionLossError, match="cuts the autograd graph"):
        torchcast.safe_to(x, torch.int64, policy="raise")
    with pytest.warns(torchcast.PrecisionWarning, match="cuts the autograd graph"):
        y = torchcast.safe_to(x, torch.bool, policy="warn")
    assert y.dtype == torch.bool
    assert torch.equal(torchcast.safe_to(x.detach(), torch.int64, policy="raise"), torch.tensor([1, -2]))


def test_bad_arguments():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        torchcast.safe_to([1.0], torch.float16)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        torchcast.safe_to(torch.ones(2), "float16")
    with pytest.raises(TypeError, match="autocast is not enabled"):
        torchcast.safe_to(torch.ones(2))
    with pytest.raises(TypeError, match="torch.int32 to torch.float16"):
        torchcast.safe_to(torch.ones(2, dtype=torch.int32), torch.float16)


def test_same_dtype_returns_input():
    x = torch.randn(3)
    assert torchcast.safe_to(x, torch.float32) is x


def test_autocast_neither_recasts_input_nor_output(device):
    x = (torch.randn(64, 64, dtype=torch.float64) * 1e3).to(device)
    expected_y, expected = op_stats(x, torch.float16)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = torchcast.safe_to(x, torch.float16, policy="record")
        s = torchcast.last_stats()
        y_auto = torchcast.safe_to(x, policy="record")  # the autocast dtype
        s_auto = torchcast.last_stats()
        z = torch.mm(y_auto, y_auto)  # autocast still works around it
    assert y.dtype == torch.float16 and torch.equal(y, expected_y)
    assert s == expected
    assert y_auto.dtype == torch.bfloat16 and s_auto.dtype == torch.bfloat16
    assert z.dtype == torch.bfloat16
    assert s_auto == op_stats(x, torch.bfloat16)[1]


@pytest.mark.cuda_cases
@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_autocast_passes_through(device, autocast_dtype, src, dst):
    x = sample(40000, src, seed=13)
    want_y, want_stats = op(x, dst)  # on the CPU, outside autocast
    with torch.autocast(device, dtype=autocast_dtype):
        y, stats = op(on_device(x, device), dst)
        y_auto = torchcast.safe_to(on_device(x, device), policy="record")  # the autocast dtype
        s_auto = torchcast.last_stats()
    assert y.dtype == dst
    assert torch.equal(bits(y.cpu()), bits(want_y))
    assert torch.equal(stats.cpu().view(torch.int64), want_stats.view(torch.int64))
    auto_y, auto_stats = op(x, autocast_dtype)
    assert y_auto.dtype == autocast_dtype and torch.equal(bits(y_auto.cpu()), bits(auto_y))
    assert s_auto == CastStats.from_tensor(auto_stats, src, autocast_dtype)


def test_fallback_is_used_where_no_kernel_exists(monkeypatch):
    monkeypatch.setattr(_ops, "has_kernel", lambda op, device: False)
    monkeypatch.setattr(_ops, "_cast_entry", lambda *args: None)  # declines, as for such a device
    monkeypatch.setattr(_ops, "_warned_fallback", set())
    x = wide_random(5000, torch.float64, 9).requires_grad_()
    with pytest.warns(RuntimeWarning, match="pure-PyTorch implementation"):
        y, stats = _ops.cast_with_stats(x, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        y2 = torchcast.safe_to(x, torch.bfloat16, policy="record")
    ky, kstats = torch.ops.torchcast.cast_with_stats(x.detach(), torch.bfloat16)
    assert torch.equal(stats, kstats) and torch.equal(y.detach(), ky) and torch.equal(y2.detach(), ky)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


CAST_OP = torch.ops.torchcast.cast_with_stats.default


def test_cast_reaches_torch_function_modes_subclasses_and_dispatch_modes():
    """torchcast.cast_with_stats calls the op through a C++ entry that skips
    torch.ops' argument boxing; it must keep what torch.ops gives: a torch
    function mode and a subclass overriding __torch_function__ see the op,
    as does a dispatch mode, and nn.Parameter (which disables
    __torch_function__) is cast with its gradient."""
    x = wide_random(300, torch.float64, 5)
    ref_y, ref_stats = CAST_OP(x, torch.float16)
    with FunctionsSeen() as mode:
        y, stats = torchcast.cast_with_stats(x, torch.float16)
    assert CAST_OP in mode.seen
    assert torch.equal(y, ref_y) and torch.equal(stats, ref_stats)

    LoggedTensor.seen.clear()
    y, stats = torchcast.cast_with_stats(x.as_subclass(LoggedTensor), torch.float16)
    assert CAST_OP in LoggedTensor.seen
    assert torch.equal(y.as_subclass(torch.Tensor), ref_y)
    assert torch.equal(stats.as_subclass(torch.Tensor), ref_stats)

    with OpsSeen() as mode:
        y, stats = torchcast.cast_with_stats(x, torch.float16)
    assert CAST_OP in mode.seen
    assert torch.equal(y, ref_y) and torch.equal(stats, ref_stats)

    p = torch.nn.Parameter(x.clone())
    y, stats = torchcast.cast_with_stats(p, torch.float16)
    assert torch.equal(y.detach(), ref_y) and torch.equal(stats, ref_stats)
    (y.double() * 3).sum().backward()
    assert torch.equal(p.grad, torch.full_like(x, 3.0))


def test_cast_leaves_argument_errors_to_torch_ops():
    x = torch.randn(8)
    for args in ((x, "float16"), (x, torch.float16, 2.0)):
        with pytest.raises(RuntimeError) as ours:
            torchcast.cast_with_stats(*args[:2], scale=args[2] if len(args) > 2 else None)
        with pytest.raises(RuntimeError) as theirs:
            CAST_OP(*args)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("saturate", [None, True, False])
@pytest.mark.parametrize("scaled", [False, True])
def test_cast_passes_scale_and_saturate_as_torch_ops_does(saturate, scaled):
    x = wide_random(2000, torch.float32, 6)
    x[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30])
    scale = torch.tensor(0.25) if scaled else None
    y, stats = torchcast.cast_with_stats(x, torch.float8_e4m3fn, scale=scale, saturate=saturate)
    ref_y, ref_stats = CAST_OP(x, torch.float8_e4m3fn, scale, saturate=saturate)
    assert torch.equal(y.view(torch.uint8), ref_y.view(torch.uint8))
    assert torch.equal(stats, ref_stats)


def test_torch_compile_fullgraph_no_graph_break(device):
    def f(t):
        y = torchcast.safe_to(t, torch.bfloat16, policy="record")
        return y.float() * 2

    def g(t):
        return torch.ops.torchcast.cast_with_stats(t, torch.float16)

    x = torch.randn(1000, dtype=torch.float64, device=device) * 1e3
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
    cy, cs = torch.compile(g, fullgraph=True)(x)
    ey, es = g(x)
    assert torch.equal(cy, ey) and torch.equal(cs, es)
    explain = torch._dynamo.explain(f)(x)
    assert explain.graph_break_count == 0


@pytest.mark.cuda_cases
def test_torch_compile_dynamic_sizes(device):
    # One dynamic-shape graph around the op for sizes within a chunk, past one
    # and over several.
    def f(x, scale):
        y, stats = op(x * scale, torch.bfloat16)
        return y.float() + 1, stats

    def g(x):
        return torchcast.safe_to(x, torch.float16, policy="record").float() * 2

    torch._dynamo.reset()
    compiled_f = torch.compile(f, fullgraph=True, dynamic=True)
    compiled_g = torch.compile(g, fullgraph=True)
    for n in (1000, 70001, 3 * 65536):
        x = sample(n, torch.float32, seed=n).to(device)
        eager = f(x, 3.0)
        got = compiled_f(x, 3.0)
        assert torch.equal(bits(eager[0]), bits(got[0]))
        assert torch.equal(eager[1].view(torch.int64), got[1].view(torch.int64))
        assert torch.equal(bits(g(x)), bits(compiled_g(x)))


def test_nn_cast_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).double(), torchcast.nn.Cast(torch.float32, policy="record"),
                                torch.nn.Linear(4, 2))
    out = model(torch.randn(3, 4, dtype=torch.float64))
    out.sum().backward()
    assert out.dtype == torch.float32 and model[0].weight.grad is not None
    assert torchcast.last_stats().numel == 12
    assert "dtype=torch.float32" in repr(model[1])


def test_cast_stats_merge_dict_str():
    a = op_stats(torch.tensor([1e6, 1.0 / 3], dtype=torch.float64), torch.float16)[1]
    b = op_stats(torch.tensor([1e-9, 0.1], dtype=torch.float64), torch.float16)[1]
    m = a + b
    assert m.numel == 4 and m.overflow == 1 and m.underflow == 1
    assert m.max_rel_err == max(a.max_rel_err, b.max_rel_err)
    assert m.sum_abs_err == a.sum_abs_err + b.sum_abs_err
    d = m.to_dict()
    assert d["dtype"] == "torch.float16" and d["overflow"] == 1 and "sqnr_db" in d
    assert "float64->float16: 4 elements" in str(m)
    exact = op_stats(torch.ones(3, dtype=torch.float64), torch.float16)[1]
    assert exact.sqnr_db == math.inf and exact.lossless
    with pytest.raises(dataclasses_frozen_error()):
        m.numel = 3


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_sqnr_matches_numpy():
    x = torch.randn(10000, dtype=torch.float64)
    s = op_stats(x, torch.bfloat16)[1]
    y = round_to_format(x.numpy(), torch.bfloat16)
    ref = 10 * np.log10(np.sum(x.numpy() ** 2) / np.sum((x.numpy() - y) ** 2))
    assert abs(s.sqnr_db - ref) < 1e-4


# --- dtype names in errors --------------------------------------------------------

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_unsupported_dtype_named_as_python_writes_it(dtype):
    if dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                 torch.float8_e4m3fn, torch.float8_e5m2):
        return
    x = torch.zeros(3)
    for cast in (torch.ops.torchcast.cast_with_stats, cast_ref.cast_with_stats):
        with pytest.raises(TypeError) as err:
            cast(x, dtype)
        assert str(dtype) in str(err.value), str(err.value)
    with pytest.raises(TypeError) as err:
        torch.ops.torchcast.cast_with_stats.out(x, dtype, out=torch.empty(3))
    assert str(dtype) in str(err.value)
    try:
        bad = torch.zeros(3, dtype=dtype)
    except (RuntimeError, TypeError):
        return  # quantized and bit dtypes cannot be made by zeros()
    with pytest.raises(TypeError) as err:
        torch.ops.torchcast.cast_with_stats(bad, torch.float16)
    assert str(dtype) in str(err.value), str(err.value)


# --- NaN bits ---------------------------------------------------------------------

def all_float32_nans():
    """Every float32 NaN: both signs, every nonzero mantissa."""
    mant = torch.arange(1, 1 << 23, dtype=torch.int32)
    pos = mant | 0x7F800000
    return torch.cat([pos, pos | torch.tensor(-(1 << 31), dtype=torch.int32)]).view(torch.float32)


def bits16(t):
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def float64_nan_samples():
    g = torch.Generator().manual_seed(11)
    payload = torch.randint(1, 1 << 52, (100_000,), generator=g, dtype=torch.int64)
    fixed = torch.tensor([1, 1 << 51, (1 << 52) - 1, 1 << 29, (1 << 29) - 1, 1 << 42], dtype=torch.int64)
    pos = torch.cat([fixed, payload]) | 0x7FF0000000000000
    return torch.cat([pos, pos | torch.tensor(-(1 << 63), dtype=torch.int64)]).view(torch.float64)


def test_float32_to_float16_nan_bits_match_torch_for_every_payload():
    # torch (F16C, and its AVX2/AVX-512 loops at any layout): sign kept, quiet
    # bit set, the top 10 mantissa bits kept.
    x = all_float32_nans()
    want = bits16(x.to(torch.float16))
    u = x.view(torch.int32)
    assert torch.equal(want, ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF))
    y, stats = torch.ops.torchcast.cast_with_stats(x, torch.float16)
    assert torch.equal(bits16(y), want)
    assert stats[1] == x.numel()
    assert torch.equal(bits16(cast_ref.correctly_rounded(x, torch.float16)), want)
    strided = torch.stack([x, x], 1)[:, 0]
    assert torch.equal(bits16(torch.ops.torchcast.cast_with_stats(strided, torch.float16)[0]), want)


def test_float32_to_bfloat16_nan_is_0x7fc0_for_every_payload():
    # torch's answer depends on the layout (contiguous AVX2/AVX-512: 0xffff;
    # strided or ATEN_CPU_CAPABILITY=default: c10::BFloat16's 0x7fc0); ours is
    # always 0x7fc0.
    x = all_float32_nans()
    assert bool((bits16(x[::7].to(torch.bfloat16)) == 0x7FC0).all())
    assert bool((bits16(x.to(torch.bfloat16)) == 0xFFFF).all()) or \
        torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    y, _ = torch.ops.torchcast.cast_with_stats(x, torch.bfloat16)
    assert bool((bits16(y) == 0x7FC0).all())
    assert bool((bits16(cast_ref.correctly_rounded(x, torch.bfloat16)) == 0x7FC0).all())


def test_float64_nan_bits_match_torch():
    x = float64_nan_samples()
    y32, _ = torch.ops.torchcast.cast_with_stats(x, torch.float32)
    want32 = x.to(torch.float32).view(torch.int32)
    assert torch.equal(y32.view(torch.int32), want32)
    assert torch.equal(cast_ref.correctly_rounded(x, torch.float32).view(torch.int32), want32)
    y16, _ = torch.ops.torchcast.cast_with_stats(x, torch.float16)
    assert torch.equal(bits16(y16), bits16(x.to(torch.float16)))
    assert torch.equal(bits16(cast_ref.correctly_rounded(x, torch.float16)), bits16(y16))
    yb, _ = torch.ops.torchcast.cast_with_stats(x, torch.bfloat16)
    assert bool((bits16(yb) == 0x7FC0).all())
    assert torch.equal(bits16(cast_ref.correctly_rounded(x, torch.bfloat16)), bits16(yb))


# --- devices: the fake kernels refuse a meta tensor among real ones -----------------

def test_out_on_another_device_raises_before_writing():
    x = torch.randn(4, 5)
    out_meta = torch.empty(4, 5, dtype=torch.float16, device="meta")
    for call in (lambda: torch.ops.torchcast.cast_with_stats.out(x, torch.float16, out=out_meta),
                 lambda: _ops.cast_with_stats(x, torch.float16, out=out_meta),
                 lambda: torchcast.cast_with_stats(x, torch.float16, out=out_meta)):
        with pytest.raises(RuntimeError, match="out is on meta but x is on cpu"):
            call()
    out = torch.full((4, 5), 7.0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="out is on cpu but x is on meta"):
        torch.ops.torchcast.cast_with_stats.out(x.to("meta"), torch.float16, out=out)
    assert bool((out == 7).all())
    # all on meta: the fake kernel, as before
    stats = torch.ops.torchcast.cast_with_stats.out(x.to("meta"), torch.float16, out=out_meta)
    assert stats.device.type == "meta" and stats.shape == (len(STAT_FIELDS),)


def adam_operands(device="cpu"):
    g = torch.Generator().manual_seed(0)
    p = [torch.randn(3, 2, generator=g) for _ in range(2)]
    return [[t.to(device) for t in p], [t.to(device) * 0.1 for t in p],
            [torch.zeros(3, 2, device=device) for _ in p], [torch.zeros(3, 2, device=device) for _ in p],
            [], [], [torch.tensor(0.0) for _ in p]]


ADAM_KW = dict(beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
               decoupled_weight_decay=False, compensation="none")


@pytest.mark.parametrize("where,what", [((2, 1), "exp_avg 1 is on meta but its param is on cpu"),
                                        ((1, 0), "grad 0 is on meta but its param is on cpu"),
                                        ((0, 1), "param 1 is on meta but param 0 is on cpu"),
                                        ((6, 0), "state_step 0 is on meta but state steps must be on the CPU"),
                                        ("grad_scale", "grad_scale is on meta"),
                                        ("found_inf", "found_inf is on meta"),
                                        ("lr", "lr is on meta")])
def test_adam_meta_tensor_among_cpu_ones_raises_and_changes_nothing(where, what):
    ops = adam_operands()
    kw = dict(ADAM_KW, lr=1e-3)
    if isinstance(where, tuple):
        ops[where[0]][where[1]] = ops[where[0]][where[1]].to("meta")
    elif where == "lr":
        kw["lr"] = torch.tensor(1e-3, device="meta")
    else:
        kw[where] = torch.tensor(1.0, device="meta")
    before = [[t.clone() for t in group] for group in ops]
    op = torch.ops.torchcast.adam_step_.tensor_lr if where == "lr" else torch.ops.torchcast.adam_step_
    with pytest.raises(RuntimeError, match=what):
        op(*ops, **kw)
    for group, old in zip(ops, before):
        for t, o in zip(group, old):
            if t.device.type == "cpu":
                assert torch.equal(t, o)


def test_adam_all_meta_stays_the_fake_path():
    ops = adam_operands("meta")
    torch.ops.torchcast.adam_step_(*ops, lr=1e-3, **ADAM_KW)  # CPU step counts, as in real use
    ops[6] = [s.to("meta") for s in ops[6]]
    torch.ops.torchcast.adam_step_(*ops, lr=1e-3, grad_scale=torch.tensor(1.0, device="meta"), **ADAM_KW)
    torch.ops.torchcast.adam_step_.tensor_lr(*ops, lr=torch.tensor(1e-3), **ADAM_KW)


# --- out=: autograd and aliasing -----------------------------------------------------

OUT_GRAD = "don't support automatic differentiation, but one of the arguments requires grad"


def test_out_refuses_autograd_like_torch():
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    out = torch.empty(6, dtype=torch.float16)
    leaf = torch.empty(6, dtype=torch.float16, requires_grad=True)
    with pytest.raises(RuntimeError, match=OUT_GRAD):
        torch.add(x, 1, out=torch.empty(6, dtype=torch.float64))  # torch's own wording
    for call in (torch.ops.torchcast.cast_with_stats.out, _ops.cast_with_stats,
                 cast_ref.cast_with_stats):
        for a, o in ((x, out), (x.detach(), leaf)):
            with pytest.raises(RuntimeError, match=OUT_GRAD):
                call(a, torch.float16, out=o)
    with torch.no_grad():  # as torch: allowed without grad mode
        torch.ops.torchcast.cast_with_stats.out(x, torch.float16, out=leaf)
        assert torch.equal(leaf, x.detach().half())


def test_out_refuses_autograd_on_the_fallback(monkeypatch):
    monkeypatch.setattr(_ops, "has_kernel", lambda op, device: False)
    monkeypatch.setattr(_ops, "_warned_fallback", {"cpu"})
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=OUT_GRAD):
        _ops.cast_with_stats(x, torch.float16, out=torch.empty(6, dtype=torch.float16))


def aliasing_outs():
    """(x, out) pairs whose out overlaps x or itself."""
    n = 8
    x = torch.randn(2 * n)
    yield "strided view of x", x, x.view(torch.float16)[::2]
    x = torch.randn(2 * n)
    yield "tail of x", x, x.view(torch.float16)[2 * n:]
    x = torch.randn(n, dtype=torch.float64)
    yield "float64 x, float32 out inside it", x, x.view(torch.float32)[::2]
    x = torch.randn(n, dtype=torch.float64)
    yield "expanded out", x, torch.empty(1, dtype=torch.float32).expand(n)
    x = torch.randn(4, 4, dtype=torch.float64)
    yield "as_strided out overlapping itself", x, torch.empty(16, dtype=torch.float32).as_strided((4, 4), (2, 1))


@pytest.mark.parametrize("case", range(5))
def test_out_aliasing_x_or_itself_raises_before_writing(case):
    name, x, out = list(aliasing_outs())[case]
    dtype = out.dtype
    for call in (torch.ops.torchcast.cast_with_stats.out, cast_ref.cast_with_stats):
        x_before = x.clone()
        with pytest.raises(RuntimeError, match="shares memory with x|elements share memory"):
            call(x, dtype, out=out)
        assert torch.equal(x, x_before), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "strided", "empty", "0-d", "large",
                                    "large, non-finite only"])
def test_exact_cast_stats_count_every_nan_bit_pattern(device, dtype, layout):
    """The NaN count of an exact cast (bit compares on the CPU) against
    torch.isnan, over NaN payloads of both signs, infinities and the largest
    finite values, in every layout; non-finite only: every element counted
    (the CPU counts in blocks with counters as wide as the elements)."""
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
    info = torch.finfo(dtype)
    specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, info.max, -info.max,
                             info.tiny, 0.0, -0.0], dtype=torch.float64).to(dtype)
    mantissa_bits = {torch.float64: 52, torch.float32: 23, torch.float16: 10,
                     torch.bfloat16: 7}[dtype]
    payloads = (specials[2:3].view(bits) | torch.tensor([1, (1 << mantissa_bits) - 1], dtype=bits))
    values = torch.cat([specials, payloads.view(dtype), -payloads.view(dtype)])
    if layout == "large, non-finite only":
        values = values[~torch.isfinite(values)]
    n = (1 << 17) + 5 if layout.startswith("large") else 600  # past a 2^16 chunk: several threads
    x = values[torch.randint(0, len(values), (n,), generator=torch.Generator().manual_seed(0))]
    x = {"contiguous": x, "permuted": x[:600].view(20, 30).t(), "strided": x[::3], "empty": x[:0],
         "0-d": x[0]}.get(layout, x)
    x = on_device(x, device)
    stats = _ops.exact_cast_stats(x)
    assert stats.device == x.device and stats.dtype == torch.float64
    expected = torch.zeros(len(STAT_FIELDS), dtype=torch.float64)
    xd = x.cpu().double()
    for name, value in (("numel", x.numel()), ("nan", torch.isnan(xd).sum().item()),
                        ("inf", torch.isinf(xd).sum().item()),
                        ("amax", torch.where(torch.isfinite(xd), xd.abs(), 0).max().item()
                         if x.numel() else 0)):
        expected[STAT_FIELDS.index(name)] = value
    assert torch.equal(stats.cpu(), expected)
    assert torch.equal(cast_ref.exact_cast_stats(x.cpu()), expected)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "NaN only"])
def test_exact_cast_stats_of_every_float8_value(device, dtype, layout):
    """A float8 x widened exactly: NaN, inf and amax over all 256 bit
    patterns, against ml_dtypes' decoding (e4m3fn has no inf; its NaN is
    0x7f/0xff, e5m2's are 0x7d-0x7f/0xfd-0xff); NaN only: 600 NaN, past the
    CPU's 255-element blocks of 8-bit counters."""
    import ml_dtypes
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = codes.repeat(300).view(dtype)  # past a 2^16 chunk
    x = {"contiguous": x, "strided": x[::3], "NaN only": x[x.view(torch.uint8) | 0x80 == 0xff]}[layout]
    np_dtype = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
                torch.float8_e5m2: ml_dtypes.float8_e5m2}[dtype]
    v = x.view(torch.uint8).numpy().view(np_dtype).astype(np.float64)
    stats = CastStats.from_tensor(_ops.exact_cast_stats(on_device(x, device)))
    assert (stats.numel, stats.nan, stats.inf) == (v.size, np.isnan(v).sum(), np.isinf(v).sum())
    assert stats.amax == np.abs(v[np.isfinite(v)]).max(initial=0)
    for wide in (torch.float32, torch.bfloat16, torch.float16):
        y, s = torch.ops.torchcast.cast_with_stats(on_device(x, device), wide)
        assert s.cpu().tolist() == _ops.exact_cast_stats(on_device(x, device)).cpu().tolist()
        assert np.array_equal(y.cpu().double().numpy(), v, equal_nan=True)
