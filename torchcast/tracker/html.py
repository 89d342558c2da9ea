"""``Report.to_html``: the report as one self-contained HTML page (inline CSS
and SVG, no script, nothing fetched), rendered from ``Report.to_dict()``'s
values, so a saved JSON report renders the same.

It leads with what to fix: the op and module where NaN/inf started first, the
cast sites with violations, the modules closest to overflow. Then the ops that
first made NaN/inf; the cast sites (the worst CAST_ROWS, the rest folded);
per module and phase, the histogram of |x| by binade drawn over the windows
that float16, bfloat16, float8_e4m3fn and float8_e5m2 represent (subnormal
range lighter), where the mass falling off a window is what a cast to it
loses (the module where NaN/inf started first, then worst first, the rest
folded to one-line headers; one tensor measured for two modules is shown
once, naming both); and the headroom table (``health.headroom_view``: no
cast to the entry's own dtype, the amax scale only where scale 1 loses
something, the casts that would lose nothing folded below it). Long site and
module names are cut, whole in their title, so that a 1400-px window holds
every table.
"""
import html
import json
import math
import os
from typing import Any, Dict, List, Optional

import torch

from .._reference.health import format_exponents
from ..stats import dtype_from_name
from .health import headroom_view
from .nonfinite_origin import reach_rank
from .sites import short_path

