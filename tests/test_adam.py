"""torchcast.optim.Adam/AdamW and the adam_step_ kernel, checked against
torch.optim.Adam/AdamW, a numpy float64 Adam, the pure-PyTorch reference (bit
for bit) and PyTorch's own optimizer checks (common_optimizers). The kernel's
checks run on every device: off the CPU, every operand after every step must
also equal the CPU kernel's, bit for bit."""
import copy
import io
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_optimizers import (
    OptimizerInfo, optim_db, optim_inputs_func_adam, OptimizerInput,
    get_error_inputs_for_all_optims)

import torchcast
from torchcast.optim import Adam, AdamW
from torchcast._reference import adam as ref

from adam_common import adam_kw, assert_same_bits, bits, make_operands, operands_on

OPS = torch.ops.torchcast
CLASSES = [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)]
CLASS_IDS = ["Adam", "AdamW"]

# (param dtype, state dtype, compensation) combinations the kernel supports.
COMBOS = [
    (torch.float32, torch.float32, "none"), (torch.float32, torch.float32, "kahan"),
    (torch.float64, torch.float64, "none"),
    *[(torch.bfloat16, s, m) for s in (torch.float32, torch.bfloat16)
      for m in ("none", "kahan", "remainder", "stochastic", "remainder8")],
    *[(torch.float16, s, m) for s in (torch.float32, torch.bfloat16)
      for m in ("none", "kahan", "stochastic")],
]
COMBO_IDS = [f"{str(p)[6:]}-{str(s)[6:]}-{m}" for p, s, m in COMBOS]
OPERAND_NAMES = ["param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "compensation",
                 "step"]


def assert_same_state(a, b):
    """Nested state dicts equal: tensors bit for bit, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert_same_bits(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------------------
# The kernel against the pure-PyTorch reference, bit for bit

def clone_operands(ops):
    return [[x.clone() for x in lst] for lst in ops]


def adam_kernel(kw):
    """The overload of adam_step_ that takes kw's lr."""
    return OPS.adam_step_.tensor_lr if isinstance(kw["lr"], torch.Tensor) else OPS.adam_step_.default


def assert_device_step_matches(ops, stepped, device, kw):
    """One kernel step on device from ops equals stepped (the CPU kernel's
    step from ops) bit for bit, each operand on its device, in its layout.
    lr, grad_scale and found_inf go to the device too: the kernel reads them there."""
    on_dev = operands_on(ops, device)
    adam_kernel(kw)(*on_dev, **{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                for k, v in kw.items()})
    for name, la, lb in zip(OPERAND_NAMES, stepped, on_dev):
        for x, y in zip(la, lb):
            assert y.device.type == ("cpu" if name == "step" else torch.device(device).type), name
            assert y.stride() == x.stride(), name
            assert_same_bits(x, y.cpu(), name)


def run_both(ops, device="cpu", **kw):
    """The kernel and the reference, each on copies of ops on the CPU; off the
    CPU, also the kernel on device, checked against the CPU kernel."""
    a, b = clone_operands(ops), clone_operands(ops)
    adam_kernel(kw)(*a, **kw)
    ref.adam_step_(*b, **kw)
    if device != "cpu":
        assert_device_step_matches(ops, a, device, kw)
    return a, b


def assert_operands_match(a, b):
    for name, la, lb in zip(OPERAND_NAMES, a, b):
        for x, y in zip(la, lb):
            assert_same_bits(x, y, name)


