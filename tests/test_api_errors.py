"""The Python API's edges: float -> integer/bool casts under safe_to, argument
checks (rtol/atol/name, kahan_* dims and dtypes), tensor kinds the ops cannot
take, the wording of violation messages and CastStats, and track() re-entry.

Integer casts are checked against numpy float64 (np.trunc, np.iinfo); argument
errors against what torch itself raises for the same mistake."""
import math
import warnings

import numpy as np
import pytest
import torch

import torchcast
from torchcast import _ops
from torchcast import cast as cast_module
from torchcast.stats import STAT_FIELDS, CastStats

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)

EDGES = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.75, 127.0, 127.5, 128.0, -128.0, -128.9999,
         -129.0, 255.0, 255.5, 256.0, -255.0, 32767.0, 32768.0, -32768.0, -32769.0, 65504.0,
         2.0 ** 31 - 1, 2.0 ** 31, -2.0 ** 31, -2.0 ** 31 - 1, 2.0 ** 63 - 1024, 2.0 ** 63,
         -2.0 ** 63, -2.0 ** 63 - 2048, 1e30, -1e30, 3.3e38, math.inf, -math.inf, math.nan,
         1e-300, -1e-40, 300.7]


def integer_reference(values, dtype):
    """CastStats fields of casting float64 values to an integer or bool dtype,
    computed in numpy float64 with exact Python-int range checks."""
    a = np.asarray(values, dtype=np.float64)
    nan = np.isnan(a)
    finite = np.isfinite(a)
    if dtype == torch.bool:
        back = (a != 0).astype(np.float64)
        measured = finite
        overflow = np.zeros_like(finite)
    else:
        info = np.iinfo(str(dtype).replace("torch.", ""))
        back = np.where(finite, np.trunc(np.where(finite, a, 0.0)), a)
        measured = np.array([f and info.min <= int(t) <= info.max for f, t in zip(finite, back)],
                            dtype=bool)
        overflow = ~nan & ~measured
    err = np.where(measured, np.abs(a - np.where(measured, back, 0.0)), 0.0)
    rel = err / np.where(measured & (a != 0), np.abs(a), 1.0)
    return dict(numel=a.size, nan=int(nan.sum()), inexact=int((~measured | (a != back)).sum()),
                overflow=int(overflow.sum()), underflow=0, subnormal=0,
                max_abs_err=float(err.max()) if a.size else 0.0,
                max_rel_err=float(rel.max()) if a.size else 0.0,
                sum_abs_err=float(err.sum()), sum_sq_err=float((err * err).sum()),
                sum_sq=float(np.where(measured, a * a, 0.0).sum()))


def representable(values, src):
    """The values of src dtype (rounded), as float64 numbers."""
    return torch.tensor(values, dtype=torch.float64).to(src).double().tolist()


# ---------------------------------------------------------------------------
# 1. float -> integer / bool casts

