"""What rounding did to the optimizer's updates, in a track's report: the
update accounting of torchcast.optim.Adam/AdamW (``track_updates=True``,
optim/_update_stats.py), read once as the track exits from every such
optimizer that stepped in the block (one transfer per device), and written
out with the rest of the report: ``Report.updates``, the text table, the
HTML page, TensorBoard, JSON."""
import dataclasses
import threading
import weakref
from typing import Any, Dict, List, Optional

from .events import OPTIMIZER_STEP, subscribe, unsubscribe

# A fraction of lost updates above which the report says what to do.
LOST_NOTABLE = 0.01

ADVICE = ("raise the learning rate, keep that parameter in float32, or turn compensation on "
          "(torchcast.optim.AdamW(..., compensation=\"kahan\"))")


class UpdateWatch:
    """The torchcast optimizers counting their updates that step while the
    track is active (any thread: an optimizer step is the training loop's)."""

    def __init__(self):
        self._seen: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._order: List[int] = []
        self._lock = threading.Lock()
        self.report = None

    def start(self, report: Any) -> None:
        """Starts noting the optimizers that step; ``stop`` writes their rows
        into ``report.updates``."""
        self.report = report
        subscribe(OPTIMIZER_STEP, self._stepped, any_thread=True)

    def _stepped(self, optimizer, before: bool) -> None:
        if before or not hasattr(optimizer, "update_stats") or not any(
                g.get("track_updates") for g in optimizer.param_groups):
            return
        with self._lock:
            if id(optimizer) not in self._seen:
                self._seen[id(optimizer)] = optimizer
                self._order.append(id(optimizer))

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Stops noting, and writes into the report the rows of every
        optimizer seen: its group totals then its parameters, each with
        ``optimizer``, the optimizer's number in the order they first
        stepped, counted since its counters began (or were last reset)."""
        unsubscribe(OPTIMIZER_STEP, self._stepped, any_thread=True)
        self.report.updates = self.rows()

    def rows(self) -> List[Dict[str, Any]]:
        """The rows of every optimizer seen (see ``stop``)."""
        rows = []
        for k, key in enumerate(self._order):
            optimizer = self._seen.get(key)
            if optimizer is None:
                continue
            stats = optimizer.update_stats()
            for r in stats.groups + stats.params:
                rows.append(dict(dataclasses.asdict(r), optimizer=k,
                                 lost_fraction=r.lost_fraction,
                                 shrunk_fraction=r.shrunk_fraction))
        return rows


def row_label(row: Dict[str, Any]) -> str:
    """"optimizer 0 group 1" for a group total, "optimizer 0 group 1 fc.weight"
    (or "param 2") for a parameter."""
    label = f"optimizer {row['optimizer']} group {row['group']}"
    if row["index"] is None:
        return label
    return f"{label} {row['name'] or 'param ' + str(row['index'])}"


def notable(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The parameters whose lost fraction is above LOST_NOTABLE, worst first."""
    return sorted((r for r in rows if r["index"] is not None
                   and r["lost_fraction"] > LOST_NOTABLE),
                  key=lambda r: r["lost_fraction"], reverse=True)


def update_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """The text table's section: each group total, then the notable params."""
    if not rows:
        return []
    lines = ["torchcast.track: optimizer updates (track_updates=True; lost: the stored "
             "parameter did not change; <half: it changed by less than half the update)"]
    for r in [r for r in rows if r["index"] is None] + notable(rows):
        lines.append(f"  {row_label(r)}: {r['updated']} of {r['elements']} element-steps "
                     f"updated, {r['lost_fraction']:.2%} lost, {r['shrunk_fraction']:.2%} "
                     f"<half, compensation mean {r['comp_mean_ulp']:.3g} ulp, "
                     f"max {r['comp_max_ulp']:.3g} ulp")
    if notable(rows):
        lines.append(f"  over {LOST_NOTABLE:.0%} lost: {ADVICE}")
    return lines
