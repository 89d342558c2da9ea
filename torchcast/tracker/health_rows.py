"""Module health as data: ``ModuleHealth``, one module's merged outputs or
gradients of one dtype (``track(health=True)``, health.py, measures them),
and what they say: the health lines of the report table and the headroom
tables, what a cast to a narrower format would do.
"""
import dataclasses
import math
from typing import Any, Dict, List, Optional, Union

import torch

from ..headroom import FORMATS, Headroom, headroom
from ..health import TensorHealth
from ..stats import short_dtype_name
from .json_floats import float_from_json
from .text_table import RowTable, format_table, percent

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

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ModuleHealth":
        """A row from its ``to_dict()`` form (read back from JSON too)."""
        d = dict(d, **{k: float_from_json(d[k], f"a health row's {k}")
                       for k in ("amax", "min_nonzero")})
        return cls(d["module"], d["phase"], TensorHealth.from_dict(d))


def _binades_to_overflow(dtype: torch.dtype, amax: float) -> float:
    return math.log2(torch.finfo(dtype).max / amax) if amax > 0 else math.inf


def severity(row: ModuleHealth):
    """Sort key, worst first: non-finite values, then the fewest binades to
    overflow, then the largest share of zero and subnormal elements."""
    h = row.health.read()
    lost = (h.zero + h.subnormal) / max(h.numel, 1)
    return (-(h.nan + h.posinf + h.neginf), _binades_to_overflow(row.dtype, h.amax), -lost)


@dataclasses.dataclass
class HeadroomRow:
    module: Optional[str]
    phase: str
    src_dtype: torch.dtype
    result: Headroom

    @property
    def identity(self) -> bool:
        """Whether the entry is in the format already: a "cast" to it changes
        nothing at scale 1, and a scale within one format is no cast at all."""
        return self.result.dtype == self.src_dtype

    def to_dict(self) -> Dict[str, Any]:
        r = self.result
        return {"module": self.module, "phase": self.phase, "src_dtype": str(self.src_dtype),
                "format": str(r.dtype), "scale": r.scale, "numel": r.numel,
                "overflow": r.overflow_fraction, "underflow": r.underflow_fraction,
                "subnormal": r.subnormal_fraction}


class HeadroomTable(RowTable):
    """``Report.headroom``'s answer: per module and phase, what a cast to a
    format would do; ``str()`` prints it worst first (overflow, then
    underflow, then subnormal results). ``omitted`` counts the entries left
    out for being in ``dtype`` already (``HeadroomRow.identity``)."""

    def __init__(self, dtype: torch.dtype, scale: Union[None, float, str],
                 rows: List[HeadroomRow], omitted: int = 0):
        self.dtype, self.scale, self.omitted = dtype, scale, omitted
        self.rows = sorted(rows, key=lambda r: (-r.result.overflow_fraction,
                                                -r.result.underflow_fraction,
                                                -r.result.subnormal_fraction))

    def __str__(self) -> str:
        scale = "per-entry power-of-two amax scale" if self.scale == "amax" else \
            f"scale {1.0 if self.scale is None else self.scale:g}"
        head = f"torchcast headroom in {short_dtype_name(self.dtype)} ({scale}), worst first"
        table = [("module", "phase", "dtype", "elements", "scale", "overflow", "underflow",
                  "subnormal")]
        for r in self.rows:
            h = r.result
            table.append((r.module or "-", r.phase, short_dtype_name(r.src_dtype), str(h.numel),
                          f"2^{int(math.log2(h.scale))}", percent(h.overflow_fraction),
                          percent(h.underflow_fraction), percent(h.subnormal_fraction)))
        text = format_table(head, table, left=3)
        if self.omitted:
            text += (f"\n... {self.omitted} more already in {short_dtype_name(self.dtype)} "
                     "(no cast)")
        return text



def headroom_table(entries: List[ModuleHealth], dtype: torch.dtype,
                   scale: Union[None, float, str] = None) -> HeadroomTable:
    """``Report.headroom``: every entry cast to ``dtype``, but those in
    ``dtype`` already (counted as ``omitted``): of a model run in float16,
    the float16 table would otherwise be half "0" rows of no cast."""
    rows = [HeadroomRow(r.module, r.phase, r.dtype, r.headroom(dtype, scale))
            for r in entries if r.dtype != dtype]
    return HeadroomTable(dtype, scale, rows, omitted=len(entries) - len(rows))


def _lost(h: Headroom) -> str:
    return f"{percent(h.overflow_fraction)}/{percent(h.underflow_fraction)}"