@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", INTEGERS + (torch.bool,))
def test_integer_cast_stats_match_numpy(src, dst):
    g = torch.Generator().manual_seed(hash((str(src), str(dst))) % 2 ** 31)
    noise = (torch.randn(200, generator=g, dtype=torch.float64) * 300).tolist()
    values = representable(EDGES + noise, src)
    x = torch.tensor(values, dtype=torch.float64).to(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_y = x.to(dst)
    y = torchcast.safe_to(x, dst, policy="record")
    assert y.dtype == dst and torch.equal(y, expected_y)  # bitwise what torch gives
    s = torchcast.last_stats()
    assert (s.src_dtype, s.dtype) == (src, dst)
    ref = integer_reference(values, dst)
    got = {f: getattr(s, f) for f in STAT_FIELDS}
    for f in ("numel", "nan", "inexact", "overflow", "underflow", "subnormal", "max_abs_err",
              "max_rel_err"):
        assert got[f] == ref[f], (f, got[f], ref[f])
    for f in ("sum_abs_err", "sum_sq_err", "sum_sq"):
        assert got[f] == pytest.approx(ref[f], rel=1e-12), f


def test_integer_cast_edges_int8():
    x = torch.tensor([127.0, 127.5, 128.0, -128.9999, -129.0, 0.0, -0.0], dtype=torch.float64)
    torchcast.safe_to(x, torch.int8, policy="record")
    s = torchcast.last_stats()
    assert (s.overflow, s.inexact, s.nan) == (2, 4, 0)
    assert s.max_abs_err == pytest.approx(0.9999)


def test_integer_cast_int64_bounds_and_uint8_negatives():
    x = torch.tensor([2.0 ** 63, -2.0 ** 63, 2.0 ** 63 - 1024], dtype=torch.float64)
    torchcast.safe_to(x, torch.int64, policy="record")
    assert torchcast.last_stats().overflow == 1
    torchcast.safe_to(torch.tensor([-1.0, -0.5, -0.0, 255.0, 256.0]), torch.uint8, policy="record")
    s = torchcast.last_stats()
    assert (s.overflow, s.inexact) == (2, 3)


def test_integer_cast_raises_on_nan_inf_and_out_of_range():
    torchcast.safe_to(torch.tensor([1.0, 1e6], dtype=torch.float64), torch.float16, policy="record")
    x = torch.tensor([300.7, math.nan, math.inf])
    with pytest.raises(torchcast.PrecisionLossError,
                       match=r"casting 3 elements from torch.float32 to torch.int8 lost precision: "
                             r"1 NaN, 2 out of range or infinite") as e:
        torchcast.safe_to(x, torch.int8, policy="raise")
    assert e.value.stats.nan == 1 and e.value.stats.overflow == 2
    assert torchcast.last_stats().dtype == torch.int8
    with pytest.warns(torchcast.PrecisionWarning, match="1 NaN"):
        torchcast.safe_to(torch.tensor([math.nan]), torch.int32, policy="warn")
    with pytest.raises(torchcast.PrecisionLossError, match="1 NaN"):
        torchcast.safe_to(torch.tensor([math.nan, 0.0]), torch.bool, policy="raise")


def test_integer_cast_dropped_fraction_is_no_violation_unless_rtol_atol():
    x = torch.tensor([1.25, -2.5, 3.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torchcast.safe_to(x, torch.int32, policy="raise")
        s = torchcast.last_stats()
        torchcast.safe_to(x, torch.bool, policy="raise")
    assert torch.equal(y, torch.tensor([1, -2, 3], dtype=torch.int32))
    assert s.inexact == 2 and s.max_abs_err == 0.5 and s.max_rel_err == pytest.approx(0.2)
    with pytest.raises(torchcast.PrecisionLossError, match=r"1 broke atol=0.3"):
        torchcast.safe_to(x, torch.int32, policy="raise", atol=0.3)
    with pytest.raises(torchcast.PrecisionLossError, match=r"2 broke rtol=0.1"):
        torchcast.safe_to(x, torch.int32, policy="raise", rtol=0.1)


def test_integer_cast_record_does_not_read_stats():
    torchcast.safe_to(torch.tensor([1.5, math.nan]), torch.int16, policy="record")
    pending = cast_module._local.last
    assert pending._value is None and isinstance(pending.tensor, torch.Tensor)
    assert pending.tensor.dtype == torch.float64 and pending.tensor.shape == (len(STAT_FIELDS),)
    assert torchcast.last_stats().nan == 1


def test_integer_cast_keeps_graph_cut_violation_and_is_tracked():
    x = torch.tensor([1.7, -2.2], requires_grad=True)
    with pytest.raises(torchcast.PrecisionLossError, match="cuts the autograd graph"):
        torchcast.safe_to(x, torch.int64, policy="raise")
    with torchcast.track() as report:
        torchcast.safe_to(torch.tensor([1.5, 300.0]), torch.int8, policy="record", name="ids")
        torchcast.safe_to(torch.tensor([math.nan]), torch.bool, policy="record", name="mask")
    ids, mask = sorted(report.records, key=lambda r: r.name)
    assert ids.name == "ids" and ids.stats.overflow == 1 and ids.dtype == torch.int8
    assert ids.violations() == ["1 overflow"] and mask.violations() == ["1 nan"]


@pytest.mark.slow
def test_integer_cast_empty_and_compiled():
    torchcast.safe_to(torch.empty(0), torch.int8, policy="record")
    assert torchcast.last_stats() == CastStats(torch.float32, torch.int8)

    def f(t):
        return torchcast.safe_to(t, torch.int32, policy="raise") * 2

    x = torch.tensor([1.5, -2.5, 7.0])
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


def test_last_stats_describes_every_safe_to():
    x = torch.tensor([1.0, 1e6], dtype=torch.float64)
    torchcast.safe_to(x, torch.float16, policy="record")
    same = torch.ones(3, 2)
    assert torchcast.safe_to(same, torch.float32, policy="record") is same
    assert torchcast.last_stats() == CastStats(torch.float32, torch.float32, numel=6)
    torchcast.safe_to(x, torch.float16, policy="ignore")
    assert torchcast.last_stats().overflow == 1 and torchcast.last_stats().numel == 2


# ---------------------------------------------------------------------------
# 2. rtol / atol / name

@pytest.mark.parametrize("arg", ["rtol", "atol"])
@pytest.mark.parametrize("value,error,match", [
    (-1, ValueError, r"must be a non-negative number, got -1"),
    (-0.5, ValueError, r"got -0.5"),
    (math.nan, ValueError, r"got nan"),
    ("1e-3", TypeError, r"must be a real number.*got str \('1e-3'\)"),
    (torch.tensor([1e-3, 1e-3]), TypeError, r"got Tensor"),
    (True, TypeError, r"got bool"),
    (1j, TypeError, r"got complex"),
])
def test_bad_tolerances_are_rejected_at_the_call(arg, value, error, match):
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)  # exact: nothing would be reported
    with pytest.raises(error, match=rf"safe_to: {arg} .*{match}"):
        torchcast.safe_to(x, torch.float32, policy="raise", **{arg: value})


def test_good_tolerances_are_accepted():
    for value in (0, 0.0, 1, np.float32(1e-3), np.float64(1.0), math.inf):
        torchcast.safe_to(torch.tensor([0.5], dtype=torch.float64), torch.float16,
                          policy="raise", rtol=value, atol=value)
    x = torch.tensor([1.0 / 3.0], dtype=torch.float64)
    with pytest.raises(torchcast.PrecisionLossError, match=r"1 broke rtol=0\b"):
        torchcast.safe_to(x, torch.float16, policy="raise", rtol=0)


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match=r"safe_to: name must be a str or None, got int \(3\)"):
        torchcast.safe_to(torch.ones(2, dtype=torch.float64), torch.float16, name=3)


def test_track_rejects_bad_tolerances():
    with pytest.raises(ValueError, match=r"torchcast.track: rtol must be a non-negative number"):
        torchcast.track(rtol=-1)


# ---------------------------------------------------------------------------
# 3. kahan_sum / kahan_mean arguments, as torch.sum / torch.mean word them

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dim=True), TypeError, r"received an invalid combination of arguments - got "
                                r"\(Tensor, dim=bool\)"),
    (dict(dim=0.5), TypeError, r"received an invalid combination of arguments - got "
                               r"\(Tensor, dim=float\)"),
    (dict(dim=(0.5,)), TypeError, r"received an invalid combination of arguments - got "
                                  r"\(Tensor, dim=tuple\)"),
    (dict(dim="a"), TypeError, r"got \(Tensor, dim=str\)"),
    (dict(dim=(0, 0)), RuntimeError, r"dim 0 appears multiple times in the list of dims"),
    (dict(dim=(1, -1)), RuntimeError, r"dim 1 appears multiple times in the list of dims"),
    (dict(dtype="float32"), TypeError, r"received an invalid combination of arguments - got "
                                       r"\(Tensor, dtype=str\)"),
    (dict(keepdim=2), TypeError, r"got \(Tensor, keepdim=int\)"),
])
@pytest.mark.parametrize("pair", [(torch.sum, torchcast.kahan_sum),
                                  (torch.mean, torchcast.kahan_mean)])
