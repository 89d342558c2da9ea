"""kahan_sum / kahan_mean: accuracy against math.fsum and numpy float64, the
kernel's order restated in PyTorch (torchcast/_reference/reduce.py) bit for
bit, thread-count determinism, torch's error types, opcheck, autograd,
torch.compile and the fallback. The checks of the op run on every device:
the references stay on the CPU, and the op gets the same data and layout.

Run with -s to see the accuracy report (condition numbers and errors)."""
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import torchcast
from torchcast import _ops
from torchcast._reference import reduce as R

from devices import on_device
from reduce_common import assert_bitwise, assert_matches, chain_length, spread_sample, ulp

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
U32 = 2.0 ** -24  # float32 unit roundoff
U64 = 2.0 ** -53
OPS = {"sum": torchcast.kahan_sum, "mean": torchcast.kahan_mean}


# ---------------------------------------------------------------------------
# Accuracy on 2^24 float32 values against math.fsum.

N = 1 << 24


def _exact(x):
    """The exact sum of x as an unevaluated pair hi + lo of float64 (math.fsum
    is correctly rounded, so lo is the exact residual, rounded once)."""
    values = x.double().tolist()
    hi = math.fsum(values)
    values.append(-hi)
    return hi, math.fsum(values)


def _datasets():
    g = torch.Generator().manual_seed(1234)
    half = N // 2
    # Uniform [0, 1): the sum reaches 2^23, where float32 keeps no fractional bits.
    uniform = torch.rand(N, generator=g)
    # Normal: positive and negative terms, sum ~ sqrt(N) (condition ~ 3e3).
    normal = torch.randn(N, generator=g)
    # Alternating large and small magnitudes: +-2^k (k random in [10, 20]) with
    # random signs, every other element, and values in [0, 2^-10) between.
    big = torch.where(torch.rand(half, generator=g) < 0.5, -1.0, 1.0) * torch.exp2(
        torch.randint(10, 21, (half,), generator=g).float()) * (1 + torch.rand(half, generator=g))
    small = torch.rand(half, generator=g) * 2.0 ** -10
    alternating = torch.stack([big, small], 1).reshape(-1)

    def cancelling(spread):
        # v, then -v in another order, plus a few small terms: a large sum that
        # cancels exactly, leaving the small ones (magnitudes over 2^spread).
        quarter = (N - 1024) // 2
        v = torch.randn(quarter, generator=g) * torch.exp2(
            torch.randint(-spread, spread + 1, (quarter,), generator=g).float())
        rest = torch.rand(N - 2 * quarter, generator=g)
        x = torch.cat([v, -v[torch.randperm(quarter, generator=g)], rest])
        return x[torch.randperm(N, generator=g)]

    return {"uniform": uniform, "normal": normal, "alternating": alternating,
            "cancelling, 2^+-8": cancelling(8), "cancelling, 2^+-20": cancelling(20)}


