"""``Report.to_html``: the report as one self-contained HTML page (inline CSS
and SVG, no script, nothing fetched), rendered from ``Report.to_dict()``'s
values, so a saved JSON report renders the same.

It leads with what to fix: the op and module where NaN/inf started first, the
cast sites with violations, the modules closest to overflow. Then the ops that
first made NaN/inf; the cast sites (the worst CAST_ROWS, the rest folded);
per module and phase, the histogram of |x| by binade over the formats'
windows (the module where NaN/inf started first, then worst first, the rest
folded to one-line headers); and the headroom table. Long site and module
names are cut, whole in their title, so that a 1400-px window holds every
table.

This module is the page: its layout, its style sheet, and the sections on
casts, origins and what to fix. The module health and headroom sections are
html_health.py's; the small pieces every section uses (escaping, numbers,
tables, cut names) html_parts.py's.
"""
import os
from typing import Any, Dict, Optional

from .html_health import OPEN_ENTRIES  # noqa: F401  (the page's; tests read it here)
from .html_health import (binades_to_max, block_headroom_section, headroom_section,
                          health_section, module_names, nonfinite_count, same_measures)
from .html_parts import (counted, ellipsize, esc, html_table, module_tail, number, short_dtype,
                         titled)
from .html_plan import plan_section
from .origin import reach_rank, step_phrase
from .report_dict import ended_early
from .sites import short_path
from .updates import ADVICE, LOST_NOTABLE, notable, row_label

# Cast rows shown before the table folds the rest below it (counted): a
# GPT-2's hundreds of casts must not bury what leads.
CAST_ROWS = 25
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


def _origins(data: Dict[str, Any]) -> str:
    origins = data.get("nonfinite")
    if origins is None:
        return ""
    reached = sum(1 for o in origins if o.get("reached"))
    absorbed = sum(1 for o in origins if o.get("reached") is False)
    entries = sum(1 for o in origins if o.get("entered") is not None)
    parts = [f"<h2>Where NaN/inf first appeared ({counted(len(origins) - entries, 'op')} made "
             f"them, {counted(entries, 'entry', 'entries')} of NaN/inf no watched op made; "
             f"{esc(counted(data.get('propagated', 0), 'op call'))} only passed them on)</h2>"]
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
        inputs = "; ".join(f"{short_dtype(i['dtype'])}{i['shape']} amax {number(i['amax'])}"
                           for i in o["inputs"]) or "no floating inputs"
        calls = f" &middot; {o['count']} calls" if o.get("count", 1) > 1 else ""
        step = ""
        if o.get("step") is not None:
            step = f"{esc(step_phrase(o.get('step_kind'), o['step']))}: "
            if o.get("reached"):
                at = o.get("reached_step")
                step += f"<b>reached {esc(o.get('reached_at'))}</b>" + (
                    f" at step {esc(at)}" if at is not None else "")
                if o.get("absorbed_steps"):
                    step += (f" (absorbed in {esc(o['absorbed_steps'])} other steps: perhaps "
                             "another origin's NaN/inf reached)")
            elif o.get("reached") is False:
                step += ("absorbed (the step's outputs, loss and gradients stayed finite, or "
                         "GradScaler skipped the step)")
            else:
                step += "not decided (the block ended inside its step)"
            step = f"{step}<br>"
        made = (f"received {esc(counts)} through {esc(o['entered'])}, no watched op made "
                "them;" if o.get("entered") is not None else f"made {esc(counts)} in")
        parts.append(
            f'<div class="origin"><b><code>{esc(o["op"])}</code></b> {made} '
            f'{esc(short_dtype(o["dtype"]))} &middot; module '
            f'<code>{esc(o.get("module") or "-")}</code> '
            f'&middot; {esc(phase)} &middot; <code>{esc(where)}</code>{calls}<br>{step}'
            f'inputs: {esc(inputs)}<br><span class="note">{esc(o.get("note", ""))}</span></div>')
    return "".join(parts)


