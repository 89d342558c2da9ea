"""Update accounting (track_updates=True, adam_step_'s update_stats): the
kernel's counts against a reference that counts directly, from the stored
param before and after the step and the update computed in float64 (numpy,
from the saved state and the textbook formulas), and against the
pure-PyTorch restatement of the kernel (bit for bit, edge values included);
then the optimizer's API."""
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchcast.optim import Adam, AdamW
from torchcast._reference import adam as ref

from adam_common import adam_kw, assert_same_bits, make_operands, operands_on

OPS = torch.ops.torchcast
NSTATS = len(ref.UPDATE_STAT_FIELDS)
UNIT = 2.0 ** -20  # the kernel's resolution of |compensation| / ulp
COMBOS = [
    (torch.float32, torch.float32, "none"), (torch.float32, torch.float32, "kahan"),
    (torch.float64, torch.float64, "none"),
    *[(torch.bfloat16, s, m) for s in (torch.float32, torch.bfloat16)
      for m in ("none", "kahan", "remainder", "stochastic")],
    *[(torch.float16, s, m) for s in (torch.float32, torch.bfloat16)
      for m in ("none", "kahan", "stochastic")],
]
COMBO_IDS = [f"{str(p)[6:]}-{str(s)[6:]}-{m}" for p, s, m in COMBOS]
SIGNIFICAND = {torch.float32: (24, -149), torch.bfloat16: (8, -133), torch.float16: (11, -24)}


def counters(n, device="cpu"):
    return [torch.zeros(NSTATS, dtype=torch.int64, device=device) for _ in range(n)]


def step_tracked(ops, kw, stats, device="cpu"):
    OPS.adam_step_(*ops, update_stats=stats, **{
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


# ---------------------------------------------------------------------------
# The kernel against a direct count in float64

def float64_update(ops, i, kw):
    """The update of tensor i in float64 from its state before the step:
    Adam's textbook formulas (numpy), the step's decay included. The
    moments are the kernel's stored float32 ones after the step (they are
    what drives its update), so the two differ only by the float32
    arithmetic of the update itself."""
    p, g, m, v, _, comp, step = (lst[i] if lst else None for lst in ops)
    mode = kw["compensation"]
    w = (ref.join_bf16_remainder(p, comp) if mode == "remainder" else p).double().numpy()
    t = float(step)
    m_hat = m.double().numpy() / (1 - kw["beta1"] ** t)
    v_hat = v.double().numpy() / (1 - kw["beta2"] ** t)
    u = -kw["lr"] * m_hat / (np.sqrt(v_hat) + kw["eps"])
    if kw["decoupled_weight_decay"]:
        u = u - kw["lr"] * kw["weight_decay"] * w
    return u


def ulp_of(x, dtype):
    """ulp of the values x (float64 array) in dtype: 2^(exponent - bits + 1),
    at least the smallest subnormal."""
    bits, tiny = SIGNIFICAND[dtype]
    _, e = np.frexp(np.abs(x))
    return np.where(x == 0, 2.0 ** tiny, np.ldexp(1.0, np.maximum(e - bits, tiny)))


def direct_counts(p_before, p_after, comp_after, u, mode, dtype):
    """(lo, hi) bounds of each count from the definitions, in float64: lo
    counts what holds with a margin of 2^-20 of the update, hi what holds at
    all, so that the kernel's float32 update (2^-24 from this one) must fall
    between them; comp: the exact mean and max of |compensation| / ulp."""
    before = p_before.double().numpy()
    after = p_after.double().numpy()
    change = np.abs(after - before)
    a = np.abs(u)
    updated_hi = a > 0
    updated_lo = a > 2.0 ** -120
    margin = 2.0 ** -20
    lost = lambda upd: upd & (change == 0)
    counts = {
        "updated": (updated_lo.sum(), updated_hi.sum()),
        "lost": (lost(updated_lo).sum(), lost(updated_hi).sum()),
        "shrunk": ((updated_lo & (2 * change < a * (1 - margin))).sum(),
                   (updated_hi & (2 * change < a * (1 + margin))).sum()),
    }
    if mode in ("kahan", "remainder"):
        if mode == "kahan":
            carried = comp_after.double().numpy()
        else:
            carried = ref.join_bf16_remainder(p_after, comp_after).double().numpy() - after
        ratio = np.abs(carried) / ulp_of(after, dtype)
        counts["comp_sum"] = ratio.sum()
        counts["comp_max"] = ratio.max() if ratio.size else 0.0
    return counts


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[0] != torch.float64 and
                                   c[1] == torch.float32], ids=lambda c: f"{c[0]}-{c[2]}")