@pytest.fixture(scope="module")
def accuracy_report():
    rows = []
    for name, x in _datasets().items():
        hi, lo = _exact(x)
        abs_sum = x.abs().double().sum().item()  # only scales the bound

        def error(result):
            # (result - hi) is exact (Sterbenz) for results within 2x of hi.
            return abs((float(result) - hi) - lo)

        rows.append(dict(
            name=name, exact=hi, cond=abs_sum / abs(hi), abs_sum=abs_sum,
            torch_f32=error(torch.sum(x)),
            ours_f32=error(torchcast.kahan_sum(x)),
            ours_f64=error(torchcast.kahan_sum(x, dtype=torch.float64)),
            torch_f64=error(torch.sum(x, dtype=torch.float64)),
        ))
    print("\n2^24 float32 values: |result - exact| / |exact| (math.fsum exact sums); "
          "float32 results also in ulps of the exact sum")
    print(f"| data | cond | torch.sum f32 | (ulp) | kahan_sum f32 | (ulp) | "
          f"kahan_sum dtype=f64 | torch.sum dtype=f64 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = abs(r["exact"])
        u = ulp(s, torch.float32)
        print(f"| {r['name']} | {r['cond']:.3g} | {r['torch_f32'] / s:.3e} | "
              f"{r['torch_f32'] / u:.3g} | {r['ours_f32'] / s:.3e} | {r['ours_f32'] / u:.2f} | "
              f"{r['ours_f64'] / s:.3e} | {r['torch_f64'] / s:.3e} |")
    return rows


# One worker computes the 2^24-element report (math.fsum of each data set) for both.
@pytest.mark.xdist_group("reduce-accuracy-2-24")
def test_accuracy_against_fsum(accuracy_report):
    n_chain = chain_length(N)
    for r in accuracy_report:
        s = abs(r["exact"])
        two_ulp = 2 * ulp(s, torch.float32)
        # Neumaier: error <= u |S| + O(chain u^2) sum|x|; once rounded to
        # float32 another half ulp. The second term is the condition number's.
        cond_term = 4 * n_chain * U32 ** 2 * r["abs_sum"]
        if cond_term <= 0.25 * ulp(s, torch.float32):
            assert r["ours_f32"] <= two_ulp, r  # well conditioned: 2 ulp
        assert r["ours_f32"] <= two_ulp + cond_term, r
        # Before the final rounding (dtype=float64) only the second term is left.
        assert r["ours_f64"] <= cond_term + 4 * U64 * s, r
    well = [r for r in accuracy_report if r["name"] in ("uniform", "normal")]
    assert len(well) == 2 and all(r["ours_f32"] <= 2 * ulp(abs(r["exact"]), torch.float32)
                                  for r in well)


@pytest.mark.xdist_group("reduce-accuracy-2-24")
def test_beats_float32_sum_on_adversarial_data(accuracy_report):
    for r in accuracy_report:
        if r["name"].startswith(("alternating", "cancelling")):
            assert r["torch_f32"] > 0, r
            # Compare before the final float32 rounding, which bounds both.
            assert r["ours_f64"] * 1000 <= r["torch_f32"], r
            if r["cond"] < 1e6:
                assert r["ours_f32"] <= 2 * ulp(abs(r["exact"]), torch.float32), r


# ---------------------------------------------------------------------------
# Random shapes, dims and strides: bit for bit the reference order, close to
# numpy float64.

@st.composite
def reductions(draw):
    nd = draw(st.sampled_from([0, 1, 2, 2, 3, 3, 4]))
    sizes = st.sampled_from([1, 2, 3, 5, 8, 17, 31, 32, 33, 40, 64, 97, 130, 300])
    shape = [draw(sizes) for _ in range(nd)]
    while math.prod(shape) > 6000:  # keep the reference's Python loops short
        shape[shape.index(max(shape))] //= 3
    if nd and draw(st.integers(0, 15)) == 0:
        shape[draw(st.integers(0, nd - 1))] = 0
    # Layout: contiguous, permuted dims, every other element, an expanded dim.
    kind = draw(st.sampled_from(["contiguous", "contiguous", "permuted", "strided", "expanded"]))
    perm = draw(st.permutations(range(nd))) if kind == "permuted" else list(range(nd))
    steps = [draw(st.sampled_from([1, 2])) for _ in range(nd)] if kind == "strided" else [1] * nd
    expand = draw(st.integers(0, nd - 1)) if kind == "expanded" and nd else None
    dtype = draw(st.sampled_from(FLOATS))
    which = draw(st.integers(0, 9))
    if which == 0:
        dim = None
    elif which == 1:
        dim = []  # torch: every dim
    elif nd == 0:
        dim = [draw(st.sampled_from([0, -1]))]
    else:
        # Mostly keep a dim: several outputs exercise the per-dim schemes.
        nred = draw(st.integers(1, nd - 1)) if nd > 1 and which < 8 else nd
        dim = draw(st.permutations(range(nd)))[:nred]
        dim = [d - nd if draw(st.booleans()) else d for d in dim]
    out_dtype = draw(st.sampled_from((None,) + FLOATS))
    return dict(shape=shape, perm=perm, steps=steps, expand=expand, dtype=dtype, dim=dim,
                keepdim=draw(st.booleans()), out_dtype=out_dtype, mean=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 31 - 1)),
                scale=draw(st.sampled_from([1.0, 1e-30, 1e4])))


