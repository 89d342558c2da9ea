"""``Report.to_tensorboard``: the report's figures as scalars and histograms
through any writer with ``add_scalar(tag, value, step)`` and
``add_histogram`` / ``add_histogram_raw`` (torch.utils.tensorboard's
SummaryWriter; nothing is imported here), from ``Report.to_dict()``'s values.

Tags (under ``prefix``): ``nonfinite/origins``, ``nonfinite/propagated``;
``cast/<site>/<origin>/<src>-<dtype>/<stat>`` per cast site and dtype pair
(fractions of its elements, max rel err, SQNR; inf and NaN are written as
such); ``health/<module>/<phase>/<dtype>/<stat>`` (amax, fractions of zero,
subnormal and non-finite elements) and the histogram
``health/<module>/<phase>/<dtype>/log2_abs`` (elements by binade);
``headroom/<module>/<phase>/<dtype>/<format>/scale_1/<kind>`` and, where
scale 1 loses something, ``.../amax_scale/<kind>`` and
``.../amax_scale/log2_scale`` (the rows of ``health.headroom_view``: no
cast to the entry's own dtype, and one series per scale kind, not per scale,
so that a chart follows the amax scale as it moves).

No tag is written twice in one call: TensorBoard keeps one of two values at
a step, silently. Tags are unique per record (every field of its key: a
site's casts of two dtype pairs are two records) and per row; those that
would still meet (unsafe characters replaced, a file shortened, None and
"-") each get a suffix, a hash of what tells them apart, never hanging on
the order of the records (which changes as the worst does); a row given
twice gets ``_2``.
"""
import collections
import hashlib
import math
import re
from typing import Any, Dict, List, Tuple

from .health_rows import headroom_view

_UNSAFE = re.compile(r"[^A-Za-z0-9_./-]+")
# add_histogram (without the raw form) takes values: a binade of n elements
# becomes min(n, this) copies of its midpoint, counts scaled alike.
MAX_HISTOGRAM_VALUES = 100_000


def _float(x: Any) -> float:
    """A float field of to_dict(): a number, or "inf"/"-inf"/"nan" (strict
    JSON has no inf/NaN), which float() reads. Non-finite values are data:
    they are written (TensorBoard marks them on the chart), not skipped."""
    return float(x)


def _tag(*parts: Any) -> str:
    return "/".join(_UNSAFE.sub("_", str(p)).strip("_") or "_" for p in parts)


