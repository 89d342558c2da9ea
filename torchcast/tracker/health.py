"""track(health=True): per module, the numeric health of its forward outputs
and of the gradients flowing into it in backward, merged over calls, and
what a narrower format would make of them (headroom).

Forward: a listener on the tracker's module hooks (modules.py) measures each
floating output with ``torchcast.tensor_health``; backward: a hook on each
output that requires grad measures the gradient that reaches it (the
gradient flowing into the module from what used its output). The measures
stay tensors on the device, merged per (module, phase, dtype), until read.
"""
import collections
import dataclasses
import math
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten

from .._inputs import PLAIN_TENSOR_TYPES, dense_strided
from ..headroom import FORMATS, Headroom, headroom
from ..health import TensorHealth, tensor_health
from ..stats import short_dtype_name
from .modules import add_output_listener, remove_output_listener
from .nonfinite import unwatched

PHASES = ("forward", "backward")
# The histograms an entry keeps unmerged at most (float32's is 28 KiB).
_PENDING_BYTES = 256 << 10


@dataclasses.dataclass
class ModuleHealth:
    """The merged health of a module's outputs (phase "forward") or of the
    gradients flowing into it (phase "backward"), for one dtype."""

    module: Optional[str]
    phase: str
    health: TensorHealth

    @property
    def dtype(self) -> torch.dtype:
        return self.health.dtype

    def headroom(self, dtype: torch.dtype, scale: Union[None, float, str] = None) -> Headroom:
        """``torchcast.headroom.headroom`` of this entry."""
        return headroom(self.health, dtype, scale)

    def binades_to_overflow(self) -> float:
        """log2(largest finite value of its dtype / amax): how many doublings
        the largest element can take (inf when all are zero)."""
        return _binades_to_overflow(self.dtype, self.health.amax)

    def to_dict(self) -> Dict[str, Any]:
        h = self.health
        return {"module": self.module, "phase": self.phase, **h.to_dict()}


class HealthWatch:
    """The module health of one track(health=True).

    Each measure is kept as it is, appended to its entry's list, and the list
    merged (``TensorHealth.merged``: a few ops for any number) when it is read
    or when it holds _PENDING_BYTES of histograms: merging at every module
    call cost five ops per call. A measure can be in several lists (a
    container returning its last child's output shares the child's); none
    is changed, merging makes new tensors."""

    def __init__(self):
        self.entries: Dict[Tuple[Optional[str], str, torch.dtype], List[TensorHealth]] = {}
        self._merged = set()  # the keys whose list is one TensorHealth of this watch's own
        self.lock = threading.RLock()
        self.active = False
        # (weakref to the tensor, its version, its measure, its gradient hook):
        # the output measured last.
        self._last = None

    def start(self) -> None:
        self.active = True
        add_output_listener(self.on_output)

    def stop(self) -> None:
        self.active = False
        remove_output_listener(self.on_output)

    def _add(self, module, phase, dtype, measured):
        """Appends ``measured`` to the entry (module, phase, dtype)."""
        key = (module, phase, dtype)
        with self.lock:
            pending = self.entries.get(key)
            if pending is None:
                self.entries[key] = [measured]
                return
            pending.append(measured)
            if len(pending) * measured.hist.numel() * 8 >= _PENDING_BYTES:
                self._merge(key)

    def _merge(self, key):
        """Replaces the list of ``key`` by one TensorHealth (lock held)."""
        with unwatched():
            self.entries[key] = [TensorHealth.merged(self.entries[key])]
        self._merged.add(key)

    def measure(self, modules: List[Optional[str]], phase: str, t: torch.Tensor) -> None:
        """Measures ``t`` once, for each of ``modules``."""
        with unwatched():
            measured = tensor_health(t.detach())
        for module in modules:
            self._add(module, phase, t.dtype, measured)

    def on_output(self, module: Optional[str], output: Any) -> None:
        """The module hooks' listener: measures each floating output, and
        hooks its gradient. A tensor that is also the output of the module
        just measured (a container returning its last child's output) is not
        measured again: its measure and its gradient hook are shared."""
        if not self.active:
            return
        for t in tree_flatten(output)[0]:
            if type(t) not in PLAIN_TENSOR_TYPES or not t.is_floating_point() or t.numel() == 0:
                continue
            if not dense_strided(t):
                _warn_not_measured(module, t)
                continue
            last = self._last
            if last is not None and last[0]() is t and last[1] == t._version:
                _, _, measured, hook = last
                self._add(module, "forward", t.dtype, measured)
                if hook is not None:
                    hook.modules.append(module)
                continue
            with unwatched():
                measured = tensor_health(t.detach())
            self._add(module, "forward", t.dtype, measured)
            hook = None
            if t.requires_grad and torch.is_grad_enabled():
                hook = _GradHook(self, module)
                t.register_hook(hook)
            self._last = (weakref.ref(t), t._version, measured, hook)

    @classmethod
    def from_dicts(cls, rows: List[Dict[str, Any]]) -> "HealthWatch":
        """A stopped watch holding ``ModuleHealth.to_dict()`` rows (a report
        read back from JSON)."""
        watch = cls()
        for d in rows:
            h = TensorHealth.from_dict(d)
            key = (d["module"], d["phase"], h.dtype)
            watch.entries[key] = [h]
            watch._merged.add(key)
        return watch

    def rows(self) -> List[ModuleHealth]:
        """Every entry, worst first: non-finite values, then the fewest
        binades to overflow (forward) and the largest share of zero and
        subnormal gradients (backward)."""
        with self.lock:
            for key in [k for k, pending in self.entries.items() if len(pending) > 1]:
                self._merge(key)
            # A measure one entry holds alone becomes that entry's own; one that
            # several hold (a container and its last child) is copied for all
            # but one of them, so that no two rows share tensors.
            holders = collections.Counter(id(h) for (h,) in self.entries.values())
            for key, (h,) in list(self.entries.items()):
                if key not in self._merged and holders[id(h)] > 1:
                    holders[id(h)] -= 1
                    self._merge(key)
                self._merged.add(key)
            rows = [ModuleHealth(m, phase, h) for (m, phase, _), (h,) in self.entries.items()]
        return sorted(rows, key=_severity)