def make_input(case):
    g = torch.Generator().manual_seed(case["seed"])
    shape, perm, steps = case["shape"], case["perm"], case["steps"]
    base = torch.randn([shape[p] * steps[p] for p in perm], generator=g, dtype=torch.float64)
    x = (base * case["scale"]).to(case["dtype"]).permute(list(np.argsort(perm)))
    x = x[tuple(slice(None, None, step) for step in steps)]
    e = case["expand"]
    if e is not None and x.shape[e] > 0:
        x = x.narrow(e, 0, 1).expand(x.shape)
    assert list(x.shape) == shape
    return x


def numpy_reference(x, dim, keepdim, mean):
    a = x.double().numpy()
    axes = None if dim is None or len(dim) == 0 else tuple(d % max(x.dim(), 1) for d in dim)
    if x.dim() == 0:
        axes = None
    fn = np.mean if mean else np.sum
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = fn(a, axis=axes, keepdims=keepdim)
        abs_sum = np.sum(np.abs(a), axis=axes, keepdims=keepdim)
    return np.asarray(ref, dtype=np.float64), np.asarray(abs_sum, dtype=np.float64)


# The device fixture is a string, the same for every example.
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(reductions())
def test_random_layouts(device, case):
    x = make_input(case)
    event(f"scheme {R.plan(x, R.reduce_dims(x, case['dim']))[2]}")
    event(f"numel {'0' if x.numel() == 0 else '<100' if x.numel() < 100 else '>=100'}")
    op = "mean" if case["mean"] else "sum"
    got = OPS[op](on_device(x, device), case["dim"], case["keepdim"], dtype=case["out_dtype"])
    out_dtype = case["out_dtype"] or x.dtype
    # The kernel's order, restated in PyTorch: the same bits.
    assert_matches(got, R.kahan_reduce(x, case["dim"], case["keepdim"], case["out_dtype"],
                                       case["mean"]))
    # torch's shape and dtype.
    like = getattr(torch, op)(x.double(), dim=case["dim"], keepdim=case["keepdim"])
    assert got.shape == like.shape and got.dtype == out_dtype
    # Close to numpy's float64 result: one rounding to the output dtype plus
    # the compensated (float32) or plain (float64) accumulation error.
    ref, abs_sum = numpy_reference(x, case["dim"], case["keepdim"], case["mean"])
    count = x.numel() / max(ref.size, 1) if x.numel() else 0
    if x.dtype == torch.float64:
        acc = 2 * count * U64 * abs_sum
    else:
        acc = 4 * max(count, 1) * U32 ** 2 * abs_sum
    g, ref = np.atleast_1d(got.double().cpu().numpy()), np.atleast_1d(ref)
    tol = np.atleast_1d(ulp(ref, out_dtype) + acc)
    if out_dtype == torch.float64 and x.dtype != torch.float64:
        tol = tol + ulp(ref, torch.float32)  # the pair (s, c) carries ~48 bits
    # Sums beyond the output's range round to inf (float16 in particular).
    huge = np.abs(ref) > torch.finfo(out_dtype).max / 2
    close = np.abs(g - ref) <= tol
    assert np.all(np.where(huge, close | (np.isinf(g) & (np.sign(g) == np.sign(ref))), close)
                  | np.isnan(ref)), (g, ref)
    assert np.array_equal(np.isnan(g), np.isnan(ref))


@pytest.mark.parametrize("shape,dim,dtype", [
    ((3, 70000), [1], torch.float32),       # warp lanes, two segments per output
    ((3, 70000), [1], torch.float16),
    ((200000,), None, torch.float32),       # full order, four chunks
    ((200000,), None, torch.bfloat16),
    ((70000, 4), [0, 1], torch.float64),    # full order over a 2-D tensor
    ((70000, 3), [0], torch.float32),       # one lane, two segments per output
    ((5, 333, 80), [0, 2], torch.bfloat16), # warp lanes over non-adjacent dims
])
def test_multi_segment_matches_reference(device, shape, dim, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 1e3).to(dtype)
    x_dev = on_device(x, device)
    assert_matches(torchcast.kahan_sum(x_dev, dim), R.kahan_reduce(x, dim, False, None, False))
    assert_matches(torchcast.kahan_mean(x_dev, dim, dtype=torch.float64),
                   R.kahan_reduce(x, dim, False, torch.float64, True))