# The device fixture is a string, the same for every example.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(combo=st.sampled_from(COMBOS), amsgrad=st.booleans(), maximize=st.booleans(),
       decoupled=st.booleans(), wd=st.sampled_from([0.0, 0.01, 0.5]),
       beta1=st.sampled_from([0.0, 0.5, 0.9]), lr=st.sampled_from([1e-3, 0.1, 1e-7]),
       shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
       layout=st.sampled_from(["contiguous", "strided", "transposed"]),
       edge=st.booleans(), scaled=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_kernel_matches_reference(device, combo, amsgrad, maximize, decoupled, wd, beta1, lr,
                                  shape, layout, edge, scaled, seed):
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(seed)
    if layout != "contiguous" and not shape:
        shape = [3]
    ops = make_operands(pdtype, sdtype, mode, amsgrad, tuple(shape), gen, layout, edge)
    kw = dict(lr=lr, beta1=beta1, beta2=0.999, weight_decay=wd, eps=1e-8, amsgrad=amsgrad,
              maximize=maximize, decoupled_weight_decay=decoupled, compensation=mode,
              seed=seed * 0x9E3779B97F4A7C15 % 2 ** 63)  # stochastic: the full seed range
    if scaled:
        kw.update(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    for _ in range(3):  # several steps, each from the previous state
        a, b = run_both(ops, device, **kw)
        assert_operands_match(a, b)
        ops = a


# The device fixture is a string, the same for every example.
@pytest.mark.cuda_cases
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(combo=st.sampled_from(COMBOS), amsgrad=st.booleans(), maximize=st.booleans(),
       decoupled=st.booleans(), wd=st.sampled_from([0.0, 0.01, 0.5]),
       beta1=st.sampled_from([0.0, 0.5, 0.9]), lr=st.sampled_from([1e-3, 0.1, 1e-7]),
       shapes=st.lists(st.lists(st.integers(0, 70), min_size=0, max_size=3), min_size=1,
                       max_size=4),
       layout=st.sampled_from(["contiguous", "strided", "transposed"]),
       edge=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_kernel_matches_reference_several_tensors(device, combo, amsgrad, maximize, decoupled,
                                                  wd, beta1, lr, shapes, layout, edge, seed):
    """Up to four tensors of up to 70 elements a dim (empty and 0-d ones
    included) in one launch."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(seed)
    parts = [make_operands(pdtype, sdtype, mode, amsgrad, tuple(s) or (), gen,
                           layout if s else "contiguous", edge) for s in shapes]
    ops = [sum((p[i] for p in parts), []) for i in range(7)]
    for _ in range(2):
        a, b = run_both(ops, device, **adam_kw(mode, amsgrad, maximize, decoupled, wd, lr, beta1))
        assert_operands_match(a, b)
        ops = a


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
def test_kernel_matches_reference_many_chunks(device, combo):
    """Several tensors, one spanning more than one 2^16-element chunk, and an
    empty one: the parallel pass covers each element once."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(1)
    parts = [make_operands(pdtype, sdtype, mode, True, s, gen)
             for s in [(70001,), (0,), (), (3, 5)]]
    ops = [sum((p[i] for p in parts), []) for i in range(7)]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=True,
              maximize=False, decoupled_weight_decay=True, compensation=mode)
    for _ in range(2):
        a, b = run_both(ops, device, **kw)
        assert_operands_match(a, b)
        ops = a
    assert all(float(s) > 1 for s in ops[6])


@pytest.mark.cuda_cases
@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("wd,decoupled", [(0.0, False), (0.1, False), (0.1, True)])
def test_kernel_matches_reference_every_option(device, combo, amsgrad, maximize, wd, decoupled):
    """Edge values (+-0, +-inf, NaN, subnormals), and a tensor over several
    chunks, an empty one and a 0-d one, in one launch."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(7)
    parts = [make_operands(pdtype, sdtype, mode, amsgrad, s, gen, edge=True)
             for s in [(40_000,), (0,), (), (3, 5)]]
    ops = [sum((p[i] for p in parts), []) for i in range(7)]
    for _ in range(3):
        a, b = run_both(ops, device, **adam_kw(mode, amsgrad, maximize, decoupled, wd))
        assert_operands_match(a, b)
        ops = a


@pytest.mark.cuda_cases
@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_kernel_matches_reference_layouts(device, combo, layout):
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(11)
    ops = make_operands(pdtype, sdtype, mode, True, (33, 17), gen, layout)
    for _ in range(3):
        a, b = run_both(ops, device, **adam_kw(mode, True, wd=0.01, decoupled=True))
        assert_operands_match(a, b)
        ops = a


@pytest.mark.cuda_cases
@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
def test_kernel_tensor_lr_and_grad_scale_match_reference(device, combo, lr_dtype):
    """lr and grad_scale as tensors on the device: read there, the constants
    computed with the host's float64 expressions."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(13)
    ops = make_operands(pdtype, sdtype, mode, False, (5000,), gen, edge=True)
    kw = adam_kw(mode, wd=0.05, decoupled=True, lr=torch.tensor(3e-3, dtype=lr_dtype))
    kw.update(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    for _ in range(3):
        a, b = run_both(ops, device, **kw)
        assert_operands_match(a, b)
        ops = a


@pytest.mark.parametrize("shape", [(4, 3), pytest.param((70_000,), marks=pytest.mark.cuda_cases)])
def test_kernel_found_inf_changes_nothing(device, shape):
    gen = torch.Generator().manual_seed(0)
    ops = operands_on(make_operands(torch.bfloat16, torch.float32, "kahan", True, shape, gen),
                      device)
    before = clone_operands(ops)
    OPS.adam_step_(*ops, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                   amsgrad=True, maximize=False, decoupled_weight_decay=False,
                   compensation="kahan", grad_scale=torch.tensor(8.0, device=device),
                   found_inf=torch.tensor(1.0, device=device))
    for la, lb in zip(ops, before):
        for x, y in zip(la, lb):
            assert_same_bits(x, y)


@pytest.mark.parametrize("bad", ["grad dtype", "state dtype", "shape", "count", "remainder",
                                 "stochastic", "kahan64", "mode", "sparse"])
def test_kernel_rejects_bad_arguments_before_writing(bad):
    gen = torch.Generator().manual_seed(0)
    mode = {"remainder": "remainder", "stochastic": "stochastic", "kahan64": "kahan",
            "mode": "bogus"}.get(bad, "kahan")
    pdtype = torch.float64 if bad == "kahan64" else torch.float32
    ops = make_operands(pdtype, pdtype, "none" if mode in ("remainder", "stochastic") else "kahan",
                        False, (3, 2), gen)
    ops = [lst * 2 for lst in ops]  # two tensors: the second one is bad
    ops[6] = [torch.tensor(0.0), torch.tensor(0.0)]
    if mode == "remainder":
        ops[5] = [torch.zeros(3, 2, dtype=torch.int16)] * 2
    if bad == "grad dtype":
        ops[1][1] = ops[1][1].double()
    elif bad == "state dtype":
        ops[3][1] = ops[3][1].half()
    elif bad == "shape":
        ops[2][1] = ops[2][1].reshape(2, 3)
    elif bad == "count":
        ops[6] = ops[6][:1]
    elif bad == "sparse":
        ops[1][1] = ops[1][1].to_sparse()
    before = clone_operands(ops)
    with pytest.raises((RuntimeError, TypeError, ValueError)) as e:
        OPS.adam_step_(*ops, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                       amsgrad=False, maximize=False, decoupled_weight_decay=False,
                       compensation=mode)
    assert "adam_step_" in str(e.value)
    for la, lb in zip(ops, before):
        for x, y in zip(la, lb):
            if x.layout == torch.strided:
                assert_same_bits(x, y)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(0)
    for pdtype, sdtype, mode in [(torch.float32, torch.float32, "none"),
                                 (torch.bfloat16, torch.float32, "kahan"),
                                 (torch.bfloat16, torch.bfloat16, "remainder"),
                                 (torch.bfloat16, torch.float32, "remainder8"),
                                 (torch.bfloat16, torch.float32, "stochastic")]:
        ops = [lst * 2 for lst in make_operands(pdtype, sdtype, mode, True, (4, 5), gen)]
        ops = operands_on(ops, device)
        kw = dict(beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=True,
                  maximize=False, decoupled_weight_decay=True, compensation=mode,
                  grad_scale=torch.tensor(2.0, device=device),
                  found_inf=torch.tensor(0.0, device=device), seed=2 ** 62 + 3)
        torch.library.opcheck(OPS.adam_step_.default, ops, dict(kw, lr=1e-3))
        torch.library.opcheck(OPS.adam_step_.tensor_lr, ops,
                              dict(kw, lr=torch.tensor(1e-3, device=device)))


# ---------------------------------------------------------------------------
# The bfloat16 remainder: exact float32 master weights in 2 + 2 bytes

def np_join(hi, rem):
    u = (hi.astype(np.int64) << 16) + rem.astype(np.int64)
    return (u & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def test_remainder_split_is_exact_and_nearest():
    """A step that changes nothing (lr=0, zero grads) re-splits the master:
    over every bfloat16 bit pattern and random remainders, the master comes
    back bit for bit and the param is its nearest bfloat16 (ties away from
    zero); a NaN master keeps a NaN param."""
    hi = np.arange(2 ** 16, dtype=np.int64).repeat(4)
    rng = np.random.default_rng(0)
    rem = rng.integers(-2 ** 15, 2 ** 15, hi.size)
    rem[::4] = 0
    rem[1::4] = -2 ** 15  # an exact tie
    p = torch.from_numpy(((hi + 2 ** 15) % 2 ** 16 - 2 ** 15).astype(np.int16)).view(
        torch.bfloat16)
    r = torch.from_numpy(rem.astype(np.int16))
    master = np_join(hi, rem)
    ops = [[p.clone()], [torch.zeros_like(p)], [torch.zeros(p.shape)], [torch.zeros(p.shape)],
           [], [r.clone()], [torch.tensor(0.0)]]
    OPS.adam_step_(*ops, lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                   amsgrad=False, maximize=False, decoupled_weight_decay=False,
                   compensation="remainder")
    new_p, new_r = ops[0][0], ops[5][0]
    back = np_join(bits(new_p).numpy().astype(np.int64) & 0xFFFF, new_r.numpy())
    nan = np.isnan(master)
    np.testing.assert_array_equal(back.view(np.uint32)[~nan], master.view(np.uint32)[~nan])
    assert np.isnan(new_p.float().numpy()[nan]).all()
    assert (new_r.numpy()[nan] == 0).all()  # NaN payloads differ by device: no remainder
    # nearest bfloat16 in float64, ties away from zero
    m64 = master[~nan].astype(np.float64)
    q = new_p.float().numpy()[~nan].astype(np.float64)
    fin = np.isfinite(m64) & (np.abs(m64) < 3.389e38)
    m64, q = m64[fin], q[fin]
    ulp = np.ldexp(1.0, np.maximum(np.frexp(np.abs(m64))[1] - 8, -133))
    err = np.abs(q - m64)
    assert (err <= ulp / 2).all()
    tie = err == ulp / 2
    assert (np.abs(q[tie]) > np.abs(m64[tie])).all()


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_remainder_is_float32_master_adam(amsgrad, weight_decay):
    """bfloat16 params + remainders step exactly like float32 master weights
    under plain float32 Adam: the same bits every step."""
    torch.manual_seed(0)
    w = torch.randn(300, dtype=torch.float32)
    pb = torch.nn.Parameter(w.bfloat16())
    pm = torch.nn.Parameter(pb.detach().float())
    kw = dict(lr=3e-3, weight_decay=weight_decay, amsgrad=amsgrad)
    ob = Adam([pb], compensation="remainder", **kw)
    om = Adam([pm], compensated=False, **kw)
    for _ in range(100):
        g = torch.randn(300).bfloat16()
        pb.grad, pm.grad = g, g.float()
        ob.step()
        om.step()
        master = ref.join_bf16_remainder(pb.detach(), ob.state[pb]["remainder"])
        assert_same_bits(master, pm.detach())
    # the param the model sees is the master rounded to nearest
    assert ((pb.detach().float() - pm.detach()).abs() <= pm.detach().abs() * 2.0 ** -8).all()


# ---------------------------------------------------------------------------
# Compensation against a float64 Adam

def np_adam(w0, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    """Adam in numpy float64, the textbook formulas."""
    p = np.array(w0, dtype=np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, 1):
        g = np.array(g, dtype=np.float64)
        if weight_decay and decoupled:
            p = p * (1 - lr * weight_decay)
        elif weight_decay:
            g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        mhat = m / (1 - betas[0] ** t)
        vhat = v / (1 - betas[1] ** t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
        out.append(p.copy())
    return out


def value_of(opt, p):
    """What the optimizer holds for p, in float64: param + compensation."""
    s = opt.state[p]
    x = p.detach().double()
    if "compensation" in s:
        x = x + s["compensation"].double()
    if "remainder" in s:
        x = ref.join_bf16_remainder(p.detach(), s["remainder"]).double()
    return x


def test_float32_small_updates_compensated_tracks_float64():
    """Updates below half an ulp of the weights: plain float32 Adam does not
    move at all, compensated float32 follows the float64 run."""
    torch.manual_seed(0)
    w = (torch.rand(500, dtype=torch.float64) + 0.5).float().double()  # representable start
    sign = torch.randn(500, dtype=torch.float64).sign()  # steady directions
    grads = [sign * (1 + 0.1 * torch.rand(500, dtype=torch.float64)) for _ in range(400)]
    lr = 2e-8  # half an ulp of weights in [0.5, 2) is 3e-8 to 1.2e-7
    exact = np_adam(w.numpy(), [g.numpy() for g in grads], lr)[-1]
    plain = torch.nn.Parameter(w.float())
    comp = torch.nn.Parameter(w.float())
    op, oc = Adam([plain], lr=lr), Adam([comp], lr=lr, compensated=True)
    for g in grads:
        plain.grad, comp.grad = g.float(), g.float()
        op.step()
        oc.step()
    assert torch.equal(plain.detach(), w.float())  # plain float32 never moved
    start_err = np.abs(w.numpy() - exact).max()
    comp_err = np.abs(value_of(oc, comp).numpy() - exact).max()
    assert start_err > 5e-6
    assert comp_err < start_err / 1000, (comp_err, start_err)
    # and the param itself is the float64 run rounded (within one ulp)
    assert np.abs(comp.detach().double().numpy() - exact).max() <= 1.2e-7


@pytest.mark.parametrize("cls", [Adam, AdamW], ids=CLASS_IDS)
@pytest.mark.parametrize("dtype,mode,bound", [
    # a bfloat16 Kahan buffer holds 8 more bits: about 16 in all, and its own
    # rounding each step adds up; the remainder is a float32 master
    (torch.bfloat16, "kahan", 1e-3), (torch.bfloat16, "remainder", 1e-5),
    (torch.float16, "kahan", 2e-5)], ids=["bf16-kahan", "bf16-remainder", "f16-kahan"])
def test_low_precision_compensated_tracks_float64(cls, dtype, mode, bound):
    """bfloat16/float16 params with compensation stay near the float64 Adam
    run at an ordinary learning rate; without it they drift far away."""
    torch.manual_seed(0)
    w = torch.randn(400, dtype=torch.float64).to(dtype).double()  # representable start
    grads = [torch.randn(400, dtype=torch.float64).to(dtype).double() for _ in range(300)]
    wd = 0.01 if cls is AdamW else 0.0
    exact = np_adam(w.numpy(), [g.numpy() for g in grads], 1e-3, weight_decay=wd,
                    decoupled=True)[-1]
    plain = torch.nn.Parameter(w.to(dtype))
    comp = torch.nn.Parameter(w.to(dtype))
    op = cls([plain], lr=1e-3, compensated=False)
    oc = cls([comp], lr=1e-3, compensation=mode)
    for g in grads:
        plain.grad, comp.grad = g.to(dtype), g.to(dtype)
        op.step()
        oc.step()
    plain_err = np.abs(plain.detach().double().numpy() - exact).max()
    comp_err = np.abs(value_of(oc, comp).numpy() - exact).max()
    assert comp_err < bound, comp_err
    assert plain_err > 100 * comp_err, (plain_err, comp_err)
    # one rounding: the param is the held value rounded to its dtype
    held = value_of(oc, comp)
    half_ulp = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    assert ((comp.detach().double() - held).abs() <= held.abs() * half_ulp + 2.0 ** -25).all()


# ---------------------------------------------------------------------------
# Equivalence with torch.optim.Adam/AdamW (compensated=False, float32)

def train(cls, params_fn, steps, seed=1, **kw):
    params = params_fn()
    opt = cls(params if not isinstance(params[0], dict) else params, **kw)
    tensors = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in tensors:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return tensors, opt


def assert_close_to_torch(ours, theirs, rel=1e-6):
    for a, b in zip(ours, theirs):
        scale = b.detach().abs().max()
        assert (a.detach() - b.detach()).abs().max() <= rel * scale


def three_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(64, 33), (33,), ()]]


EQUIV_CONFIGS = [
    {}, {"amsgrad": True}, {"maximize": True}, {"weight_decay": 0.1},
    {"weight_decay": 0.1, "amsgrad": True, "maximize": True},
    {"lr": torch.tensor(0.01)}, {"lr": 0.01, "betas": (0.5, 0.99), "eps": 1e-6},
]


@pytest.mark.parametrize("cls,tcls", CLASSES, ids=CLASS_IDS)
@pytest.mark.parametrize("config", EQUIV_CONFIGS, ids=lambda c: str(c) or "default")
def test_matches_torch_optim_200_steps(cls, tcls, config):
    ours, _ = train(cls, three_params, 200, compensated=False, **copy.deepcopy(config))
    theirs, _ = train(tcls, three_params, 200, **copy.deepcopy(config))
    assert_close_to_torch(ours, theirs)


@pytest.mark.parametrize("cls,tcls", CLASSES, ids=CLASS_IDS)
def test_matches_torch_optim_param_groups(cls, tcls):
    def groups():
        a, b, c = three_params()
        return [{"params": [a], "lr": 0.01, "amsgrad": True},
                {"params": [b], "weight_decay": 0.3, "maximize": True},
                {"params": [c], "lr": torch.tensor(0.002), "betas": (0.8, 0.9)}]
    ours, _ = train(cls, groups, 200, lr=1e-3, compensated=False)
    theirs, _ = train(tcls, groups, 200, lr=1e-3)
    assert_close_to_torch(ours, theirs)


@pytest.mark.parametrize("sched", range(7))
def test_lr_schedulers_match_torch(sched):
    """The scheduler battery torch runs on its Adam, against torch.optim.Adam."""
    makers = TORCH_ADAM_INFO.scheduler_inputs[sched]

    def run(cls, **kw):
        params = three_params()
        opt = cls(params, lr=0.01, **kw)
        scheds = [m(opt) for m in makers]
        gen = torch.Generator().manual_seed(3)
        for _ in range(30):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            for s in scheds:
                s.step(1.0) if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) \
                    else s.step()
        return params, opt

    ours, o1 = run(Adam, compensated=False)
    theirs, o2 = run(torch.optim.Adam)
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]
    assert_close_to_torch(ours, theirs)


def test_every_lr_scheduler_runs():
    """Every torch.optim.lr_scheduler drives torchcast's optimizer, including
    those that cycle betas (OneCycleLR, CyclicLR)."""
    S = torch.optim.lr_scheduler
    makers = [
        lambda o: S.LambdaLR(o, lambda e: 0.9 ** e), lambda o: S.MultiplicativeLR(o, lambda e: 0.9),
        lambda o: S.StepLR(o, 2), lambda o: S.MultiStepLR(o, [2, 4]),
        lambda o: S.ConstantLR(o), lambda o: S.LinearLR(o), lambda o: S.ExponentialLR(o, 0.9),
        lambda o: S.PolynomialLR(o), lambda o: S.CosineAnnealingLR(o, 5),
        lambda o: S.CosineAnnealingWarmRestarts(o, 3),
        lambda o: S.CyclicLR(o, 1e-4, 1e-2, step_size_up=2),
        lambda o: S.OneCycleLR(o, 1e-2, total_steps=10),
        lambda o: S.SequentialLR(o, [S.ConstantLR(o), S.ExponentialLR(o, 0.9)], [3]),
        lambda o: S.ChainedScheduler([S.ConstantLR(o), S.ExponentialLR(o, 0.9)]),
    ]
    for make in makers:
        lrs = []
        for cls in (Adam, torch.optim.Adam):
            params = three_params()
            opt = cls(params, lr=0.01)
            s = make(opt)
            for _ in range(6):
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
                s.step()
            lrs.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
        assert lrs[0] == lrs[1]


# ---------------------------------------------------------------------------
# state_dict

MODES = [
    (torch.float32, {"compensated": False}), (torch.float32, {"compensated": True}),
    (torch.bfloat16, {}), (torch.bfloat16, {"compensation": "remainder"}),
    # no seed given: each optimizer draws its own, and loading brings the saved one
    (torch.bfloat16, {"compensation": "stochastic", "amsgrad": True}),
    (torch.bfloat16, {"state_dtype": torch.bfloat16, "amsgrad": True}),
    (torch.float16, {"amsgrad": True}),
    (torch.bfloat16, {"compensation": "remainder8"}),
]
MODE_IDS = ["f32", "f32-kahan", "bf16-kahan", "bf16-remainder", "bf16-stochastic",
            "bf16-bf16states", "f16", "bf16-remainder8"]


def model_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
            for s in [(8, 5), (5,)]]


