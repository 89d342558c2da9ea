"""compensation="stochastic": the update rounded into bfloat16 or float16
params up or down at random. Checked against exact values
(fractions.Fraction, with ml_dtypes and numpy for the neighbours): the mean
of many rounded results equals the exact float32 value within its
statistical bound, every result is one of its two neighbours, and
the bits depend on the seed alone (not the thread count, the chunking or the
device). The kernel equals the pure-PyTorch reference bit for bit in
tests/test_adam.py (COMBOS)."""
import copy
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from torchcast.optim import Adam, AdamW
from torchcast._reference import adam as ref

from adam_common import assert_same_bits, operands_on

OPS = torch.ops.torchcast


def sign_step(p, lr, seed, steps=1, grad_sign=1.0, device="cpu"):
    """Steps bfloat16 or float16 params p with Adam at beta1 = beta2 = eps = 0 and grads
    of +-1: the update is then exactly -lr * sign(grad) (float32 lr), so each
    param becomes float32(p - lr * sign) rounded stochastically. Returns the
    params after each step, every step from the same p (step counts go on,
    so each step draws new bits)."""
    step = torch.tensor(0.0)
    out = []
    for _ in range(steps):
        q = p.clone().to(device)
        g = torch.full_like(q, grad_sign)
        zeros = torch.zeros_like(q, dtype=torch.float32)
        OPS.adam_step_([q], [g], [zeros.clone()], [zeros.clone()], [], [], [step], lr=lr,
                       beta1=0.0, beta2=0.0, weight_decay=0.0, eps=0.0, amsgrad=False,
                       maximize=False, decoupled_weight_decay=False, compensation="stochastic",
                       seed=seed)
        out.append(q.cpu())
    return out


NUMPY_DTYPE = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}


def neighbours(x, dtype=torch.bfloat16):
    """The values of dtype just below and above the float32 value x (equal
    when x is one of them), as Fractions."""
    nd = NUMPY_DTYPE[dtype]
    down = np.array(x, dtype=np.float32).astype(nd)  # nearest
    if Fraction(float(down)) > Fraction(float(x)):
        down = np.nextafter(down, np.array(-np.inf, dtype=nd))
    up = down if Fraction(float(down)) == Fraction(float(x)) else np.nextafter(
        down, np.array(np.inf, dtype=nd))
    return Fraction(float(down)), Fraction(float(up))


def assert_unbiased(results, exact, down, up):
    """results: 16-bit values, each down or up, whose mean must equal exact
    within 5 standard deviations of a mean of Bernoulli draws."""
    vals = [Fraction(v) for v in results.double().tolist()]
    assert set(vals) <= {down, up}, set(vals) - {down, up}
    if down == up:
        return
    q = (exact - down) / (up - down)  # the probability of rounding up
    n = len(vals)
    ups = sum(v == up for v in vals)
    sigma = math.sqrt(float(q * (1 - q)) * n)
    assert abs(ups - float(q) * n) <= 5 * sigma + 1, (ups, float(q) * n, sigma)


# (dtype, p, lr), the result p - lr: fractions of an ulp from near 0 to near
# 1, both signs, a result below a binade boundary (1 - lr), a subnormal and
# an exact one, in each dtype.
CASES = [
    (torch.bfloat16, 1.0, 0.3 * 2 ** -7), (torch.bfloat16, 1.0, 0.01 * 2 ** -8),
    (torch.bfloat16, -3.0, 0.77 * 2 ** -6), (torch.bfloat16, -3.0, -0.5 * 2 ** -6),
    (torch.bfloat16, 2.0 ** -130, 2.0 ** -134 * 1.25), (torch.bfloat16, 0.5, 2 ** -9),
    (torch.bfloat16, 1e30, 1e26),
    (torch.float16, 1.0, 0.3 * 2 ** -10), (torch.float16, 1.0, 0.01 * 2 ** -11),
    (torch.float16, -3.0, 0.77 * 2 ** -9), (torch.float16, -3.0, -0.5 * 2 ** -9),
    (torch.float16, 2.0 ** -20, 2.0 ** -26 * 1.25), (torch.float16, 2.0 ** -24, 0.3 * 2 ** -24),
    (torch.float16, 0.5, 2 ** -12), (torch.float16, 60000.0, 10.0),
]


