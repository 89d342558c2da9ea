"""Update accounting of torchcast.optim.Adam/AdamW (``track_updates=True``):
what rounding did to each parameter's updates, counted by the fused step in
the same pass (csrc/adam_common.h, UpdateTally) into one small int64 tensor
per parameter on its device, and read here only when the user asks."""
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._reference.adam import COMP_UNITS, UPDATE_STAT_FIELDS

__all__ = ["UpdateRecord", "UpdateStats", "MOMENT_FIELDS"]


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
    """What rounding did to the updates of one parameter (or, with
    ``index=None``, of all the tracked parameters of a param group), summed
    over the steps since tracking began or was last reset.

    The *intended update* of an element is the float32 change the step
    computed for it, weight decay included: ``-lr * m_hat / (sqrt(v_hat) +
    eps)`` in float32, minus ``lr * weight_decay * w`` under decoupled decay
    (AdamW; ``w`` the weight before the step, for ``"remainder"`` its float32
    master). It is compared with the change of the stored parameter (for
    ``"remainder"`` the bfloat16 param, not its master): in float32 for
    bfloat16 and float16 params (the intended update rounded once to it),
    in float64 for wider ones.

    Attributes:
        group: the param group's index.
        index: the parameter's index in its group, None for a group total.
        name: the parameter's name where the optimizer was given
            ``named_parameters()``, else None.
        elements: element-steps counted (elements times the steps counted:
            every step, or every N-th with ``track_updates=N``).
        updated: element-steps with a finite, non-zero intended update.
        lost: of those, the ones whose stored parameter did not change: the
            update was rounded away entirely (for the compensated modes it
            went into the compensation instead).
        shrunk: of those, the ones whose stored parameter changed by less
            than half the intended amount (``lost`` included).
        comp_mean_ulp: mean over element-steps of |compensation| / ulp of
            the parameter after the step (compensated modes; 0 otherwise).
        comp_max_ulp: the largest such ratio.
        exp_avg_lost, exp_avg_off, exp_avg_sq_lost, exp_avg_sq_off: 8-bit
            moments (``state_dtype="8bit"``; 0 for other formats): of the
            element-steps, those whose stored moment was code 0 though its
            float32 value was not (lost), and those whose stored moment
            differs from its float32 value by more than half that value
            (off, lost ones included); exp_avg_sq compared as the second
            moment itself. Their fractions say when a block's scale, set by
            its largest element, leaves the others unresolved.
    """

    group: int
    index: Optional[int]
    name: Optional[str]
    elements: int
    updated: int
    lost: int
    shrunk: int
    comp_mean_ulp: float
    comp_max_ulp: float
    exp_avg_lost: int = 0
    exp_avg_off: int = 0
    exp_avg_sq_lost: int = 0
    exp_avg_sq_off: int = 0

    @property
    def lost_fraction(self) -> float:
        """lost / updated (0 when nothing was updated)."""
        return self.lost / self.updated if self.updated else 0.0

    @property
    def shrunk_fraction(self) -> float:
        """shrunk / updated (0 when nothing was updated)."""
        return self.shrunk / self.updated if self.updated else 0.0

    @property
    def moment_fractions(self) -> Dict[str, float]:
        """{"exp_avg_lost": ..., "exp_avg_off": ..., "exp_avg_sq_lost": ...,
        "exp_avg_sq_off": ...}: each count / elements (0 when none)."""
        return {key: getattr(self, key) / self.elements if self.elements else 0.0
                for key in MOMENT_FIELDS}


MOMENT_FIELDS = ("exp_avg_lost", "exp_avg_off", "exp_avg_sq_lost", "exp_avg_sq_off")
_MAX_FIELD = UPDATE_STAT_FIELDS.index("comp_max")