def feed(params, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype,kw", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("cls", [Adam, AdamW], ids=CLASS_IDS)
def test_save_load_continue_is_bit_identical(cls, dtype, kw):
    pa = model_params(dtype)
    oa = cls(pa, lr=1e-2, **kw)
    feed(pa, oa, 5, seed=1)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in pa], "opt": oa.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    pb = [torch.nn.Parameter(t.clone()) for t in ck["model"]]
    ob = cls(pb, lr=1e-2, **kw)
    ob.load_state_dict(ck["opt"])
    for a, p in zip(pa, pb):
        for key, value in ob.state[p].items():
            saved = oa.state[a][key]
            assert value.dtype == saved.dtype, key  # no silent downcast on load
            assert_same_bits(value, saved, key)
    feed(pa, oa, 5, seed=2)
    feed(pb, ob, 5, seed=2)
    for a, b in zip(pa, pb):
        assert_same_bits(a.detach(), b.detach())
        for key in oa.state[a]:
            assert_same_bits(oa.state[a][key], ob.state[b][key], key)


def test_torch_load_state_dict_downcasts_but_ours_does_not():
    """The problem (pytorch issue 43706) shown on torch itself, and torchcast's fix."""
    pa = model_params(torch.bfloat16)
    oa = Adam(pa)
    feed(pa, oa, 2, seed=0)
    sd = oa.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    pt = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ot = torch.optim.Adam(pt)
    ot.load_state_dict(copy.deepcopy(sd))
    assert ot.state[pt[0]]["exp_avg"].dtype == torch.bfloat16  # torch casts to the param's dtype
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ob = Adam(pb)
    ob.load_state_dict(copy.deepcopy(sd))
    assert ob.state[pb[0]]["exp_avg"].dtype == torch.float32
    assert ob.state[pb[0]]["compensation"].dtype == torch.bfloat16