def _site(r: Dict[str, Any]) -> str:
    """A cast site as the page shows it: whole when short; else the file's
    name and line, the library file's name and as much of the module's path
    as fits (its last components), the full site in the title: a 1400-px
    window must hold the casts table, violations included."""
    site = str(r["site"])
    if len(site) <= SITE_CHARS:
        return esc(site)
    if r.get("file") is None:
        return titled(site, ellipsize(site, SITE_CHARS))
    rest = [f"{os.path.basename(str(r['file']))}:{r['line']}"]
    if r.get("name"):
        rest.append(f"safe_to({r['name']})")
    if r.get("via"):
        rest.append("via " + os.path.basename(str(r["via"])))
    rest = " ".join(rest)
    room = SITE_CHARS - len(rest) - 1
    module = module_tail(r["module"], max(room, 12)) + " " if r.get("module") else ""
    return titled(site, ellipsize(module + rest, SITE_CHARS))


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
                 f'<span class="bad">{esc(", ".join(violations))}</span>' if violations else "",
                 esc(r["origin"]), esc(f"{short_dtype(r['src_dtype'])}->{short_dtype(r['dtype'])}"),
                 esc(r["calls"]), esc(s["numel"])]
        for k in ("inexact", "nan", "overflow", "underflow", "subnormal"):
            cells.append(esc(s[k]) if measured else "-")
        # An overflowed element's relative error is inf (CastStats.worst_rel_err).
        worst = "inf" if s.get("overflow") else s["max_rel_err"]
        cells.append(esc(number(worst)) if measured else "-")
        cells.append(esc(number(s.get("sqnr_db"))) if measured else "-")
        rows.append(cells)
        classes.append("violation" if violations else "")
    bad = sum(1 for c in classes if c)
    page = (f'<section id="casts"><h2>Casts ({counted(len(records), "site")}, '
            f"{bad} with violations; worst first)</h2>"
            + html_table(header, rows[:CAST_ROWS], left=4, row_classes=classes[:CAST_ROWS]))
    if len(rows) > CAST_ROWS:
        rest = len(rows) - CAST_ROWS
        rest_bad = sum(1 for c in classes[CAST_ROWS:] if c)
        page += (f'<details class="more"><summary>{counted(rest, "more site")}'
                 + (f" ({rest_bad} with violations)" if rest_bad else " (no violations)")
                 + "</summary>" + html_table(header, rows[CAST_ROWS:], left=4,
                                             row_classes=classes[CAST_ROWS:]) + "</details>")
    return page + "</section>"


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
        more = f" ({counted(len(origins) - 1, 'more origin')} below.)" if len(origins) > 1 else ""
        items.append(
            f"<li><b>NaN/inf started in module <code>{esc(o.get('module') or '(none)')}</code></b>"
            f": <code>{esc(o['op'])}</code> made {esc(counts or 'NaN/inf')} in "
            f"{esc(short_dtype(o['dtype']))} ({esc(when)}, <code>{esc(where)}</code>). "
            f"{esc(o.get('note') or '')}{more}</li>")
    groups = same_measures(data.get("health") or [])
    poisoned = [e for g in groups if nonfinite_count(g[0]) for e in g]
    if poisoned:
        hint = ("" if "nonfinite" in data else " track(nonfinite=\"record\") names the op "
                "that made them.")
        items.append(f"<li>{len(poisoned)} of the module outputs and gradients hold NaN/inf "
                     f"(module health, below).{esc(hint)}</li>")
    bad = [r for r in data.get("records", []) if r.get("violations")]
    if bad:
        rows = "".join(
            f"<li><code>{_site(r)}</code> ({esc(short_dtype(r['src_dtype']))}->"
            f"{esc(short_dtype(r['dtype']))}, {esc(r['origin'])}): "
            f'<span class="bad">{esc(", ".join(r["violations"]))}</span></li>'
            for r in bad[:FIX_ROWS])
        worst = f", the worst {FIX_ROWS}" if len(bad) > FIX_ROWS else ""
        items.append(f'<li><b>{counted(len(bad), "cast site")} with '
                     f"violations</b>{worst}:<ul>{rows}</ul></li>")
    close = sorted(((binades_to_max(g[0]), g) for g in groups if not nonfinite_count(g[0])),
                   key=lambda bg: bg[0])
    close = [(b, g) for b, g in close if b < CLOSE_BINADES][:FIX_ROWS]
    if close:
        rows = "".join(
            f"<li><code>{module_names(g, 60)}</code> {esc(g[0]['phase'])}: amax "
            f"{esc(number(g[0]['amax']))}, {b:.1f} binades below "
            f"{esc(short_dtype(g[0]['dtype']))}'s largest value</li>" for b, g in close)
        items.append(f'<li><b>Closest to overflow</b> (within '
                     f"2^{CLOSE_BINADES} of their dtype's largest value):<ul>{rows}</ul></li>")
    regions = data.get("compiled_regions")
    if regions:
        items.append(f'<li>{counted(len(regions), "torch.compile region")} not fully '
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
        f"<li><code>{esc(r['compile_id'])}</code> "
        f"<code>{esc(r.get('function') or '?')}</code> "
        f"({esc(short_path(r['file']) if r.get('file') else '?')}:{esc(r.get('line'))})"
        f"{esc(when[bool(r.get('compiled_in_track'))])}: not watched: "
        f"{esc('; '.join(r['unwatched']))}</li>" for r in regions)
    return (f"<h2>Not watched: {counted(len(regions), 'torch.compile region')}</h2>"
            f"<ul>{rows}</ul>")