SWEEP = [  # (layout of 630 elements, dim, scheme)
    (lambda t: t.reshape(6, 105), [1], "warp"),
    (lambda t: t.reshape(5, 126)[:, 20:], [-1], "warp"),
    (lambda t: t.reshape(2, 5, 63), [1, 2], "warp"),     # merged into one run of 315
    (lambda t: t.reshape(9, 70).t(), [0], "warp"),       # transposed: dim 0 is contiguous
    (lambda t: t.reshape(10, 63), [1], "one"),           # a run shorter than 2 warps
    (lambda t: t.reshape(9, 70), [0], "one"),
    (lambda t: t.reshape(15, 42)[:, ::2], [1], "one"),   # strided run
    (lambda t: t.reshape(6, 105)[:1].expand(4, 105), [0], "one"),  # stride-0 dim
    (lambda t: t.reshape(5, 7, 18), [0, 2], "one"),
    (lambda t: t.reshape(630), [0], "full"),
    (lambda t: t.reshape(9, 70).t(), None, "full"),
]


def assert_every_variant_matches_reference(x, dim, device):
    """kahan_sum and kahan_mean of x on device, with every output dtype
    class and keepdim, equal the reference on x."""
    x_dev = on_device(x, device)
    for mean in (False, True):
        for out_dtype in (None, torch.float16, torch.float64):
            for keepdim in (False, True):
                got = OPS["mean" if mean else "sum"](x_dev, dim, keepdim, dtype=out_dtype)
                assert_matches(got, R.kahan_reduce(x, dim, keepdim, out_dtype, mean))


