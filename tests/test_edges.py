"""Edges of the API that an outside fuzz pass found (issue 26, items 5 and 6):
validation before mutation in Adam.seed_compensation, hyperparameter types
at construction, meta tensors through safe_to and nn.Cast, tensor kinds
tensor_health cannot read, torch.func over the cast, track()'s flags."""
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing._internal.two_tensor import TwoTensor

import torchcast
from torchcast.optim import Adam, AdamW

from numpy_ref import tensor_health_reference
from test_health import numpy_values, wide_random


# ---------------------------------------------------------------------------
# 1. Adam.seed_compensation: every weight checked before anything is written

def _snapshot(opt):
    """Every param and state tensor of opt, cloned, and the rest of the state."""
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return params, state


def _assert_unchanged(opt, snapshot):
    params, state = snapshot
    now = [p.detach() for g in opt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(params, now))
    assert {id(p): set(s) for p, s in opt.state.items()} == {k: set(s) for k, s in state.items()}
    for p, s in opt.state.items():
        for key, value in s.items():
            before = state[id(p)][key]
            assert type(value) is type(before), key
            if torch.is_tensor(value):
                assert value.dtype == before.dtype and torch.equal(value, before), key


def _stepped_adam(mode, steps):
    """An Adam over two bfloat16 params of shape [4], stepped ``steps`` times."""
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(4).bfloat16()) for _ in range(2)]
    opt = Adam(params, compensation=mode)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(4).bfloat16()
        opt.step()
    return opt


BAD_WEIGHTS = {
    # the case: param 0 was overwritten before the ValueError
    "shape": ([torch.randn(4), torch.randn(5)], ValueError,
              r"weight for param 1 of param group 0 \(shape \(4,\), torch.bfloat16\) has "
              r"shape \(5,\); pass one of the param's shape; nothing was changed"),
    "count": ([torch.randn(4)], ValueError,
              r"1 weights given for 2 params; pass one per param.*nothing was changed"),
    "integer": ([torch.randn(4), torch.arange(4)], TypeError,
                r"weight for param 1 .* is torch.int64 but the param is torch.bfloat16; "
                r"pass a real floating weight.*nothing was changed"),
    "complex": ([torch.randn(4), torch.randn(4, dtype=torch.complex64)], TypeError,
                r"weight for param 1 .* is torch.complex64 but the param is torch.bfloat16"),
    "not a tensor": ([torch.randn(4), [0.0] * 4], TypeError,
                     r"weight for param 1 .* is list \[0.0, 0.0, 0.0, 0.0\]; pass a tensor"),
    "sparse": ([torch.randn(4), torch.randn(4).to_sparse()], TypeError,
               r"weight for param 1 .* is a torch.sparse_coo tensor; call .to_dense\(\)"),
}


@pytest.mark.parametrize("mode", ["kahan", "remainder"])
@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_seed_compensation_checks_every_weight_before_writing(case, mode, steps):
    opt = _stepped_adam(mode, steps)
    weights, error, message = BAD_WEIGHTS[case]
    snapshot = _snapshot(opt)
    with pytest.raises(error) as info:
        opt.seed_compensation(weights)
    _assert_unchanged(opt, snapshot)
    assert re.search(message, str(info.value)), str(info.value)
    # ... and the same optimizer still seeds from good weights
    good = [torch.randn(4), torch.randn(4)]
    opt.seed_compensation(good)
    for p, w in zip((p for g in opt.param_groups for p in g["params"]), good):
        assert torch.equal(p.detach(), w.bfloat16())


def test_seed_compensation_checks_existing_state_before_writing():
    """A state the step would refuse (here a compensation of the wrong dtype,
    on the second param) stops the call before the first param is written."""
    opt = _stepped_adam("kahan", 1)
    p1 = opt.param_groups[0]["params"][1]
    opt.state[p1]["compensation"] = opt.state[p1]["compensation"].float()
    snapshot = _snapshot(opt)
    with pytest.raises(ValueError, match=r"state 'compensation' of param 1 .* torch.float32"):
        opt.seed_compensation([torch.randn(4), torch.randn(4)])
    _assert_unchanged(opt, snapshot)


