"""tensor_health against numpy (tests/numpy_ref.py: frexp and the fraction's
digits read by doubling; bfloat16 and float8 decoded by ml_dtypes from the
bits), exhaustively for the 16- and 8-bit dtypes, on edge values, random
wide-range data, layouts and hypothesis shapes; the fallback; opcheck,
autograd and torch.compile."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchcast
from devices import on_device
from modes import FunctionsSeen, LoggedTensor, OpsSeen
from numpy_ref import tensor_health_reference
from torchcast import _ops
from torchcast._reference import health as health_reference
from values import every_value

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2]
_ML = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
       torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
       torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}


def numpy_values(x):
    """x's values as numpy float64, decoded without torch's conversions."""
    x = x.detach().cpu().contiguous()
    if x.dtype in _ML:
        bits, ml = _ML[x.dtype]
        with np.errstate(invalid="ignore"):  # NaN patterns
            return x.view(bits).numpy().view(ml).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return x.numpy().astype(np.float64)


def edge_values(dtype):
    fi = torch.finfo(dtype)
    specials = [0.0, -0.0, fi.tiny, fi.smallest_normal / 2, fi.max, -fi.max, 1.0, 2.0, -0.5,
                1.8125, 1.8125 * 2 ** -3, 1.75, 1.875, 1.9375, 3.0, 464.0, 465.0, 448.0, 480.0,
                fi.eps, 1 + fi.eps, 2 - fi.eps, fi.smallest_normal * fi.eps]
    x = torch.tensor(specials, dtype=torch.float64).to(dtype)
    extra = [float("inf"), float("-inf"), float("nan")]
    if dtype != torch.float8_e4m3fn:  # it has no inf: torch saturates to 448
        x = torch.cat([x, torch.tensor(extra, dtype=torch.float64).to(dtype)])
    if dtype.itemsize >= 2:  # NaN payloads and a negative NaN, written as bits
        bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
        nan_bits = {torch.float64: [0x7FF0000000000001, -0x7FF8000000000000 - 1 + 0x10],
                    torch.float32: [0x7F800001, -0x00400000],
                    torch.float16: [0x7C01, -0x0200], torch.bfloat16: [0x7F81, -0x0040]}[dtype]
        x = torch.cat([x, torch.tensor(nan_bits, dtype=bits).view(dtype)])
    return x


def wide_random(dtype, n, seed):
    """Magnitudes spread over every binade of ``dtype``, and a little beyond."""
    g = torch.Generator().manual_seed(seed)
    e_sub, e_max = health_reference.binade_range(dtype)
    exps = torch.randint(e_sub - 2, e_max + 2, (n,), generator=g)
    mant = torch.rand(n, generator=g, dtype=torch.float64) + 1
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (sign * mant * torch.pow(2.0, exps.double())).to(dtype)


def check(x, device):
    counts, hist, extrema = _ops.tensor_health(on_device(x, device))
    want_counts, want_hist, want_extrema = tensor_health_reference(numpy_values(x), x.dtype)
    assert counts.dtype == hist.dtype == torch.int64 and extrema.dtype == torch.float64
    assert counts.device.type == device
    assert counts.tolist() == want_counts
    assert np.array_equal(hist.cpu().numpy(), want_hist)
    assert extrema.tolist() == want_extrema
    assert int(counts[:4].sum() + hist.sum()) == x.numel()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.itemsize <= 2])
def test_every_value_of_16_and_8_bit_dtypes(device, dtype):
    check(every_value(dtype), device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values(device, dtype):
    check(edge_values(dtype), device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_wide_random_data(device, dtype):
    check(wide_random(dtype, 200_000, seed=1), device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_empty_and_0d(device, dtype):
    x = wide_random(torch.float64, 6 * 7 * 5, seed=2).to(dtype).reshape(6, 7, 5)
    check(x.transpose(0, 2), device)
    check(x[::2, 1:, ::3], device)
    check(x[0, 0, 0], device)
    check(x[:0], device)
    counts, hist, extrema = _ops.tensor_health(on_device(x[:0], device))
    assert extrema.tolist() == [0.0, math.inf]


@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=4), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from(DTYPES), transpose=st.booleans(), step=st.integers(1, 3))
def test_hypothesis_shapes_and_strides(shape, seed, dtype, transpose, step):
    x = wide_random(torch.float64, math.prod(shape), seed).to(dtype).reshape(shape)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)
    if x.dim() >= 1:
        x = x[::step]
    check(x, "cpu")


def test_thread_count_does_not_change_the_result():
    x = wide_random(torch.float32, 1 << 20, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ops.tensor_health(x)
        torch.set_num_threads(max(2, threads))
        many = _ops.tensor_health(x)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_kernel(dtype):
    x = torch.cat([every_value(dtype) if dtype.itemsize <= 2 else wide_random(dtype, 50_000, 4),
                   edge_values(dtype)])
    for a, b in zip(health_reference.tensor_health(x), _ops.tensor_health(x)):
        assert torch.equal(a, b)


def test_fallback_warns_once_and_matches(monkeypatch):
    monkeypatch.setattr(_ops, "_KERNELS", frozenset())
    monkeypatch.setattr(_ops, "_health_entry", lambda x: None)  # declines, as for such a device
    monkeypatch.setattr(_ops, "_warned_fallback", set())
    x = edge_values(torch.float32)
    with pytest.warns(RuntimeWarning, match="pure-PyTorch"):
        got = _ops.tensor_health(x)
    want = tensor_health_reference(numpy_values(x), x.dtype)
    assert got[0].tolist() == want[0] and np.array_equal(got[1].numpy(), want[1])


def test_unsupported_dtype_names_it():
    with pytest.raises(TypeError, match="x is torch.int64; supported dtypes: torch.float64"):
        torch.ops.torchcast.tensor_health(torch.arange(3))
    with pytest.raises(TypeError, match="int64"):
        _ops._tensor_health_fake(torch.empty(3, dtype=torch.int64, device="meta"))


# opcheck's schema check multiplies tensors, which torch cannot do in float8:
# float8 gets the fake-kernel check below instead.
@pytest.mark.parametrize("dtype", DTYPES[:4])
def test_opcheck(device, dtype):
    x = on_device(wide_random(torch.float64, 60, 5).to(dtype).reshape(6, 10), device)
    torch.library.opcheck(torch.ops.torchcast.tensor_health.default, (x,))
    torch.library.opcheck(torch.ops.torchcast.tensor_health.default, (x.t(),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_kernel_matches(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = wide_random(torch.float64, 60, 5).to(dtype).reshape(6, 10)
    real = torch.ops.torchcast.tensor_health(x)
    with FakeTensorMode() as mode:
        fake = torch.ops.torchcast.tensor_health(mode.from_tensor(x))
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device)


def test_input_that_requires_grad():
    x = torch.randn(5, requires_grad=True)
    counts, hist, extrema = torch.ops.torchcast.tensor_health(x)
    assert not extrema.requires_grad and extrema.grad_fn is None
    health = torchcast.tensor_health(x * 2)
    assert health.numel == 5


HEALTH_OP = torch.ops.torchcast.tensor_health.default
# What a mode sees: the overload (dispatch modes) or the packet torch.ops calls.
HEALTH_OPS = (HEALTH_OP, torch.ops.torchcast.tensor_health)


def test_reaches_torch_function_modes_subclasses_and_dispatch_modes():
    """torchcast.tensor_health calls the op through a C++ entry that skips
    torch.ops' argument boxing (as cast_with_stats does): modes and
    subclasses still see the op, and the results are torch.ops' own."""
    x = torch.randn(300, dtype=torch.float64) * 1e20
    ref = HEALTH_OP(x)

    def same(h):
        return all(torch.equal(a.as_subclass(torch.Tensor), b)
                   for a, b in zip((h.counts, h.hist, h.extrema), ref))

    with FunctionsSeen() as mode:
        assert same(torchcast.tensor_health(x))
    assert any(f in HEALTH_OPS for f in mode.seen)
    LoggedTensor.seen.clear()
    assert same(torchcast.tensor_health(x.as_subclass(LoggedTensor)))
    assert any(f in HEALTH_OPS for f in LoggedTensor.seen)
    with OpsSeen() as mode:
        assert same(torchcast.tensor_health(x))
    assert any(f in HEALTH_OPS for f in mode.seen)
    assert same(torchcast.tensor_health(torch.nn.Parameter(x)))


