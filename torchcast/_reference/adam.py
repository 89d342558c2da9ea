"""Pure-PyTorch restatement of the adam_step_ kernel (csrc/adam_common.h).

The same float operations in the same order, each one a correctly rounded
torch elementwise op (no lerp, addcmul or addcdiv: ATen may fuse those into
FMAs), so this gives the kernel's bits on devices without a compiled kernel
and serves the tests as the kernel's independent statement (torch's own CPU
sqrt, not correctly rounded, is replaced by one that is, as the kernel's).
Takes the op's arguments and checks them as csrc/adam_common.cpp does, before
writing anything (as the op, in the build without the compiled extension).
"""
import math
from types import SimpleNamespace

import numpy as np
import torch

from ..adam_modes import COMPENSATIONS, compensation_names, refusal
from . import moments8
from .compensated import neumaier_add, settled
from .rounding import fma


def compute_dtype(param_dtype):
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def _rounder(compute):
    if compute == torch.float64:
        return float
    return lambda x: torch.tensor(x, dtype=torch.float32).item()


def step_constants(compute, lr, beta1, beta2, weight_decay, eps, maximize, decoupled):
    """AdamConsts: the hyperparameters rounded once to the compute dtype."""
    r = _rounder(compute)
    wd = weight_decay != 0
    w = r(1.0 - beta1)
    return SimpleNamespace(
        grad_sign=-1.0 if maximize else 1.0,
        use_l2=wd and not decoupled, l2=r(weight_decay),
        lerp_w=w, lerp_wc=r(1.0 - w), lerp_small=abs(w) < 0.5,
        beta2=r(beta2), one_minus_beta2=r(1.0 - beta2), eps=r(eps),
        use_decay=wd and decoupled,
        decay=r(1.0 - lr * weight_decay) if wd and decoupled else 1.0,
        lr_wd=r(lr * weight_decay))


def tensor_constants(compute, lr, beta1, beta2, step, seed=0, tensor=0):
    """AdamTensorConsts: what depends on the parameter's step count (and,
    for stochastic rounding, its key from the seed and its position
    ``tensor`` in the op's lists)."""
    r = _rounder(compute)
    bc2 = 1.0 - beta2 ** step
    return SimpleNamespace(neg_step_size=r(-(lr / (1.0 - beta1 ** step))),
                           bc2_sqrt=r(bc2 ** 0.5), inv_bc2_sqrt=r(1.0 / math.sqrt(bc2)),
                           key=stochastic_key(seed, tensor, int(step)),
                           moment_key=stochastic_key(seed, tensor, int(step) ^ MOMENT_STREAM))


# -- stochastic rounding (numerics.h), on Python ints and int64 tensors ----------

_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
# adam_common.h kMomentStream: the 8-bit moments' bits are keyed by the step
# count with its top bit set.
MOMENT_STREAM = 1 << 63


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stochastic_key(seed, tensor, step):
    """(lo, hi): the 32-bit halves of the key of one tensor at one step."""
    z = splitmix64(splitmix64(splitmix64(seed & _M64) ^ tensor) ^ (step & _M64))
    return z & _M32, z >> 32