def test_seed_compensation_copies_nonfinite_weights_as_copy_does():
    """Values are not read (that would be a device sync per weight): inf and
    NaN reach the param as Tensor.copy_ would put them there."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    Adam([p], compensated=False).seed_compensation(
        [torch.tensor([float("inf"), float("nan"), 1.0])])
    assert p[0] == float("inf") and p[1].isnan() and p[2] == 1.0


# ---------------------------------------------------------------------------
# 2. Adam/AdamW hyperparameters: a bool or a non-number refused at construction

@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", [True, False])
def test_bool_hyperparameter_refused_at_construction(cls, key, value):
    """torch.optim.AdamW takes a bool as 0 or 1; torchcast's step refuses it,
    so its constructor does too (before, the step raised)."""
    torch_cls = getattr(torch.optim, cls.__name__)
    torch_cls([torch.nn.Parameter(torch.randn(2))], **{key: value})  # torch: accepted
    with pytest.raises(TypeError, match=rf"torchcast.optim.{cls.__name__}: {key} must be a "
                                        rf"float or a 1-element tensor, got bool {value}; "
                                        "pass a float"):
        cls([torch.nn.Parameter(torch.randn(2))], **{key: value})


@pytest.mark.parametrize("kwargs,key", [({"lr": "0.1"}, "lr"), ({"eps": "1e-8"}, "eps"),
                                        ({"weight_decay": None}, "weight_decay"),
                                        ({"betas": ("0.9", 0.999)}, r"betas\[0\]"),
                                        ({"betas": (0.9, None)}, r"betas\[1\]"),
                                        ({"lr": 1 + 2j}, "lr")])
def test_non_number_hyperparameter_named(kwargs, key):
    """torch.optim.AdamW refuses these too, with a TypeError from its range
    checks ("'<=' not supported ..."); torchcast names the argument."""
    with pytest.raises(TypeError):
        torch.optim.AdamW([torch.nn.Parameter(torch.randn(2))], **kwargs)
    with pytest.raises(TypeError, match=rf"torchcast.optim.AdamW: {key} must be a float or a "
                                        r"1-element tensor, got .*; pass a float"):
        AdamW([torch.nn.Parameter(torch.randn(2))], **kwargs)


@pytest.mark.parametrize("betas", [(True, 0.9), (0.9, True), (False, False)])
def test_bool_betas_keep_torchs_error(betas):
    """torch refuses bool betas itself (out of range, or not both floats):
    the same ValueError and message."""
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW([torch.nn.Parameter(torch.randn(2))], betas=betas)
    with pytest.raises(ValueError) as ours:
        AdamW([torch.nn.Parameter(torch.randn(2))], betas=betas)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("betas", [0.9, (0.9,), (0.9, 0.99, 0.1), torch.tensor(0.9)])
def test_betas_not_a_pair_refused_at_construction(betas):
    with pytest.raises(TypeError, match=r"torchcast.optim.Adam: betas must be a pair of floats "
                                        r"or of 1-element tensors, got "):
        Adam([torch.nn.Parameter(torch.randn(2))], betas=betas)


def test_param_group_hyperparameters_checked_when_added():
    p, q = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match=r"Adam: param group 1: lr must be a float or a "
                                        r"1-element tensor, got bool True"):
        Adam([{"params": [p]}, {"params": [q], "lr": True}])
    opt = Adam([p])
    with pytest.raises(TypeError, match=r"param group 1: eps must be .* got str 'x'"):
        opt.add_param_group({"params": [q], "eps": "x"})
    assert len(opt.param_groups) == 1  # not added


def test_number_and_tensor_hyperparameters_still_work():
    """ints, floats, 1-element tensors (lr and both betas) and a 2-element
    betas tensor construct and step as before, matching torch.optim.AdamW."""
    for kwargs in [{"lr": 1, "eps": 0, "weight_decay": 0},
                   {"lr": torch.tensor(0.01)},
                   {"lr": torch.tensor([0.01]), "betas": (torch.tensor(0.9), torch.tensor(0.99))},
                   {"betas": torch.tensor([0.9, 0.99], dtype=torch.float64)}]:
        torch.manual_seed(0)
        ours, theirs = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
        theirs.data.copy_(ours.data)
        a, b = AdamW([ours], **kwargs), torch.optim.AdamW([theirs], **kwargs)
        for _ in range(3):
            g = torch.randn(5)
            ours.grad, theirs.grad = g.clone(), g.clone()
            a.step()
            b.step()
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# 3. Meta tensors through safe_to and nn.Cast: no values, no policy

CAST_CASES = [(torch.float32, torch.float16, {}), (torch.float64, torch.bfloat16, {}),
              (torch.float32, torch.float8_e4m3fn, {"scale": "amax"}),
              (torch.float32, torch.float16, {"rtol": 0.0, "atol": 0.0}),
              (torch.float32, torch.int32, {}), (torch.float16, torch.float16, {})]


@pytest.mark.parametrize("policy", ["ignore", "record", "warn", "raise"])
@pytest.mark.parametrize("src,dtype,kwargs", CAST_CASES)
def test_safe_to_on_meta_returns_meta(policy, src, dtype, kwargs):
    x = torch.empty(3, 5, dtype=src, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said: there are no values
        with torchcast.track() as report:
            y = torchcast.safe_to(x, dtype, policy=policy, **kwargs)
    assert (y.device.type, y.dtype, y.shape) == ("meta", dtype, x.shape)
    if src != dtype:
        assert torchcast.last_stats() is None  # no values, no stats
    assert report.records == []  # nothing recorded, as track(all_casts=True) skips meta casts


def test_meta_cast_keeps_its_graph_cut_error():
    """A graph cut needs no values: it is still refused under "raise"."""
    x = torch.empty(3, device="meta", requires_grad=True)
    with pytest.raises(torchcast.PrecisionLossError, match="cuts the autograd graph"):
        torchcast.safe_to(x, torch.int32, policy="raise")


@pytest.mark.parametrize("policy", ["record", "warn", "raise"])
def test_cast_module_in_a_meta_initialized_model(policy):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torchcast.nn.Cast(torch.float16, policy))
        y = model(torch.randn(2, 4))
    assert (y.device.type, y.dtype, y.shape) == ("meta", torch.float16, (2, 6))
    # once materialized, the policy applies again: 4e5 overflows float16
    model.to_empty(device="cpu")
    with torch.no_grad():
        model[0].weight.fill_(1e5)
        model[0].bias.zero_()
    if policy == "record":
        model(torch.ones(2, 4))
    else:
        with pytest.raises(torchcast.PrecisionLossError) if policy == "raise" else \
                pytest.warns(torchcast.PrecisionWarning):
            model(torch.ones(2, 4))
    assert torchcast.last_stats().overflow == 12


# ---------------------------------------------------------------------------
# 4. tensor_health: tensor kinds it cannot read, and wrapper subclasses

def test_tensor_health_refuses_sparse_naming_the_fix():
    x = torch.randn(4, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: sparse CSR is beta, quantization deprecated
        kinds = [(x.to_sparse(), "sparse_coo"), (x.to_sparse_csr(), "sparse_csr")]
        quantized = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    for t, kind in kinds:
        with pytest.raises(TypeError, match=rf"torchcast.tensor_health: x is a {kind} tensor; "
                                            r"torchcast takes dense strided tensors only: call "
                                            r"\.to_dense\(\) first"):
            torchcast.tensor_health(t)
    with pytest.raises(TypeError, match=r"tensor_health: x is a quantized tensor .* "
                                        r"\.dequantize\(\)"):
        torchcast.tensor_health(quantized)
    with pytest.raises(TypeError, match=r"tensor_health: x must be a torch.Tensor, got list"):
        torchcast.tensor_health([1.0])


def _check_health(h, values, dtype):
    """h against the numpy reference for ``values`` (a plain tensor)."""
    counts, hist, extrema = tensor_health_reference(numpy_values(values), dtype)
    assert h.dtype == dtype and h.counts.tolist() == counts
    assert np.array_equal(h.hist.numpy(), hist) and h.extrema.tolist() == list(extrema)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16,
                                   torch.float8_e5m2])
def test_tensor_health_of_a_two_tensor_is_that_of_everything_it_holds(dtype):
    """A TwoTensor's own dispatch runs the op on both inner tensors: their
    healths merge (as safe_to merges their stats) into the health of a plain
    tensor holding both. Before, the TensorHealth held TwoTensors and read()
    failed."""
    a = wide_random(torch.float64, 40, 3).to(dtype)
    b = torch.cat([wide_random(torch.float64, 37, 4).to(dtype),
                   torch.tensor([0.0, float("inf"), float("nan")]).to(dtype)])[:40]
    h = torchcast.tensor_health(TwoTensor(a, b))
    assert type(h.counts) is torch.Tensor and type(h.hist) is torch.Tensor
    assert h.read().numel == 80
    _check_health(h, torch.cat([a, b]), dtype)
    nested = torchcast.tensor_health(TwoTensor(TwoTensor(a, b), TwoTensor(b, a)))
    _check_health(nested, torch.cat([a, b, b, a]), dtype)


# ---------------------------------------------------------------------------
# 5. torch.func over the cast: a Python autograd Function under its transforms

FUNC_CASES = [(torch.float64, torch.float16, None), (torch.float32, torch.bfloat16, None),
              (torch.float64, torch.float32, None), (torch.float32, torch.float64, None),
              (torch.float64, torch.float16, 64.0), (torch.float32, torch.float8_e4m3fn, 0.25)]


def _x(src):
    torch.manual_seed(3)
    return (torch.randn(6, dtype=torch.float64) * 100).to(src)


def _ref(x, dtype, scale):
    """The same computation with x.to(dtype): the cast's derivative is the
    identity, times scale (csrc/autograd.cpp)."""
    return (x * scale if scale is not None else x).to(dtype)


def _ours(x, dtype, scale):
    s = torch.tensor(scale, dtype=torch.float32) if scale is not None else None
    return torchcast.cast_with_stats(x, dtype, scale=s)[0]


def _loss(cast, dtype, scale):
    weights = torch.arange(1.0, 7.0, dtype=torch.float64)
    return lambda x: (cast(x, dtype, scale).double() * weights).sum()


@pytest.mark.parametrize("src,dtype,scale", FUNC_CASES)
def test_func_grad_over_cast_with_stats(src, dtype, scale):
    x = _x(src)
    ours = torch.func.grad(_loss(_ours, dtype, scale))(x)
    ref = torch.func.grad(_loss(_ref, dtype, scale))(x)
    assert ours.dtype == x.dtype and torch.equal(ours, ref)
    # and torch.autograd (the C++ Function) gives the same
    leaf = x.clone().requires_grad_()
    _loss(_ours, dtype, scale)(leaf).backward()
    assert torch.equal(leaf.grad, ref)


@pytest.mark.parametrize("src,dtype,scale", FUNC_CASES)
def test_func_vmap_jacrev_jvp_over_cast_with_stats(src, dtype, scale):
    x = _x(src).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no batching rule: the per-example fallback
        ys, stats = torch.func.vmap(lambda t: torchcast.cast_with_stats(
            t, dtype, scale=None if scale is None else torch.tensor(scale)))(x)
        per_example = torch.func.vmap(torch.func.grad(_loss(_ours, dtype, scale)))(
            x.repeat(1, 2))
        jac = torch.func.jacrev(lambda t: _ours(t, dtype, scale))(x[0])
    assert torch.equal(ys, _ref(x, dtype, scale))
    for i in range(2):  # per-example stats: the op's on each example
        one = torchcast.cast_with_stats(
            x[i], dtype, scale=None if scale is None else torch.tensor(scale))[1]
        assert torch.equal(stats[i], one)
    ref_grad = torch.func.vmap(torch.func.grad(_loss(_ref, dtype, scale)))(x.repeat(1, 2))
    assert torch.equal(per_example, ref_grad)
    assert torch.equal(jac, torch.func.jacrev(lambda t: _ref(t, dtype, scale))(x[0]))
    tangent = torch.linspace(-1, 1, 3, dtype=src)
    _, ours_t = torch.func.jvp(lambda t: _ours(t, dtype, scale), (x[0],), (tangent,))
    _, ref_t = torch.func.jvp(lambda t: _ref(t, dtype, scale), (x[0],), (tangent,))
    assert ours_t.dtype == dtype and torch.equal(ours_t, ref_t)


def test_func_grad_of_grad_over_cast_with_stats():
    x = _x(torch.float32)
    ours = torch.func.grad(lambda t: torch.func.grad(
        lambda u: torchcast.cast_with_stats(u, torch.float64)[0].pow(3).sum())(t).sum())(x)
    assert torch.equal(ours, 6 * x.double().float())


def test_safe_to_under_func_grad_says_what_to_use():
    """safe_to applies a policy to stats read outside the transform: it
    refuses every torch.func transform, and names cast_with_stats, which
    works there (above)."""
    with pytest.raises(TypeError, match=r"torchcast.safe_to: x is a tensor inside torch.vmap or "
                                        r"another torch.func transform.*use "
                                        r"torchcast.cast_with_stats inside it"):
        torch.func.grad(lambda t: torchcast.safe_to(t, torch.float16).float().sum())(_x(
            torch.float32))


@settings(max_examples=40, derandomize=True)
@given(src=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float8_e5m2]),
       exponent=st.integers(-8, 8), n=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_func_grad_matches_x_to_dtype(src, dtype, exponent, n, seed):
    if src == dtype:
        return
    torch.manual_seed(seed)
    x = (torch.randn(n, dtype=torch.float64) * 10).to(src)
    scale = 2.0 ** exponent
    ours = torch.func.grad(lambda t: _ours(t, dtype, scale).double().pow(2).sum())(x)
    ref = torch.func.grad(lambda t: _ref(t, dtype, scale).double().pow(2).sum())(x)
    assert torch.equal(ours, ref)


# ---------------------------------------------------------------------------
# 6. track(): its flags are bools

@pytest.mark.parametrize("arg", ["all_casts", "health"])
@pytest.mark.parametrize("value,shown", [("no", "str 'no'"), (1, "int 1"), (None, "NoneType None"),
                                         (np.bool_(True), "numpy.bool np.True_")])
def test_track_flags_must_be_bools(arg, value, shown):
    with pytest.raises(TypeError, match=rf"torchcast.track: {arg} must be True or False, got "
                                        rf"{shown}; pass a bool \(bool\(x\) for a numpy bool\)"):
        torchcast.track(**{arg: value})


def test_track_all_casts_no_string_does_not_turn_tracking_on():
    x = torch.tensor([1e6], dtype=torch.float64)
    with pytest.raises(TypeError):
        with torchcast.track(all_casts="no"):
            pass
    with torchcast.track(all_casts=False, policy="record") as report:
        x.to(torch.float16)
    assert report.records == []
    with torchcast.track(all_casts=True, policy="record") as report:
        x.to(torch.float16)
    assert [r.stats.overflow for r in report.records] == [1]


def test_seed_compensation_refuses_a_self_overlapping_param_before_writing():
    # Found by tests/test_fuzz.py: an expanded param made torch's copy_ raise
    # after the first param was already written.
    p0 = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(1, dtype=torch.bfloat16).expand(4))
    opt = torchcast.optim.AdamW([p0])
    opt.add_param_group({"params": [q]})
    before = p0.detach().clone()
    with pytest.raises(RuntimeError, match="overlapping memory"):
        opt.seed_compensation([torch.randn(3), torch.randn(4)])
    assert torch.equal(p0.detach(), before) and not opt.state