@pytest.mark.parametrize("cls,tcls", CLASSES, ids=CLASS_IDS)
def test_torch_state_dict_round_trip(cls, tcls):
    """torch.optim -> torchcast (compensation added at zero, steps kept) ->
    torch.optim (torchcast-only state dropped): the trajectory continues
    like torch's own within float32 rounding."""
    pt = model_params(torch.float32)
    ot = tcls(pt, lr=1e-2, amsgrad=True)
    feed(pt, ot, 5, seed=1)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    oref = tcls(ref_params, lr=1e-2, amsgrad=True)
    oref.load_state_dict(copy.deepcopy(ot.state_dict()))

    pc = [torch.nn.Parameter(p.detach().clone()) for p in pt]
    oc = cls(pc, lr=1e-2, amsgrad=True, compensated=True)
    oc.load_state_dict(copy.deepcopy(ot.state_dict()))
    for p in pc:
        assert "compensation" not in oc.state[p]  # added at the next step
        assert float(oc.state[p]["step"]) == 5.0
    feed(pc, oc, 3, seed=2)
    for p in pc:
        assert oc.state[p]["compensation"].dtype == torch.float32
        assert float(oc.state[p]["step"]) == 8.0

    back = [torch.nn.Parameter(p.detach().clone()) for p in pc]
    ob = tcls(back, lr=1e-2, amsgrad=True)
    sd = copy.deepcopy(oc.state_dict(torch_format=True))
    assert all("compensation" not in s for s in sd["state"].values())
    assert all("compensated" not in g for g in sd["param_groups"])
    ob.load_state_dict(sd)
    feed(back, ob, 3, seed=3)
    feed(pc, oc, 3, seed=3)
    feed(ref_params, oref, 3, seed=2)
    feed(ref_params, oref, 3, seed=3)
    for a, b, r in zip(back, pc, ref_params):
        assert float(ob.state[a]["step"]) == 11.0
        assert_close_to_torch([a], [r], rel=1e-5)
        assert_close_to_torch([b], [r], rel=1e-5)


def bad_state_dict(case, opt, params):
    """opt's state dict, broken in one place (in param group 1 where it can)."""
    sd = copy.deepcopy(opt.state_dict())
    if case == "state is a string":
        sd["state"][2] = "garbage"
    elif case == "exp_avg shape":
        sd["state"][2]["exp_avg"] = torch.zeros(5)
    elif case == "exp_avg integer":
        sd["state"][2]["exp_avg"] = torch.zeros(4, dtype=torch.int64)
    elif case == "exp_avg None":
        sd["state"][2]["exp_avg"] = None
    elif case == "step string":
        sd["state"][2]["step"] = "3"
    elif case == "unknown key":
        sd["state"][2]["momentum_buffer"] = torch.zeros(4)
    elif case == "SGD state dict":
        sgd = torch.optim.SGD([{"params": params[:2]}, {"params": [params[2]]}], lr=0.1,
                              momentum=0.9)
        sgd.step()
        sd = sgd.state_dict()
    elif case == "lr string":
        sd["param_groups"][1]["lr"] = "0.01"
    elif case == "remainder on float32":
        sd["param_groups"][1]["compensation"] = "remainder"
        sd["param_groups"][1]["compensated"] = True
    elif case == "group count":
        sd["param_groups"].pop()
    return sd


