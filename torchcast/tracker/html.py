"""``Report.to_html``: the report as one self-contained HTML page (inline CSS
and SVG, no script, nothing fetched), rendered from ``Report.to_dict()``'s
values, so a saved JSON report renders the same.

Sections: a summary; the ops that first made NaN/inf; the cast sites; per
module and phase, the histogram of |x| by binade drawn over the windows that
float16, bfloat16, float8_e4m3fn and float8_e5m2 represent (subnormal range
lighter), where the mass falling off a window is what a cast to it loses
(worst first, the rest folded to one-line headers); and the headroom table
(the casts that would lose nothing folded below it).
"""
import html
import math
from typing import Any, Dict, List, Optional

import torch

from .._reference.health import format_exponents
from .sites import short_path

WINDOW_FORMATS = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; max-width: 1200px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.summary { color: #4a5468; margin-bottom: 12px; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e3e6ee; text-align: right; }
th { background: #f3f5f9; } td.l, th.l { text-align: left; }
tr.violation td { background: #fff1f0; } .bad { color: #b3261e; font-weight: 600; }
.origin { border-left: 4px solid #b3261e; background: #fff7f6; padding: 8px 12px; margin: 8px 0; }
.note { color: #4a5468; } code { font: 12px ui-monospace, monospace; }
.module { margin: 10px 0 4px; } .module b { font-family: ui-monospace, monospace; }
summary { cursor: pointer; }
svg text { font: 10px system-ui, sans-serif; fill: #4a5468; }
.bar { fill: #3f6fd8; } .bar.nonfinite { fill: #b3261e; }
.window.normal { fill: #2f9e6b; opacity: 0.55; } .window.subnormal { fill: #2f9e6b; opacity: 0.2; }
.amax { stroke: #b3261e; stroke-dasharray: 3 2; }
"""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _short(dtype: Optional[str]) -> str:
    return (dtype or "-").replace("torch.", "")


def _float(x: Any) -> float:
    """A float field of to_dict(): a number, or "inf"/"-inf"/"nan" (strict
    JSON has no inf/NaN), which float() reads."""
    return float(x)


def _number(x: Any) -> str:
    """A number as the page shows it: inf as "inf", None as "-"."""
    if x is None:
        return "-"
    if isinstance(x, str):
        x = _float(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    return f"{x:.3g}"


def _table(header: List[str], rows: List[List[str]], left: int = 1,
           row_classes: Optional[List[str]] = None) -> str:
    """rows of already escaped cells; the first ``left`` columns left-aligned."""
    head = "".join(f'<th class="l">{h}</th>' if i < left else f"<th>{h}</th>"
                   for i, h in enumerate(header))
    body = []
    for k, row in enumerate(rows):
        cls = f' class="{row_classes[k]}"' if row_classes and row_classes[k] else ""
        cells = "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>"
                        for i, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _origins(data: Dict[str, Any]) -> str:
    origins = data.get("nonfinite")
    if origins is None:
        return ""
    parts = [f"<h2>Where NaN/inf first appeared ({_count(len(origins), 'op')}; "
             f"{_e(_count(data.get('propagated', 0), 'op call'))} only passed them on)</h2>"]
    for o in origins:
        counts = ", ".join(f"{o[k]} {label}" for k, label in
                           (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf")) if o[k])
        where = f"{short_path(o['file'])}:{o['line']}" + (f" via {o['via']}" if o.get("via") else "")
        phase = o["phase"] + (f" ({o['node']})" if o.get("node") else "")
        inputs = "; ".join(f"{_short(i['dtype'])}{i['shape']} amax {_number(i['amax'])}"
                           for i in o["inputs"]) or "no floating inputs"
        calls = f" &middot; {o['count']} calls" if o.get("count", 1) > 1 else ""
        parts.append(
            f'<div class="origin"><b><code>{_e(o["op"])}</code></b> made {_e(counts)} in '
            f'{_e(_short(o["dtype"]))} &middot; module <code>{_e(o.get("module") or "-")}</code> '
            f'&middot; {_e(phase)} &middot; <code>{_e(where)}</code>{calls}<br>'
            f'inputs: {_e(inputs)}<br><span class="note">{_e(o.get("note", ""))}</span></div>')
    return "".join(parts)


def _casts(data: Dict[str, Any]) -> str:
    records = data.get("records", [])
    if not records:
        return ""
    rows, classes = [], []
    for r in records:
        s = r["stats"]
        measured = r["measured"]
        cells = [_e(r["site"]), _e(r["origin"]), _e(f"{_short(r['src_dtype'])}->{_short(r['dtype'])}"),
                 _e(r["calls"]), _e(s["numel"])]
        for k in ("inexact", "nan", "overflow", "underflow", "subnormal"):
            cells.append(_e(s[k]) if measured else "-")
        cells.append(_e(_number(s["max_rel_err"])) if measured else "-")
        cells.append(_e(_number(s.get("sqnr_db"))) if measured else "-")
        violations = r.get("violations", [])
        cells.append(f'<span class="bad">{_e(", ".join(violations))}</span>' if violations else "")
        rows.append(cells)
        classes.append("violation" if violations else "")
    return ("<h2>Casts</h2>" + _table(
        ["site", "origin", "dtypes", "calls", "elements", "inexact", "nan", "overflow",
         "underflow", "subnormal", "max rel err", "SQNR dB", "violations"], rows, left=3,
        row_classes=classes))


def _windows() -> List[tuple]:
    """(name, e_sub, e_min, e_max) of each drawn format."""
    out = []
    for dtype in WINDOW_FORMATS:
        fraction_bits, e_min, e_max = format_exponents(dtype)
        out.append((_short(str(dtype)), e_min - fraction_bits, e_min, e_max))
    return out


def _histogram_svg(entry: Dict[str, Any], lo: int, hi: int) -> str:
    """Bars of the entry's binade counts on the exponent axis [lo, hi], over
    the formats' windows; counts outside the axis go to its end bars."""
    width, left, bar_h, band_h = 960, 110, 110, 14
    windows = _windows()
    span = hi - lo + 1
    step = (width - left - 10) / span
    x_of = lambda e: left + (e - lo) * step  # noqa: E731
    counts: Dict[int, int] = {}
    for e, n in zip(entry["binades"], entry["hist"]):
        counts[min(max(e, lo), hi)] = counts.get(min(max(e, lo), hi), 0) + n
    nonfinite = entry["nan"] + entry["posinf"] + entry["neginf"]
    peak = max([*counts.values(), nonfinite, 1])
    scale = lambda n: bar_h * math.log1p(n) / math.log1p(peak)  # noqa: E731
    height = bar_h + 22 + band_h * len(windows) + 18
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="exponent histogram">']
    for e, n in sorted(counts.items()):
        h = scale(n)
        parts.append(f'<rect class="bar" x="{x_of(e):.1f}" y="{bar_h - h:.1f}" '
                     f'width="{max(step - 0.5, 0.8):.1f}" height="{h:.1f}">'
                     f"<title>2^{e} &lt;= |x| &lt; 2^{e + 1}: {n}</title></rect>")
    if nonfinite:
        h = scale(nonfinite)
        parts.append(f'<rect class="bar nonfinite" x="{width - 8}" y="{bar_h - h:.1f}" width="6" '
                     f'height="{h:.1f}"><title>NaN/inf: {nonfinite}</title></rect>')
    amax = _float(entry.get("amax") or 0.0)
    if amax > 0 and math.isfinite(amax):
        xa = x_of(min(max(math.frexp(amax)[1] - 1, lo), hi)) + step
        parts.append(f'<line class="amax" x1="{xa:.1f}" y1="0" x2="{xa:.1f}" y2="{bar_h}">'
                     f"<title>amax {amax:.4g}</title></line>")
    parts.append(f'<text x="{left - 6}" y="{bar_h}" text-anchor="end">count (log)</text>')
    y = bar_h + 8
    for name, e_sub, e_min, e_max in windows:
        a, b, c = (max(e_sub, lo), max(e_min, lo), min(e_max, hi))
        if b > a:
            parts.append(f'<rect class="window subnormal {name}" x="{x_of(a):.1f}" y="{y}" '
                         f'width="{(b - a) * step:.1f}" height="{band_h - 3}">'
                         f"<title>{name} subnormal: 2^{e_sub} .. 2^{e_min}</title></rect>")
        parts.append(f'<rect class="window normal {name}" x="{x_of(b):.1f}" y="{y}" '
                     f'width="{(c - b + 1) * step:.1f}" height="{band_h - 3}">'
                     f"<title>{name} normal: 2^{e_min} .. 2^{e_max + 1}</title></rect>")
        parts.append(f'<text x="{left - 6}" y="{y + 9}" text-anchor="end">{name}</text>')
        y += band_h
    tick = 10 if hi - lo <= 120 else 20
    for e in range(lo - lo % tick + tick if lo % tick else lo, hi + 1, tick):
        parts.append(f'<text x="{x_of(e):.1f}" y="{y + 10}" text-anchor="middle">2^{e}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _axis(entries: List[Dict[str, Any]]) -> tuple:
    """One exponent axis for every histogram: the data's binades and the
    float16 and float8 windows (bfloat16's, as wide as float32's, is cut to
    the axis), two binades of margin, at most float32's range (a float64
    tensor's far binades go to the end bars)."""
    narrow = [w for w in _windows() if w[0] != "bfloat16"]
    lo, hi = min(w[1] for w in narrow), max(w[3] for w in narrow)
    for entry in entries:
        if entry["binades"]:
            lo, hi = min(lo, entry["binades"][0]), max(hi, entry["binades"][-1])
    return max(lo - 2, -149), min(hi + 2, 127)


# Histograms drawn open at first (worst first); the others fold to their
# one-line headers, so that a model's hundred entries stay one screen of them.
OPEN_ENTRIES = 8


def _health(data: Dict[str, Any]) -> str:
    entries = data.get("health")
    if not entries:
        return ""
    lo, hi = _axis(entries)
    parts = ["<h2>Module health: |x| by binade, over each format's window</h2>",
             '<p class="note">Bars: elements per binade (log scale); red: NaN/inf; dashed: '
             "amax. Bands: the range each format represents, subnormal lighter. A cast to a "
             "format flushes what lies left of its band and overflows what lies right of it "
             "(at scale 1: see the headroom table for scaled casts). Worst first: the first "
             f"{OPEN_ENTRIES} entries and any with NaN/inf are open; click a header to open "
             "another.</p>"]
    for i, entry in enumerate(entries):
        nonfinite = entry["nan"] + entry["posinf"] + entry["neginf"]
        low = entry.get("min_nonzero")
        opened = " open" if i < OPEN_ENTRIES or nonfinite else ""
        parts.append(
            f'<details class="module"{opened}><summary><b>{_e(entry.get("module") or "-")}</b>'
            f' &middot; {_e(entry["phase"])} &middot; {_e(_short(entry["dtype"]))} &middot; '
            f'{_e(entry["numel"])} elements &middot; amax {_e(_number(entry["amax"]))} &middot; '
            f'min nonzero {_e(_number(low))} &middot; zeros {_e(entry["zero"])} &middot; '
            f'subnormal {_e(entry["subnormal"])}'
            + (f' &middot; <span class="bad">{nonfinite} NaN/inf</span>' if nonfinite else "")
            + "</summary>" + _histogram_svg(entry, lo, hi) + "</details>")
    return "".join(parts)


def _scale(scale: Any) -> str:
    """A power-of-two scale as 2^k (a non-finite one as it is)."""
    scale = _float(scale)
    return f"2^{int(math.log2(scale))}" if math.isfinite(scale) and scale > 0 else str(scale)


def _headroom(data: Dict[str, Any]) -> str:
    rows = data.get("headroom")
    if not rows:
        return ""
    pct = lambda x: "0" if x == 0 else f"{100 * _float(x):.3g}%"  # noqa: E731
    ordered = sorted(rows, key=lambda r: (-_float(r["overflow"]), -_float(r["underflow"]),
                                          -_float(r["subnormal"])))
    header = ["module", "phase", "format", "scale", "overflow", "underflow to 0", "subnormal"]

    def body(rows):
        return [[_e(r.get("module") or "-"), _e(r["phase"]), _e(_short(r["format"])),
                 _e(_scale(r["scale"])), _e(pct(r["overflow"])),
                 _e(pct(r["underflow"])), _e(pct(r["subnormal"]))] for r in rows]

    lossy = [r for r in ordered if _float(r["overflow"]) or _float(r["underflow"])
             or _float(r["subnormal"])]
    lossless = ordered[len(lossy):]
    page = ("<h2>Headroom: what a cast would do (exact, from the histograms)</h2>"
            '<p class="note">Scale 2^0: the values as they are; the other scale is the one '
            "per-tensor amax scaling rounded to a power of two uses: the largest power of two "
            "that maps the entry's amax to at most the format's largest value.</p>")
    if lossy:
        page += _table(header, body(lossy), left=3)
    if lossless:
        page += (f'<details class="lossless"><summary>{_count(len(lossless), "cast")} '
                 "that would lose nothing to overflow, underflow or subnormals</summary>"
                 + _table(header, body(lossless), left=3) + "</details>")
    return page


def _regions(data: Dict[str, Any]) -> str:
    regions = data.get("compiled_regions")
    if not regions:
        return ""
    rows = "".join(
        f"<li><code>{_e(r['compile_id'])}</code> "
        f"<code>{_e(r.get('function') or '?')}</code> "
        f"({_e(short_path(r['file']) if r.get('file') else '?')}:{_e(r.get('line'))})"
        f"{_e(', compiled and run in this track' if r.get('compiled_in_track') else ', compiled before this track (if it ran in it)')}: not watched: "
        f"{_e('; '.join(r['unwatched']))}</li>" for r in regions)
    return (f"<h2>Not watched: {_count(len(regions), 'torch.compile region')}</h2>"
            f"<ul>{rows}</ul>")


def render_html(data: Dict[str, Any]) -> str:
    """The page for a report.

    Args:
        data: ``Report.to_dict()`` (or the same read from its JSON).

    Returns:
        The HTML text (UTF-8).
    """
    records = data.get("records", [])
    bad = sum(1 for r in records if r.get("violations"))
    origins = data.get("nonfinite")
    summary = [f"{len(records)} cast sites, {bad} with violations"]
    if origins is not None:
        summary.append(f"{_count(len(origins), 'op')} made NaN/inf from finite inputs")
    if data.get("health"):
        summary.append(f"{len(data['health'])} module outputs and gradients measured")
    if data.get("compiled_regions"):
        summary.append(f"{len(data['compiled_regions'])} compiled regions not fully watched "
                       "(listed at the end)")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>torchcast report</title>"
            f"<style>{_CSS}</style></head><body><h1>torchcast report</h1>"
            f'<div class="summary">{_e(" · ".join(summary))} · violations: '
            f"{_e(data.get('violations', ''))}</div>"
            + _origins(data) + _casts(data) + _health(data) + _headroom(data) + _regions(data)
            + "</body></html>")