def _updates(data: Dict[str, Any]) -> str:
    rows = data.get("updates")
    if not rows:
        return ""
    shown = [r for r in rows if r["index"] is None] + notable(rows)
    cells = [[esc(row_label(r)), esc(r["elements"]), esc(r["updated"]),
              f"{r['lost_fraction']:.2%}", f"{r['shrunk_fraction']:.2%}",
              esc(number(r["comp_mean_ulp"])), esc(number(r["comp_max_ulp"]))] for r in shown]
    advice = (f"<p>Over {LOST_NOTABLE:.0%} of a parameter's updates lost: "
              f"{esc(ADVICE)}.</p>" if notable(rows) else "")
    return ("<h2>Optimizer updates</h2><p>Per param group, and the parameters with over "
            f"{LOST_NOTABLE:.0%} lost (track_updates=True): lost, the stored parameter did "
            "not change; &lt;half, it changed by less than half the update; compensation "
            "in ulps of the parameter.</p>"
            + html_table(["where", "element-steps", "updated", "lost", "&lt;half",
                          "comp mean (ulp)", "comp max (ulp)"], cells) + advice)


def render_html(data: Dict[str, Any], plan: Optional[Dict[str, Any]] = None) -> str:
    """The page for a report.

    Args:
        data: ``Report.to_dict()`` (or the same read from its JSON).
        plan: ``PrecisionPlan.to_dict()``, shown after the headroom tables.

    Returns:
        The HTML text (UTF-8).
    """
    records = data.get("records", [])
    bad = sum(1 for r in records if r.get("violations"))
    origins = data.get("nonfinite")
    summary = [f"{len(records)} cast sites, {bad} with violations"]
    if origins is not None:
        entries = sum(1 for o in origins if o.get("entered") is not None)
        summary.append(f"{counted(len(origins) - entries, 'op')} made NaN/inf from finite inputs")
        if entries:
            summary.append(f"{counted(entries, 'entry', 'entries')} of NaN/inf no watched op made")
    if data.get("health"):
        summary.append(f"{len(data['health'])} module outputs and gradients measured")
    if data.get("updates"):
        summary.append(f"{counted(len(notable(data['updates'])), 'parameter')} with over "
                       f"{LOST_NOTABLE:.0%} of its updates lost")
    if data.get("compiled_regions"):
        summary.append(f"{len(data['compiled_regions'])} compiled regions not fully watched "
                       "(listed at the end)")
    summary = (f"In all: {esc(' · '.join(summary))} · violations: "
               f"{esc(data.get('violations', ''))}")
    origins_html = _origins(data)
    regions = _regions(data)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>torchcast report</title>"
            f"<style>{_CSS}</style></head><body><h1>torchcast report</h1>"
            + (f'<p class="ended">{esc(ended_early(data["ended_by"]))}</p>'
               if data.get("ended_by") else "")
            + _what_to_fix(data, summary)
            + (f'<section id="origins">{origins_html}</section>' if origins_html else "")
            + _casts(data) + health_section(data, _origin_module(data))
            + headroom_section(data) + block_headroom_section(data)
            + (plan_section(plan) if plan is not None else "")
            + (f'<section id="updates">{_updates(data)}</section>' if data.get("updates") else "")
            + (f'<section id="regions">{regions}</section>' if regions else "")
            + "</body></html>")
