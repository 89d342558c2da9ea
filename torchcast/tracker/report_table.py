"""``Report.table`` (and ``str(report)``): a report's dict form as plain
text, what ``python -m torchcast track`` prints.

How the block ended if not normally; the non-finite origins (those that
reached first, then in time order); one line per cast site, worst first,
with its losses, the kinds of violation and notes; the program's upcasts
that autocast undoes; the module health lines; optimizer updates; the
compiled regions a track could not watch inside. Like html.py and
tensorboard.py, it reads the dict form only.
"""
from typing import Any, Dict, List, Optional

from ..stats import short_dtype_name
from ..violations import Violations
from .health_rows import ModuleHealth, health_lines, severity
from .origin import NonFiniteOrigin, reach_rank
from .records import Record, undone_upcasts
from .regions import CompiledRegion
from .report_dict import ended_early
from .updates import update_lines

_LOSS_COLUMNS = ("inexact", "nan", "overflow", "saturated", "underflow", "subnormal")


def render_table(data: Dict[str, Any], limit: Optional[int] = None) -> str:
    """The text of ``data`` (``Report.to_dict()``), the worst ``limit``
    cast sites (None: all): ``Report.table``."""
    records = [Record.from_dict(d) for d in data.get("records", ())]
    found = {id(r): d["violations"] for r, d in zip(records, data.get("records", ()))}
    kinds = Violations(data.get("violations"))
    lines = [f"torchcast.track: {ended_early(data['ended_by'])}"] if data.get("ended_by") else []
    lines += _nonfinite_lines(data)
    shown = records if limit is None else records[:limit]
    bad = sum(1 for r in records if found[id(r)])
    calls = sum(r.calls for r in records)
    head = (f"torchcast.track: {len(records)} cast sites, {calls} casts, "
            f"{bad} with violations (worst first)")
    rest = _health_lines(data) + update_lines(data.get("updates", [])) + _region_lines(data)
    if not records:  # a track that only watches says nothing of casts
        only_watching = "nonfinite" in data or "health" in data
        return "\n".join(lines + ([] if only_watching else [head]) + rest)
    rows = [("site", "origin", "calls", "dtypes", "elements", *_LOSS_COLUMNS, "max rel err",
             "violations", "notes")]
    for r in shown:
        s = r.stats
        losses = ([str(getattr(s, c)) for c in _LOSS_COLUMNS] + [f"{s.worst_rel_err:.3g}"]
                  if r.measured else ["-"] * (len(_LOSS_COLUMNS) + 1))
        flagged = ", ".join(_phrase_kind(p) for p in found[id(r)])
        notes = [n for n in r.notes(kinds) if _phrase_kind(n).split()[0] not in _LOSS_COLUMNS]
        if r.double_rounded:
            notes.append(f"{r.double_rounded} double-rounded by torch")
        if r.origin.startswith("promotion"):
            notes.append(f"a float64 operand made the result float64: the "
                         f"{short_dtype_name(r.src_dtype)} operands were computed on in "
                         "float64")
        rows.append((r.site, r.origin, str(r.calls),
                     f"{short_dtype_name(r.src_dtype)}->{short_dtype_name(r.dtype)}",
                     str(s.numel), *losses, flagged, "; ".join(notes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append(head)
    for row in rows:
        cells = [c.ljust(w) if i in (0, 1, 3, len(row) - 2, len(row) - 1) else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    if len(shown) < len(records):
        lines.append(f"... {len(records) - len(shown)} more sites")
    for up, back in undone_upcasts(records):
        lines.append(f"{up.site}: {undone_upcast_message(up)}")
    return "\n".join(lines + rest)


def undone_upcast_message(up: Record) -> str:
    """What to say of a program's upcast that autocast undoes at its line."""
    src, dst = short_dtype_name(up.src_dtype), short_dtype_name(up.dtype)
    return (f"this upcast {src}->{dst} has no effect under autocast, which casts the op's "
            f"inputs back to {src} at the same line; wrap the region in "
            "torch.autocast(..., enabled=False) to compute it in " + dst)


def _phrase_kind(phrase):
    """The kind a violation phrase names ("12 overflow" -> "overflow",
    "max rel err > rtol=1e-3" -> "rtol=1e-3")."""
    if phrase.startswith("max "):
        return phrase.split("> ")[-1]
    return phrase.split(" ", 1)[1].replace("graph cuts", "graph cut")


def _nonfinite_lines(data: Dict[str, Any]) -> List[str]:
    """The opening lines on non-finite origins (none without a watch)."""
    if "nonfinite" not in data:
        return []
    origins = [NonFiniteOrigin.from_dict(d) for d in data["nonfinite"]]
    reached = sum(1 for o in origins if o.reached)
    absorbed = sum(1 for o in origins if o.reached is False)
    entries = sum(1 for o in origins if o.entered is not None)
    made = len(origins) - entries
    lines = [f"torchcast.track: {made} op{'' if made == 1 else 's'} made NaN/inf from finite "
             f"inputs, {entries} entr{'y' if entries == 1 else 'ies'} of NaN/inf no watched op "
             f"made ({reached} reached the outputs, loss or gradients, listed first; {absorbed} "
             f"absorbed; each in time order), {data.get('propagated', 0)} op calls passed "
             "NaN/inf on"]
    # A stable sort: time order within each rank.
    for o in sorted(origins, key=lambda o: reach_rank(o.reached, o.absorbed_steps)):
        calls = f" [{o.count} calls]" if o.count > 1 else ""
        lines.append(f"  {o.describe()}{calls}")
    return lines


def _health_lines(data: Dict[str, Any]) -> List[str]:
    if "health" not in data:
        return []
    return health_lines(sorted((ModuleHealth.from_dict(d) for d in data["health"]), key=severity))


def _region_lines(data: Dict[str, Any]) -> List[str]:
    regions = [CompiledRegion.from_dict(d) for d in data.get("compiled_regions", ())]
    if not regions:
        return []
    n = len(regions)
    return ([f"torchcast.track: {n} torch.compile'd region{'s' if n != 1 else ''} with "
             "what this track could not watch inside:"]
            + [f"  {r.describe()}" for r in regions])