def _mul32(x, c):
    """x * c mod 2^32 for an int64 tensor x of uint32 values, without int64
    overflow (c split into 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def element_index(p):
    """Each element's position in the order the kernel steps p: p's memory
    order when p is dense (as empty_like preserves it), row-major otherwise
    (the kernel steps a contiguous copy)."""
    like = torch.empty_like(p, dtype=torch.int64, device="cpu")
    return torch.arange(p.numel(), dtype=torch.int64).as_strided(like.shape, like.stride())


def stochastic_bits(key, index):
    """numerics.h stochastic_bits: 32 random bits per element index (int64)."""
    lo, hi = key
    return mix32((mix32((index & _M32) ^ lo) + ((index >> 32) ^ hi)) & _M32)


def bfloat16_stochastic(x, r):
    """numerics.h bfloat16_bits_stochastic: float32 x rounded to bfloat16 with
    the random bits r (int64 tensor of uint32 values)."""
    u = x.view(torch.int32).to(torch.int64) & _M32
    rounded = (u + (r >> 16)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return _as_int16(torch.where(nan, 0x7FC0, rounded & 0xFFFF)).view(torch.bfloat16)


def _half_of_bits(b):
    return _as_int16(b & 0xFFFF).view(torch.float16).float()


def float16_stochastic(x, r):
    """numerics.h half_bits_stochastic: float32 x rounded to float16 with the
    random bits r (NaN payloads as torch's cast leaves them)."""
    a = x.abs()
    nearest = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    low = nearest - (_half_of_bits(nearest).abs() > a).to(torch.int64)
    low_value = _half_of_bits(low)
    spacing = (_half_of_bits(low ^ 1) - low_value).abs()
    frac = (a - low_value.abs()) / spacing
    threshold = (r >> 8).to(torch.float32) * 2.0 ** -24
    return _as_int16((low + (threshold < frac).to(torch.int64)) & 0xFFFF).view(torch.float16)


def _sqrt(x):
    # torch's CPU sqrt is not correctly rounded (SLEEF on AVX-512), the
    # kernel's is. float32 through float64 is (53 >= 2 * 24 + 2 bits: the
    # double rounding is innocuous, even from a float64 sqrt one ulp off);
    # float64 on the CPU through numpy (the hardware's sqrt). MPS has no float64.
    if x.dtype == torch.float32 and x.device.type != "mps":
        return x.double().sqrt().float()
    if x.dtype == torch.float64 and x.device.type == "cpu":
        return torch.from_numpy(np.asarray(np.sqrt(x.numpy(force=True))))
    return x.sqrt()


def _as_int16(v):
    """int64 values in [0, 2^16) reinterpreted as int16 bits."""
    return (v - (v >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)


def join_bf16_remainder(p, rem):
    """The float32 master weight held by a bfloat16 param and its int16 remainder."""
    hi = p.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + rem.to(torch.int64)) & 0xFFFFFFFF
    bits = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32
    return bits.to(torch.int32).view(torch.float32)


def split_bf16_remainder(master):
    """(bfloat16 param, int16 remainder) holding a float32 master bit-exactly:
    the top half rounded to nearest, ties away from zero (a NaN stays NaN,
    with a zero remainder)."""
    u = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    hi = torch.where(nan, (u >> 16) | 0x40, (u >> 16) + (lo >> 15)) & 0xFFFF
    return _as_int16(hi).view(torch.bfloat16), _as_int16(torch.where(nan, 0, lo))


def join_bf16_remainder8(p, rem):
    """numerics.h join_bf16_remainder8: the 24-bit master weight held by a
    bfloat16 param and its int8 remainder."""
    hi = p.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + (rem.to(torch.int64) << 8)) & 0xFFFFFFFF
    bits = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32
    return bits.to(torch.int32).view(torch.float32)


def split_bf16_remainder8(master, r):
    """numerics.h split_bf16_remainder8: float32 master rounded to 24 bits
    stochastically with the random bits r (int64 tensor of uint32 values),
    as (bfloat16 param, int8 remainder)."""
    u = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    u24 = (u + (r >> 24)) & 0xFFFFFF00
    lo = u24 & 0xFFFF
    hi = torch.where(nan, (u >> 16) | 0x40, (u24 >> 16) + (lo >> 15)) & 0xFFFF
    rem = torch.where(nan, 0, _as_int16(lo).to(torch.int64) >> 8)
    return _as_int16(hi).view(torch.bfloat16), rem.to(torch.int8)