def test_kahan_argument_errors_match_torch(pair, kwargs, error, match):
    x = torch.ones(2, 3)
    for fn in pair:
        with pytest.raises(error, match=match):
            fn(x, **kwargs)


def test_kahan_accepts_what_torch_accepts():
    x = torch.arange(6.0).reshape(2, 3)
    for dim in (1, -1, (0, 1), [0, True], (), None, np.int64(1), torch.tensor(1)):
        assert torch.equal(torchcast.kahan_sum(x, dim), torch.sum(x, dim)), dim


@pytest.mark.parametrize("fn", [torchcast.kahan_sum, torchcast.kahan_mean])
def test_kahan_list_input(fn):
    with pytest.raises(TypeError, match=rf"torchcast.{fn.__name__}: x must be a Tensor, got list"):
        fn([1.0, 2.0])


# ---------------------------------------------------------------------------
# 4. Tensor kinds the ops cannot take

def _kinds():
    x = torch.randn(4, 4, dtype=torch.float64)
    return {
        "sparse_coo": (x.to_sparse(), r"sparse_coo.*to_dense\(\)"),
        "sparse_csr": (x.to_sparse_csr(), r"sparse_csr.*to_dense\(\)"),
        "sparse_csc": (x.to_sparse_csc(), r"sparse_csc.*to_dense\(\)"),
        "sparse_bsr": (x.to_sparse_bsr((2, 2)), r"sparse_bsr.*to_dense\(\)"),
        "quantized": (torch.quantize_per_tensor(x.float(), 0.1, 0, torch.qint8),
                      r"quantized.*dequantize\(\)"),
        "mkldnn": (x.float().to_mkldnn(), r"mkldnn.*to_dense\(\)"),
        "nested": (torch.nested.nested_tensor([torch.randn(2), torch.randn(3)],
                                              dtype=torch.float64), r"nested.*unbind\(\)"),
        "jagged": (torch.nested.nested_tensor([torch.randn(2), torch.randn(3)],
                                              dtype=torch.float64, layout=torch.jagged),
                   r"nested.*unbind\(\)"),
    }


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sparse/nested are "beta" and warn on creation
    KINDS = _kinds()