class _GradHook:
    """Measures the gradient reaching a module's output, for that module and
    the containers that returned the same tensor (returns None: the gradient
    passes unchanged)."""

    __slots__ = ("watch", "modules")

    def __init__(self, watch, module):
        self.watch, self.modules = watch, [module]

    def __call__(self, grad):
        if self.watch.active and grad is not None and grad.numel():
            if not dense_strided(grad):
                _warn_not_measured(self.modules[0], grad)
                return
            self.watch.measure(self.modules, "backward", grad)


_warned_layouts = set()


def _warn_not_measured(module: Optional[str], t: torch.Tensor) -> None:
    """Says once per layout that such tensors are left out of health rows:
    tensor_health reads dense strided tensors."""
    kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
    if kind not in _warned_layouts:
        _warned_layouts.add(kind)
        warnings.warn(f"torchcast.track(health=True): {module or 'the model'} passed a {kind} "
                      f"tensor, which tensor_health cannot read; {kind} tensors are left out "
                      "of the health rows (said once)", RuntimeWarning, stacklevel=2)


def _binades_to_overflow(dtype: torch.dtype, amax: float) -> float:
    return math.log2(torch.finfo(dtype).max / amax) if amax > 0 else math.inf


def _severity(row: ModuleHealth):
    h = row.health.read()
    lost = (h.zero + h.subnormal) / max(h.numel, 1)
    return (-(h.nan + h.posinf + h.neginf), _binades_to_overflow(row.dtype, h.amax), -lost)


@dataclasses.dataclass
class HeadroomRow:
    module: Optional[str]
    phase: str
    src_dtype: torch.dtype
    result: Headroom

    def to_dict(self) -> Dict[str, Any]:
        r = self.result
        return {"module": self.module, "phase": self.phase, "src_dtype": str(self.src_dtype),
                "format": str(r.dtype), "scale": r.scale, "numel": r.numel,
                "overflow": r.overflow_fraction, "underflow": r.underflow_fraction,
                "subnormal": r.subnormal_fraction}


