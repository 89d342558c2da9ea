"""One param group's step in torchcast.optim.Adam/AdamW: its checked (param,
grad) pairs batched into adam_step_ calls, one per (device, param dtype,
moment dtype, compensation mode), or, under differentiable=True, torch's own
single-tensor Adam on the same tensors."""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.optim.adam import adam as torch_adam

from .. import _ops
from .._reference import adam as adam_reference
from ..adam_modes import COMPENSATIONS
from . import _state
from ._state import local
from ._validation import is_dtensor

# (param, compensation mode) -> the param's state, complete for the mode.
StateOf = Callable[[torch.Tensor, str], Dict[str, Any]]


@dataclasses.dataclass(slots=True)
class Batch:
    """The tensors of one adam_step_ call (one device, param dtype, moment
    dtype and compensation mode), in the op's argument order; lists left
    empty where amsgrad or compensation is off. Slots: the step appends to
    these once per param, and a slot is the quickest attribute to reach."""

    params: List[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: List[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avgs: List[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avg_sqs: List[torch.Tensor] = dataclasses.field(default_factory=list)
    max_exp_avg_sqs: List[torch.Tensor] = dataclasses.field(default_factory=list)
    compensations: List[torch.Tensor] = dataclasses.field(default_factory=list)
    state_steps: List[torch.Tensor] = dataclasses.field(default_factory=list)
    update_stats: List[torch.Tensor] = dataclasses.field(default_factory=list)
    moment_scales: List[torch.Tensor] = dataclasses.field(default_factory=list)


def stream_seed(seed: int, gi: int, bi: int) -> int:
    """The op's seed for batch bi of param group gi: the group's seed mixed
    with both, so that groups sharing a seed draw independent bits (the op
    mixes in each param's position and step count), as a signed int64."""
    z = adam_reference.splitmix64(adam_reference.splitmix64(seed) ^ ((gi << 32) | bi))
    return z - 2 ** 64 if z >= 2 ** 63 else z


def step_group(group: Dict[str, Any], gi: int,
               items: Sequence[Tuple[torch.Tensor, torch.Tensor]], state_of: StateOf,
               counter_of: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
               grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
    """Steps group ``gi``'s checked (param, grad) pairs in one adam_step_
    call per batch.

    Args:
        group: the param group (its options as the step reads them).
        gi: its index (mixed into the stochastic seed).
        items: the (param, grad) pairs to step, checked.
        state_of: the param's state for a mode, complete.
        counter_of: (param, the tensor the kernel steps) -> its update_stats
            counter, on a step that counts updates; None on the others.
        grad_scale, found_inf: GradScaler's, or None.
    """
    amsgrad = bool(group["amsgrad"])
    batches: Dict[tuple, Batch] = {}
    for p, g in items:
        plain = not (p.is_complex() or is_dtensor(p))
        lp = p if plain else local(p)
        mode = _state.mode_of(group, lp.dtype)
        carried = COMPENSATIONS[mode].state_key
        state = state_of(p, mode)
        tensors = [g] + [state[k] for k in (_state.CODES if _state.SCALES in state
                                             else ("exp_avg", "exp_avg_sq"))]
        if amsgrad:
            tensors.append(state["max_exp_avg_sq"])
        if carried is not None:
            tensors.append(state[carried])
        if not plain:
            tensors = [local(t) for t in tensors]
        key = (lp.device, lp.dtype, tensors[1].dtype, mode)
        b = batches.get(key)
        if b is None:
            b = batches[key] = Batch()
        b.params.append(lp)
        b.grads.append(tensors[0])
        b.exp_avgs.append(tensors[1])
        b.exp_avg_sqs.append(tensors[2])
        if amsgrad:
            b.max_exp_avg_sqs.append(tensors[3])
        if carried is not None:
            b.compensations.append(tensors[-1])
        b.state_steps.append(state["step"])
        if _state.SCALES in state:
            b.moment_scales.append(state[_state.SCALES])
        if counter_of is not None:
            b.update_stats.append(counter_of(p, lp))
    beta1, beta2 = group["betas"]
    for bi, ((device, _, moments, mode), batch) in enumerate(batches.items()):
        eight_bit = moments == torch.int8
        random = COMPENSATIONS[mode].draws_bits or eight_bit
        seed = stream_seed(group["seed"], gi, bi) if random else 0
        _ops.adam_step_(
            batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs,
            batch.max_exp_avg_sqs, batch.compensations, batch.state_steps,
            fused=group["fused"], lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            amsgrad=amsgrad, maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]), compensation=mode,
            grad_scale=None if grad_scale is None else grad_scale.to(device),
            found_inf=None if found_inf is None else found_inf.to(device), seed=seed,
            update_stats=batch.update_stats if counter_of is not None else None,
            moment_scales=batch.moment_scales if eight_bit else None)


def torch_step(group: Dict[str, Any], items: Sequence[Tuple[torch.Tensor, torch.Tensor]],
               state_of: StateOf, grad_scale: Optional[torch.Tensor],
               found_inf: Optional[torch.Tensor]) -> None:
    """differentiable=True: torch's own single-tensor Adam on the group's
    tensors, so that autograd sees every operation (torchcast's kernel is
    opaque to it). No compensation in this mode (checked at construction).

    Args:
        group, items, state_of, grad_scale, found_inf: as ``step_group``.
    """
    lists = [[] for _ in range(6)]
    for p, g in items:
        state = state_of(p, "none")
        for lst, t in zip(lists, (p, g, state["exp_avg"], state["exp_avg_sq"],
                                  state.get("max_exp_avg_sq"), state["step"])):
            if t is not None:
                lst.append(t)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
    beta1, beta2 = group["betas"]
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
               foreach=False, capturable=False, differentiable=True, fused=False,
               grad_scale=grad_scale, found_inf=found_inf,
               has_complex=any(p.is_complex() for p in params),
               decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
               amsgrad=bool(group["amsgrad"]), beta1=beta1, beta2=beta2, lr=group["lr"],
               weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=bool(group["maximize"]))