def kahan_update(pv, p, c, u):
    """numerics.h kahan_update: p, c <- one rounding of pv + (u + c)."""
    t, e = neumaier_add(pv, 0.0, u + c.to(pv.dtype))
    p.copy_(t)
    c.copy_(settled(t, (t - p.to(pv.dtype)) + e))


# -- update accounting (adam_common.h UpdateStat, UpdateTally) -------------------

# The entries of one param's update_stats tensor (int64), in the kernel's order.
UPDATE_STAT_FIELDS = ("elements", "updated", "lost", "shrunk", "comp_sum", "comp_max",
                      "exp_avg_lost", "exp_avg_off", "exp_avg_sq_lost", "exp_avg_sq_off")
COMP_UNITS = 2 ** 20  # comp_sum and comp_max count |compensation| / ulp in 2^-20 units
_COMP_CAP = float(2 ** 22)  # units: a ratio past 4 ulp is clamped


def flip_last_bit(p):
    """p with its last significand bit flipped: one ulp away from p."""
    iview = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
    return (p.contiguous().view(iview) ^ 1).view(p.dtype)


def _tally(stats, p, p_old, intended, mode, c):
    """AdamElement::tally_element over a tensor, added to stats: p and c after
    the step, p_old the stored param before it, intended the float64 update.
    Counted in float32 for 16-bit params (intended rounded once to it), in
    float64 for wider ones, as the kernel does."""
    tally = torch.float32 if p.element_size() == 2 else torch.float64
    intended = intended.to(tally)
    change = p.to(tally) - p_old.to(tally)
    updated = (intended != 0) & (intended - intended == 0)
    add = [p.numel(), int(updated.sum()), int((updated & (change == 0)).sum()),
           int((updated & (2.0 * change.abs() < intended.abs())).sum()), 0]
    q_max = 0
    if c is not None:
        p_new = p.float()
        carried = c.float() if mode == "kahan" else _weight_of(p, c, mode) - p_new
        ulp = (flip_last_bit(p).float() - p_new).abs()
        units = (carried.abs() / ulp) * float(COMP_UNITS)
        capped = torch.where(units < _COMP_CAP, units,
                             torch.where(units == units, _COMP_CAP, 0.0))
        q = capped.to(torch.int64)
        add[4] = int(q.sum())
        q_max = int(q.max()) if q.numel() else 0
    for i, value in enumerate(add):
        stats[i] += value
    stats[5] = max(int(stats[5]), q_max)


def _weight_of(p, c, mode):
    """AdamElement::weight_of: the weight a param (and its remainder) holds."""
    if mode == "remainder":
        return join_bf16_remainder(p, c)
    if mode == "remainder8":
        return join_bf16_remainder8(p, c)
    return p


def _update_of(k, t, compute, mode, amsgrad, pv, g, mo, vo, xo):
    """AdamElement::update_of: (u, mn, vn, xn, root) from the weight pv and
    the old moments (xo: the old max under amsgrad, else None)."""
    gr = g.to(compute) * k.grad_sign
    if k.use_l2:
        gr = fma(pv, k.l2, gr)
    if k.lerp_small:
        mn = fma(k.lerp_w, gr - mo, mo)
    else:
        mn = fma(-k.lerp_wc, gr - mo, gr)
    vn = fma(k.one_minus_beta2 * gr, gr, vo * k.beta2)
    # This step's moments drive its update; the stored ones are rounded.
    xn = torch.maximum(xo, vn) if amsgrad else None
    root = _sqrt(xn if amsgrad else vn)
    if mode in ("none", "remainder"):  # adam_common.h kDividesByBc2
        denom = root / t.bc2_sqrt + k.eps
    else:
        denom = root * t.inv_bc2_sqrt + k.eps
    upd = (t.neg_step_size * mn) / denom
    u = upd - k.lr_wd * pv if k.use_decay and mode != "none" else upd
    return u, mn, vn, xn, root