class HeadroomTable:
    """``Report.headroom``'s answer: per module and phase, what a cast to a
    format would do; ``str()`` prints it worst first (overflow, then
    underflow, then subnormal results)."""

    def __init__(self, dtype: torch.dtype, scale: Union[None, float, str],
                 rows: List[HeadroomRow]):
        self.dtype, self.scale = dtype, scale
        self.rows = sorted(rows, key=lambda r: (-r.result.overflow_fraction,
                                                -r.result.underflow_fraction,
                                                -r.result.subnormal_fraction))

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_dict(self) -> List[Dict[str, Any]]:
        return [r.to_dict() for r in self.rows]

    def __str__(self) -> str:
        scale = "per-entry power-of-two amax scale" if self.scale == "amax" else \
            f"scale {1.0 if self.scale is None else self.scale:g}"
        head = f"torchcast headroom in {short_dtype_name(self.dtype)} ({scale}), worst first"
        table = [("module", "phase", "dtype", "elements", "scale", "overflow", "underflow",
                  "subnormal")]
        for r in self.rows:
            h = r.result
            table.append((r.module or "-", r.phase, short_dtype_name(r.src_dtype), str(h.numel),
                          f"2^{int(math.log2(h.scale))}", _percent(h.overflow_fraction),
                          _percent(h.underflow_fraction), _percent(h.subnormal_fraction)))
        return _format_table(head, table, left=3)


def _percent(x: float) -> str:
    if x == 0:
        return "0"
    return f"{100 * x:.3g}%" if x >= 1e-5 else f"{100 * x:.1e}%"


def _format_table(head: str, rows: List[tuple], left: int) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def headroom_table(watch: HealthWatch, dtype: torch.dtype,
                   scale: Union[None, float, str] = None) -> HeadroomTable:
    """``Report.headroom``: every entry of ``watch`` cast to ``dtype``."""
    rows = [HeadroomRow(r.module, r.phase, r.dtype, r.headroom(dtype, scale))
            for r in watch.rows()]
    return HeadroomTable(dtype, scale, rows)


def _lost(h: Headroom) -> str:
    return f"{_percent(h.overflow_fraction)}/{_percent(h.underflow_fraction)}"


def headroom_lines(watch: HealthWatch) -> List[str]:
    """``Report.headroom_summary``: one row per entry of ``watch``, one
    column per format of FORMATS (``headroom_table`` gives one format's
    full table, subnormals included)."""
    rows = watch.rows()
    head = (f"torchcast headroom of {len(rows)} module outputs and gradients (worst first): the "
            "% of elements a cast to each format loses\nto overflow/underflow at scale 1, and "
            "where it loses any, at the entry's power-of-two amax scale (2^k: overflow/underflow)")
    table = [("module", "phase", "dtype", "elements", *(short_dtype_name(f) for f in FORMATS))]
    lossless = 0
    for r in rows:
        health = r.health.cpu()  # one transfer for the 8 predictions
        cells = []
        for fmt in FORMATS:
            plain = headroom(health, fmt)
            cell = _lost(plain)
            if plain.overflow or plain.underflow:
                scaled = headroom(health, fmt, "amax")
                cell += f", 2^{int(math.log2(scaled.scale))}: {_lost(scaled)}"
            cells.append(cell)
        if all(c == "0/0" for c in cells):
            lossless += 1  # a table of only "0/0" rows says less than their count
            continue
        table.append((r.module or "-", r.phase, short_dtype_name(r.dtype),
                      str(health.numel), *cells))
    lines = _format_table(head, table, left=3).split("\n") if len(table) > 1 else [head]
    if lossless:
        lines.append(f"... {lossless} more lose nothing in any format at scale 1")
    return lines


def health_lines(watch: HealthWatch) -> List[str]:
    """The report table's section on module health, worst first."""
    rows = watch.rows()
    head = (f"torchcast.track: numeric health of {len(rows)} module outputs and gradients "
            "(worst first)")
    table = [("module", "phase", "dtype", "elements", "amax", "binades to max", "min nonzero",
              "nan/inf", "zero", "subnormal")]
    for r in rows:
        h = r.health.read()
        n = max(h.numel, 1)
        room = _binades_to_overflow(r.dtype, h.amax)
        table.append((r.module or "-", r.phase, short_dtype_name(r.dtype), str(h.numel),
                      f"{h.amax:.3g}", f"{room:.1f}" if math.isfinite(room) else "-",
                      f"{h.min_nonzero:.3g}" if math.isfinite(h.min_nonzero) else "-",
                      str(h.nan + h.posinf + h.neginf), _percent(h.zero / n),
                      _percent(h.subnormal / n)))
    return _format_table(head, table, left=3).split("\n")


__all__ = ["FORMATS", "HealthWatch", "HeadroomRow", "HeadroomTable", "ModuleHealth",
           "headroom_lines", "headroom_table", "health_lines"]