def test_compiles_fullgraph():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return torch.ops.torchcast.tensor_health(x * 2)

    x = wide_random(torch.float32, 1000, 6)
    try:
        for a, b in zip(f(x), _ops.tensor_health(x * 2)):
            assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()  # later tracks warn about frames compiled outside them


def test_tensor_health_object_reads_merges_and_round_trips():
    x, y = edge_values(torch.float16), every_value(torch.float16)
    hx, hy = torchcast.tensor_health(x), torchcast.tensor_health(y)
    both = hx.merge(hy)
    whole = torchcast.tensor_health(torch.cat([x, y]))
    assert torch.equal(both.counts, whole.counts) and torch.equal(both.hist, whole.hist)
    assert torch.equal(both.extrema, whole.extrema)
    assert hx.counts.tolist() != both.counts.tolist()  # merge leaves its operands alone
    assert (both.nan, both.posinf, both.neginf, both.zero, both.subnormal) == \
        tuple(whole.counts.tolist())
    assert both.numel == x.numel() + y.numel()
    assert both.amax == 65504.0 and both.min_nonzero == 2.0 ** -24
    assert both.binades[0] == -24 and both.binades[-1] == 15
    assert sum(both.binade_counts) == int(whole.hist.sum())
    back = torchcast.TensorHealth.from_dict(both.to_dict())
    assert torch.equal(back.counts, both.counts) and torch.equal(back.hist, both.hist)
    assert torch.equal(back.extrema, both.extrema)
    start = torchcast.TensorHealth.empty(torch.float16)
    assert start.numel == 0 and start.min_nonzero == math.inf
    start.add_(hx)
    assert torch.equal(start.hist, hx.hist) and torch.equal(start.extrema, hx.extrema)
    with pytest.raises(ValueError, match="float32.*float16"):
        start.add_(torchcast.tensor_health(torch.ones(2)))