OPS = {
    "safe_to": lambda t: torchcast.safe_to(t, torch.float16, policy="record"),
    "safe_to_int": lambda t: torchcast.safe_to(t, torch.int8, policy="record"),
    "cast_with_stats": lambda t: torchcast.cast_with_stats(t, torch.float16),
    "kahan_sum": lambda t: torchcast.kahan_sum(t),
    "kahan_mean": lambda t: torchcast.kahan_mean(t, 0),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unsupported_tensor_kinds_raise_type_error(op, kind):
    t, match = KINDS[kind]
    with pytest.raises(TypeError, match=match):
        OPS[op](t)


def test_safe_to_under_vmap_raises_and_others_work():
    x = torch.tensor([[1.0, 1e6], [0.1, 0.2]], dtype=torch.float64)
    with pytest.raises(TypeError, match=r"safe_to: x is a tensor inside torch.vmap"):
        torch.vmap(lambda t: torchcast.safe_to(t, torch.float16, policy="record"))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no batching rule: the per-example fallback
        sums = torch.vmap(torchcast.kahan_sum)(x)
        ys, stats = torch.vmap(lambda t: torchcast.cast_with_stats(t, torch.float16))(x)
    assert torch.equal(sums, x.sum(1))
    assert torch.equal(ys, torchcast.cast_with_stats(x, torch.float16)[0])
    overflow = STAT_FIELDS.index("overflow")
    assert stats.shape == (2, len(STAT_FIELDS)) and stats[0, overflow] == 1
    assert stats[1, overflow] == 0


class _DispatchSubclass(torch.Tensor):
    """A minimal wrapper subclass with __torch_dispatch__ (as DTensor, etc.)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.inner if isinstance(a, cls) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


@pytest.mark.parametrize("op", sorted(OPS))
def test_torch_dispatch_subclass_raises_type_error(op):
    t = _DispatchSubclass(torch.randn(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"_DispatchSubclass.*__torch_dispatch__"):
        OPS[op](t)


def test_traceable_wrapper_subclass_runs_through_its_own_dispatch():
    """A subclass with __tensor_flatten__ (TwoTensor here; DTensor too) runs
    the ops on its inner tensors; safe_to's stats merge theirs."""
    from torch.testing._internal.two_tensor import TwoTensor
    a = torch.tensor([1.0, 1e6, 3.3, 1e-9], dtype=torch.float64)
    b = torch.tensor([2.0, 7.1, -1e5, 0.0], dtype=torch.float64)
    t = TwoTensor(a, b)
    y = torchcast.safe_to(t, torch.float16, policy="record")
    assert isinstance(y, TwoTensor)
    assert torch.equal(y.a, torchcast.safe_to(a, torch.float16, policy="record"))
    sa = torchcast.last_stats()
    assert torch.equal(y.b, torchcast.safe_to(b, torch.float16, policy="record"))
    sb = torchcast.last_stats()
    torchcast.safe_to(t, torch.float16, policy="record")
    assert torchcast.last_stats() == sa + sb
    with pytest.raises(torchcast.PrecisionLossError, match="2 overflowed"):
        torchcast.safe_to(t, torch.float16, policy="raise")
    total = torchcast.kahan_sum(t)
    assert isinstance(total, TwoTensor)
    assert torch.equal(total.a, torchcast.kahan_sum(a)) and torch.equal(total.b, torchcast.kahan_sum(b))
    y, stats = torchcast.cast_with_stats(t, torch.bfloat16)
    assert isinstance(stats, TwoTensor)
    assert torchcast.CastStats.from_tensor(stats) == (
        torchcast.CastStats.from_tensor(torchcast.cast_with_stats(a, torch.bfloat16)[1])
        + torchcast.CastStats.from_tensor(torchcast.cast_with_stats(b, torch.bfloat16)[1]))


@pytest.mark.skipif(_ops.plain_tensor is None,
                    reason="the C++ check exists with the extension only")
def test_plain_tensor_says_yes_only_where_check_input_has_nothing_to_ask():
    """_ops.plain_tensor is check_input's shortcut: True must mean that the
    full check passes silently, for every kind it tells apart."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor
    x = torch.randn(4, 6, dtype=torch.float64)
    plain = _ops.plain_tensor
    assert plain(x) and plain(x.t()) and plain(x[::2, 1]) and plain(torch.tensor(1.0))
    assert plain(torch.nn.Parameter(x.clone())) and plain(torch.empty(0))
    for kind, (t, _) in KINDS.items():
        assert not plain(t), kind
    assert not plain(_DispatchSubclass(x)) and not plain(TwoTensor(x, x))
    assert not plain(x.as_subclass(torch.nn.Buffer)) and not plain(1.0)
    with FakeTensorMode() as mode:
        assert not plain(mode.from_tensor(x))
    seen = {}

    def inside(name):
        def f(t):
            seen[name] = plain(t)
            with pytest.raises(TypeError, match=r"inside torch.vmap or another torch.func"):
                torchcast.safe_to(t, torch.float16, policy="record")
            return t.sum()
        return f

    torch.vmap(inside("vmap"))(x)
    torch.func.grad(inside("grad"))(x)
    torch.func.functionalize(inside("functionalize"))(x)
    assert seen == {"vmap": False, "grad": False, "functionalize": False}


def test_parameter_and_fake_tensors_still_work():
    p = torch.nn.Parameter(torch.tensor([1.0, 1e6], dtype=torch.float64))
    y = torchcast.safe_to(p, torch.float16, policy="record")
    assert torchcast.last_stats().overflow == 1 and y.requires_grad
    assert torchcast.kahan_sum(p).item() == 1e6 + 1
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(3, dtype=torch.float64))
        y, stats = torchcast.cast_with_stats(fake, torch.float16)
        assert y.dtype == torch.float16 and stats.shape == (len(STAT_FIELDS),)
        assert torchcast.kahan_sum(fake).shape == ()


def test_compiled_safe_to_has_no_graph_break():
    def f(t):
        return torchcast.safe_to(t, torch.bfloat16, policy="record").float() * 2

    x = torch.randn(100, dtype=torch.float64)
    torch._dynamo.reset()
    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


# ---------------------------------------------------------------------------
# 5. Messages when the maxima exclude the overflowed elements

def test_overflow_message_does_not_claim_zero_error():
    with pytest.raises(torchcast.PrecisionLossError) as e:
        torchcast.safe_to(torch.tensor([1e6], dtype=torch.float64), torch.float16, policy="raise")
    message = str(e.value)
    assert "max abs err 0" not in message and "max rel err 0" not in message
    assert "max error inf (1 element overflowed)" in message
    with pytest.raises(torchcast.PrecisionLossError) as e:
        torchcast.safe_to(torch.tensor([1e6, 1.0 / 3], dtype=torch.float64), torch.float16,
                          policy="raise")
    assert "max error inf (1 element overflowed; the other elements: max abs err 8.13802e-05" \
        in str(e.value)


def test_cast_stats_str_with_overflow():
    all_over = CastStats(torch.float64, torch.float16, numel=2, inexact=2, overflow=2)
    assert "max abs err inf, max rel err inf (all overflowed)" in str(all_over)
    some = CastStats(torch.float64, torch.float16, numel=3, inexact=3, overflow=1,
                     max_abs_err=0.25, max_rel_err=0.001)
    assert "max abs err inf, max rel err inf (1 overflowed; the others: 0.25, 0.001)" in str(some)
    none = CastStats(torch.float64, torch.float16, numel=3, max_abs_err=0.25, max_rel_err=0.001)
    assert "max abs err 0.25, max rel err 0.001," in str(none)


# ---------------------------------------------------------------------------
# 6. CastStats.from_tensor and sum()

@pytest.mark.parametrize("n", [5, 20, 0])
def test_from_tensor_wrong_length(n):
    with pytest.raises(ValueError, match=rf"expected {len(STAT_FIELDS)} values \(numel, nan, "
                                         rf"inf, inexact.*sum_sq\), got {n}"):
        CastStats.from_tensor(torch.zeros(n, dtype=torch.float64))


def test_from_tensor_wrong_shape():
    with pytest.raises(ValueError, match=rf"a 1-D tensor.*got shape \(1, {len(STAT_FIELDS)}\)"):
        CastStats.from_tensor(torch.zeros(1, len(STAT_FIELDS), dtype=torch.float64))


def test_sum_of_cast_stats():
    a = CastStats(torch.float64, torch.float16, numel=2, overflow=1, max_rel_err=0.5)
    b = CastStats(torch.float64, torch.float16, numel=3, inexact=2, max_rel_err=0.25)
    total = sum([a, b])
    assert total == a + b and total.numel == 5 and total.max_rel_err == 0.5
    assert sum([a]) == a
    with pytest.raises(TypeError):
        1 + a


# ---------------------------------------------------------------------------
# 7. track() re-entry

def test_track_reentry_after_exit_gives_a_fresh_report():
    t = torchcast.track()
    x = torch.tensor([1.0, 1e6], dtype=torch.float64)
    with t as first:
        torchcast.safe_to(x, torch.float16, policy="record")
    with t as second:
        for _ in range(2):
            torchcast.safe_to(x, torch.float32, policy="record")
    assert second is not first
    assert [r.dtype for r in first.records] == [torch.float16]
    assert [(r.dtype, r.calls) for r in second.records] == [(torch.float32, 2)]
    torchcast.safe_to(x, torch.float16, policy="record")  # after exit: recorded nowhere
    assert len(first) == 1 and len(second) == 1


def test_track_nesting_the_same_object_raises():
    t = torchcast.track()
    with t as report:
        with pytest.raises(RuntimeError, match=r"already active.*create a new torchcast.track\(\)"):
            with t:
                pass
        torchcast.safe_to(torch.tensor([1.0], dtype=torch.float64), torch.float16,
                          policy="record")
    assert len(report) == 1
    with t:  # still usable after the failed nesting
        pass
