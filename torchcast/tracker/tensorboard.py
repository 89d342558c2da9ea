"""``Report.to_tensorboard``: the report's figures as scalars and histograms
through any writer with ``add_scalar(tag, value, step)`` and
``add_histogram`` / ``add_histogram_raw`` (torch.utils.tensorboard's
SummaryWriter; nothing is imported here), from ``Report.to_dict()``'s values.

Tags (under ``prefix``): ``nonfinite/origins``, ``nonfinite/propagated``;
``cast/<site>/<stat>`` per cast site (fractions of its elements, max rel
err, SQNR; inf and NaN are written as such); ``health/<module>/<phase>/<stat>``
(amax, fractions of zero, subnormal and non-finite elements) and the histogram
``health/<module>/<phase>/log2_abs`` (elements by binade);
``headroom/<module>/<phase>/<dtype>/<format>/<scale>/<kind>``.
"""
import math
import re
from typing import Any, Dict

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
    for r in data.get("records", []):
        if not r["measured"]:
            continue
        s = r["stats"]
        n = max(s["numel"], 1)
        site = _tag(prefix, "cast", r["site"], r["origin"])
        for k in ("overflow", "underflow", "nan", "subnormal"):
            writer.add_scalar(f"{site}/{k}_fraction", s[k] / n, step)
        writer.add_scalar(f"{site}/max_rel_err", _float(s["max_rel_err"]), step)
        if s.get("sqnr_db") is not None:  # None in reports written before "inf" strings
            writer.add_scalar(f"{site}/sqnr_db", _float(s["sqnr_db"]), step)
    for h in data.get("health", []):
        base = _tag(prefix, "health", h["module"] or "-", h["phase"], h["dtype"])
        n = max(h["numel"], 1)
        writer.add_scalar(f"{base}/amax", _float(h["amax"]), step)
        writer.add_scalar(f"{base}/zero_fraction", h["zero"] / n, step)
        writer.add_scalar(f"{base}/subnormal_fraction", h["subnormal"] / n, step)
        writer.add_scalar(f"{base}/nonfinite_fraction",
                          (h["nan"] + h["posinf"] + h["neginf"]) / n, step)
        _histogram(writer, f"{base}/log2_abs", h["binades"], h["hist"], step)
    for r in data.get("headroom", []):
        scale = _float(r["scale"])
        base = _tag(prefix, "headroom", r["module"] or "-", r["phase"], r["src_dtype"], r["format"],
                    f"2^{int(math.log2(scale))}" if math.isfinite(scale) and scale > 0 else scale)
        for k in ("overflow", "underflow", "subnormal"):
            writer.add_scalar(f"{base}/{k}", _float(r[k]), step)