@pytest.mark.parametrize("layout,dim,scheme", SWEEP)
@pytest.mark.parametrize("dtype", FLOATS)
def test_scheme_sweep_matches_reference(device, layout, dim, scheme, dtype):
    base = torch.randn(630, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    x = layout((base * 100).to(dtype))
    assert R.plan(x, R.reduce_dims(x, dim))[2] == scheme
    assert_every_variant_matches_reference(x, dim, device)


SCHEME_SIZES = [  # (shape, view, dim, scheme), sized past one block, one chunk, one warp run
    ((0,), None, None, None),
    ((1,), None, None, "full"),
    ((1000,), None, None, "full"),
    ((65537,), None, None, "full"),
    ((3 * 65536 + 5,), None, None, "full"),
    ((3 * 65536 + 5,), lambda t: t[1:], None, "full"),           # misaligned: scalar loads
    ((700, 300), lambda t: t.t(), None, "full"),                # transposed: strided offsets
    ((2 * 65536 + 9, 3), lambda t: t[:, 1], None, "full"),      # strided run
    ((6, 105), None, [1], "warp"),
    ((3, 70000), None, [1], "warp"),                             # two segments per output
    ((5, 333, 80), None, [0, 2], "warp"),                        # non-adjacent dims
    ((9, 70), lambda t: t.t(), [0], "warp"),
    ((10, 63), None, [1], "one"),                                # a run shorter than 2 warps
    ((70000, 3), None, [0], "one"),                              # two segments per output
    ((4096, 257), None, [0], "one"),
    ((15, 42), lambda t: t[:, ::2], [1], "one"),
    ((6, 105), lambda t: t[:1].expand(4, 105), [0], "one"),      # stride-0 dim
    ((5, 7, 18), None, [0, 2], "one"),                           # two unmergeable dims
    ((5, 7, 18), lambda t: t.permute(2, 0, 1), [0, 2], "warp"),  # permuted dims that merge
    ((4, 0, 3), None, [1], None),                                # empty reduction: 0 / NaN
]


@pytest.mark.cuda_cases
@pytest.mark.parametrize("case", SCHEME_SIZES, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_scheme_sizes_match_reference(device, case, dtype):
    shape, view, dim, scheme = case
    x = spread_sample(shape, dtype, seed=len(shape))
    if view is not None:
        x = view(x)
    if scheme is not None:
        assert R.plan(x, R.reduce_dims(x, dim))[2] == scheme
    assert_every_variant_matches_reference(x, dim, device)


def test_schemes_are_the_documented_ones():
    x = torch.zeros(4, 64)
    assert R.plan(x, [0, 1])[2] == "full"
    assert R.plan(x, [1])[2] == "warp"
    assert R.plan(x, [0])[2] == "one"
    assert R.plan(torch.zeros(64, 63), [1])[2] == "one"  # run shorter than two warps
    assert R.plan(torch.zeros(8, 4, 16), [1, 2])[2] == "warp"  # contiguous dims merge
    assert R.plan(torch.zeros(1, 5), [1])[2] == "full"  # one output


# ---------------------------------------------------------------------------
# Determinism across thread counts.

@pytest.mark.parametrize("shape,dim", [
    ((1 << 21,), None), ((64, 1 << 15), [1]), ((3, 1 << 18), [1]), ((1 << 15, 64), [0]),
    ((1 << 18, 3), [0]), ((96, 3, 1024), [0, 2]),
])
def test_bitwise_equal_across_thread_counts(shape, dim):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 1e5
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append([torchcast.kahan_sum(x, dim), torchcast.kahan_mean(x, dim),
                            torchcast.kahan_sum(x.half(), dim),
                            torchcast.kahan_sum(x.double(), dim)])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise(a, b)


# ---------------------------------------------------------------------------
# Edge values.

SPECIAL = [
    ([1.0, math.inf, 2.0], math.inf), ([-math.inf, 1.0], -math.inf),
    ([math.inf, -math.inf], math.nan), ([math.nan, 1.0], math.nan),
    ([3e38, 3e38], math.inf), ([-3e38, -3e38], -math.inf),  # float32 overflow
    ([-0.0, -0.0], 0.0), ([], 0.0),
]


@pytest.mark.parametrize("values,expected", SPECIAL)
def test_special_values(device, values, expected):
    x = torch.tensor(values, dtype=torch.float32)
    for xx in (x, x.repeat(1000), x.repeat(1000, 3).t()):
        for dtype in (None, torch.float64):
            # torch's sum agrees on every case: float32 accumulation overflows,
            # and with dtype=torch.float64 both accumulate in float64.
            want = torch.sum(xx, dtype=dtype)
            got = torchcast.kahan_sum(on_device(xx, device), dtype=dtype)
            if math.isnan(expected):
                assert torch.isnan(got) and torch.isnan(want)
            else:
                if dtype is None or not math.isinf(expected):
                    assert got.item() == expected
                assert_bitwise(got.cpu(), want)  # +0, not -0, like torch


@pytest.mark.cuda_cases
@pytest.mark.parametrize("values", [
    [1.0, float("inf"), 2.0], [float("-inf"), float("inf")], [float("nan"), 1.0],
    [3e38, 3e38, -3e38], [1e-45, 1e-45, 2e-45], [-0.0, -0.0],
])
def test_special_values_in_every_scheme(device, values):
    x = torch.tensor(values * 3000, dtype=torch.float32)
    for shape, dim in (((len(values) * 3000,), None), ((3000, len(values)), [1]),
                       ((3000, len(values)), [0])):
        xs = x.reshape(shape)
        assert_matches(torchcast.kahan_sum(on_device(xs, device), dim),
                       R.kahan_reduce(xs, dim, False, None, False))


def test_non_finite_stays_in_its_output():
    x = torch.ones(4, 100)
    x[1, 7] = math.inf
    x[2, 3] = math.nan
    for got in (torchcast.kahan_sum(x, 1), torchcast.kahan_sum(x.t().contiguous(), 0)):
        assert got[0].item() == 100 and got[1].item() == math.inf
        assert math.isnan(got[2].item()) and got[3].item() == 100


def test_subnormals_are_summed_exactly():
    tiny = torch.finfo(torch.float32).tiny
    x = torch.full((10000,), tiny * 2.0 ** -20)  # subnormal
    assert torchcast.kahan_sum(x).item() == 10000 * tiny * 2.0 ** -20
    h = torch.full((3000,), 2.0 ** -24, dtype=torch.float16)  # float16 subnormal
    assert torchcast.kahan_sum(h, dtype=torch.float32).item() == 3000 * 2.0 ** -24


def test_empty_and_zero_dim():
    e = torch.empty(0)
    assert torchcast.kahan_sum(e).item() == 0 and math.isnan(torchcast.kahan_mean(e).item())
    z = torch.empty(3, 0)
    assert torch.equal(torchcast.kahan_sum(z, 1), torch.zeros(3))
    assert torch.isnan(torchcast.kahan_mean(z, 1)).all()
    assert torchcast.kahan_sum(z, 0).shape == (0,)
    assert torchcast.kahan_sum(z, 0, keepdim=True).shape == (1, 0)
    s = torch.tensor(2.5)
    for dim in (None, 0, -1, (), [0]):
        args = () if dim is None else (dim,)
        got = torchcast.kahan_sum(s, *args)
        assert got.shape == torch.sum(s, *args).shape and got.item() == 2.5
        got = torchcast.kahan_mean(s, dim, keepdim=True)
        assert got.shape == torch.mean(s, dim=dim, keepdim=True).shape and got.item() == 2.5


def test_dim_forms_match_torch():
    many = torch.ones([2] * 3 + [1] * 62)  # torch.sum takes any number of dims with dim=None
    assert torchcast.kahan_sum(many).item() == 8 and torchcast.kahan_mean(many, ()).item() == 1
    x = torch.randn(2, 3, 4, 5)
    for dim in (0, -1, (1, 3), [0, -2], (), [], (-4, 1, 2, 3)):
        for keepdim in (False, True):
            got = torchcast.kahan_sum(x, dim, keepdim)
            want = torch.sum(x.double(), dim, keepdim)
            assert got.shape == want.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_result_dtype():
    x = torch.randn(100, 30)
    for src in FLOATS:
        xs = x.to(src)
        assert torchcast.kahan_sum(xs).dtype == src
        for dst in FLOATS:
            assert torchcast.kahan_sum(xs, 1, dtype=dst).dtype == dst
            assert torchcast.kahan_mean(xs, dtype=dst).dtype == dst
    # Narrow outputs are the compensated sum rounded once (not a float32 sum
    # rounded again): compare with the exact sum correctly rounded.
    y = (torch.rand(5000, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    exact = math.fsum(y.double().tolist())
    for dst in (torch.bfloat16, torch.float16):
        got = torchcast.kahan_sum(y, dtype=dst)
        assert got.item() == torch.tensor(exact, dtype=torch.float64).to(dst).item() or \
            abs(got.item() - exact) <= 0.5 * ulp(exact, dst)


# ---------------------------------------------------------------------------
# Bad input: the exception torch raises for the same mistake.

def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return e
    raise AssertionError("no exception")


def test_errors_match_torch():
    x = torch.randn(3, 4)
    mistakes = [
        # integer / bool / complex x: torch.mean and torch.nansum reject them
        (lambda f: f(x.long()), lambda: torch.mean(x.long())),
        (lambda f: f(x.bool()), lambda: torch.mean(x.bool())),
        (lambda f: f(x.to(torch.complex64)), lambda: torch.nansum(x.to(torch.complex64))),
        (lambda f: f(x, dtype=torch.int64), lambda: torch.mean(x, dtype=torch.int64)),
        (lambda f: f(x, 2), lambda: torch.sum(x, 2)),
        (lambda f: f(x, -3), lambda: torch.sum(x, -3)),
        (lambda f: f(x, (0, 0)), lambda: torch.sum(x, (0, 0))),
        (lambda f: f(x, (1, -1)), lambda: torch.sum(x, (1, -1))),
        (lambda f: f(torch.tensor(1.0), 1), lambda: torch.sum(torch.tensor(1.0), 1)),
        (lambda f: f(torch.ones([1] * 65), 0), lambda: torch.sum(torch.ones([1] * 65), 0)),
    ]
    for ours, theirs in mistakes:
        expected = type(_raised(theirs))
        for f in (torchcast.kahan_sum, torchcast.kahan_mean):
            err = _raised(lambda: ours(f))
            assert type(err) is expected, (err, expected)
            assert isinstance(err, (RuntimeError, IndexError))
    # Same from the fake kernel (meta tensors) and the fallback.
    m = torch.empty(3, 4, device="meta")
    assert type(_raised(lambda: torchcast.kahan_sum(m, 2))) is IndexError
    assert type(_raised(lambda: torchcast.kahan_sum(m, (0, -2)))) is RuntimeError
    assert type(_raised(lambda: torchcast.kahan_sum(m.long()))) is RuntimeError
    assert type(_raised(lambda: R.kahan_reduce(x, [5], False, None, False))) is IndexError
    assert type(_raised(lambda: R.kahan_reduce(x.int(), None, False, None, True))) is RuntimeError
    msg = str(_raised(lambda: torchcast.kahan_sum(x.long())))
    assert "torch.int64" in msg and "x.float()" in msg


# ---------------------------------------------------------------------------
# Custom-op machinery.

@pytest.mark.parametrize("op", [torch.ops.torchcast.kahan_sum.default,
                                torch.ops.torchcast.kahan_mean.default])
@pytest.mark.parametrize("args,kwargs", [
    ((torch.randn(4, 5), None, False), {}),
    ((torch.randn(4, 5), [1], True), {"dtype": torch.float64}),
    ((torch.randn(6, 40, 3).bfloat16(), [0, -1], False), {}),
    ((torch.randn(3, 7).half().t(), [0], False), {"dtype": torch.float32}),
    ((torch.randn(50, 2, dtype=torch.float64), [0], False), {}),
    ((torch.randn(0, 3), [1], False), {}),  # (an empty mean is NaN, which opcheck rejects)
    pytest.param((torch.randn(4, 70), [1], False), {"dtype": torch.float64},  # warp lanes
                 marks=pytest.mark.cuda_cases),
    pytest.param((torch.randn(70, 4).t(), None, True), {}, marks=pytest.mark.cuda_cases),
])
def test_opcheck(device, op, args, kwargs):
    x = on_device(args[0], device).requires_grad_()
    torch.library.opcheck(op, (x,) + args[1:], kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_gradient_is_exact(dtype):
    x = torch.randn(6, 7, 8).to(dtype).requires_grad_()
    for dim, keepdim in ((None, False), (1, False), ((0, 2), True), (-1, True), ((0, 2), False)):
        x.grad = None
        y = torchcast.kahan_sum(x, dim, keepdim)
        g = torch.randn(y.shape).to(dtype)
        y.backward(g)
        dims = R.reduce_dims(x, None if dim is None else [dim] if isinstance(dim, int) else dim)
        kept_shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        assert x.grad.dtype == dtype
        assert_bitwise(x.grad, g.reshape(kept_shape).expand(x.shape))  # g, exactly
        xt = x.detach().requires_grad_()
        torch.sum(xt, dim=dim, keepdim=keepdim).backward(g)
        assert_bitwise(x.grad, xt.grad)  # as torch.sum's backward


def test_mean_gradient_matches_torch():
    x = torch.randn(5, 9, requires_grad=True)
    for dim in (None, 0, (0, 1), -1):
        args = () if dim is None else (dim,)
        x.grad = None
        torchcast.kahan_mean(x, *args).sum().backward()
        ours = x.grad.clone()
        x.grad = None
        torch.mean(x, *args).sum().backward()
        assert torch.equal(ours, x.grad)


def test_gradcheck_float64():
    # float64 inputs accumulate in float64, so finite differences apply.
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    for f in (lambda t: torchcast.kahan_sum(t, 1), lambda t: torchcast.kahan_mean(t, (0, 1)),
              lambda t: torchcast.kahan_sum(t, 0, keepdim=True),
              lambda t: torchcast.kahan_mean(t, -1, dtype=torch.float64)):
        assert torch.autograd.gradcheck(f, (x,))
        assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_gradcheck_float32_input():
    # A float32 input with a float64 result: the compensated sum is accurate
    # enough for finite differences at float32 step sizes.
    x = torch.randn(5, 8, dtype=torch.float32, requires_grad=True)
    f = lambda t: torchcast.kahan_sum(t, 1, dtype=torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x,), eps=1e-2, atol=1e-3, rtol=1e-3)


def test_torch_compile_fullgraph(device):
    def f(x):
        return (torchcast.kahan_sum(x, (0, 2)), torchcast.kahan_mean(x, -1, keepdim=True),
                torchcast.kahan_sum(x, dtype=torch.float64))

    compiled = torch.compile(f, fullgraph=True)
    for shape in ((4, 5, 40), (3, 7, 33)):
        x = torch.randn(shape, device=device)
        for a, b in zip(compiled(x), f(x)):
            assert_bitwise(a, b)
    x = torch.randn(4, 5, 40, device=device, requires_grad=True)
    torch.compile(lambda t: torchcast.kahan_sum(t, 1).sum(), fullgraph=True)(x).backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.cuda_cases
def test_torch_compile_fuses_around_the_op(device):
    def f(t):
        return torchcast.kahan_sum(t * 2, 0) + torchcast.kahan_mean(t)

    x = torch.randn(4, 70, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert_bitwise(f(x), compiled(x))


def test_fallback_same_bits_and_warns_once(monkeypatch):
    monkeypatch.setattr(_ops, "has_kernel", lambda op, device: False)
    monkeypatch.setattr(_ops, "_warned_fallback", set())
    x = torch.randn(7, 50, 3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="pure-PyTorch"):
        y = torchcast.kahan_sum(x, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = torchcast.kahan_mean(x, (0, 2), keepdim=True, dtype=torch.float16)
    monkeypatch.undo()
    assert_bitwise(y, torchcast.kahan_sum(x, 1))
    assert_bitwise(m, torchcast.kahan_mean(x, (0, 2), keepdim=True, dtype=torch.float16))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_meta_shapes():
    m = torch.empty(3, 4, 5, device="meta", dtype=torch.bfloat16)
    assert torchcast.kahan_sum(m, 1).shape == (3, 5)
    assert torchcast.kahan_mean(m, (0, 2), keepdim=True, dtype=torch.float32).dtype == torch.float32


# --- dtype names in errors --------------------------------------------------------

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_unsupported_dtype_named_as_python_writes_it(dtype):
    if dtype in R.FLOAT_DTYPES:
        return
    x = torch.zeros(3)
    for op in (torch.ops.torchcast.kahan_sum, torch.ops.torchcast.kahan_mean):
        with pytest.raises(RuntimeError) as err:
            op(x, dtype=dtype)
        assert str(dtype) in str(err.value), str(err.value)
    try:
        bad = torch.zeros(3, dtype=dtype)
    except (RuntimeError, TypeError):
        return
    with pytest.raises(RuntimeError) as err:
        torch.ops.torchcast.kahan_sum(bad)
    assert str(dtype) in str(err.value), str(err.value)


# --- dtype=torch.float64 accumulates in float64 -------------------------------------

@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["kahan_sum", "kahan_mean"])
def test_float64_dtype_does_not_overflow_where_torch_does_not(src, op):
    big = torch.finfo(src).max
    mean = op == "kahan_mean"
    fn = getattr(torchcast, op)
    cases = [torch.full((4,), big, dtype=src), torch.full((3, 1000), big, dtype=src),
             torch.tensor([big, big, -big, big / 2], dtype=src)]
    for x in cases:
        exact = math.fsum(x.double().reshape(-1).tolist())
        want = exact / x.numel() if mean else exact
        for got in (fn(x, dtype=torch.float64), R.kahan_reduce(x, None, False, torch.float64, mean)):
            assert got.dtype == torch.float64 and got.item() == want, (got, want)
        torch_ref = (torch.mean if mean else torch.sum)(x, dtype=torch.float64)
        assert math.isfinite(torch_ref.item()) and torch_ref.item() == want
        if x.dim() == 2:
            for dim in (0, 1):
                got = fn(x, dim=dim, dtype=torch.float64)
                ref = (torch.mean if mean else torch.sum)(x.double(), dim=dim)
                assert torch.equal(got, ref)


@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16])
def test_float64_dtype_is_the_float64_sum_of_the_float64_values(src):
    # The rule: kahan_sum(x, dtype=torch.float64) == kahan_sum(x.to(torch.float64)),
    # on every scheme and layout, and the fallback agrees.
    g = torch.Generator().manual_seed(8)
    base = (torch.randn(300, 257, generator=g, dtype=torch.float64) * 1e4).to(src)
    for x, dim in ((base, None), (base, 1), (base, 0), (base.t(), 1), (base[::2, 1::3], None),
                   (base[::2, 1::3], 0)):
        dims = None if dim is None else [dim]
        for mean in (False, True):
            op = torch.ops.torchcast.kahan_mean if mean else torch.ops.torchcast.kahan_sum
            got = op(x, dims, dtype=torch.float64)
            assert_bitwise(got, op(x.to(torch.float64), dims))
            assert_bitwise(got, R.kahan_reduce(x, dims, False, torch.float64, mean))
    x = base.reshape(-1)
    np.testing.assert_allclose(torchcast.kahan_sum(x, dtype=torch.float64).item(),
                               math.fsum(x.double().tolist()), rtol=1e-15)