def _short(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _unique(pairs: List[Tuple[str, Any]]) -> List[str]:
    """A tag for each (base tag, identity): the base, unless several
    identities share it; then each gets the base and a hash of its identity,
    whatever their order (records come worst first, and the worst changes
    from step to step: no tag may pass from one record to another). An
    identity given again (a row twice) gets ``_2``, ``_3``."""
    identities = collections.defaultdict(set)
    for base, identity in pairs:
        identities[base].add(repr(identity))
    seen = collections.Counter()
    tags = []
    for base, identity in pairs:
        tag = base
        if len(identities[base]) > 1:
            tag = f"{base}_{hashlib.sha1(repr(identity).encode()).hexdigest()[:8]}"
        seen[tag] += 1
        tags.append(tag if seen[tag] == 1 else f"{tag}_{seen[tag]}")
    return tags


def _histogram(writer, tag: str, binades, counts, step: int) -> None:
    """The elements' log2|x| by binade: exact bucket counts through
    add_histogram_raw, else values standing for them."""
    pairs = [(e, n) for e, n in zip(binades, counts) if n]
    if not pairs:
        return
    total = sum(n for _, n in pairs)
    if hasattr(writer, "add_histogram_raw"):
        mids = [(e + 0.5, n) for e, n in pairs]
        writer.add_histogram_raw(
            tag, min=float(pairs[0][0]), max=float(pairs[-1][0] + 1), num=total,
            sum=sum(m * n for m, n in mids), sum_squares=sum(m * m * n for m, n in mids),
            bucket_limits=[float(e + 1) for e, _ in pairs], bucket_counts=[n for _, n in pairs],
            global_step=step)
        return
    import numpy as np
    keep = min(1.0, MAX_HISTOGRAM_VALUES / total)
    values = np.repeat([e + 0.5 for e, _ in pairs],
                       [max(1, round(n * keep)) for _, n in pairs])
    writer.add_histogram(tag, values, step)


def write_tensorboard(data: Dict[str, Any], writer: Any, step: int,
                      prefix: str = "torchcast") -> None:
    """Writes the report's figures at ``step``.

    Args:
        data: ``Report.to_dict()``.
        writer: e.g. ``torch.utils.tensorboard.SummaryWriter``.
        step: the global step.
        prefix: the first component of every tag.
    """
    if "nonfinite" in data:
        writer.add_scalar(_tag(prefix, "nonfinite", "origins"), len(data["nonfinite"]), step)
        writer.add_scalar(_tag(prefix, "nonfinite", "propagated"), data.get("propagated", 0), step)
    records = [r for r in data.get("records", []) if r["measured"]]
    # The site's text holds module, file:line, safe_to name and via; the dtype
    # pair is what sets apart the records of one line.
    sites = _unique([(_tag(prefix, "cast", r["site"], r["origin"],
                           f"{_short(r['src_dtype'])}-{_short(r['dtype'])}"),
                      (r["site"], r.get("module"), r.get("file"), r.get("line"), r["origin"],
                       r.get("name"), r["src_dtype"], r["dtype"], r.get("via")))
                     for r in records])
    for r, site in zip(records, sites):
        s = r["stats"]
        n = max(s["numel"], 1)
        for k in ("overflow", "underflow", "nan", "subnormal"):
            writer.add_scalar(f"{site}/{k}_fraction", s[k] / n, step)
        writer.add_scalar(f"{site}/max_rel_err", _float(s["max_rel_err"]), step)
        if s.get("sqnr_db") is not None:  # None in reports written before "inf" strings
            writer.add_scalar(f"{site}/sqnr_db", _float(s["sqnr_db"]), step)
    health = data.get("health", [])
    bases = _unique([(_tag(prefix, "health", h["module"] or "-", h["phase"], h["dtype"]),
                      (h["module"], h["phase"], h["dtype"])) for h in health])
    for h, base in zip(health, bases):
        n = max(h["numel"], 1)
        writer.add_scalar(f"{base}/amax", _float(h["amax"]), step)
        writer.add_scalar(f"{base}/zero_fraction", h["zero"] / n, step)
        writer.add_scalar(f"{base}/subnormal_fraction", h["subnormal"] / n, step)
        writer.add_scalar(f"{base}/nonfinite_fraction",
                          (h["nan"] + h["posinf"] + h["neginf"]) / n, step)
        _histogram(writer, f"{base}/log2_abs", h["binades"], h["hist"], step)
    view = headroom_view(data.get("headroom", []))
    bases = _unique([(_tag(prefix, "headroom", v["module"] or "-", v["phase"], v["src_dtype"],
                           v["format"]), (v["module"], v["phase"], v["src_dtype"], v["format"]))
                     for v in view])
    for v, base in zip(view, bases):
        plain = v["plain"]
        kind = "scale_1" if _float(plain["scale"]) == 1 else f"scale_{_log2(plain['scale']):g}"
        for k in ("overflow", "underflow", "subnormal"):
            writer.add_scalar(f"{base}/{kind}/{k}", _float(plain[k]), step)
        if v["scaled"] is not None:
            scaled = v["scaled"]
            writer.add_scalar(f"{base}/amax_scale/log2_scale", _log2(scaled["scale"]), step)
            for k in ("overflow", "underflow", "subnormal"):
                writer.add_scalar(f"{base}/amax_scale/{k}", _float(scaled[k]), step)
    blocks = data.get("block_headroom", [])
    bases = _unique([(_tag(prefix, "block_headroom", b["module"] or "-", b["phase"],
                           b["src_dtype"], b["format"]),
                      (b["module"], b["phase"], b["src_dtype"], b["format"])) for b in blocks])
    for b, base in zip(blocks, bases):
        s = b["stats"]
        n = max(_float(s["numel"]), 1)
        for k in ("underflow", "subnormal", "saturated"):
            writer.add_scalar(f"{base}/{k}_fraction", _float(s[k]) / n, step)
        writer.add_scalar(f"{base}/sqnr_db", _float(s["sqnr_db"]), step)
    updates = data.get("updates", [])
    bases = _unique([(_tag(prefix, "updates", f"optimizer{u['optimizer']}", f"group{u['group']}",
                           *(() if u["index"] is None else (u["name"] or f"param{u['index']}",))),
                      (u["optimizer"], u["group"], u["index"])) for u in updates])
    for u, base in zip(updates, bases):
        for k in ("lost_fraction", "shrunk_fraction", "comp_mean_ulp", "comp_max_ulp"):
            writer.add_scalar(f"{base}/{k}", _float(u[k]), step)


def _log2(scale: Any) -> float:
    """log2 of a power-of-two scale (a non-finite or zero one as it is)."""
    scale = _float(scale)
    return float(math.log2(scale)) if math.isfinite(scale) and scale > 0 else scale
