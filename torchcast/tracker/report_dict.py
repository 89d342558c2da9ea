"""A Report's dict form: what leaves a track. Its JSON, the text table, the
HTML page and the TensorBoard figures are made from it, a saved one reads
back into an equal Report, and reports merge as dicts (another rank's,
a worker process's): ``merge_dict``, section by section.

The sections (a key each, absent when the track did not record it):
"records" (the cast sites), "nonfinite" and "propagated" (the origins and
entries of NaN/inf), "health" and "headroom" (module health, and what it
predicts in each format: derived, not read back), "block_headroom", "updates",
"compiled_regions", "ended_by", "ranks" (the ranks a merged report holds),
"sent_nonfinite" (the collectives whose input from this rank held NaN/inf:
what a merge of ranks needs to name where an arrival came from).
Floats follow json_floats.py; files are written atomically (``write_text``).
"""
import dataclasses
import os
import secrets
from typing import Any, Dict, List, Optional

from .block_headroom import BlockHeadroomRow
from .health_rows import FORMATS, HeadroomRow, ModuleHealth
from .json_floats import float_from_json, json_float
from .origin import NonFiniteOrigin, origin_order
from .regions import CompiledRegion

FORMAT, VERSION = "torchcast.track.Report", 1


def ended_early(ended_by: str) -> str:
    """What a report says first when its block did not end normally
    (``Report.ended_by``, e.g. "KeyboardInterrupt")."""
    return (f"The block ended early ({ended_by}): this report holds what was recorded until "
            "then; the non-finite origins of the step it stopped in are undecided, unless "
            "they were seen to reach before it stopped.")


def report_to_dict(report: Any) -> Dict[str, Any]:
    """``report`` (a Report) in its dict form: ``Report.to_dict``."""
    records = []
    for r in report.records:
        record = r.to_dict()
        record["violations"] = r.violations(report.rtol, report.atol, report.kinds)
        records.append(record)
    data = {"format": FORMAT, "version": VERSION, "rtol": report.rtol,
            "atol": report.atol, "violations": str(report.kinds), "records": records}
    if report.nonfinite_tracked:
        data["nonfinite"] = [o.to_dict() for o in report.nonfinite]
        data["propagated"] = report.propagated
    if report.compiled_regions:
        data["compiled_regions"] = [r.to_dict() for r in report.compiled_regions]
    if report.updates:
        data["updates"] = [dict(r) for r in report.updates]
    if report.health_tracked:
        # On the host once: each row is read for 8 headroom entries.
        rows = [dataclasses.replace(r, health=r.health.cpu()) for r in report.health]
        data["health"] = [r.to_dict() for r in rows]
        data["headroom"] = [
            HeadroomRow(r.module, r.phase, r.dtype, r.headroom(fmt, scale)).to_dict()
            for r in rows for fmt in FORMATS for scale in (None, "amax")]
        if report.block_formats:
            data["block_formats"] = list(report.block_formats)
            data["block_headroom"] = [r.to_dict() for r in report.block_rows]
    if report.ended_by is not None:
        data["ended_by"] = report.ended_by
    if report.ranks is not None:
        data["ranks"] = list(report.ranks)
    if report.sent_nonfinite:
        data["sent_nonfinite"] = list(report.sent_nonfinite)
    # The records' stats are encoded already; this covers rtol/atol, the
    # origins' input amax, the health extrema and any float added later.
    return json_float(data)


def check_format(data: Dict[str, Any]) -> None:
    """ValueError unless ``data`` is a report's dict form."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"torchcast.Report.from_dict: not a torchcast.track report "
                         f"(format={got!r})")


def merge_dict(report: Any, data: Dict[str, Any], rank: Optional[int] = None) -> None:
    """Merges a report's dict form into ``report``, every section: the cast
    sites by site; origins by what they are, their counts added, kept in
    time order; the rows of health, block headroom, updates and compiled
    regions appended. ``rank``: the rank ``data`` came from, written into
    its origins and before its rows' modules ("[rank 1] fc").

    Args:
        report: the Report to merge into.
        data: ``Report.to_dict()`` of another report (or a part of it: a
            worker process's "records", "nonfinite" and "propagated").
        rank: None for a report of this process (a worker's).
    """
    label = (lambda name: f"[rank {rank}] {name}" if name else f"[rank {rank}]") \
        if rank is not None else (lambda name: name)
    for record in data.get("records", ()):
        report.casts.add_record(record)
    if "nonfinite" in data:
        origins = [NonFiniteOrigin.from_dict(d) for d in data["nonfinite"]]
        if rank is not None:
            for o in origins:
                o.rank = rank if o.rank is None else o.rank
        report.add_origins(origins, data.get("propagated", 0))
    if "health" in data:
        report.add_health([dataclasses.replace(ModuleHealth.from_dict(d),
                                               module=label(d["module"]))
                           for d in data["health"]])
    if "block_headroom" in data or "block_formats" in data:
        rows = [BlockHeadroomRow.from_dict(d) for d in data.get("block_headroom", ())]
        report.add_block_rows(data.get("block_formats") or [r.format for r in rows],
                              [dataclasses.replace(r, module=label(r.module)) for r in rows])
    report.updates += [dict(d, **{k: float_from_json(d[k], f"an update row's {k}")
                                  for k in ("comp_mean_ulp", "comp_max_ulp")},
                            name=label(d["name"] or "").rstrip() if rank is not None
                            else d["name"])
                       for d in data.get("updates", ())]
    report.compiled_regions += [CompiledRegion.from_dict(d)
                                for d in data.get("compiled_regions", ())]
    if data.get("ended_by") is not None:
        ended = data["ended_by"] if rank is None else f"rank {rank}: {data['ended_by']}"
        report.ended_by = ended if report.ended_by is None else f"{report.ended_by}; {ended}"


def merge_ranks_dicts(report: Any, payloads: List[Dict[str, Any]]) -> None:
    """Merges every rank's ``{"rank", "report": to_dict(), "sent":
    [collective ids]}`` into ``report`` (a new Report): each rank's
    sections labelled with it, the origins then ordered across ranks
    (``origin_order``), and each arrival told the ranks whose input to its
    collective held NaN/inf ("sent")."""
    payloads = sorted(payloads, key=lambda p: p["rank"])
    for p in payloads:
        merge_dict(report, p["report"], rank=p["rank"])
    sent = {p["rank"]: set(p.get("sent", ())) for p in payloads}
    origins = report.nonfinite
    for o in origins:
        if o.arrived_through is not None and o.from_ranks is None and o.collective:
            o.from_ranks = [r for r in sorted(sent) if o.collective in sent[r]]
    report.set_origins(sorted(origins, key=origin_order), report.propagated)
    report.ranks = [p["rank"] for p in payloads]


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: into a new file beside it,
    then renamed over it, so that a reader (or a crash) never sees an empty
    or partial report. The new file gets the mode ``open()`` would give.

    Args:
        path: the file to write (a symlink is written through).
        text: the contents (UTF-8).
    """
    path = os.path.realpath(path)
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