LOAD_CASES = {  # case -> what the message must name
    "state is a string": "param 0 of param group 1", "exp_avg shape": "shape (5,)",
    "exp_avg integer": "torch.int64", "exp_avg None": "'exp_avg'", "step string": "'step'",
    "unknown key": "momentum_buffer", "SGD state dict": "momentum_buffer",
    "lr string": "param group 1", "remainder on float32": "param 0 of param group 1",
    "group count": "number of parameter groups"}


@pytest.mark.parametrize("cls", [Adam, AdamW], ids=CLASS_IDS)
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_failed_load_state_dict_changes_nothing(cls, case):
    """A state dict that does not fit raises a ValueError naming the param
    (group and index) and what is wrong, and leaves the optimizer exactly as
    it was: it still steps, as if the load had not been tried."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, generator=gen)),
              torch.nn.Parameter(torch.randn(6, generator=gen).bfloat16()),
              torch.nn.Parameter(torch.randn(4, generator=gen))]
    opt = cls([{"params": params[:2]}, {"params": [params[2]], "lr": 0.01}])
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()
    sd = bad_state_dict(case, opt, params)
    snap = full_snapshot(opt)
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(sd)
    assert LOAD_CASES[case] in str(e.value), str(e.value)
    assert_nothing_changed(opt, snap)
    assert all(type(s) is dict for s in opt.state.values())
    opt.step()
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


def test_adamw_loading_adam_state_stays_adamw():
    """As torch.optim.AdamW: a torch.optim.Adam state dict (decoupled_weight_decay
    False) loaded into AdamW keeps the weight decay decoupled; 20 steps then
    match torch.optim.AdamW loading the same dict."""
    def make():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(8, 3, generator=gen)),
                torch.nn.Parameter(torch.randn(5, generator=gen))]
    source = torch.optim.Adam(make(), lr=1e-2, weight_decay=0.5)
    assert source.state_dict()["param_groups"][0]["decoupled_weight_decay"] is False
    ours_p, theirs_p = make(), make()
    ours = AdamW(ours_p, compensated=False)
    theirs = torch.optim.AdamW(theirs_p)
    ours.load_state_dict(source.state_dict())
    theirs.load_state_dict(source.state_dict())
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    assert theirs.param_groups[0]["decoupled_weight_decay"] is True
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for a, b in zip(ours_p, theirs_p):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    assert_close_to_torch(ours_p, theirs_p)
    # with weight decay 0.5 and lr 1e-2, L2 (Adam) and decoupled decay part ways
    l2 = make()
    l2_opt = torch.optim.Adam(l2, lr=1e-2, weight_decay=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for a in l2:
            a.grad = torch.randn(a.shape, generator=gen)
        l2_opt.step()
    assert (l2[0] - theirs_p[0]).abs().max() > 1e-3


def test_switching_compensation_modes():
    """A loaded state brings its group options (as in torch); a group then
    switched to another mode drops the old mode's state and starts the new
    one at zero."""
    pa = model_params(torch.bfloat16)
    oa = Adam(pa)  # kahan
    feed(pa, oa, 3, seed=0)
    for switch, kept in [({"compensation": "remainder"}, "remainder"),
                         ({"compensated": False}, None)]:
        pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
        ob = Adam(pb)
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))
        assert all(ob.state[p]["compensation"].dtype == torch.bfloat16 for p in pb)
        ob.param_groups[0].update(switch)
        feed(pb, ob, 1, seed=1)
        for p in pb:
            assert "compensation" not in ob.state[p]
            assert set(ob.state[p]) == {"step", "exp_avg", "exp_avg_sq"} | (
                {kept} if kept else set())
            assert float(ob.state[p]["step"]) == 4.0


@pytest.mark.parametrize("mode", ["kahan", "remainder"])
def test_seed_compensation_from_float32(mode):
    """An fp32 checkpoint moved to bfloat16 training keeps its low bits."""
    torch.manual_seed(0)
    w32 = [torch.randn(50), torch.randn(7, 3)]
    params = [torch.nn.Parameter(w.bfloat16()) for w in w32]
    opt = Adam(params, compensation=mode)
    opt.seed_compensation(w32)
    for p, w in zip(params, w32):
        held = value_of(opt, p)
        assert torch.equal(p.detach(), w.bfloat16())
        if mode == "remainder":
            assert torch.equal(held.float(), w)  # bit-exact float32 master
        else:  # p + c: the float32 weight to within c's own rounding
            c = opt.state[p]["compensation"].double()
            assert ((held - w.double()).abs() <= c.abs() * 2.0 ** -7).all()
            assert (held - w.double()).abs().max() < (w.abs().max() * 2.0 ** -16)
        assert float(opt.state[p]["step"]) == 0.0
    with pytest.raises(ValueError, match="weights given"):
        opt.seed_compensation(w32[:1])


# ---------------------------------------------------------------------------
# Bad input: clear errors, nothing changed

def snapshot(opt):
    return [(p, p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for g in opt.param_groups for p in g["params"] if p in opt.state]


def assert_unchanged(opt, snap):
    assert len(opt.state) == len(snap)
    for p, value, state in snap:
        assert_same_bits(p.detach(), value)
        assert set(opt.state[p]) == set(state)
        for k, v in state.items():
            assert_same_bits(opt.state[p][k], v, k)


def full_snapshot(opt):
    """Everything a step could change, deep-copied: every param, every state
    entry (whatever its type) and the param groups' options."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return ([p.detach().clone() for p in params],
            [copy.deepcopy(opt.state[p]) if p in opt.state else None for p in params],
            [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
             for g in opt.param_groups],
            len(opt.state))


def assert_nothing_changed(opt, snap):
    params, states, groups, n_states = snap
    now = full_snapshot(opt)
    for before, after in zip(params, now[0]):
        assert_same_bits(after, before, "param")
    assert_same_state(now[1], states)
    assert_same_state(now[2], groups)
    assert now[3] == n_states


def corrupt(case, opt, params):
    """Breaks group 1 (or the second dtype of group 0) after a good step, so
    that a non-atomic step would update group 0 before failing."""
    g1 = params[2]
    if case == "exp_avg shape":
        opt.state[g1]["exp_avg"] = torch.zeros(5)
    elif case == "exp_avg dtype, second dtype of a group":
        opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"].double()
    elif case == "lr string":
        opt.param_groups[1]["lr"] = "0.01"
    elif case == "exp_avg None":
        opt.state[g1]["exp_avg"] = None
    elif case == "exp_avg list":
        opt.state[g1]["exp_avg"] = [0.0] * 4
    elif case == "expanded param":
        opt.param_groups[1]["params"].append(params[3])
    elif case == "expanded exp_avg":
        opt.state[g1]["exp_avg"] = torch.zeros(1).expand(4)
    elif case == "step on another dtype":
        opt.state[g1]["step"] = torch.tensor(1, dtype=torch.int64)


FAILED_STEP_CASES = ["exp_avg shape", "exp_avg dtype, second dtype of a group", "lr string",
                     "exp_avg None", "exp_avg list", "expanded param", "expanded exp_avg",
                     "step on another dtype"]