def _apply(k, t, mode, p, c, pv, u, stats):
    """AdamElement::apply: p (and c) stepped from pv by u, tallied into stats."""
    p_old = p.clone() if stats is not None else None
    if mode == "none":
        p.copy_(pv * k.decay + u)
        if stats is not None:
            intended = u.double() - (k.lr_wd if k.use_decay else 0.0) * pv.double()
            _tally(stats, p, p_old, intended, mode, c)
        return
    if mode == "kahan":
        kahan_update(pv, p, c, u)
    elif mode == "stochastic":
        bits = stochastic_bits(t.key, element_index(p)).to(p.device)
        rounded = bfloat16_stochastic if p.dtype == torch.bfloat16 else float16_stochastic
        p.copy_(rounded(pv + u, bits))
    elif mode == "remainder8":
        hi, lo = split_bf16_remainder8(pv + u, stochastic_bits(t.key, element_index(p)).to(p.device))
        p.copy_(hi)
        c.copy_(lo)
    else:
        hi, lo = split_bf16_remainder(pv + u)
        p.copy_(hi)
        c.copy_(lo)
    if stats is not None:
        _tally(stats, p, p_old, u.double(), mode, c)


def _step_tensor(k, t, compute, mode, amsgrad, p, g, m, v, vmax, c, stats=None):
    pv = _weight_of(p, c, mode).to(compute)
    u, mn, vn, xn, _ = _update_of(k, t, compute, mode, amsgrad, pv, g, m.to(compute),
                                  v.to(compute), vmax.to(compute) if amsgrad else None)
    m.copy_(mn)
    v.copy_(vn)
    if amsgrad:
        vmax.copy_(xn)
    _apply(k, t, mode, p, c, pv, u, stats)


def _step_tensor_moments8(k, t, mode, p, g, m, v, scales, c, stats=None):
    """The step of a param with 8-bit moments (adam_run_moments8): every
    operand taken in the order the kernel steps p (element_index), in
    blocks of moments8.BLOCK, and written back in place."""
    n = p.numel()
    idx = element_index(p).reshape(-1).to(p.device)

    def ordered(x):
        return torch.empty(n, dtype=x.dtype, device=x.device).scatter_(0, idx, x.reshape(-1))

    pf, gf, mq, rq = ordered(p), ordered(g), ordered(m), ordered(v)
    cf = ordered(c) if c is not None else None
    block = torch.arange(n, device=p.device) // moments8.BLOCK
    pv = _weight_of(pf, cf, mode).float()
    ro = moments8.root_of(rq, scales[1][block])
    u, mn, _, _, root = _update_of(k, t, torch.float32, mode, False, pv, gf,
                                   moments8.m_of(mq, scales[0][block]), ro * ro, None)
    new_scales = torch.stack([moments8.block_scales(mn, block, scales.shape[1]),
                              moments8.block_scales(root, block, scales.shape[1])])
    bits = stochastic_bits(t.moment_key, torch.arange(n, dtype=torch.int64)).to(p.device)
    mq = moments8.m_code(mn, 1.0 / _nonzero(new_scales[0])[block], moments8.m_fraction(bits))
    rq = moments8.root_code(root, 1.0 / _nonzero(new_scales[1])[block],
                            moments8.root_fraction(bits))
    if stats is not None:
        moments8.tally(stats, mn, mq, new_scales[0][block], root, rq, new_scales[1][block])
    _apply(k, t, mode, pf, cf, pv, u, stats)
    scales.copy_(new_scales)
    for x, flat in ((p, pf), (m, mq), (v, rq), (c, cf)):
        if x is not None:
            x.copy_(flat[idx].view(x.shape))


def _nonzero(s):
    """Moments8::inverse's guard: 1 / s for s > 0, else 1 / inf = 0."""
    return torch.where(s > 0, s, torch.full_like(s, float("inf")))


_NARROW = (torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float64, torch.float32) + _NARROW