def _record(group, index, name, v: Tuple[int, ...]) -> UpdateRecord:
    elements, updated, lost, shrunk, comp_sum, comp_max, *moments = v
    return UpdateRecord(group, index, name, elements, updated, lost, shrunk,
                        comp_sum / COMP_UNITS / elements if elements else 0.0,
                        comp_max / COMP_UNITS, *moments)


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    """The update accounting of an optimizer: ``params`` one record per
    tracked parameter that has stepped, ``groups`` one total per param group
    with such parameters. ``str()`` gives a text table."""

    params: List[UpdateRecord]
    groups: List[UpdateRecord]

    def __str__(self) -> str:
        moments = any(getattr(r, f) for r in self.groups for f in MOMENT_FIELDS)
        head = (f"{'param':<28} {'elements':>12} {'lost':>8} {'<half':>8} {'comp mean':>10} "
                f"{'comp max':>9}" + (f" {'m lost':>8} {'m off':>8} {'v lost':>8} {'v off':>8}"
                                      if moments else ""))
        lines = [head, "-" * len(head)]
        for r in self.groups + self.params:
            label = (f"group {r.group}" if r.index is None
                     else f"  {r.name or f'param {r.index}'}")
            line = (f"{label[:28]:<28} {r.elements:>12} {r.lost_fraction:>8.2%} "
                    f"{r.shrunk_fraction:>8.2%} {r.comp_mean_ulp:>10.3f} {r.comp_max_ulp:>9.3f}")
            if moments:
                line += "".join(f" {f:>8.2%}" for f in r.moment_fractions.values())
            lines.append(line)
        return "\n".join(lines)

    def to_tensorboard(self, writer: Any, step: int, prefix: str = "torchcast") -> None:
        """Writes each record's ``lost_fraction``, ``shrunk_fraction``,
        ``comp_mean_ulp`` and ``comp_max_ulp`` as scalars, under
        ``{prefix}/updates/group{g}/...`` for the group totals and
        ``{prefix}/updates/group{g}/{name or param i}/...`` for the params.

        Args:
            writer: anything with ``add_scalar(tag, value, step)``, e.g.
                torch.utils.tensorboard.SummaryWriter.
            step (int): the global step the values belong to.
            prefix (str, optional): the tags' first part (default: "torchcast").
        """
        for r in self.groups + self.params:
            where = f"{prefix}/updates/group{r.group}"
            if r.index is not None:
                where += f"/{r.name or f'param{r.index}'}"
            for key in ("lost_fraction", "shrunk_fraction", "comp_mean_ulp", "comp_max_ulp"):
                writer.add_scalar(f"{where}/{key}", getattr(r, key), step)
            for key, fraction in r.moment_fractions.items():
                if getattr(r, key):
                    writer.add_scalar(f"{where}/{key}_fraction", fraction, step)


def new_counter(local: torch.Tensor) -> torch.Tensor:
    """A zero counter for the param whose kernel operand is ``local``."""
    return torch.zeros(len(UPDATE_STAT_FIELDS), dtype=torch.int64, device=local.device)


def collect(param_groups, counters: Dict[torch.Tensor, torch.Tensor], reset: bool) -> UpdateStats:
    """The records of every param that has a counter, read in one transfer
    per device; ``reset`` zeroes the counters after reading."""
    located = [(gi, i, p, group) for gi, group in enumerate(param_groups)
               for i, p in enumerate(group["params"]) if p in counters]
    by_device: Dict[torch.device, List[int]] = {}
    for k, (_, _, p, _) in enumerate(located):
        by_device.setdefault(counters[p].device, []).append(k)
    values: List[Optional[Tuple[int, ...]]] = [None] * len(located)
    for ks in by_device.values():
        rows = torch.stack([counters[located[k][2]] for k in ks]).cpu().tolist()
        for k, row in zip(ks, rows):
            values[k] = tuple(row)
    params, totals = [], {}
    for (gi, i, p, group), v in zip(located, values):
        names = group.get("param_names")
        params.append(_record(gi, i, names[i] if names else None, v))
        t = totals.get(gi, (0,) * len(UPDATE_STAT_FIELDS))
        totals[gi] = tuple(max(a, b) if f == _MAX_FIELD else a + b
                           for f, (a, b) in enumerate(zip(t, v)))
    if reset:
        for _, _, p, _ in located:
            counters[p].zero_()
    return UpdateStats(params, [_record(gi, None, None, t) for gi, t in sorted(totals.items())])