@pytest.mark.parametrize("cls", [Adam, AdamW], ids=CLASS_IDS)
@pytest.mark.parametrize("case", FAILED_STEP_CASES)
def test_failed_step_changes_nothing(cls, case):
    """A step that raises leaves every param, state entry and step count
    bit for bit as it was, whichever group or dtype batch is bad."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, generator=gen)),
              torch.nn.Parameter(torch.randn(6, generator=gen).bfloat16()),
              torch.nn.Parameter(torch.randn(4, generator=gen)),
              torch.nn.Parameter(torch.randn(1, generator=gen).expand(4))]
    opt = cls([{"params": params[:2]}, {"params": [params[2]], "lr": 0.01}])
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()
    corrupt(case, opt, params)
    snap = full_snapshot(opt)
    with pytest.raises((RuntimeError, TypeError, ValueError)) as e:
        opt.step()
    assert_nothing_changed(opt, snap)
    msg = str(e.value)
    where = "param 0 of param group 1"
    if case == "exp_avg dtype, second dtype of a group":
        where = "param 1 of param group 0"
    elif case == "expanded param":
        where = "param 1 of param group 1"
    elif case == "lr string":
        where = "param group 1"
    assert where in msg and "nothing was updated" in msg, msg


@pytest.mark.parametrize("cls", [Adam, AdamW], ids=CLASS_IDS)
def test_mismatched_grad_dtype_raises_before_anything_changes(cls):
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    opt = cls([{"params": [a]}, {"params": [torch.nn.Parameter(torch.randn(2)), b]}])
    a.grad = torch.randn(4)
    feed([a], opt, 1, seed=0)
    a.grad = torch.randn(4)
    b.grad_dtype = None  # torch >= 2.9 allows grads of another dtype once asked to
    b.grad = torch.randn(3, dtype=torch.float64)
    snap = snapshot(opt)
    with pytest.raises(RuntimeError) as e:
        opt.step()
    msg = str(e.value)
    for part in ("param 1 of param group 1", "shape (3,)", "torch.float32", "torch.float64",
                 "cast_grads=True"):
        assert part in msg, (part, msg)
    assert_unchanged(opt, snap)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a second device: torch refuses a CPU param a grad on "
                           "another device, and the meta device cannot take a param's data")
def test_mismatched_grad_device_raises():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    p.data = p.data.cuda()  # the param moved, its grad did not
    opt = Adam([p])
    with pytest.raises(RuntimeError, match="on cpu but the param is torch.float32 on cuda"):
        opt.step()
    assert len(opt.state) == 0


def test_cast_grads_casts_with_safe_to(monkeypatch):
    """bfloat16 params with float32 grads: an error by default, cast (through
    torchcast.safe_to, correctly rounded) with cast_grads=True."""
    from torchcast import cast as cast_module
    calls = []
    real = cast_module.safe_to

    def spy(x, dtype, **kw):
        calls.append((x.dtype, dtype, kw.get("name")))
        return real(x, dtype, **kw)

    monkeypatch.setattr(cast_module, "safe_to", spy)
    torch.manual_seed(0)
    w = torch.randn(20).bfloat16()
    g32 = torch.randn(20)
    results = []
    for cast in (True, False):
        p = torch.nn.Parameter(w.clone())
        p.grad_dtype = None
        p.grad = g32.clone()
        opt = Adam([p], cast_grads=cast)
        if not cast:
            with pytest.raises(RuntimeError, match="cast_grads=True"):
                opt.step()
            p.grad = g32.bfloat16()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        results.append(p.detach().clone())
    assert calls and calls[0][:2] == (torch.float32, torch.bfloat16)
    assert "param 0 of param group 0" in calls[0][2]
    assert torch.equal(results[0], results[1])


def test_sparse_and_non_leaf_and_integer_params():
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients.*SparseAdam"):
        Adam([p]).step()
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="non-leaf"):
        Adam([leaf * 2])
    with pytest.raises(TypeError, match="floating point"):
        Adam([torch.zeros(3, dtype=torch.int64)])


def test_configuration_errors():
    p16 = torch.nn.Parameter(torch.randn(3).half())
    with pytest.raises(ValueError, match="needs bfloat16 params"):
        Adam([p16], compensation="remainder")
    with pytest.raises(ValueError, match="'stochastic' rounds updates into 16-bit"):
        Adam([torch.nn.Parameter(torch.randn(3))], compensated=True, compensation="stochastic")
    for seed, kind in ((-1, ValueError), (2 ** 63, ValueError), (1.5, TypeError),
                       (True, TypeError)):
        with pytest.raises(kind, match="seed must be"):
            Adam([p16], seed=seed)
    with pytest.raises(ValueError, match="float64 needs none"):
        Adam([torch.nn.Parameter(torch.randn(3).double())], compensated=True)
    with pytest.raises(ValueError, match="compensation must be"):
        Adam([p16], compensation="neumaier")
    with pytest.raises(ValueError, match="state_dtype"):
        Adam([p16], state_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="capturable"):
        Adam([p16], capturable=True)
    # differentiable=True runs torch's own step: the torchcast options do not apply
    for kw in ({"compensated": True}, {"compensation": "remainder"},
               {"compensation": "stochastic"}, {"state_dtype": torch.bfloat16}):
        with pytest.raises(ValueError, match="differentiable=True.*" + next(iter(kw))):
            AdamW([p16], differentiable=True, **kw)


def test_nan_grads_are_left_to_the_user():
    """As torch: a NaN gradient makes its parameter NaN (no silent skip)."""
    for cls in (Adam, torch.optim.Adam):
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.tensor([1.0, float("nan"), 1.0])
        cls([p]).step()
        assert torch.isnan(p).tolist() == [False, True, False]


# ---------------------------------------------------------------------------
# Mixed precision

def test_grad_scaler_float16_params():
    """GradScaler with float16 params and grads: steps with infs are skipped
    (nothing changes, step count included) and the rest equal unscaled steps."""
    torch.manual_seed(0)
    w = torch.randn(16, 4).half()
    x = torch.randn(32, 16).half()
    pa = torch.nn.Parameter(w.clone())
    pb = torch.nn.Parameter(w.clone())
    oa = AdamW([pa], lr=1e-2, eps=1e-4)
    ob = AdamW([pb], lr=1e-2, eps=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)  # the first steps overflow
    skipped = 0
    for _ in range(25):
        loss = (x @ pa).float().pow(2).mean()
        scaler.scale(loss).backward()
        before = pa.detach().clone()
        scale = scaler.get_scale()
        scaler.step(oa)
        scaler.update()
        if scaler.get_scale() < scale:  # infs found: skipped
            skipped += 1
            assert torch.equal(pa.detach(), before)
        else:
            # the same step on the unscaled gradient (exact: powers of two)
            pb.grad = pa.grad.clone()  # unscaled in place by the step, as torch's fused Adam
            ob.step()
            assert_same_bits(pa.detach(), pb.detach())
        oa.zero_grad()
    assert skipped > 0
    assert float(oa.state[pa]["step"]) == 25 - skipped
    assert float(oa.state[pa]["step"]) == float(ob.state[pb]["step"])


def test_bf16_autocast_training_decreases_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    for _ in range(50):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# ---------------------------------------------------------------------------
# torch.compile

def test_torch_compile_step_matches_eager():
    def make():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(10, 5, generator=gen).bfloat16()),
                torch.nn.Parameter(torch.randn(7, generator=gen))]
    pa, pb = make(), make()
    oa, ob = AdamW(pa, lr=1e-2), AdamW(pb, lr=1e-2)
    torch._dynamo.reset()
    step = torch.compile(oa.step, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(pa, pb):
            a.grad = torch.randn(a.shape, generator=gen).to(a.dtype)
            b.grad = a.grad.clone()
        step()
        ob.step()
    for a, b in zip(pa, pb):
        assert_same_bits(a.detach(), b.detach())
        for k in oa.state[a]:
            assert_same_bits(oa.state[a][k], ob.state[b][k], k)


# ---------------------------------------------------------------------------
# PyTorch's optimizer battery (torch.testing._internal.common_optimizers),
# restated for torchcast's optimizers: the checks torch's test_optim.py runs
# on its own optimizers that apply to a CPU optimizer without foreach/fused
# variants of its own.

TORCH_ADAM_INFO = next(i for i in optim_db if i.optim_cls is torch.optim.Adam)


def tc_inputs(device, dtype=None):
    return optim_inputs_func_adam(device, dtype) + [
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.01)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"compensated": True, "weight_decay": 0.1},
                       desc="compensated float32"),
        OptimizerInput(params=None, kwargs={"fused": False, "amsgrad": True},
                       desc="pure-PyTorch step"),
    ]


def tc_error_inputs(device, dtype):
    return get_error_inputs_for_all_optims(device, dtype)


TC_INFOS = [
    OptimizerInfo(cls, optim_inputs_func=tc_inputs, optim_error_inputs_func=tc_error_inputs,
                  scheduler_inputs=TORCH_ADAM_INFO.scheduler_inputs, supported_impls=(),
                  not_og_supported_flags=("foreach", "differentiable", "fused", "maximize",
                                          "capturable", "compensated", "compensation",
                                          "state_dtype", "cast_grads",
                                          "decoupled_weight_decay"),
                  supports_fused_on=())
    for cls in (Adam, AdamW)
]
INFO_IDS = ["Adam", "AdamW"]


def battery_inputs(info):
    for inp in info.optim_inputs_func("cpu", torch.float32):
        yield inp.desc, copy.deepcopy(inp.kwargs)


def wb_closure(weight, bias, inp, opt):
    def closure():
        opt.zero_grad()
        loss = (weight.mv(inp) + bias).pow(2).sum()
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_errors(info):
    for err in info.optim_error_inputs_func("cpu", torch.float32):
        inp = err.optimizer_error_input
        params = inp.params if inp.params is not None else [torch.nn.Parameter(torch.randn(2))]
        if issubclass(err.error_type, Warning):
            with pytest.warns(err.error_type, match=err.error_regex):
                info.optim_cls(params, **inp.kwargs)
        else:
            with pytest.raises(err.error_type, match=err.error_regex):
                info.optim_cls(params, **inp.kwargs)
    for kwargs, regex in [({"lr": -1.0}, "Invalid learning rate"),
                          ({"betas": (1.0, 0.0)}, "Invalid beta parameter at index 0"),
                          ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
                          ({"eps": -1.0}, "Invalid epsilon value"),
                          ({"weight_decay": -1.0}, "Invalid weight_decay value"),
                          ({"betas": (0.9, torch.tensor(0.99))}, "both floats or both Tensors")]:
        with pytest.raises(ValueError, match=regex):
            info.optim_cls([torch.nn.Parameter(torch.randn(2))], **kwargs)


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
@pytest.mark.parametrize("contiguous", [True, False])
def test_battery_goes_right_direction(info, contiguous):
    """test_forloop_goes_right_direction, on contiguous and non-contiguous params."""
    for desc, kwargs in battery_inputs(info):
        if contiguous:
            weight = torch.nn.Parameter(torch.randn(10, 5))
            bias = torch.nn.Parameter(torch.randn(10))
        else:
            weight = torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0])
            bias = torch.nn.Parameter(torch.randn(10, 2)[..., 0])
        inp = torch.randn(5)
        opt = info.optim_cls([weight, bias], **kwargs)
        closure = wb_closure(weight, bias, inp, opt)
        initial = closure().item()
        for _ in range(5):
            opt.step(closure)
        if kwargs.get("maximize"):
            assert closure().item() > initial, desc
        else:
            assert closure().item() < initial, desc


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_param_groups_with_lrscheduler(info):
    """test_param_group_with_lrscheduler_goes_right_direction."""
    for schedulers in info.scheduler_inputs:
        weight = torch.nn.Parameter(torch.randn(2, 1))
        bias = torch.nn.Parameter(torch.randn(1))
        opt = info.optim_cls([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
        scheds = [s(opt) for s in schedulers]
        closure = wb_closure(weight, bias, torch.randn(1), opt)
        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            for s in scheds:
                if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    s.step(loss.item())
                else:
                    s.step()
        assert closure().item() < initial


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_param_groups_weight_decay_and_lr(info):
    """test_param_groups_weight_decay / test_param_groups_lr."""
    for desc, kwargs in battery_inputs(info):
        if kwargs.get("maximize"):
            continue
        weight = torch.nn.Parameter(torch.randn(10, 5))
        bias = torch.nn.Parameter(torch.randn(10))
        inp = torch.randn(5)
        kw = {k: v for k, v in kwargs.items() if k not in ("lr", "weight_decay")}
        opt = info.optim_cls([{"params": [weight], "weight_decay": 0.1, "lr": 1e-2},
                              {"params": [bias], "weight_decay": 0.0, "lr": 1e-3}], **kw)
        closure = wb_closure(weight, bias, inp, opt)
        initial = closure().item()
        for _ in range(20):
            opt.step(closure)
        assert closure().item() < initial, desc


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_tensor_lr(info):
    """test_tensor_lr: a tensor lr gives the float lr's result."""
    for desc, kwargs in battery_inputs(info):
        kwargs.pop("lr", None)
        results = []
        for lr in (0.01, torch.tensor(0.01, dtype=torch.float64)):
            weight = torch.nn.Parameter(torch.arange(10.0).reshape(2, 5) / 10)
            bias = torch.nn.Parameter(torch.arange(2.0) / 10)
            opt = info.optim_cls([weight, bias], lr=lr, **kwargs)
            closure = wb_closure(weight, bias, torch.arange(5.0) / 10, opt)
            for _ in range(5):
                opt.step(closure)
            results.append((weight.detach().clone(), bias.detach().clone()))
        assert_same_bits(results[0][0], results[1][0], desc)
        assert_same_bits(results[0][1], results[1][1], desc)


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_step_is_noop_for_zero_grads_and_no_grads(info):
    """test_step_is_noop_for_zero_grads / test_step_is_noop_when_params_have_no_grad."""
    for desc, kwargs in battery_inputs(info):
        if kwargs.get("weight_decay", 0) != 0:
            continue
        if info.optim_cls is AdamW:
            kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr"), torch.Tensor) \
                else 1e-5
        param = torch.nn.Parameter(torch.randn(5, 1))
        old = param.detach().clone()
        opt = info.optim_cls([param], **kwargs)
        opt.zero_grad(set_to_none=False)
        opt.step(lambda: torch.tensor([1.0]))
        torch.testing.assert_close(param.detach(), old)
        nograd = torch.nn.Parameter(torch.randn(3))
        old = nograd.detach().clone()
        opt2 = info.optim_cls([nograd], **kwargs)
        opt2.step()
        assert torch.equal(nograd.detach(), old) and len(opt2.state) == 0, desc


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_state_dict_deterministic(info):
    """test_state_dict_deterministic: loading gives identical steps after, and
    equal state dicts for equal but not identical params."""
    for desc, kwargs in battery_inputs(info):
        weight = torch.nn.Parameter(torch.randn(2, 3))
        bias = torch.nn.Parameter(torch.randn(2))
        inp = torch.randn(3)
        opt = info.optim_cls([weight, bias], **kwargs)
        closure = wb_closure(weight, bias, inp, opt)
        for _ in range(10):
            opt.step(closure)
        weight_c = torch.nn.Parameter(weight.detach().clone())
        bias_c = torch.nn.Parameter(bias.detach().clone())
        opt_c = info.optim_cls([weight_c, bias_c], **kwargs)
        closure_c = wb_closure(weight_c, bias_c, inp, opt_c)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(10):
            opt.step(closure)
            opt_c.step(closure_c)
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), desc
        assert_same_state(opt.state_dict(), opt_c.state_dict())


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_can_load_older_state_dict(info):
    """test_can_load_older_state_dict and test_load_nontensor_step: group
    flags added later, and Python-number steps, still load and step."""
    for desc, kwargs in battery_inputs(info):
        weight = torch.nn.Parameter(torch.randn(2, 3))
        bias = torch.nn.Parameter(torch.randn(2))
        opt = info.optim_cls([weight, bias], **kwargs)
        closure = wb_closure(weight, bias, torch.randn(3), opt)
        for _ in range(3):
            opt.step(closure)
        sd = copy.deepcopy(opt.state_dict())
        for group in sd["param_groups"]:
            for flag in info.not_og_supported_flags:
                group.pop(flag, None)
        for state in sd["state"].values():
            state["step"] = state["step"].item()
        opt2 = info.optim_cls([weight, bias], **kwargs)
        opt2.load_state_dict(sd)
        for state in opt2.state.values():
            assert torch.is_tensor(state["step"]) and float(state["step"]) == 3.0
        opt2.step(closure)
        assert float(opt2.state[weight]["step"]) == 4.0, desc


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_save_load_weights_only(info):
    """test_save_load_equality_with_weights_only."""
    for desc, kwargs in battery_inputs(info):
        weight = torch.nn.Parameter(torch.randn(2, 3))
        bias = torch.nn.Parameter(torch.randn(2))
        opt = info.optim_cls([weight, bias], **kwargs)
        closure = wb_closure(weight, bias, torch.randn(3), opt)
        opt.step(closure)
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert_same_state(loaded, sd)
        opt.load_state_dict(loaded)
        opt.step(closure)