WINDOW_FORMATS = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# Rows shown before a table folds the rest below it (counted): a GPT-2's
# hundreds of casts and headroom rows must not bury what leads.
CAST_ROWS = 25
HEADROOM_ROWS = 25
# A site longer than this is cut on the page (whole in its title).
SITE_CHARS = 48
# What to fix: at most this many sites and modules per item; a module is
# "close to overflow" within 2^CLOSE_BINADES of its dtype's largest value.
FIX_ROWS = 5
CLOSE_BINADES = 8
_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; max-width: 1200px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.summary { color: #4a5468; margin-bottom: 12px; }
.fix { border: 1px solid #e3e6ee; border-left: 4px solid #b3261e; padding: 2px 14px; }
.fix h2 { margin-top: 10px; } .fix ul { padding-left: 20px; } .fix li { margin: 3px 0; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e3e6ee; text-align: right; }
th { background: #f3f5f9; } td.l, th.l { text-align: left; }
td { white-space: nowrap; } .bad { white-space: normal; }
td.w, .fix li, .origin, .module summary { overflow-wrap: anywhere; }
td.w { white-space: normal; min-width: 14em; }
.cut { text-decoration: underline dotted #9aa3b5; }
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
    """rows of already escaped cells; the first ``left`` columns left-aligned.
    The first column (a site or module) wraps anywhere, the others only
    within a violations list: the table fits its window by its names alone."""
    def cls(i):
        return ' class="l w"' if i == 0 < left else ' class="l"' if i < left else ""

    head = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(header))
    body = []
    for k, row in enumerate(rows):
        tr = f' class="{row_classes[k]}"' if row_classes and row_classes[k] else ""
        cells = "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr{tr}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _origins(data: Dict[str, Any]) -> str:
    origins = data.get("nonfinite")
    if origins is None:
        return ""
    reached = sum(1 for o in origins if o.get("reached"))
    absorbed = sum(1 for o in origins if o.get("reached") is False)
    parts = [f"<h2>Where NaN/inf first appeared ({_count(len(origins), 'op')}; "
             f"{_e(_count(data.get('propagated', 0), 'op call'))} only passed them on)</h2>"]
    if reached or absorbed:
        parts.append(f"<p>{reached} reached the outputs, the loss or the gradients (listed "
                     f"first: the likely cause); {absorbed} absorbed, each in time order.</p>")
    # Those that reached first, then the undecided, then the absorbed
    # (reach_rank); the sort is stable, so each group stays in time order.
    ranked = sorted(origins,
                    key=lambda o: reach_rank(o.get("reached"), o.get("absorbed_steps", 0)))
    for o in ranked:
        counts = ", ".join(f"{o[k]} {label}" for k, label in
                           (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf")) if o[k])
        where = f"{short_path(o['file'])}:{o['line']}" + (f" via {o['via']}" if o.get("via") else "")
        phase = o["phase"] + (f" ({o['node']})" if o.get("node") else "")
        if o.get("forward"):
            made = o["forward"] + (f" at {short_path(o['forward_file'])}:{o['forward_line']}"
                                   if o.get("forward_file") else "")
            phase += f", made by {made}"
        inputs = "; ".join(f"{_short(i['dtype'])}{i['shape']} amax {_number(i['amax'])}"
                           for i in o["inputs"]) or "no floating inputs"
        calls = f" &middot; {o['count']} calls" if o.get("count", 1) > 1 else ""
        step = ""
        if o.get("step") is not None:
            step = f"{_e(o.get('step_kind'))} {_e(o['step'])}: "
            if o.get("reached"):
                at = o.get("reached_step")
                step += f"<b>reached {_e(o.get('reached_at'))}</b>" + (
                    f" at step {_e(at)}" if at is not None else "")
                if o.get("absorbed_steps"):
                    step += (f" (absorbed in {_e(o['absorbed_steps'])} other steps: perhaps "
                             "another origin's NaN/inf reached)")
            elif o.get("reached") is False:
                step += "absorbed (the step's outputs, loss and gradients stayed finite)"
            else:
                step += "not decided (the block ended inside its step)"
            step = f"{step}<br>"
        parts.append(
            f'<div class="origin"><b><code>{_e(o["op"])}</code></b> made {_e(counts)} in '
            f'{_e(_short(o["dtype"]))} &middot; module <code>{_e(o.get("module") or "-")}</code> '
            f'&middot; {_e(phase)} &middot; <code>{_e(where)}</code>{calls}<br>{step}'
            f'inputs: {_e(inputs)}<br><span class="note">{_e(o.get("note", ""))}</span></div>')
    return "".join(parts)


def _ellipsize(text: str, limit: int) -> str:
    """``text`` cut in the middle to ``limit`` characters (the ends say the most)."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (limit - 1 - head):]


def _tail(name: str, limit: int) -> str:
    """A dotted module path cut to its last components (the module itself
    and its parents up to ``limit`` characters)."""
    if len(name) <= limit:
        return name
    parts = name.split(".")
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(kept) + 1 > limit:
            break
        kept = f"{part}.{kept}"
    return _ellipsize("\u2026" + kept, limit)


def _label(text: Any, short: str) -> str:
    """Escaped ``short``, with the full ``text`` in its title when they differ."""
    text = str(text)
    if short == text:
        return _e(text)
    return f'<span class="cut" title="{_e(text)}">{_e(short)}</span>'


def _site(r: Dict[str, Any]) -> str:
    """A cast site as the page shows it: whole when short; else the file's
    name and line, the library file's name and as much of the module's path
    as fits (its last components), the full site in the title: a 1400-px
    window must hold the casts table, violations included."""
    site = str(r["site"])
    if len(site) <= SITE_CHARS:
        return _e(site)
    if r.get("file") is None:
        return _label(site, _ellipsize(site, SITE_CHARS))
    rest = [f"{os.path.basename(str(r['file']))}:{r['line']}"]
    if r.get("name"):
        rest.append(f"safe_to({r['name']})")
    if r.get("via"):
        rest.append("via " + os.path.basename(str(r["via"])))
    rest = " ".join(rest)
    room = SITE_CHARS - len(rest) - 1
    module = _tail(r["module"], max(room, 12)) + " " if r.get("module") else ""
    return _label(site, _ellipsize(module + rest, SITE_CHARS))


def _module(name: Optional[str], limit: int = 40) -> str:
    return _label(name or "-", _tail(name or "-", limit))


def _casts(data: Dict[str, Any]) -> str:
    records = data.get("records", [])
    if not records:
        return ""
    header = ["site", "violations", "origin", "dtypes", "calls", "elements", "inexact", "nan",
              "overflow", "underflow", "subnormal", "max rel err", "SQNR dB"]
    rows, classes = [], []
    for r in records:
        s = r["stats"]
        measured = r["measured"]
        violations = r.get("violations", [])
        # The violations come second: what makes a row matter must not be the
        # column a narrow window cuts off.
        cells = [_site(r),
                 f'<span class="bad">{_e(", ".join(violations))}</span>' if violations else "",
                 _e(r["origin"]), _e(f"{_short(r['src_dtype'])}->{_short(r['dtype'])}"),
                 _e(r["calls"]), _e(s["numel"])]
        for k in ("inexact", "nan", "overflow", "underflow", "subnormal"):
            cells.append(_e(s[k]) if measured else "-")
        cells.append(_e(_number(s["max_rel_err"])) if measured else "-")
        cells.append(_e(_number(s.get("sqnr_db"))) if measured else "-")
        rows.append(cells)
        classes.append("violation" if violations else "")
    bad = sum(1 for c in classes if c)
    page = (f'<section id="casts"><h2>Casts ({_count(len(records), "site")}, '
            f"{bad} with violations; worst first)</h2>"
            + _table(header, rows[:CAST_ROWS], left=4, row_classes=classes[:CAST_ROWS]))
    if len(rows) > CAST_ROWS:
        rest = len(rows) - CAST_ROWS
        rest_bad = sum(1 for c in classes[CAST_ROWS:] if c)
        page += (f'<details class="more"><summary>{_count(rest, "more site")}'
                 + (f" ({rest_bad} with violations)" if rest_bad else " (no violations)")
                 + "</summary>" + _table(header, rows[CAST_ROWS:], left=4,
                                         row_classes=classes[CAST_ROWS:]) + "</details>")
    return page + "</section>"


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


def _measures(entry: Dict[str, Any]) -> tuple:
    """What an entry measured, without its module: equal for the entries of
    one tensor (a container returning its last child's output)."""
    return (entry["phase"], entry["dtype"], entry["numel"], entry["nan"], entry["posinf"],
            entry["neginf"], entry["zero"], entry["subnormal"], str(entry["amax"]),
            str(entry.get("min_nonzero")), tuple(entry["binades"]), tuple(entry["hist"]),
            json.dumps(entry.get("columns"), sort_keys=True))


def _same_measures(entries: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """The entries grouped by equal measures, in the order of each group's
    first entry: GPT-2's root and its lm_head are one tensor (a dropout of
    p=0 gives its input's values again), and showing its histogram (and its
    headroom) twice hides that and doubles the page. Gradients all NaN after
    a NaN spread are equal too, and one picture of them says as much."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for entry in entries:
        groups.setdefault(_measures(entry), []).append(entry)
    return list(groups.values())


def _names(group: List[Dict[str, Any]], limit: int = 40, bold: bool = False) -> str:
    """The modules of a group of entries, each cut to ``limit``, escaped:
    "lm_head" or "lm_head = GPT"."""
    names = [_module(name, limit) for name in dict.fromkeys(e.get("module") for e in group)]
    return " = ".join(f"<b>{n}</b>" for n in names) if bold else " = ".join(names)


def _first_origin(data: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The origin the page names first, as the origins section orders them
    (reach_rank: the first that reached the outputs, the loss or the
    gradients; else the first in time), or None."""
    origins = data.get("nonfinite") or []
    ranked = sorted(origins,
                    key=lambda o: reach_rank(o.get("reached"), o.get("absorbed_steps", 0)))
    return ranked[0] if ranked else None


def _origin_module(data: Dict[str, Any]) -> Optional[str]:
    """The module of the origin the page names first, if any."""
    origin = _first_origin(data)
    return origin.get("module") if origin else None


def _is_module(name: Optional[str], module: Optional[str]) -> bool:
    """Whether a health row's name is ``module``: the same path, or one of
    them qualified by its root ("GPT#2.h.0" for an origin's "h.0")."""
    if not name or not module:
        return False
    return name == module or name.endswith("." + module) or module.endswith("." + name)


def _nonfinite(entry: Dict[str, Any]) -> int:
    return entry["nan"] + entry["posinf"] + entry["neginf"]


def _ordered_groups(data: Dict[str, Any]) -> List[List[Dict[str, Any]]]:
    """The health entries as the page lists them: one group per tensor,
    the groups of the module where the first NaN/inf started first (the
    reader came for it), then worst first as ``Report.health`` gave them."""
    groups = _same_measures(data.get("health") or [])
    module = _origin_module(data)
    first = [g for g in groups if any(_is_module(e.get("module"), module) for e in g)]
    first.sort(key=lambda g: g[0]["phase"] != "forward")  # where it started, then its gradient
    return first + [g for g in groups if all(g is not f for f in first)]


def _health(data: Dict[str, Any]) -> str:
    entries = data.get("health")
    if not entries:
        return ""
    groups = _ordered_groups(data)
    lo, hi = _axis(entries)
    origin = _origin_module(data)
    parts = ['<section id="health"><h2>Module health: |x| by binade, over each format\'s '
             "window</h2>",
             '<p class="note">Bars: elements per binade (log scale); red: NaN/inf; dashed: '
             "amax. Bands: the range each format represents, subnormal lighter. A cast to a "
             "format flushes what lies left of its band and overflows what lies right of it "
             "(at scale 1: see the headroom table for scaled casts). "
             + ("The module where NaN/inf started first, then worst first"
                if any(_is_module(e.get("module"), origin) for e in entries) else "Worst first")
             + f": the first {OPEN_ENTRIES} entries are open; click a "
             "header to open another. Entries with equal measures share one histogram, "
             "named \"a = b\": a container returning its last child's output, or "
             "gradients all NaN.</p>"]
    for i, group in enumerate(groups):
        entry = group[0]
        nonfinite = _nonfinite(entry)
        low = entry.get("min_nonzero")
        # Only the first are open, NaN/inf or not: once NaN spreads, most of a
        # model's entries hold some (their headers say how many, in red).
        opened = " open" if i < OPEN_ENTRIES else ""
        names = _names(group, 60, bold=True)
        parts.append(
            f'<details class="module"{opened}><summary>{names}'
            f' &middot; {_e(entry["phase"])} &middot; {_e(_short(entry["dtype"]))} &middot; '
            f'{_e(entry["numel"])} elements &middot; amax {_e(_number(entry["amax"]))} &middot; '
            f'min nonzero {_e(_number(low))} &middot; zeros {_e(entry["zero"])} &middot; '
            f'subnormal {_e(entry["subnormal"])}'
            + (f' &middot; <span class="bad">{nonfinite} NaN/inf</span>' if nonfinite else "")
            + "</summary>" + _histogram_svg(entry, lo, hi) + "</details>")
    return "".join(parts) + "</section>"


def _scale(scale: Any) -> str:
    """A power-of-two scale as 2^k (a non-finite one as it is)."""
    scale = _float(scale)
    return f"2^{int(math.log2(scale))}" if math.isfinite(scale) and scale > 0 else str(scale)


def _headroom(data: Dict[str, Any]) -> str:
    rows = data.get("headroom")
    if not rows:
        return ""
    pct = lambda x: "0" if _float(x) == 0 else f"{100 * _float(x):.3g}%"  # noqa: E731
    # One row per tensor: the entries of a container that returns its child's
    # output are the child's, named by both.
    names = {}
    for group in _same_measures(data.get("health") or []):
        label = _names(group, 32)
        for k, e in enumerate(group):
            names[(e.get("module"), e["phase"], e["dtype"])] = label if k == 0 else None
    view = []
    for entry in headroom_view(rows):
        label = names.get((entry["module"], entry["phase"], entry["src_dtype"]),
                          _module(entry["module"]))
        if label is not None:
            view.append((label, entry))
    header = ["module", "phase", "from", "to", "overflow", "underflow to 0", "subnormal",
              "amax scale", "overflow", "underflow to 0", "subnormal"]

    def body(view):
        out = []
        for label, v in view:
            plain, scaled = v["plain"], v["scaled"]
            to = _short(v["format"]) + ("" if _float(plain["scale"]) == 1
                                        else f" at {_scale(plain['scale'])}")
            cells = [label, _e(v["phase"]), _e(_short(v["src_dtype"])), _e(to),
                     _e(pct(plain["overflow"])), _e(pct(plain["underflow"])),
                     _e(pct(plain["subnormal"]))]
            if scaled is None:
                cells += ["", "", "", ""]
            else:
                cells += [_e(_scale(scaled["scale"])), _e(pct(scaled["overflow"])),
                          _e(pct(scaled["underflow"])), _e(pct(scaled["subnormal"]))]
            out.append(cells)
        return out

    lossy = [(label, v) for label, v in view if v["lossy"]]
    lossless = view[len(lossy):]
    page = ('<section id="headroom"><h2>Headroom: what a cast would do (exact, from the '
            "histograms)</h2>"
            '<p class="note">Per module output or gradient and narrower format: what a cast '
            "at scale 2^0 would lose, and where it loses anything, what it would lose at the "
            "amax scale, the one per-tensor amax scaling rounded to a power of two uses (the "
            "largest power of two that maps the entry's amax to at most the format's largest "
            "value, as safe_to(scale=\"amax_pow2\")). Casts to the entry's own dtype are left "
            "out. Those that lose something come first, worst first.</p>")
    if lossy:
        page += _table(header, body(lossy[:HEADROOM_ROWS]), left=4)
    if len(lossy) > HEADROOM_ROWS:
        more = _count(len(lossy) - HEADROOM_ROWS, "more cast")
        page += (f'<details class="more"><summary>{more} that would lose something</summary>'
                 + _table(header, body(lossy[HEADROOM_ROWS:]), left=4) + "</details>")
    if lossless:
        page += (f'<details class="lossless"><summary>{_count(len(lossless), "cast")} '
                 "that would lose nothing to overflow, underflow or subnormals</summary>"
                 + _table(header[:7], [c[:7] for c in body(lossless)], left=4) + "</details>")
    return page + "</section>"


def _binades_to_max(entry: Dict[str, Any]) -> float:
    """log2(the dtype's largest finite value / the entry's amax): the
    doublings its largest element can take (inf: no finite nonzero element)."""
    amax = _float(entry.get("amax") or 0.0)
    if not (amax > 0 and math.isfinite(amax)):
        return math.inf
    try:
        largest = torch.finfo(dtype_from_name(entry["dtype"])).max
    except (TypeError, ValueError):
        return math.inf
    return math.log2(largest / amax)


def _what_to_fix(data: Dict[str, Any], summary: str) -> str:
    """The page's first section: the first NaN/inf origin's module and op,
    the cast sites with violations, the modules closest to overflow, what
    was not watched; then the counts. Each item names its section below (no
    links: the page fetches and runs nothing, anchors included)."""
    items = []
    origins = data.get("nonfinite") or []
    if origins:
        o = _first_origin(data)
        counts = ", ".join(f"{o[k]} {label}" for k, label in
                           (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf")) if o.get(k))
        where = f"{short_path(o['file'])}:{o['line']}" if o.get("file") else "?"
        when = o["phase"] + (f", step {o['step']}" if o.get("step") is not None else "")
        if o.get("reached") and o.get("reached_at"):
            when += f", reached {o['reached_at']}"
        more = f" ({_count(len(origins) - 1, 'more origin')} below.)" if len(origins) > 1 else ""
        items.append(
            f"<li><b>NaN/inf started in module <code>{_e(o.get('module') or '(none)')}</code></b>"
            f": <code>{_e(o['op'])}</code> made {_e(counts or 'NaN/inf')} in "
            f"{_e(_short(o['dtype']))} ({_e(when)}, <code>{_e(where)}</code>). "
            f"{_e(o.get('note') or '')}{more}</li>")
    groups = _same_measures(data.get("health") or [])
    poisoned = [e for g in groups if _nonfinite(g[0]) for e in g]
    if poisoned:
        hint = ("" if "nonfinite" in data else " track(nonfinite=\"record\") names the op "
                "that made them.")
        items.append(f"<li>{len(poisoned)} of the module outputs and gradients hold NaN/inf "
                     f"(module health, below).{_e(hint)}</li>")
    bad = [r for r in data.get("records", []) if r.get("violations")]
    if bad:
        rows = "".join(
            f"<li><code>{_site(r)}</code> ({_e(_short(r['src_dtype']))}->"
            f"{_e(_short(r['dtype']))}, {_e(r['origin'])}): "
            f'<span class="bad">{_e(", ".join(r["violations"]))}</span></li>'
            for r in bad[:FIX_ROWS])
        worst = f", the worst {FIX_ROWS}" if len(bad) > FIX_ROWS else ""
        items.append(f'<li><b>{_count(len(bad), "cast site")} with '
                     f"violations</b>{worst}:<ul>{rows}</ul></li>")
    close = sorted(((_binades_to_max(g[0]), g) for g in groups if not _nonfinite(g[0])),
                   key=lambda bg: bg[0])
    close = [(b, g) for b, g in close if b < CLOSE_BINADES][:FIX_ROWS]
    if close:
        rows = "".join(
            f"<li><code>{_names(g, 60)}</code> {_e(g[0]['phase'])}: amax "
            f"{_e(_number(g[0]['amax']))}, {b:.1f} binades below "
            f"{_e(_short(g[0]['dtype']))}'s largest value</li>" for b, g in close)
        items.append(f'<li><b>Closest to overflow</b> (within '
                     f"2^{CLOSE_BINADES} of their dtype's largest value):<ul>{rows}</ul></li>")
    regions = data.get("compiled_regions")
    if regions:
        items.append(f'<li>{_count(len(regions), "torch.compile region")} not fully '
                     "watched (listed at the end): what ran inside is not in this report.</li>")
    if not items:
        items.append(f"<li>Nothing found: no NaN/inf, no cast violations, no module output "
                     f"within 2^{CLOSE_BINADES} of overflow.</li>")
    return (f'<section class="fix" id="fix"><h2>What to fix</h2><ul>{"".join(items)}</ul>'
            f'<p class="summary">{summary}</p></section>')


def _regions(data: Dict[str, Any]) -> str:
    regions = data.get("compiled_regions")
    if not regions:
        return ""
    when = {True: ", compiled and run in this track",
            False: ", compiled before this track (if it ran in it)"}
    rows = "".join(
        f"<li><code>{_e(r['compile_id'])}</code> "
        f"<code>{_e(r.get('function') or '?')}</code> "
        f"({_e(short_path(r['file']) if r.get('file') else '?')}:{_e(r.get('line'))})"
        f"{_e(when[bool(r.get('compiled_in_track'))])}: not watched: "
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
    summary = (f"In all: {_e(' · '.join(summary))} · violations: "
               f"{_e(data.get('violations', ''))}")
    origins_html = _origins(data)
    regions = _regions(data)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>torchcast report</title>"
            f"<style>{_CSS}</style></head><body><h1>torchcast report</h1>"
            + _what_to_fix(data, summary)
            + (f'<section id="origins">{origins_html}</section>' if origins_html else "")
            + _casts(data) + _health(data) + _headroom(data)
            + (f'<section id="regions">{regions}</section>' if regions else "")
            + "</body></html>")