@pytest.mark.parametrize("dtype,p0,lr", CASES)
def test_mean_over_elements_is_the_exact_value(device, dtype, p0, lr):
    """2^15 elements, one step: the mean of the rounded results equals the
    float32 p - lr (exact, from Fractions) within its statistical bound."""
    p = torch.full((2 ** 15,), p0, dtype=dtype)
    grad_sign = 1.0 if lr > 0 else -1.0
    (q,) = sign_step(p, abs(lr), seed=7, grad_sign=grad_sign, device=device)
    x = np.float32(np.float32(float(p[0])) - np.float32(lr))  # the float32 step
    exact = Fraction(float(x))
    down, up = neighbours(x, dtype)
    assert_unbiased(q, exact, down, up)


@pytest.mark.parametrize("dtype,lr", [(torch.bfloat16, 0.3 * 2 ** -7),
                                      (torch.float16, 0.3 * 2 ** -10)])
def test_mean_over_steps_is_the_exact_value(dtype, lr):
    """One element stepped 3000 times from the same value (each step a new
    key): the same bound, over time rather than over elements."""
    p = torch.full((3,), 1.0, dtype=dtype)
    results = torch.cat(sign_step(p, lr, seed=11, steps=3000))[1::3]  # element 1
    x = np.float32(np.float32(1.0) - np.float32(lr))
    assert_unbiased(results, Fraction(float(x)), *neighbours(x, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_special_values(dtype):
    """inf stays inf, NaN stays NaN, an exact result is unchanged, a value
    below the largest finite one never exceeds it, and past it (float16: an
    ulp and more past 65504) becomes inf."""
    big = float(torch.finfo(dtype).max)
    p = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0, big], dtype=dtype)
    for q in sign_step(p, 0.0, seed=3, steps=4):  # lr 0: the update is -0
        assert_same_bits(q[[0, 1, 3, 4]], p[[0, 1, 3, 4]])
        assert torch.isnan(q[2])
    below = 2.0 ** 100 if dtype == torch.bfloat16 else 3.0  # far below big's ulp
    for q in sign_step(p[4:], below, seed=3, steps=50):
        assert q.item() <= big
    if dtype == torch.float16:
        over = sign_step(torch.full((64,), big, dtype=dtype), 40.0, seed=3, grad_sign=-1.0)[0]
        assert bool(torch.isposinf(over).all())  # 65544: (65544 - 65504) / 32 > 1


def test_same_seed_same_bits_whatever_threads_and_chunks():
    """Elements past several 2^16-element CPU chunks: 1 and 2 threads, one
    call or the tensor stepped alone, give the same bits; another seed other
    bits. Same for the optimizer over 3 steps."""
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(3 * 2 ** 16 + 5, generator=gen)).bfloat16()
    lr = 1e-3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sign_step(p, lr, seed=5, steps=2)
        torch.set_num_threads(2)
        two = sign_step(p, lr, seed=5, steps=2)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert_same_bits(a, b)
    other = sign_step(p, lr, seed=6, steps=1)[0]
    assert (other != one[0]).float().mean() > 0.1  # about half the inexact ones differ


def optimizer_run(seed, threads, steps=3):
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16())
              for s in [(2 ** 16 + 3,), (40, 7)]]
    opt = AdamW(params, lr=1e-3, compensation="stochastic", seed=seed)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
    finally:
        torch.set_num_threads(old)
    return [p.detach() for p in params]


def test_optimizer_seed_reproducible():
    for a, b in zip(optimizer_run(123, 1), optimizer_run(123, 2)):
        assert_same_bits(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(optimizer_run(123, 2),
                                                     optimizer_run(124, 2)))


def test_bad_seed_set_on_a_group_fails_the_step_before_anything_changes():
    p = torch.nn.Parameter(torch.ones(4).bfloat16())
    opt = Adam([p], compensation="stochastic", seed=1)
    opt.param_groups[0]["seed"] = -5
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="param group 0: seed must be in"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4).bfloat16()) and not opt.state[p]


def test_seed_none_follows_torch_manual_seed():
    p = [torch.nn.Parameter(torch.zeros(3).bfloat16())]
    torch.manual_seed(42)
    a = Adam(p, compensation="stochastic").param_groups[0]["seed"]
    torch.manual_seed(42)
    b = Adam(p, compensation="stochastic").param_groups[0]["seed"]
    assert a == b and isinstance(a, int) and 0 <= a < 2 ** 63