def headroom_lines(rows: List[ModuleHealth]) -> List[str]:
    """``Report.headroom_summary``: one row per entry, one column per format
    of FORMATS (``headroom_table`` gives one format's full table,
    subnormals included)."""
    head = (f"torchcast headroom of {len(rows)} module outputs and gradients (worst first): the "
            "% of elements a cast to each format loses\nto overflow/underflow at scale 1, and "
            "where it loses any, at the entry's power-of-two amax scale (2^k: overflow/underflow;"
            "\n-: the entry is in that format already)")
    table = [("module", "phase", "dtype", "elements", *(short_dtype_name(f) for f in FORMATS))]
    lossless = 0
    for r in rows:
        health = r.health.cpu()  # one transfer for the 8 predictions
        cells = []
        for fmt in FORMATS:
            if fmt == r.dtype:
                cells.append("-")  # no cast: "0/0" would read as a cast that loses nothing
                continue
            plain = headroom(health, fmt)
            cell = _lost(plain)
            if plain.overflow or plain.underflow:
                scaled = headroom(health, fmt, "amax")
                if scaled.scale != 1:  # else the same figures again
                    cell += f", 2^{int(math.log2(scaled.scale))}: {_lost(scaled)}"
            cells.append(cell)
        if all(c in ("0/0", "-") for c in cells):
            lossless += 1  # a table of only "0/0" rows says less than their count
            continue
        table.append((r.module or "-", r.phase, short_dtype_name(r.dtype),
                      str(health.numel), *cells))
    lines = format_table(head, table, left=3).split("\n") if len(table) > 1 else [head]
    if lossless:
        lines.append(f"... {lossless} more lose nothing in any format at scale 1")
    return lines


def _lossy(row: Dict[str, Any]) -> bool:
    return any(float(row[k]) for k in ("overflow", "underflow", "subnormal"))


def headroom_view(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows of ``Report.to_dict()["headroom"]`` worth reading (the HTML
    page's headroom table and TensorBoard's headroom scalars), worst first.

    ``to_dict`` keeps every (entry, format, scale) as data; read as a table, most of
    them answer nothing. So, per entry (module, phase, source dtype) and format:

    - none where the format is the entry's dtype: no cast happens (a model run
      in float16 made a quarter of a GPT-2's rows float16 -> float16 at 2^0);
    - one row, holding the scale-1 figures and, beside them, the amax
      scale's: an amax scale of 1 repeats the scale-1 row (the duplicates);
    - the amax scale's figures only where scale 1 loses something: a scale
      is the remedy for a loss, and without one "bfloat16 at 2^120" only
      says that bfloat16 has float32's range.

    Args:
        rows: ``HeadroomRow.to_dict()`` rows (floats possibly "inf"/"nan").

    Returns:
        Dicts of "module", "phase", "src_dtype", "format", "numel", "plain"
        (the scale-1 row, None if the rows had none) and "scaled" (the amax
        row, or None), and "lossy" (whether scale 1 loses anything), the
        lossy first, by overflow, then underflow, then subnormal at scale 1.
        An entry whose rows repeat (the same module twice in ``rows``) is one.
    """
    view: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        if r["format"] == r["src_dtype"]:
            continue
        key = (r["module"], r["phase"], r["src_dtype"], r["format"])
        entry = view.setdefault(key, {"module": r["module"], "phase": r["phase"],
                                      "src_dtype": r["src_dtype"], "format": r["format"],
                                      "numel": r["numel"], "plain": None, "scaled": None})
        slot = "plain" if float(r["scale"]) == 1 else "scaled"
        if entry[slot] is None:
            entry[slot] = r
    out = []
    for entry in view.values():
        if entry["plain"] is None:  # rows of other scales only: shown as they are
            entry["plain"], entry["scaled"] = entry["scaled"], None
        entry["lossy"] = _lossy(entry["plain"])
        if not entry["lossy"]:
            entry["scaled"] = None
        out.append(entry)
    return sorted(out, key=lambda e: (not e["lossy"], -float(e["plain"]["overflow"]),
                                      -float(e["plain"]["underflow"]),
                                      -float(e["plain"]["subnormal"])))


def health_lines(rows: List[ModuleHealth]) -> List[str]:
    """The report table's section on module health, worst first."""
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
                      str(h.nan + h.posinf + h.neginf), percent(h.zero / n),
                      percent(h.subnormal / n)))
    return format_table(head, table, left=3).split("\n")


__all__ = ["FORMATS", "HeadroomRow", "HeadroomTable", "ModuleHealth", "headroom_lines",
           "headroom_table", "headroom_view", "health_lines", "severity"]