@pytest.mark.parametrize("lr", [1e-2, 1e-4, 1e-7])
@pytest.mark.parametrize("decoupled", [False, True])
def test_counts_match_a_direct_float64_count(combo, lr, decoupled):
    """Two tensors (one past a 2^16-element chunk), three steps: after each,
    the kernel's counts equal a count made directly from the params before
    and after and the float64 update (within the margin the float32 update
    allows, which on these data is none: the bounds coincide or nearly)."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(3)
    parts = [make_operands(pdtype, sdtype, mode, False, s, gen) for s in [(70001,), (17, 3)]]
    ops = [sum((q[i] for q in parts), []) for i in range(7)]
    kw = adam_kw(mode, decoupled=decoupled, wd=0.1 if decoupled else 0.0, lr=lr)
    stats = counters(2)
    totals = [dict(updated=0, lost=0, shrunk=0, comp_sum=0.0, comp_max=0.0) for _ in range(2)]
    bounds = [dict(updated=[0, 0], lost=[0, 0], shrunk=[0, 0]) for _ in range(2)]
    for _ in range(3):
        before = [[x.clone() for x in lst] for lst in ops]
        step_tracked(ops, dict(kw, seed=5), stats)
        for i in range(2):
            state_after = [lst if k in (2, 3, 6) else before[k] for k, lst in enumerate(ops)]
            u = float64_update(state_after, i, kw)
            direct = direct_counts(before[0][i], ops[0][i], ops[5][i] if ops[5] else None, u,
                                   mode, pdtype)
            for key in ("updated", "lost", "shrunk"):
                bounds[i][key][0] += direct[key][0]
                bounds[i][key][1] += direct[key][1]
            if "comp_sum" in direct:
                totals[i]["comp_sum"] += direct["comp_sum"]
                totals[i]["comp_max"] = max(totals[i]["comp_max"], direct["comp_max"])
    for i in range(2):
        got = dict(zip(ref.UPDATE_STAT_FIELDS, stats[i].tolist()))
        assert got["elements"] == 3 * ops[0][i].numel()
        for key in ("updated", "lost", "shrunk"):
            lo, hi = bounds[i][key]
            assert lo <= got[key] <= hi, (key, lo, got[key], hi)
            assert hi - lo <= max(2, hi // 1000), (key, lo, hi)  # the bounds say something
        n = got["elements"]
        if mode in ("kahan", "remainder"):
            # each element's ratio is truncated to 2^-20 ulp
            exact_sum = totals[i]["comp_sum"]
            assert exact_sum - n * UNIT <= got["comp_sum"] * UNIT <= exact_sum
            assert totals[i]["comp_max"] - UNIT < got["comp_max"] * UNIT <= totals[i]["comp_max"]
        else:
            assert got["comp_sum"] == got["comp_max"] == 0


def test_lost_updates_at_a_known_lr():
    """bfloat16 weights of 1 with updates of 2^-10 (a quarter of the ulp
    below 1): plain rounding loses every one (lost = updated = shrunk),
    Kahan carries them and moves the param on some steps, float32 params
    lose none."""
    def run(dtype, **kw):
        p = torch.nn.Parameter(torch.ones(1000, dtype=dtype))
        opt = Adam([p], lr=2.0 ** -10, betas=(0.0, 0.0), eps=0.0, track_updates=True, **kw)
        for _ in range(8):
            p.grad = torch.ones_like(p)
            opt.step()
        return opt.update_stats().params[0]
    plain = run(torch.bfloat16, compensated=False)
    assert plain.updated == plain.lost == plain.shrunk == 8000
    kahan = run(torch.bfloat16)
    assert kahan.updated == 8000 and 0 < kahan.lost < 8000
    assert 0 < kahan.comp_mean_ulp <= kahan.comp_max_ulp <= 0.5
    f32 = run(torch.float32, compensated=False)
    assert f32.updated == 8000 and f32.lost == 0 and f32.shrunk == 0


# ---------------------------------------------------------------------------
# The kernel against its pure-PyTorch restatement (edge values, layouts)

# The device fixture is a string, the same for every example.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(combo=st.sampled_from(COMBOS), amsgrad=st.booleans(), decoupled=st.booleans(),
       wd=st.sampled_from([0.0, 0.5]), lr=st.sampled_from([1e-3, 0.1, 1e-7]),
       shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1,
                       max_size=3),
       layout=st.sampled_from(["contiguous", "strided", "transposed"]),
       edge=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_kernel_counts_match_reference(device, combo, amsgrad, decoupled, wd, lr, shapes, layout,
                                       edge, seed):
    """Counts equal the reference's, bit for bit, over +-0, +-inf, NaN and
    subnormals, empty and 0-d tensors and every layout; off the CPU the
    device's counts equal the CPU's."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(seed)
    parts = [make_operands(pdtype, sdtype, mode, amsgrad, tuple(s) or (), gen,
                           layout if s else "contiguous", edge) for s in shapes]
    ops = [sum((q[i] for q in parts), []) for i in range(7)]
    kw = dict(adam_kw(mode, amsgrad, False, decoupled, wd, lr), seed=seed)
    n = len(ops[0])
    a, b = [[x.clone() for x in lst] for lst in ops], [[x.clone() for x in lst] for lst in ops]
    sa, sb = counters(n), counters(n)
    for _ in range(2):
        OPS.adam_step_(*a, update_stats=sa, **kw)
        ref.adam_step_(*b, update_stats=sb, **kw)
    if pdtype != torch.float64:  # float64: torch's sqrt is not correctly rounded
        for x, y in zip(sa, sb):
            assert torch.equal(x, y)
    if device != "cpu":
        d, sd = operands_on(ops, device), counters(n, device)
        for _ in range(2):
            step_tracked(d, kw, sd, device)
        for x, y in zip(sa, sd):
            assert torch.equal(x, y.cpu())
        for la, ld in zip(a, d):
            for x, y in zip(la, ld):
                assert_same_bits(x, y.cpu())