@pytest.mark.parametrize("info", TC_INFOS, ids=INFO_IDS)
def test_battery_misc(info):
    """Printing, deepcopy of public attributes, non-empty state, step
    pre/post hooks, state_dict and load_state_dict hooks, empty tensors,
    complex params (as pairs of reals, like torch)."""
    weight = torch.nn.Parameter(torch.randn(2, 3))
    opt = info.optim_cls([weight])
    assert info.optim_cls.__name__ in repr(opt)
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}

    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    weight.grad = torch.randn(2, 3)
    opt.step()
    assert len(opt.state) == 1 and set(opt.state[weight]) >= {"step", "exp_avg"}
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd", "load-pre", "load-post"]
    assert isinstance(opt.state[weight]["exp_avg"], torch.Tensor)

    empty = torch.nn.Parameter(torch.randn(0, 3))
    empty.grad = torch.randn(0, 3)
    e_opt = info.optim_cls([empty])
    e_opt.step()
    assert float(e_opt.state[empty]["step"]) == 1.0

    cparam = torch.randn(5, 5, dtype=torch.complex64, requires_grad=True)
    rparam = torch.view_as_real(cparam).detach().clone().requires_grad_()
    copt, ropt = info.optim_cls([cparam]), info.optim_cls([rparam])
    for _ in range(3):
        cparam.grad = torch.randn_like(cparam)
        rparam.grad = torch.view_as_real(cparam.grad).clone()
        copt.step()
        ropt.step()
    assert_same_bits(torch.view_as_real(cparam.detach()), rparam.detach())


