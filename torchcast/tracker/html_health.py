"""The module health and headroom sections of ``Report.to_html``'s page
(html.py), from ``Report.to_dict()``'s "health" and "headroom" rows.

Per module and phase, the histogram of |x| by binade drawn over the windows
that float16, bfloat16, float8_e4m3fn and float8_e5m2 represent (subnormal
range lighter), where the mass falling off a window is what a cast to it
loses; one tensor measured for two modules is shown once, naming both
(``same_measures``). Then the headroom table (``health.headroom_view``: no
cast to the entry's own dtype, the amax scale only where scale 1 loses
something, the casts that would lose nothing folded below it).

Apart from html.py's sections, which read the casts and the origins: these
read the health rows and draw them. html.py's what-to-fix asks this module
which modules are close to overflow (``binades_to_max``) or hold NaN/inf
(``nonfinite_count``).
"""
import json
import math
from typing import Any, Dict, List, Optional

import torch

from .._reference.health import format_exponents
from ..formats import NARROW_TARGETS
from ..stats import dtype_from_name
from .health_rows import headroom_view
from .html_parts import as_float, counted, esc, html_table, module_label, number, short_dtype

WINDOW_FORMATS = NARROW_TARGETS
# Headroom rows shown before the table folds the rest below it (counted): a
# GPT-2's hundreds of them must not bury what leads.
HEADROOM_ROWS = 25
# Histograms drawn open at first (worst first); the others fold to their
# one-line headers, so that a model's hundred entries stay one screen of them.
OPEN_ENTRIES = 8


def _windows() -> List[tuple]:
    """(name, e_sub, e_min, e_max) of each drawn format."""
    out = []
    for dtype in WINDOW_FORMATS:
        fraction_bits, e_min, e_max = format_exponents(dtype)
        out.append((short_dtype(str(dtype)), e_min - fraction_bits, e_min, e_max))
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
    amax = as_float(entry.get("amax") or 0.0)
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


def _measures(entry: Dict[str, Any]) -> tuple:
    """What an entry measured, without its module: equal for the entries of
    one tensor (a container returning its last child's output)."""
    return (entry["phase"], entry["dtype"], entry["numel"], entry["nan"], entry["posinf"],
            entry["neginf"], entry["zero"], entry["subnormal"], str(entry["amax"]),
            str(entry.get("min_nonzero")), tuple(entry["binades"]), tuple(entry["hist"]),
            json.dumps(entry.get("columns"), sort_keys=True))


