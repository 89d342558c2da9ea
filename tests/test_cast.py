"""cast_with_stats and safe_to against independent numpy float64 references."""
import math
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcast
from torchcast import _ops
from torchcast._reference import cast as cast_ref
from torchcast.stats import CastStats

from numpy_ref import edge_values, round_to_format, stats_reference, to_numpy64

PAIRS = cast_ref.LOSSY_PAIRS
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRS]
EXACT_FIELDS = ("numel", "nan", "inexact", "overflow", "underflow", "subnormal",
                "max_abs_err", "max_rel_err")
SUM_FIELDS = ("sum_abs_err", "sum_sq_err", "sum_sq")


def op_stats(x, dtype):
    y, stats = torch.ops.torchcast.cast_with_stats(x, dtype)
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
def test_edge_values_exact(src, dst):
    x = edge_values(src, dst)
    y, s = op_stats(x, dst)
    assert_matches_reference(x, dst, y, s)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_random_wide_range_exact(src, dst):
    x = wide_random(100_003, src)
    y, s = op_stats(x, dst)
    assert_matches_reference(x, dst, y, s)


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


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_torch_float64_cast_rounds_twice_ours_once(dst):
    # The fact README states: torch's float64 -> float16/bfloat16 goes through
    # float32 and rounds twice; torchcast rounds once.
    # float16: just below the overflow threshold 65520 (correct: 65504, torch: inf);
    # bfloat16: just below the midpoint between 1 + 2^-7 and 1 + 2^-6 (correct: 1 + 2^-7).
    v = 65519.99999999999 if dst == torch.float16 else 1.0 + 2.0 ** -7 + 2.0 ** -8 - 2.0 ** -40
    x = torch.tensor([v], dtype=torch.float64)
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
    xs = torch.from_numpy(below_mid)
    ref = round_to_format(below_mid, dst)
    assert np.array_equal(to_numpy64(torchcast.safe_to(xs, dst, policy="ignore")), ref)
    wrong = (to_numpy64(xs.to(dst)) != ref).mean()
    assert wrong > 0.4  # about half of them


# --- statistics -------------------------------------------------------------

@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 13), (70001,)])
def test_shapes(src, dst, shape):
    x = (torch.randn(shape, dtype=torch.float64) * 1e3).to(src)
    y, s = op_stats(x, dst)
    assert y.shape == x.shape and y.dtype == dst
    assert_matches_reference(x, dst, y, s)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_non_contiguous_layouts(src, dst):
    base = (torch.randn(301, 257, dtype=torch.float64) * 300).to(src)
    for x in (base.t(), base[::3, 1::2], base[:, 5], base.unsqueeze(0).expand(3, 301, 257),
              base[1:].view(-1)[1:]):
        y, s = op_stats(x, dst)
        assert y.stride() == torch.empty_like(x, dtype=dst).stride()
        assert_matches_reference(x, dst, y, s)
        _, ref_stats = cast_ref.cast_with_stats(x, dst)
        assert torch.equal(torch.ops.torchcast.cast_with_stats(x, dst)[1], ref_stats)


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_out_variant(src, dst):
    x = (torch.randn(500, 300, dtype=torch.float64) * 100).to(src)
    out = torch.empty(300, 500, dtype=dst).t()  # a non-contiguous destination
    stats = torch.ops.torchcast.cast_with_stats.out(x, dst, out=out)
    assert_matches_reference(x, dst, out, CastStats.from_tensor(stats, src, dst))
    y2, _ = torchcast.cast_with_stats(x, dst, out=torch.empty(500, 300, dtype=dst))
    assert np.array_equal(to_numpy64(y2), to_numpy64(out))


def test_out_variant_bad_outputs():
    x = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="out has dtype torch.float32 but the cast is to torch.float16"):
        torch.ops.torchcast.cast_with_stats.out(x, torch.float16, out=torch.empty(4, 5))
    with pytest.raises(RuntimeError, match=r"out has shape \[5, 4\] but x has shape \[4, 5\]"):
        torch.ops.torchcast.cast_with_stats.out(x, torch.float16, out=torch.empty(5, 4, dtype=torch.float16))


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


def test_compensated_sum_beats_naive_float32():
    # Many error terms of very different sizes: a plain float32 running sum
    # drifts, the compensated one stays within 1e-6 of math.fsum.
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


def test_sum_within_1e6_of_fsum_at_2_24():
    x = wide_random(1 << 24, torch.float32, 11) * 1e-20
    _, s = op_stats(x, torch.float16)
    ref = stats_reference(x, torch.float16)
    assert abs(s.sum_abs_err - ref["sum_abs_err"]) <= 1e-6 * ref["sum_abs_err"]


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason=(
    "checks the compiled kernel's 64-bit indexing; the pure-PyTorch build materializes float64 "
    "intermediates of the expanded input (over 16 GB at 2^31 elements)"))