def test_merged_is_the_health_of_the_concatenation():
    parts = [edge_values(torch.float16), every_value(torch.float16),
             torch.zeros(3, dtype=torch.float16), torch.tensor([-0.0, 1.5], dtype=torch.float16)]
    healths = [torchcast.tensor_health(p) for p in parts]
    before = [h.counts.clone() for h in healths]
    whole = torchcast.tensor_health(torch.cat(parts))
    for chosen in (healths, healths[2:3], healths[::-1]):
        merged = torchcast.TensorHealth.merged(chosen)
        expected = whole if len(chosen) == len(parts) else chosen[0]
        assert merged.dtype == torch.float16
        assert torch.equal(merged.counts, expected.counts)
        assert torch.equal(merged.hist, expected.hist)
        assert torch.equal(merged.extrema, expected.extrema)
    assert torchcast.TensorHealth.merged(healths[2:3]).extrema.tolist() == [0.0, math.inf]
    assert all(torch.equal(h.counts, b) for h, b in zip(healths, before))  # none changes
    with pytest.raises(ValueError, match="float32.*float16"):
        torchcast.TensorHealth.merged([healths[0], torchcast.tensor_health(torch.ones(2))])


def test_cpu_brings_the_health_to_the_host_once(device):
    """TensorHealth.cpu(): the same counts on the host (itself when already
    there), and headroom read from it as from the device's."""
    x = on_device(every_value(torch.bfloat16), device)
    h = torchcast.tensor_health(x)
    host = h.cpu()
    assert (host is h) == (device == "cpu")
    for name in ("counts", "hist", "extrema"):
        assert getattr(host, name).device.type == "cpu"
        assert torch.equal(getattr(host, name), getattr(h, name).cpu())
    for fmt in (torch.float16, torch.float8_e4m3fn):
        assert torchcast.headroom.headroom(host, fmt, "amax") == \
            torchcast.headroom.headroom(h, fmt, "amax")