def same_measures(entries: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """The entries grouped by equal measures, in the order of each group's
    first entry: GPT-2's root and its lm_head are one tensor (a dropout of
    p=0 gives its input's values again), and showing its histogram (and its
    headroom) twice hides that and doubles the page. Gradients all NaN after
    a NaN spread are equal too, and one picture of them says as much."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for entry in entries:
        groups.setdefault(_measures(entry), []).append(entry)
    return list(groups.values())


def module_names(group: List[Dict[str, Any]], limit: int = 40, bold: bool = False) -> str:
    """The modules of a group of entries, each cut to ``limit``, escaped:
    "lm_head" or "lm_head = GPT"."""
    names = [module_label(name, limit) for name in dict.fromkeys(e.get("module") for e in group)]
    return " = ".join(f"<b>{n}</b>" for n in names) if bold else " = ".join(names)


def _is_module(name: Optional[str], module: Optional[str]) -> bool:
    """Whether a health row's name is ``module``: the same path, or one of
    them qualified by its root ("GPT#2.h.0" for an origin's "h.0")."""
    if not name or not module:
        return False
    return name == module or name.endswith("." + module) or module.endswith("." + name)


def nonfinite_count(entry: Dict[str, Any]) -> int:
    """The NaN and ±inf elements of a health entry."""
    return entry["nan"] + entry["posinf"] + entry["neginf"]


def _ordered_groups(data: Dict[str, Any],
                    module: Optional[str]) -> List[List[Dict[str, Any]]]:
    """The health entries as the page lists them: one group per tensor,
    the groups of ``module``, where the first NaN/inf started, first (the
    reader came for it), then worst first as ``Report.health`` gave them."""
    groups = same_measures(data.get("health") or [])
    first = [g for g in groups if any(_is_module(e.get("module"), module) for e in g)]
    first.sort(key=lambda g: g[0]["phase"] != "forward")  # where it started, then its gradient
    return first + [g for g in groups if all(g is not f for f in first)]


def health_section(data: Dict[str, Any], origin: Optional[str]) -> str:
    """The module health section: per module and phase, the histogram of
    |x| by binade over the formats' windows (empty without health rows).

    Args:
        data: ``Report.to_dict()``.
        origin: the module of the origin the page names first (its entries
            come first), or None.
    """
    entries = data.get("health")
    if not entries:
        return ""
    groups = _ordered_groups(data, origin)
    lo, hi = _axis(entries)
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
        nonfinite = nonfinite_count(entry)
        low = entry.get("min_nonzero")
        # Only the first are open, NaN/inf or not: once NaN spreads, most of a
        # model's entries hold some (their headers say how many, in red).
        opened = " open" if i < OPEN_ENTRIES else ""
        names = module_names(group, 60, bold=True)
        parts.append(
            f'<details class="module"{opened}><summary>{names}'
            f' &middot; {esc(entry["phase"])} &middot; {esc(short_dtype(entry["dtype"]))} &middot; '
            f'{esc(entry["numel"])} elements &middot; amax {esc(number(entry["amax"]))} &middot; '
            f'min nonzero {esc(number(low))} &middot; zeros {esc(entry["zero"])} &middot; '
            f'subnormal {esc(entry["subnormal"])}'
            + (f' &middot; <span class="bad">{nonfinite} NaN/inf</span>' if nonfinite else "")
            + "</summary>" + _histogram_svg(entry, lo, hi) + "</details>")
    return "".join(parts) + "</section>"


def _scale(scale: Any) -> str:
    """A power-of-two scale as 2^k (a non-finite one as it is)."""
    scale = as_float(scale)
    return f"2^{int(math.log2(scale))}" if math.isfinite(scale) and scale > 0 else str(scale)


def headroom_section(data: Dict[str, Any]) -> str:
    """The headroom table (``health.headroom_view``; empty without
    headroom rows)."""
    rows = data.get("headroom")
    if not rows:
        return ""
    pct = lambda x: "0" if as_float(x) == 0 else f"{100 * as_float(x):.3g}%"  # noqa: E731
    # One row per tensor: the entries of a container that returns its child's
    # output are the child's, named by both.
    names = {}
    for group in same_measures(data.get("health") or []):
        label = module_names(group, 32)
        for k, e in enumerate(group):
            names[(e.get("module"), e["phase"], e["dtype"])] = label if k == 0 else None
    view = []
    for entry in headroom_view(rows):
        label = names.get((entry["module"], entry["phase"], entry["src_dtype"]),
                          module_label(entry["module"]))
        if label is not None:
            view.append((label, entry))
    header = ["module", "phase", "from", "to", "overflow", "underflow to 0", "subnormal",
              "amax scale", "overflow", "underflow to 0", "subnormal"]

    def body(view):
        out = []
        for label, v in view:
            plain, scaled = v["plain"], v["scaled"]
            to = short_dtype(v["format"]) + ("" if as_float(plain["scale"]) == 1
                                             else f" at {_scale(plain['scale'])}")
            cells = [label, esc(v["phase"]), esc(short_dtype(v["src_dtype"])), esc(to),
                     esc(pct(plain["overflow"])), esc(pct(plain["underflow"])),
                     esc(pct(plain["subnormal"]))]
            if scaled is None:
                cells += ["", "", "", ""]
            else:
                cells += [esc(_scale(scaled["scale"])), esc(pct(scaled["overflow"])),
                          esc(pct(scaled["underflow"])), esc(pct(scaled["subnormal"]))]
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
        page += html_table(header, body(lossy[:HEADROOM_ROWS]), left=4)
    if len(lossy) > HEADROOM_ROWS:
        more = counted(len(lossy) - HEADROOM_ROWS, "more cast")
        page += (f'<details class="more"><summary>{more} that would lose something</summary>'
                 + html_table(header, body(lossy[HEADROOM_ROWS:]), left=4) + "</details>")
    if lossless:
        page += (f'<details class="lossless"><summary>{counted(len(lossless), "cast")} '
                 "that would lose nothing to overflow, underflow or subnormals</summary>"
                 + html_table(header[:7], [c[:7] for c in body(lossless)], left=4) + "</details>")
    return page + "</section>"


def binades_to_max(entry: Dict[str, Any]) -> float:
    """log2(the dtype's largest finite value / the entry's amax): the
    doublings its largest element can take (inf: no finite nonzero element)."""
    amax = as_float(entry.get("amax") or 0.0)
    if not (amax > 0 and math.isfinite(amax)):
        return math.inf
    try:
        largest = torch.finfo(dtype_from_name(entry["dtype"])).max
    except (TypeError, ValueError):
        return math.inf
    return math.log2(largest / amax)


def block_headroom_section(data: Dict[str, Any]) -> str:
    """The block formats' headroom (``track(health=True, block_formats=...)``):
    per format, each module entry's real block cast, worst first; empty
    without such rows."""
    rows = data.get("block_headroom")
    if not rows:
        return ""

    def frac(s, k):
        n = max(as_float(s["numel"]), 1)
        x = as_float(s[k]) / n
        return "0" if x == 0 else f"{100 * x:.3g}%"

    parts = ["<h2>Headroom in block-scaled formats (real casts, blocks along the last "
             "dimension)</h2>"]
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = sorted((r for r in rows if r["format"] == fmt),
                      key=lambda r: (-as_float(r["stats"]["saturated"]) /
                                     max(as_float(r["stats"]["numel"]), 1),
                                     -as_float(r["stats"]["underflow"]) /
                                     max(as_float(r["stats"]["numel"]), 1)))
        cells = [[module_label(r["module"]), esc(r["phase"]), esc(short_dtype(r["src_dtype"])),
                  esc(r["stats"]["numel"]), frac(r["stats"], "underflow"),
                  frac(r["stats"], "subnormal"), frac(r["stats"], "saturated"),
                  esc(f"{as_float(r['stats']['sqnr_db']):.1f} dB")] for r in mine]
        parts.append(f"<h3>{esc(fmt)}</h3>" + html_table(
            ["module", "phase", "from", "elements", "flushed to 0", "subnormal", "saturated",
             "SQNR"], cells, left=3))
    return "".join(parts)