def test_more_than_2_31_elements():
    n = (1 << 31) + 5
    x = torch.tensor([1.0 + 2.0 ** -10], dtype=torch.float32).expand(n)  # 4 bytes of input
    y, stats = torch.ops.torchcast.cast_with_stats(x, torch.bfloat16)
    s = CastStats.from_tensor(stats)
    assert s.numel == n and s.inexact == n and y.numel() == n
    assert float(y[-1]) == 1.0 and float(y[n // 2]) == 1.0
    assert s.max_abs_err == 2.0 ** -10
    assert abs(s.sum_abs_err - n * 2.0 ** -10) <= 1e-6 * n * 2.0 ** -10
    del y


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float64), (torch.float16, torch.float32),
                                     (torch.bfloat16, torch.float64), (torch.float32, torch.float32),
                                     (torch.float16, torch.float16)])
def test_exact_casts_zero_loss_and_copy(src, dst):
    x = torch.randn(10, 3).to(src)
    y, s = op_stats(x, dst)
    assert y.data_ptr() != x.data_ptr()
    assert torch.equal(y, x.to(dst))
    assert s == CastStats(src, dst, numel=30)


@pytest.mark.parametrize("src,dst", [(torch.int32, torch.float32), (torch.float16, torch.bfloat16),
                                     (torch.bfloat16, torch.float16), (torch.float32, torch.int64),
                                     (torch.complex64, torch.float32), (torch.bool, torch.float16)])
def test_unsupported_pairs_name_both_dtypes(src, dst):
    x = torch.zeros(3, dtype=src)
    with pytest.raises(TypeError) as err:
        torch.ops.torchcast.cast_with_stats(x, dst)
    msg = str(err.value)
    assert str(src) in msg and str(dst) in msg and "float64->float16" in msg


@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_opcheck(src, dst):
    x = (torch.randn(33, 7, dtype=torch.float64) * 1e3).to(src)
    torch.library.opcheck(torch.ops.torchcast.cast_with_stats.default, (x, dst))
    torch.library.opcheck(torch.ops.torchcast.cast_with_stats.default, (x.t(), dst))
    torch.library.opcheck(torch.ops.torchcast.cast_with_stats.default,
                          (x.clone().requires_grad_(), dst))
    torch.library.opcheck(torch.ops.torchcast.cast_with_stats.out, (x, dst),
                          {"out": torch.empty(33, 7, dtype=dst)})


def test_opcheck_same_dtype_returns_copy():
    x = torch.randn(5, 4)
    torch.library.opcheck(torch.ops.torchcast.cast_with_stats.default, (x, torch.float32))


def test_meta_tensors_use_the_fake_kernel():
    x = torch.empty(4, 5, dtype=torch.float64, device="meta")
    y, stats = torch.ops.torchcast.cast_with_stats(x, torch.float16)
    assert y.device.type == "meta" and y.shape == (4, 5) and stats.shape == (11,)


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


@settings(max_examples=150, deadline=None)
@given(strided_inputs())
def test_hypothesis_against_references(case):
    x, dst = case
    y, s = op_stats(x, dst)
    assert_matches_reference(x, dst, y, s)
    _, ref_stats = cast_ref.cast_with_stats(x, dst)
    assert torch.equal(torch.ops.torchcast.cast_with_stats(x, dst)[1], ref_stats)


# --- safe_to --------------------------------------------------------------------

def test_safe_to_gradient_flows_in_source_dtype():
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = torchcast.safe_to(x, torch.float32, policy="ignore")
    (y * torch.arange(6.0)).sum().backward()
    assert x.grad.dtype == torch.float64
    assert torch.equal(x.grad, torch.arange(6.0, dtype=torch.float64))


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


def test_autocast_neither_recasts_input_nor_output():
    x = (torch.randn(64, 64, dtype=torch.float64) * 1e3)
    expected_y, expected = op_stats(x, torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
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


def test_fallback_is_used_where_no_kernel_exists(monkeypatch):
    monkeypatch.setattr(_ops, "has_kernel", lambda op, device: False)
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


def test_torch_compile_fullgraph_no_graph_break():
    def f(t):
        y = torchcast.safe_to(t, torch.bfloat16, policy="record")
        return y.float() * 2

    def g(t):
        return torch.ops.torchcast.cast_with_stats(t, torch.float16)

    x = torch.randn(1000, dtype=torch.float64) * 1e3
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
    cy, cs = torch.compile(g, fullgraph=True)(x)
    ey, es = g(x)
    assert torch.equal(cy, ey) and torch.equal(cs, es)
    explain = torch._dynamo.explain(f)(x)
    assert explain.graph_break_count == 0


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
    if dtype in cast_ref.LOSSY_PAIRS[0] + (torch.float16, torch.bfloat16):
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
    assert stats.device.type == "meta" and stats.shape == (11,)


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