def test_tracking_changes_no_result():
    """The tracked step's params and states are the untracked step's, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for pdtype, sdtype, mode in COMBOS:
        ops = make_operands(pdtype, sdtype, mode, True, (300, 3), gen, edge=True)
        a, b = [[x.clone() for x in lst] for lst in ops], [[x.clone() for x in lst] for lst in ops]
        kw = dict(adam_kw(mode, True, False, True, 0.1), seed=1)
        OPS.adam_step_(*a, update_stats=counters(1), **kw)
        OPS.adam_step_(*b, **kw)
        for la, lb in zip(a, b):
            for x, y in zip(la, lb):
                assert_same_bits(x, y)


@pytest.mark.parametrize("bad", ["count", "dtype", "shape", "non-contiguous"])
def test_bad_counters_raise_before_anything_changes(bad):
    gen = torch.Generator().manual_seed(0)
    ops = [lst * 2 for lst in make_operands(torch.bfloat16, torch.float32, "kahan", False,
                                            (3, 2), gen)]
    ops[6] = [torch.tensor(0.0), torch.tensor(0.0)]
    stats = counters(2)
    if bad == "count":
        stats = stats[:1]
    elif bad == "dtype":
        stats[1] = stats[1].float()
    elif bad == "shape":
        stats[1] = torch.zeros(NSTATS + 1, dtype=torch.int64)
    else:
        stats[1] = torch.zeros(2 * NSTATS, dtype=torch.int64)[::2]
    before = [[x.clone() for x in lst] for lst in ops]
    for step in (OPS.adam_step_, ref.adam_step_):
        with pytest.raises((TypeError, ValueError), match="update_stats"):
            step(*ops, update_stats=stats, **adam_kw("kahan"))
        for la, lb in zip(ops, before):
            for x, y in zip(la, lb):
                assert_same_bits(x, y)
        assert all(int(s.abs().sum()) == 0 for s in stats)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(0)
    ops = operands_on([lst * 2 for lst in make_operands(torch.bfloat16, torch.float32,
                                                        "remainder", True, (4, 5), gen)], device)
    kw = dict(adam_kw("remainder", True, False, True, 0.01),
              update_stats=counters(2, device))
    torch.library.opcheck(OPS.adam_step_.default, ops, kw)
    torch.library.opcheck(OPS.adam_step_.tensor_lr, ops,
                          dict(kw, lr=torch.tensor(1e-3, device=device)))


# ---------------------------------------------------------------------------
# The optimizer: track_updates and update_stats()

def named_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2)).to(dtype)


def train(opt, model, steps):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def test_update_stats_records_and_groups():
    model = named_model(torch.bfloat16)
    params = list(model.named_parameters())
    opt = AdamW([{"params": params[:2]}, {"params": params[2:], "compensation": "remainder"}],
                lr=1e-4, track_updates=True)
    train(opt, model, 5)
    stats = opt.update_stats()
    assert [r.name for r in stats.params] == [n for n, _ in params]
    assert [(r.group, r.index) for r in stats.params] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r, (_, p) in zip(stats.params, params):
        assert r.elements == 5 * p.numel()
        assert 0 <= r.lost <= r.shrunk <= r.updated <= r.elements
        assert 0 <= r.comp_mean_ulp <= r.comp_max_ulp <= 0.5 + UNIT
    for g in (0, 1):
        mine = [r for r in stats.params if r.group == g]
        total = stats.groups[g]
        assert total.index is None and total.elements == sum(r.elements for r in mine)
        assert total.lost == sum(r.lost for r in mine)
        assert total.comp_max_ulp == max(r.comp_max_ulp for r in mine)
    # at lr 1e-4, most bfloat16 updates are below half an ulp
    assert stats.groups[0].lost_fraction > 0.5
    text = str(stats)
    assert "group 1" in text and params[0][0] in text and "%" in text
    # reset: read, then zero
    assert opt.update_stats(reset=True).params[0].elements == 5 * params[0][1].numel()
    assert opt.update_stats().params[0].elements == 0
    train(opt, model, 1)
    assert opt.update_stats().params[0].elements == params[0][1].numel()


def test_to_tensorboard_writes_every_fraction():
    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = (value, step)

    model = named_model(torch.bfloat16)
    opt = Adam(model.named_parameters(), lr=1e-4, track_updates=True)
    train(opt, model, 2)
    stats = opt.update_stats()
    w = Writer()
    stats.to_tensorboard(w, step=7)
    assert len(w.scalars) == 4 * (len(stats.params) + len(stats.groups))
    r = stats.params[0]
    assert w.scalars[f"torchcast/updates/group0/{r.name}/lost_fraction"] == (r.lost_fraction, 7)
    assert w.scalars["torchcast/updates/group0/comp_max_ulp"] == (stats.groups[0].comp_max_ulp, 7)


def test_untracked_optimizer_has_no_records_and_same_results():
    a, b = named_model(torch.bfloat16), named_model(torch.bfloat16)
    oa = Adam(a.parameters(), lr=1e-3, track_updates=True)
    ob = Adam(b.parameters(), lr=1e-3)
    train(oa, a, 3)
    train(ob, b, 3)
    for x, y in zip(a.parameters(), b.parameters()):
        assert_same_bits(x.detach(), y.detach())
    assert ob.update_stats().params == [] and ob.update_stats().groups == []
    assert "track_updates" not in oa.state_dict(torch_format=True)["param_groups"][0]


def test_fallback_counts_as_the_kernel():
    """fused=False (the pure-PyTorch step) counts the same."""
    a, b = named_model(torch.bfloat16), named_model(torch.bfloat16)
    oa = AdamW(a.parameters(), lr=1e-3, track_updates=True)
    ob = AdamW(b.parameters(), lr=1e-3, track_updates=True, fused=False)
    train(oa, a, 3)
    train(ob, b, 3)
    assert oa.update_stats() == ob.update_stats()


def test_track_updates_every_nth_step_counts_those_steps():
    """track_updates=3 counts steps 1, 4 and 7 of 7: the sums of what an
    every-step optimizer on the same params counts at those steps."""
    a, b = named_model(torch.bfloat16), named_model(torch.bfloat16)
    oa = AdamW(a.parameters(), lr=1e-3, track_updates=3)
    ob = AdamW(b.parameters(), lr=1e-3, track_updates=True)
    gen = torch.Generator().manual_seed(1)
    wanted = None
    for step in range(7):
        x = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
        for opt, model in ((oa, a), (ob, b)):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
        every_step = ob.update_stats(reset=True)
        if step % 3 == 0:
            wanted = every_step.params if wanted is None else [
                dataclasses.replace(w, elements=w.elements + e.elements,
                                    updated=w.updated + e.updated, lost=w.lost + e.lost,
                                    shrunk=w.shrunk + e.shrunk)
                for w, e in zip(wanted, every_step.params)]
    got = oa.update_stats().params
    numel = [p.numel() for p in a.parameters()]
    assert [r.elements for r in got] == [3 * n for n in numel]
    assert [(r.elements, r.updated, r.lost, r.shrunk) for r in got] == \
        [(r.elements, r.updated, r.lost, r.shrunk) for r in wanted]
    for x, y in zip(a.parameters(), b.parameters()):
        assert_same_bits(x.detach(), y.detach())


def test_track_updates_errors():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for bad in ("yes", 2.0, None):
        with pytest.raises(TypeError, match="track_updates must be a bool or an int"):
            Adam(p, track_updates=bad)
    with pytest.raises(ValueError, match="track_updates must be >= 0"):
        Adam(p, track_updates=-1)
    with pytest.raises(ValueError, match="track_updates=True cannot be used"):
        Adam(p, track_updates=True, differentiable=True)
    opt = Adam(p, track_updates=2)
    opt.param_groups[0]["track_updates"] = -2
    p[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="param group 0: track_updates must be >= 0.*nothing "
                                         "was updated"):
        opt.step()
    assert torch.equal(p[0].detach(), torch.zeros(3))