def check_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
               state_steps, amsgrad, compensation, update_stats=None, moment_scales=None):
    """The argument checks of csrc/adam_common.cpp (check_adam_args), with its
    exception types and messages."""
    def fail(kind, message):
        raise kind(f"torchcast.adam_step_: {message}")

    mode = COMPENSATIONS.get(compensation)
    if mode is None:
        fail(ValueError, f"compensation must be {compensation_names()}, got '{compensation}'")
    carries = mode.carried is not None
    n = len(params)
    for lst, want, what in ((grads, n, "grads"), (exp_avgs, n, "exp_avgs"),
                            (exp_avg_sqs, n, "exp_avg_sqs"),
                            (max_exp_avg_sqs, n if amsgrad else 0, "max_exp_avg_sqs"),
                            (compensations, n if carries else 0, "compensations"),
                            (state_steps, n, "state_steps"),
                            *([(update_stats, n, "update_stats")] if update_stats is not None
                              else [])):
        if len(lst) != want:
            fail(ValueError, f"{want} {what} expected (one per param"
                             f"{', none here' if want == 0 else ''}), got {len(lst)}")
    if n == 0:
        return
    pt, st = params[0].dtype, exp_avgs[0].dtype
    if pt not in _PARAM_DTYPES:
        fail(TypeError, f"params must be float64, float32, bfloat16 or float16, got {pt}")
    if refusal(compensation, pt):
        fail(TypeError, f"{mode.needs}, got {pt}; use compensation='{mode.instead}'")
    if not (st in (torch.float32, torch.bfloat16, torch.int8) if pt in _NARROW else st == pt):
        fail(TypeError, f"param 0 is {pt} but its optimizer states are {st}; supported: "
                        "float32, bfloat16 or 8-bit (int8) states for bfloat16/float16 params, "
                        "the param's own dtype for float32/float64 params")
    eight_bit = st == torch.int8
    sqt = torch.uint8 if eight_bit else st
    if eight_bit != (moment_scales is not None):
        fail(ValueError, "8-bit moments (int8 exp_avgs) need moment_scales" if eight_bit else
             f"moment_scales are for 8-bit moments (int8 exp_avgs), but exp_avg 0 is {st}")
    if eight_bit and amsgrad:
        fail(ValueError, "amsgrad is not supported with 8-bit moments; use float32 or bfloat16 "
                         "states")
    if eight_bit and len(moment_scales) != n:
        fail(ValueError, f"{n} moment_scales expected (one per param), got {len(moment_scales)}")

    def same_shape(p, t, what, i):
        if t.layout != torch.strided:
            fail(ValueError, f"{what} {i} is not a dense tensor (layout {t.layout}); Adam does "
                             "not support sparse gradients, use torch.optim.SparseAdam")
        if t.shape != p.shape:
            fail(ValueError, f"{what} {i} has shape {list(t.shape)} but its param has shape "
                             f"{list(p.shape)}")
        if t.device != p.device:
            fail(RuntimeError, f"{what} {i} is on {t.device} but its param is on {p.device}")

    comp_dtype = mode.carried_dtype(pt)
    for i, p in enumerate(params):
        if p.layout != torch.strided:
            fail(ValueError, f"param {i} is not a dense tensor")
        if p.device != params[0].device:
            fail(RuntimeError, f"param {i} is on {p.device} but param 0 is on "
                               f"{params[0].device}; one call steps one device")
        if p.dtype != pt:
            fail(TypeError, f"param {i} is {p.dtype} but param 0 is {pt}; one call steps one "
                            "dtype group")
        if grads[i].dtype != pt:
            fail(TypeError, f"grad {i} is {grads[i].dtype} but its param is {pt}; cast the "
                            "gradient to the param's dtype")
        same_shape(p, grads[i], "grad", i)
        moments = [("exp_avg", exp_avgs[i], st), ("exp_avg_sq", exp_avg_sqs[i], sqt)]
        if amsgrad:
            moments.append(("max_exp_avg_sq", max_exp_avg_sqs[i], st))
        for what, t, want in moments:
            if t.dtype != want:
                fail(TypeError, f"{what} {i} is {t.dtype} but exp_avg 0 is {st}"
                                f"{' (8-bit moments: exp_avg_sq is uint8)' if eight_bit else ''}")
            same_shape(p, t, what, i)
        if eight_bit:
            sc, blocks = moment_scales[i], moments8.blocks_of(p.numel())
            if not (sc.dtype == torch.float32 and sc.layout == torch.strided and sc.dim() == 2
                    and tuple(sc.shape) == (2, blocks) and sc.is_contiguous()):
                fail(ValueError, f"moment_scales {i} must be a contiguous float32 tensor of "
                                 f"shape (2, {blocks}) (one scale per moment and block of "
                                 f"{moments8.BLOCK} elements), got {sc.dtype} of shape "
                                 f"{list(sc.shape)}")
            if sc.device != p.device:
                fail(RuntimeError, f"moment_scales {i} is on {sc.device} but its param is on "
                                   f"{p.device}")
        if carries:
            if compensations[i].dtype != comp_dtype:
                fail(TypeError, f"compensation {i} is {compensations[i].dtype} but must be "
                                f"{comp_dtype}")
            same_shape(p, compensations[i], "compensation", i)
        if update_stats is not None:
            u = update_stats[i]
            if u.dtype != torch.int64:
                fail(TypeError, f"update_stats {i} is {u.dtype} but must be torch.int64")
            if not (u.layout == torch.strided and u.dim() == 1
                    and u.shape[0] == len(UPDATE_STAT_FIELDS) and u.is_contiguous()):
                fail(ValueError, f"update_stats {i} must be a contiguous int64 tensor of "
                                 f"{len(UPDATE_STAT_FIELDS)} elements, got shape {list(u.shape)}")
            if u.device != p.device:
                fail(RuntimeError, f"update_stats {i} is on {u.device} but its param is on "
                                   f"{p.device}")
        step = state_steps[i]
        if not (step.numel() == 1 and step.dtype in (torch.float32, torch.float64)):
            fail(ValueError, f"state_step {i} must be a one-element float32 or float64 tensor, "
                             f"got {step.dtype} with {step.numel()} elements")
        if not step.is_cpu:
            fail(RuntimeError, f"state_step {i} is on {step.device} but state steps must be on "
                               "the CPU")


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
               state_steps, *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
               decoupled_weight_decay, compensation, grad_scale=None, found_inf=None, seed=0,
               update_stats=None, moment_scales=None):
    """torch.ops.torchcast.adam_step_ in pure PyTorch."""
    check_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
               state_steps, amsgrad, compensation, update_stats, moment_scales)
    carries = COMPENSATIONS[compensation].carried is not None
    if not params:
        return
    if found_inf is not None and found_inf.item() != 0:
        return
    if grad_scale is not None:
        inv = 1.0 / grad_scale.item()
        for g in grads:
            g.mul_(inv)
    lr = float(lr)
    compute = compute_dtype(params[0].dtype)
    k = step_constants(compute, lr, beta1, beta2, weight_decay, eps, maximize,
                       decoupled_weight_decay)
    for i, p in enumerate(params):
        step = state_steps[i]
        step.add_(1)
        t = tensor_constants(compute, lr, beta1, beta2, step.item(), seed, i)
        c = compensations[i] if carries else None
        stats = None if update_stats is None else update_stats[i]
        if moment_scales is not None:
            _step_tensor_moments8(k, t, compensation, p, grads[i], exp_avgs[i], exp_avg_sqs[i],
                                  moment_scales[i], c, stats)
            continue
        _step_tensor(k, t, compute, compensation, amsgrad, p, grads[i], exp_avgs[i],
                     exp_avg_sqs[i], max_exp_avg_sqs[i] if amsgrad else None, c, stats)
