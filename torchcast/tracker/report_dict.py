"""A Report's dict form (``Report.to_dict``, ``Report.from_dict``) and how it
goes to disk.

The dict form is what leaves a track: its JSON, the HTML page and the
TensorBoard figures are made from it, and a saved one reads back into a
Report. It is apart from report.py, which records the casts and reads them
back, because it is a format with rules of its own: which fields, in which
version; strict JSON, where a non-finite float is one of the strings
NONFINITE_STRINGS (``json_float``, ``float_from_json``); and files written
atomically (``write_text``).
"""
import dataclasses
import math
import os
import secrets
from typing import Any, Dict

from .health import FORMATS, HeadroomRow, HealthWatch
from .nonfinite import NonFiniteWatch
from .nonfinite_origin import NonFiniteOrigin
from .regions import CompiledRegion

FORMAT, VERSION = "torchcast.track.Report", 1

# Strict JSON has no inf or NaN, yet they are what a report exists for (a
# cast whose every element overflowed, an op's infinite input): a float field
# of to_dict() holds a number or one of these strings, which any JSON parser
# reads and float() turns back into the float.
NONFINITE_STRINGS = ("inf", "-inf", "nan")


def json_float(value: Any) -> Any:
    """``value`` with every non-finite float in it (inside dicts and lists
    too) as "inf", "-inf" or "nan"; anything else unchanged.

    Args:
        value: a JSON-ready value (dicts, lists, numbers, strings, None).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # Python never writes "-nan"
    if isinstance(value, dict):
        return {k: json_float(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_float(v) for v in value]
    return value


def float_from_json(value: Any, field: str) -> Any:
    """The float a to_dict() float field holds: a number (or None) as it
    is, "inf"/"-inf"/"nan" as the float.

    Args:
        value: the field's value.
        field: its name, for the error.

    Raises:
        ValueError: a string other than those three.
    """
    if isinstance(value, str):
        if value not in NONFINITE_STRINGS:
            raise ValueError(f"torchcast.Report.from_dict: {field} must be a number or one of "
                             f"{', '.join(map(repr, NONFINITE_STRINGS))}, got {value!r}")
        return float(value)
    return value


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
    if report.ended_by is not None:
        data["ended_by"] = report.ended_by
    if report.nonfinite_watch is not None:
        data["nonfinite"] = [o.to_dict() for o in report.nonfinite]
        data["propagated"] = report.propagated
    if report.compiled_regions:
        data["compiled_regions"] = [r.to_dict() for r in report.compiled_regions]
    if report.updates:
        data["updates"] = [dict(r) for r in report.updates]
    if report.health_watch is not None:
        # On the host once: each row is read for 8 headroom entries.
        rows = [dataclasses.replace(r, health=r.health.cpu()) for r in report.health]
        data["health"] = [r.to_dict() for r in rows]
        data["headroom"] = [
            HeadroomRow(r.module, r.phase, r.dtype, r.headroom(fmt, scale)).to_dict()
            for r in rows for fmt in FORMATS for scale in (None, "amax")]
        blocks = report.health_watch.block_rows()
        if blocks:
            data["block_headroom"] = [r.to_dict() for r in blocks]
    # The records' stats are encoded already; this covers rtol/atol, the
    # origins' input amax, the health extrema and any float added later.
    return json_float(data)


def report_from_dict(cls: type, data: Dict[str, Any]) -> Any:
    """A ``cls`` (Report) read back from its dict form: ``Report.from_dict``."""
    if data.get("format") != FORMAT:
        raise ValueError("torchcast.Report.from_dict: not a torchcast.track report "
                         f"(format={data.get('format')!r})")
    report = cls(float_from_json(data.get("rtol"), "rtol"),
                 float_from_json(data.get("atol"), "atol"), data.get("violations"))
    report.merge_records(data["records"])
    report.ended_by = data.get("ended_by")
    if "nonfinite" in data:
        watch = report.nonfinite_watch = NonFiniteWatch("record")
        watch.propagated = data.get("propagated", 0)
        for d in data["nonfinite"]:
            origin = origin_from_dict(d)
            watch.origins[origin.key] = origin
    report.compiled_regions = [CompiledRegion.from_dict(d)
                               for d in data.get("compiled_regions", ())]
    report.updates = [dict(d, **{k: float_from_json(d[k], f"an update row's {k}")
                                 for k in ("comp_mean_ulp", "comp_max_ulp")})
                      for d in data.get("updates", ())]
    if "health" in data:
        rows = [dict(d, **{k: float_from_json(d[k], f"a health row's {k}")
                           for k in ("amax", "min_nonzero")}) for d in data["health"]]
        report.health_watch = HealthWatch.from_dicts(rows, data.get("block_headroom", ()))
    return report


def origin_from_dict(d: Dict[str, Any]) -> NonFiniteOrigin:
    """A NonFiniteOrigin from its to_dict() form, an input's amax possibly
    one of the strings "inf", "-inf", "nan"."""
    d = dict(d, inputs=[dict(i, amax=float_from_json(i["amax"], "an input's amax"))
                        for i in d["inputs"]])
    return NonFiniteOrigin.from_dict(d)


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