def test_param_groups_sharing_a_seed_draw_different_bits():
    """Two groups with the same seed and identical params still round
    independently (the group index is mixed into the op's seed)."""
    p = [torch.nn.Parameter(torch.ones(4096).bfloat16()) for _ in range(2)]
    opt = Adam([{"params": [p[0]]}, {"params": [p[1]]}], lr=0.3 * 2 ** -7,
               betas=(0.0, 0.0), eps=0.0, compensation="stochastic", seed=9)
    for q in p:
        q.grad = torch.ones_like(q)
    opt.step()
    assert not torch.equal(p[0], p[1])


def test_stochastic_tracks_float64_where_plain_bfloat16_stalls():
    """Updates of a tenth of an ulp (or a fifth, past 0.5): plain bfloat16
    Adam never moves; each stochastic element does a random walk around the
    exact path (a standard deviation of at most ulp * sqrt(steps * 0.2 * 0.8)
    = 16 ulp of 2^-8), and their mean follows the exact path."""
    w = torch.ones(2000, dtype=torch.float64)
    steps, lr = 1600, 0.1 * 2 ** -8  # an ulp below 1 is 2^-8
    plain = torch.nn.Parameter(w.bfloat16())
    sr = torch.nn.Parameter(w.bfloat16())
    op = Adam([plain], lr=lr, compensated=False)
    osr = Adam([sr], lr=lr, compensation="stochastic", seed=1)
    for _ in range(steps):
        plain.grad = torch.ones_like(plain)
        sr.grad = torch.ones_like(sr)
        op.step()
        osr.step()
    exact = 1.0 - steps * lr / (1 + 1e-8)  # Adam on a constant grad: lr / (1 + eps) a step
    assert torch.equal(plain.detach(), w.bfloat16())
    sigma = 2 ** -8 * math.sqrt(steps * 0.2 * 0.8)
    err = sr.detach().double() - exact
    assert abs(float(err.mean())) < 5 * sigma / math.sqrt(w.numel()), float(err.mean())
    # below 6 sigma, itself below the distance plain bfloat16 stalled at
    assert float(err.abs().max()) < 6 * sigma < steps * lr, float(err.abs().max())


def test_state_dict_round_trip_keeps_the_bits():
    """A stochastic optimizer saved after 3 steps and loaded into one with
    another seed continues with the saved seed: bit-identical."""
    gen = torch.Generator().manual_seed(2)
    pa = [torch.nn.Parameter(torch.randn(300, generator=gen).bfloat16())]
    oa = AdamW(pa, lr=1e-3, compensation="stochastic", seed=77)
    grads = [torch.randn(300, generator=gen).bfloat16() for _ in range(6)]
    for g in grads[:3]:
        pa[0].grad = g
        oa.step()
    pb = [torch.nn.Parameter(pa[0].detach().clone())]
    ob = AdamW(pb, lr=1e-3, compensation="stochastic", seed=78)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # no tensors shared with oa
    assert ob.param_groups[0]["seed"] == 77
    assert "seed" not in oa.state_dict(torch_format=True)["param_groups"][0]
    for g in grads[3:]:
        pa[0].grad, pb[0].grad = g, g.clone()
        oa.step()
        ob.step()
    assert_same_bits(pa[0].detach(), pb[0].detach())


def test_reference_hash_matches_python_ints():
    """The reference's vectorized mixer against the same arithmetic on Python
    ints (which cannot overflow), indices past 2^32 included."""
    idx = [0, 1, 2 ** 16 + 3, 2 ** 32 - 1, 2 ** 32, 2 ** 40 + 12345]
    key = ref.stochastic_key(2 ** 63 - 1, 3, 17)

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    want = [mix((mix((i & 0xFFFFFFFF) ^ key[0]) + ((i >> 32) ^ key[1])) & 0xFFFFFFFF)
            for i in idx]
    got = ref.stochastic_bits(key, torch.tensor(idx, dtype=torch.int64)).tolist()
    assert got == want


@pytest.mark.cuda_cases
def test_device_kernel_matches_cpu_over_chunks(device):
    """Off the CPU (other chunk sizes, one thread per element), the same bits
    as the CPU kernel, over several steps."""
    p = torch.randn(3 * 2 ** 16 + 7).bfloat16()
    for a, b in zip(sign_step(p, 1e-3, seed=8, steps=2),
                    sign_step(p, 1e-3, seed=8, steps=2, device=device)):
        assert_same_bits(a, b)
