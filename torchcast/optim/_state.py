"""The per-param state of torchcast.optim.Adam/AdamW: the compensation mode
and moment dtype a param gets from its group's options, the state keys each
mode keeps, creating what is missing, converting a loaded state (torchcast's
or torch.optim's) to them, and seeding compensation from wider weights.

The modes and what each carries are adam_modes.COMPENSATIONS' rows; the
checks of what is converted are _validation's."""
from typing import Any, Dict

import torch

from .._reference import adam as adam_reference
from ..adam_modes import CARRIED_STATE_KEYS, COMPENSATIONS
from ._validation import is_dtensor, real_dtype

NARROW = (torch.bfloat16, torch.float16)
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# Every state key a param of some mode keeps.
KNOWN_STATE_KEYS = ("step",) + MOMENTS + CARRIED_STATE_KEYS
# The state keys of a param, by (compensation mode, amsgrad).
STATE_KEYS = {
    (name, ams): ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())
    + ((mode.state_key,) if mode.state_key else ())
    for name, mode in COMPENSATIONS.items() for ams in (False, True)
}
_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}


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


def moment_dtype(group: Dict[str, Any], p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s moments in ``group``."""
    if group["differentiable"]:
        return p.dtype  # torch's own step keeps states in the param's dtype
    dtype = real_dtype(p)
    sd = group["state_dtype"] if group["state_dtype"] is not None else torch.float32
    sd = sd if dtype in NARROW else dtype
    return _COMPLEX_OF[sd] if p.is_complex() else sd


def step_tensor(step) -> torch.Tensor:
    """A step count as the kernels read it: a float32 (or float64) CPU
    tensor, as torch's non-fused Adam keeps it (no device synchronization)."""
    if torch.is_tensor(step):
        return step if step.device.type == "cpu" and step.dtype in (
            torch.float32, torch.float64) else step.to("cpu", torch.float32)
    return torch.tensor(float(step), dtype=torch.float32)


def init_state(state: Dict[str, Any], group: Dict[str, Any], p: torch.Tensor) -> Dict[str, Any]:
    """``state`` (the param's) with whatever its mode needs and it lacks
    created: on the first step, after loading a torch.optim.Adam state (no
    compensation), or after amsgrad or another mode was switched on; what a
    mode no longer used kept is dropped."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    sd = moment_dtype(group, p)
    for key in MOMENTS[:3 if group["amsgrad"] else 2]:
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=sd, memory_format=torch.preserve_format)
    mode = COMPENSATIONS[mode_of(group, real_dtype(p))]
    if mode.state_key is not None and mode.state_key not in state:
        state[mode.state_key] = torch.zeros_like(p, dtype=mode.carried_dtype(p.dtype),
                                                 memory_format=torch.preserve_format)
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


def adopt(group: Dict[str, Any], p: torch.Tensor, saved: Dict[str, Any]) -> Dict[str, Any]:
    """A loaded (checked) state converted for ``p`` in ``group``: moments in
    the group's moment dtype, the mode's compensation in its dtype, the
    step count on the CPU; what another mode carried is dropped."""
    mode = COMPENSATIONS[mode_of(group, real_dtype(p))]
    target = {key: moment_dtype(group, p) for key in MOMENTS}
    if mode.state_key is not None:
        target[mode.state_key] = mode.carried_dtype(p.dtype)
    out = {}
    for key, value in saved.items():
        if key == "step":
            out[key] = step_tensor(value)
        elif key in target:
            out[key] = like(p, value, target[key])
        elif key not in CARRIED_STATE_KEYS:
            out[key] = value
    return out


def seed(state: Dict[str, Any], group: Dict[str, Any], p: torch.Tensor,
         weight: torch.Tensor) -> None:
    """seed_compensation for one (checked) param: p becomes ``weight``
    rounded to its dtype and its compensation what that rounding lost (for
    "remainder", exactly)."""
    state = init_state(state, group, p)
    mode = mode_of(group, real_dtype(p))
    dst = local(p)
    w = local(weight.detach()).to(dst.device)
    if mode == "remainder":
        hi, lo = adam_reference.split_bf16_remainder(w.float())
        dst.copy_(hi)
        local(state["remainder"]).copy_(lo)
        return
    dst.copy_(w)
    if mode == "kahan":
        wide = w.dtype if w.dtype == torch.float64 else torch.float32
        w = w.to(wide)
        local(state["compensation"]).copy_(w - dst.to(wide))