def test_mixed_dtypes_in_one_group_match_separate_groups():
    """test_mixed_device_dtype: one group over several dtypes steps each like
    a group of its own (one kernel call per dtype group)."""
    def make():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(6, generator=gen).to(d))
                for d in (torch.float32, torch.bfloat16, torch.float64, torch.float16)]
    mixed, sep = make(), make()
    om = AdamW(mixed, lr=1e-2)
    os_ = [AdamW([p], lr=1e-2) for p in sep]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(mixed, sep):
            a.grad = torch.randn(6, generator=gen).to(a.dtype)
            b.grad = a.grad.clone()
        om.step()
        for o in os_:
            o.step()
    for a, b in zip(mixed, sep):
        assert_same_bits(a.detach(), b.detach())


def test_exported_from_torchcast():
    assert torchcast.optim.Adam is Adam and "optim" in torchcast.__all__


@pytest.mark.parametrize("cls,tcls", CLASSES, ids=CLASS_IDS)
def test_differentiable_runs_torchs_step(cls, tcls):
    """differentiable=True: torch's own step on the user's tensors, so the
    result and the gradient through the step are torch's, bit for bit."""
    results = []
    for make in (cls, tcls):
        x = torch.arange(6.0).reshape(2, 3).requires_grad_()
        p = x.clone()  # a non-leaf param: allowed with differentiable=True
        opt = make([p], lr=0.1, weight_decay=0.1, differentiable=True)
        for k in range(3):
            p.grad = torch.full((2, 3), 0.5 - k)
            opt.step()
        (p * torch.arange(6.0).reshape(2, 3)).sum().backward()
        results.append((p.detach().clone(), x.grad.clone(),
                        {k: v.clone() for k, v in opt.state[p].items()}))
    assert_same_bits(results[0][0], results[1][0])
    assert_same_bits(results[0][1], results[1][1])
    assert_same_state(results[0][2], results[1][2])


def test_errors_name_param_group_and_index():
    """Every error about one param names its group and its index in that
    group (the kernel's own messages count params per dtype batch instead)."""
    def opt_with(second_group_param, **group_kw):
        first = torch.nn.Parameter(torch.randn(3))
        other = torch.nn.Parameter(torch.randn(2))
        return Adam([{"params": [first]}, {"params": [other, second_group_param], **group_kw}])

    where = "param 1 of param group 1"
    cases = []
    p = torch.nn.Parameter(torch.randn(4))
    opt = opt_with(p)
    p.grad = torch.randn(4)
    opt.step()
    opt.state[p]["exp_avg"] = torch.zeros(5)
    cases.append(("exp_avg shape at step", opt.step))
    p2 = torch.nn.Parameter(torch.randn(4))
    opt2 = opt_with(p2)
    p2.grad = torch.randn(4)
    opt2.step()
    opt2.state[p2]["exp_avg_sq"] = torch.zeros(4, dtype=torch.float64)
    cases.append(("exp_avg_sq dtype at step", opt2.step))
    p3 = torch.nn.Parameter(torch.randn(4).half())
    # a group option is reported at the group's first param
    cases.append(("bad compensation option", lambda: opt_with(p3, compensation="neumaier")))
    cases.append(("bad state_dtype option", lambda: opt_with(p3, state_dtype=torch.float16)))
    p4 = torch.nn.Parameter(torch.randn(4))
    opt4 = opt_with(p4)
    p4.grad = torch.randn(4)
    opt4.step()
    sd = opt4.state_dict()
    sd["state"][2]["exp_avg"] = torch.zeros(5)
    cases.append(("exp_avg shape at load", lambda: opt4.load_state_dict(sd)))
    for name, fn in cases:
        with pytest.raises((RuntimeError, TypeError, ValueError)) as e:
            fn()
        want = "param 0 of param group 1" if name.endswith("option") else where
        assert want in str(e.value), (name, str(e.value))
