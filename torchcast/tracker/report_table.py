"""``Report.table`` (and ``str(report)``): a report as plain text, what
``python -m torchcast track`` prints.

The non-finite origins first (those that reached, then in time order), then
one line per cast site, worst first, with its losses, the kinds of
violation and notes; the program's upcasts that autocast undoes; the module
health lines; the compiled regions a track could not watch inside. Apart
from report.py, which records the casts and reads them back: this only
reads a Report's public values, as html.py and tensorboard.py read its dict
form.
"""
from typing import TYPE_CHECKING, List, Optional

from ..stats import short_dtype_name
from .health import health_lines
from .nonfinite_origin import reach_rank
from .report_dict import ended_early
from .updates import update_lines

if TYPE_CHECKING:  # report.py imports this module
    from .report import Record, Report

_LOSS_COLUMNS = ("inexact", "nan", "overflow", "saturated", "underflow", "subnormal")


def render_table(report: "Report", limit: Optional[int] = None) -> str:
    """``report``'s records as a table, worst first: ``Report.table``."""
    records = report.records
    lines = [f"torchcast.track: {ended_early(report.ended_by)}"] if report.ended_by else []
    lines += _nonfinite_lines(report)
    shown = records if limit is None else records[:limit]
    bad = sum(1 for r in records if r.violations(report.rtol, report.atol, report.kinds))
    calls = sum(r.calls for r in records)
    head = (f"torchcast.track: {len(records)} cast sites, {calls} casts, "
            f"{bad} with violations (worst first)")
    if not records:  # a track that only watches says nothing of casts
        only_watching = report.nonfinite_watch is not None or report.health_watch is not None
        return "\n".join((lines if only_watching else [head]) + _health_lines(report)
                         + update_lines(report.updates) + _region_lines(report))
    rows = [("site", "origin", "calls", "dtypes", "elements", *_LOSS_COLUMNS, "max rel err",
             "violations", "notes")]
    for r in shown:
        s = r.stats
        losses = ([str(getattr(s, c)) for c in _LOSS_COLUMNS] + [f"{s.worst_rel_err:.3g}"]
                  if r.measured else ["-"] * (len(_LOSS_COLUMNS) + 1))
        found = r.violations(report.rtol, report.atol, report.kinds)
        flagged = ", ".join(_phrase_kind(p) for p in found)
        notes = [n for n in r.notes(report.kinds)
                 if _phrase_kind(n).split()[0] not in _LOSS_COLUMNS]
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
    for up, back in report.undone_upcasts():
        lines.append(f"{up.site}: {undone_upcast_message(up)}")
    return "\n".join(lines + _health_lines(report) + update_lines(report.updates)
                     + _region_lines(report))


def undone_upcast_message(up: "Record") -> str:
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


def _nonfinite_lines(report: "Report") -> List[str]:
    """The table's opening lines on non-finite origins (none without a watch)."""
    if report.nonfinite_watch is None:
        return []
    origins = report.nonfinite
    reached = sum(1 for o in origins if o.reached)
    absorbed = sum(1 for o in origins if o.reached is False)
    entries = sum(1 for o in origins if o.entered is not None)
    made = len(origins) - entries
    lines = [f"torchcast.track: {made} op{'' if made == 1 else 's'} made NaN/inf from finite "
             f"inputs, {entries} entr{'y' if entries == 1 else 'ies'} of NaN/inf no watched op "
             f"made ({reached} reached the outputs, loss or gradients, listed first; {absorbed} "
             f"absorbed; each in time order), {report.propagated} op calls passed NaN/inf on"]
    # A stable sort: time order within each rank.
    for o in sorted(origins, key=lambda o: reach_rank(o.reached, o.absorbed_steps)):
        calls = f" [{o.count} calls]" if o.count > 1 else ""
        lines.append(f"  {o.describe()}{calls}")
    return lines


def _health_lines(report: "Report") -> List[str]:
    return health_lines(report.health_watch) if report.health_watch is not None else []


def _region_lines(report: "Report") -> List[str]:
    regions = report.compiled_regions
    if not regions:
        return []
    n = len(regions)
    return ([f"torchcast.track: {n} torch.compile'd region{'s' if n != 1 else ''} with "
             "what this track could not watch inside:"]
            + [f"  {r.describe()}" for r in regions])
