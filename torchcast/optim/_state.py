"""The per-param state of torchcast.optim.Adam/AdamW: the compensation mode
and moment format a param gets from its group's options, the state keys each
keeps, creating what is missing, converting a loaded state (torchcast's, in
any moment format, or torch.optim's) to them, and seeding compensation from
wider weights.

The modes and formats are adam_modes' tables; the checks of what is
converted are _validation's."""
from typing import Any, Dict

import torch

from .._reference import adam as adam_reference
from .._reference import moments8
from ..adam_modes import CARRIED_STATE_KEYS, COMPENSATIONS, EIGHT_BIT
from ._validation import is_dtensor, lossy_load_error, real_dtype

NARROW = (torch.bfloat16, torch.float16)
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# 8-bit moments: int8 codes of exp_avg, uint8 codes of sqrt(exp_avg_sq), and
# float32 (2, blocks) scales, exp_avg's then exp_avg_sq's. Under keys of their
# own, which torch.optim.Adam does not read as moments: torch's load_state_dict
# cannot install codes as exp_avg (its step then raises KeyError 'exp_avg').
CODES = ("exp_avg_code", "exp_avg_sq_code")
SCALES = "moment_scales"
# Every state key a param of some mode keeps.
KNOWN_STATE_KEYS = ("step",) + MOMENTS + CODES + CARRIED_STATE_KEYS + (SCALES,)
_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}
_KEYS = {}  # (mode, amsgrad, 8-bit) -> state keys


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernel works on: a DTensor's local shard, complex as
    (real, imag) pairs (as torch's Adam steps complex params)."""
    if is_dtensor(t):
        t = t.to_local()
    return torch.view_as_real(t) if t.is_complex() else t


def mode_of(group: Dict[str, Any], dtype: torch.dtype) -> str:
    """The compensation mode a param of (real) ``dtype`` gets in ``group``."""
    if group["differentiable"]:
        return "none"
    on = group["compensated"]
    if on is None:
        on = dtype in NARROW
    return group["compensation"] if on else "none"


def eight_bit(group: Dict[str, Any], p: torch.Tensor) -> bool:
    """Whether ``p`` keeps 8-bit moments in ``group`` (narrow params only)."""
    return (group["state_dtype"] == EIGHT_BIT and not group["differentiable"]
            and p.dtype in NARROW)


def moment_dtype(group: Dict[str, Any], p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s exp_avg in ``group`` (8-bit: int8, its
    exp_avg_sq uint8)."""
    if group["differentiable"]:
        return p.dtype  # torch's own step keeps states in the param's dtype
    if eight_bit(group, p):
        return torch.int8
    dtype = real_dtype(p)
    sd = group["state_dtype"]
    sd = sd if dtype in NARROW and sd not in (None, EIGHT_BIT) else (
        torch.float32 if dtype in NARROW else dtype)
    return _COMPLEX_OF[sd] if p.is_complex() else sd


def state_keys(group: Dict[str, Any], p: torch.Tensor, mode: str) -> tuple:
    """The state keys ``p`` keeps in ``group`` under ``mode``."""
    key = (mode, bool(group["amsgrad"]), eight_bit(group, p))
    keys = _KEYS.get(key)
    if keys is None:
        carried = COMPENSATIONS[mode].state_key
        keys = _KEYS[key] = (("step",) + (CODES if key[2] else ("exp_avg", "exp_avg_sq"))
                             + (("max_exp_avg_sq",) if key[1] else ())
                             + ((carried,) if carried else ()) + ((SCALES,) if key[2] else ()))
    return keys


def step_tensor(step) -> torch.Tensor:
    """A step count as the kernels read it: a float32 (or float64) CPU
    tensor, as torch's non-fused Adam keeps it (no device synchronization)."""
    if torch.is_tensor(step):
        return step if step.device.type == "cpu" and step.dtype in (
            torch.float32, torch.float64) else step.to("cpu", torch.float32)
    return torch.tensor(float(step), dtype=torch.float32)


def _zeros(p, dtype):
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


def init_state(state: Dict[str, Any], group: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
    """``state`` (the param's) with whatever its mode and format need and it
    lacks created: on the first step, after loading a torch.optim.Adam state
    (no compensation), or after amsgrad or another mode was switched on;
    what a mode no longer used kept is dropped."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    if eight_bit(group, p):
        state.setdefault(CODES[0], _zeros(p, torch.int8))
        state.setdefault(CODES[1], _zeros(p, torch.uint8))
        if SCALES not in state:
            state[SCALES] = torch.zeros(2, moments8.blocks_of(p.numel()), device=p.device)
    else:
        sd = moment_dtype(group, p)
        for key in MOMENTS[:3 if group["amsgrad"] else 2]:
            if key not in state:
                state[key] = _zeros(p, sd)
    mode = COMPENSATIONS[mode_of(group, real_dtype(p))]
    if mode.state_key is not None and mode.state_key not in state:
        state[mode.state_key] = _zeros(p, mode.carried_dtype(p.dtype))
    for key in CARRIED_STATE_KEYS:
        if key != mode.state_key:
            state.pop(key, None)
    return state


def like(p: torch.Tensor, value, dtype: torch.dtype):
    """value as a state of p: p's device, the given dtype, p's memory order."""
    if not torch.is_tensor(value):
        return value
    out = value.to(device=p.device, dtype=dtype)
    if out.shape == p.shape and out.stride() != p.stride():
        out = torch.empty_like(p, dtype=dtype).copy_(out)
    return out


def _in_order(x, order):
    """x's elements flat in the order ``order`` (element_index) gives them."""
    return torch.empty(x.numel(), dtype=x.dtype, device=x.device).scatter_(
        0, order.reshape(-1).to(x.device), x.reshape(-1))


def _from_order(flat, order, shape):
    return flat[order.reshape(-1).to(flat.device)].view(shape)


def dequantized(saved: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """An 8-bit state's moments as float32 tensors of the param's shape: the
    values its next step would read (exact). The blocks follow the codes'
    memory order, as the kernel laid them out."""
    codes_m, codes_v = saved[CODES[0]], saved[CODES[1]]
    order = adam_reference.element_index(codes_m)
    m, v = moments8.dequantize(_in_order(codes_m, order), _in_order(codes_v, order),
                               saved[SCALES].float())
    return {"exp_avg": _from_order(m, order, codes_m.shape),
            "exp_avg_sq": _from_order(v, order, codes_m.shape)}


def _quantized(p, m, v):
    """float32 moments as p's 8-bit state, each code the nearest."""
    order = adam_reference.element_index(p)
    qm, qv, scales = moments8.quantize(_in_order(m.float(), order).to(p.device),
                                       _in_order(v.float(), order).to(p.device))
    return {CODES[0]: like(p, _from_order(qm, order, p.shape), torch.int8),
            CODES[1]: like(p, _from_order(qv, order, p.shape), torch.uint8), SCALES: scales}


def _same_values(a, b) -> bool:
    """a and b hold the same values (NaN equal to NaN)."""
    a, b = a.to(torch.float64), b.to(device=a.device, dtype=torch.float64)
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _lossless(value: torch.Tensor, converted: torch.Tensor) -> bool:
    """Whether converting value lost nothing: it converts back to itself."""
    if value.is_complex():
        value, converted = torch.view_as_real(value), torch.view_as_real(converted)
    return _same_values(converted, value.to(converted.device))


def adopt(name: str, gi: int, i: int, group: Dict[str, Any], p: torch.Tensor,
          saved: Dict[str, Any], round_moments: bool) -> Dict[str, Any]:
    """A loaded (checked) state converted for ``p`` in ``group``: moments in
    the group's format (8-bit codes dequantized or quantized as needed), the
    mode's compensation in its dtype, the step count on the CPU; what
    another mode carried is dropped. A conversion that would change a
    moment's value raises (lossy_load_error) unless ``round_moments``."""
    mode = COMPENSATIONS[mode_of(group, real_dtype(p))]
    out = {}
    moments = {k: v for k, v in saved.items() if k in MOMENTS}
    if SCALES in saved:
        if eight_bit(group, p) and _same_order(saved[CODES[0]], p):
            moments = {CODES[0]: like(p, saved[CODES[0]], torch.int8),
                       CODES[1]: like(p, saved[CODES[1]], torch.uint8),
                       SCALES: saved[SCALES].to(device=p.device, dtype=torch.float32)}
        else:
            moments = dequantized(saved)
    if SCALES not in moments:
        moments = _converted(name, gi, i, group, p, moments, round_moments)
    out.update(moments)
    for key, value in saved.items():
        if key == "step":
            out[key] = step_tensor(value)
        elif key == mode.state_key:
            out[key] = like(p, value, mode.carried_dtype(p.dtype))
        elif (key not in MOMENTS and key not in CODES and key != SCALES
              and key not in CARRIED_STATE_KEYS):
            out[key] = value
    return out


def _same_order(codes, p) -> bool:
    return torch.equal(adam_reference.element_index(codes), adam_reference.element_index(p))


def _converted(name, gi, i, group, p, moments, round_moments):
    """Float moments in the group's format for p, checked for loss."""
    if eight_bit(group, p):
        if "max_exp_avg_sq" in moments:
            moments = {k: v for k, v in moments.items() if k != "max_exp_avg_sq"}
        m = moments.get("exp_avg", torch.zeros(p.shape))
        v = moments.get("exp_avg_sq", torch.zeros(p.shape))
        out = _quantized(p, m, v)
        if not round_moments:
            back = dequantized(out)
            for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
                if not _same_values(back[key], value):
                    raise lossy_load_error(name, gi, i, p, key, value.dtype, EIGHT_BIT)
        return out
    dtype = moment_dtype(group, p)
    out = {}
    for key, value in moments.items():
        converted = like(p, value, dtype)
        if not round_moments and not _lossless(value, converted):
            raise lossy_load_error(name, gi, i, p, key, value.dtype, dtype)
        out[key] = converted
    return out


def seed(state: Dict[str, Any], group: Dict[str, Any], p: torch.Tensor,
         weight: torch.Tensor) -> None:
    """seed_compensation for one (checked) param: p becomes ``weight``
    rounded to its dtype and its compensation what that rounding lost (for
    "remainder", exactly; for "remainder8", to the nearest 24 bits)."""
    state = init_state(state, group, p)
    mode = mode_of(group, real_dtype(p))
    dst = local(p)
    w = local(weight.detach()).to(dst.device)
    if mode == "remainder":
        hi, lo = adam_reference.split_bf16_remainder(w.float())
        dst.copy_(hi)
        local(state["remainder"]).copy_(lo)
        return
    if mode == "remainder8":  # to the nearest 24-bit master: a random byte of one half
        half = torch.full(w.shape, 1 << 31, dtype=torch.int64, device=w.device)
        hi, lo = adam_reference.split_bf16_remainder8(w.float(), half)
        dst.copy_(hi)
        local(state["remainder8"]).copy_(lo)
        return
    dst.copy_(w)
    if mode == "kahan":
        wide = w.dtype if w.dtype == torch.float64 else torch.float32
        w = w.to(wide)
        local(state["compensation"]).copy_(w - dst.to(wide))


def torch_format(state: Dict[str, Any]) -> Dict[str, Any]:
    """A param's state as torch.optim.Adam keeps it: float32 moments (8-bit
    ones dequantized, exactly), no compensation or scales."""
    out = {k: v for k, v in state.items()
           if k not in CARRIED_STATE_KEYS and k not in CODES and k != SCALES}
    if SCALES in state:
        out.update(dequantized(state))
    return out

