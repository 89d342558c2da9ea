"""The HTML page and TensorBoard at the scale of a real model (issue 25, item
11), on the run behind docs/report.png: tools/report_example.py, a small
GPT-2-like model (embeddings, a 2-layer nn.TransformerEncoder, ln_f, lm_head)
trained three steps under float16 autocast, whose second feed-forward
overflows, under track(all_casts=True, nonfinite="record", health=True).

The page leads with what to fix; the headroom table has no identity or
duplicate rows and a source-dtype column; the casts table puts violations
before the wide columns and cuts long sites (whole in a title); one tensor's
histogram is drawn once; no TensorBoard tag gets two values at one step; in
Chromium, the page fits a 1400-px window."""
import collections
import html.parser
import json
import os
import subprocess
import sys

import pytest
import torch

import torchcast
from torchcast.headroom import FORMATS, headroom
from torchcast.tracker.health_rows import HeadroomRow, headroom_view
from torchcast.tracker.html import CAST_ROWS, SITE_CHARS, render_html
from torchcast.tracker.tensorboard import write_tensorboard

import chromium  # tests/chromium.py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import report_example  # noqa: E402

ORIGIN_MODULE = "transformer.h.layers.1.linear1"


@pytest.fixture(scope="module")
def report():
    return report_example.run()


@pytest.fixture(scope="module")
def data(report):
    return report.to_dict()


@pytest.fixture(scope="module")
def page(data):
    return render_html(data)


class _Page(html.parser.HTMLParser):
    """The page's sections (in order), its tables (with the section that
    holds them), each cell's text and title, and the module entries."""

    def __init__(self):
        super().__init__()
        self.sections, self.tables, self.modules = [], [], []
        self._section, self._cell, self._summary, self._module = None, None, None, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self._section = attrs.get("id")
            self.sections.append((attrs.get("id"), attrs.get("class")))
        elif tag == "table":
            self.tables.append((self._section, []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = {"text": "", "title": None, "tag": tag}
            self.tables[-1][1][-1].append(self._cell)
        elif tag == "span" and self._cell is not None and "title" in attrs:
            self._cell["title"] = attrs["title"]
        elif tag == "details":
            self._module = attrs.get("class") == "module"
        elif tag == "summary" and self._module:
            self._summary = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._cell = None
        elif tag == "summary" and self._summary is not None:
            self.modules.append(self._summary)
            self._summary, self._module = None, False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data
        if self._summary is not None:
            self._summary += data


def parse(text):
    page = _Page()
    page.feed(text)
    return page


def distinct(health):
    """The health entries by equal measures (one tensor, several modules)."""
    groups = collections.defaultdict(list)
    for h in health:
        groups[json.dumps({k: v for k, v in h.items() if k != "module"},
                          sort_keys=True)].append(h)
    return groups


def section_text(text, section_id):
    start = text.index(f'id="{section_id}"')
    return text[start:text.index("</section>", start)]


def test_the_run_has_what_the_page_must_cope_with(data):
    """Not the page yet: the data it is made from holds what made the old page
    fail at scale: identity and scaled-bfloat16 headroom rows, sites that
    differ only in dtype pair, a container sharing its child's output."""
    assert data["nonfinite"][0]["module"] == ORIGIN_MODULE
    rows = data["headroom"]
    assert sum(r["format"] == r["src_dtype"] for r in rows) >= 50
    assert sum(r["format"] == "torch.bfloat16" and float(r["scale"]) > 2 ** 100
               for r in rows) >= 30
    pairs = collections.Counter((r["site"], r["origin"]) for r in data["records"])
    assert max(pairs.values()) == 2
    names = {(h["module"], h["phase"]) for h in data["health"]}
    assert ("lm_head", "forward") in names and ("GPT", "forward") in names


def test_headroom_rows(data, page):
    """No cast to the entry's own dtype, no row twice, the source dtype
    shown, the amax scale only beside a scale-1 loss, the lossy rows first."""
    tables = [rows for section, rows in parse(page).tables if section == "headroom"]
    assert tables
    header = [c["text"] for c in tables[0][0]]
    assert header[:4] == ["module", "phase", "from", "to"]
    rows = [[c["text"] for c in row] for t in tables for row in t[1:]]
    keys = [tuple(r[:4]) for r in rows]
    assert all(r[2] != r[3] for r in rows)  # float16 -> float16 says nothing
    assert len(set(keys)) == len(keys)
    lossy = [any(c != "0" for c in r[4:7]) for r in rows]
    assert lossy == sorted(lossy, reverse=True) and any(lossy) and not all(lossy)
    for r, loses in zip(rows, lossy):
        assert len(r) == 7 or r[7] == "" or loses  # a scale only as the remedy for a loss
    # One row per tensor, phase, source and format: lm_head = GPT is one tensor.
    shared = set()
    for group in distinct(data["health"]).values():
        shared |= {(h["module"], h["phase"], h["dtype"]) for h in group[1:]}
    view = headroom_view(data["headroom"])
    assert len(rows) == sum((v["module"], v["phase"], v["src_dtype"]) not in shared
                            for v in view)
    assert len(rows) < len(data["headroom"]) // 3
    # The lossless rest is folded.
    assert '<details class="lossless"><summary>' in section_text(page, "headroom")


def test_headroom_tables_of_the_report(report):
    """Report.headroom and headroom_summary leave out the entries that are in
    the format already (counted), and show "-" for them."""
    table = report.headroom(torch.float16)
    float16 = sum(1 for r in report.health if r.dtype == torch.float16)
    assert float16 > 0 and table.omitted == float16
    assert len(table) == len(report.health) - float16
    assert all(r.src_dtype != torch.float16 and not r.identity for r in table)
    assert f"{float16} more already in float16 (no cast)" in str(table)
    summary = report.headroom_summary().splitlines()
    header = next(i for i, line in enumerate(summary) if line.startswith("module"))
    rows = [line.split() for line in summary[header + 1:] if not line.startswith("...")]
    assert rows and all(r[4] == "-" for r in rows if r[2] == "float16")
    assert not any("2^0:" in line for line in summary)  # an amax scale of 1 is not repeated


def test_headroom_view_drops_identity_duplicates_and_needless_scales():
    x = torch.cat([torch.randn(1000), torch.tensor([1e-9, 3e5])])
    health = torchcast.tensor_health(x)
    rows = [HeadroomRow("m", "forward", torch.float32, headroom(health, f, s)).to_dict()
            for f in FORMATS for s in (None, "amax")]
    rows += rows[:2]  # a row given twice
    half = torchcast.tensor_health(x.clamp(-6e4, 6e4).half())
    rows += [HeadroomRow("h", "forward", torch.float16, headroom(half, f, s)).to_dict()
             for f in FORMATS for s in (None, "amax")]
    view = headroom_view(rows)
    keys = [(v["module"], v["src_dtype"], v["format"]) for v in view]
    assert len(keys) == len(set(keys)) == 7  # 4 formats of m, 3 of h (not float16)
    assert ("h", "torch.float16", "torch.float16") not in keys
    by = {k: v for k, v in zip(keys, view)}
    f16 = by[("m", "torch.float32", "torch.float16")]
    assert f16["lossy"] and float(f16["scaled"]["scale"]) < 1  # 3e5 overflows: scaled down
    bf16 = by[("m", "torch.float32", "torch.bfloat16")]
    assert not bf16["lossy"] and bf16["scaled"] is None  # no loss: no 2^100 row
    assert [v["lossy"] for v in view] == sorted((v["lossy"] for v in view), reverse=True)


def test_page_leads_with_what_to_fix(data, page):
    parsed = parse(page)
    assert parsed.sections[0] == ("fix", "fix")
    assert '<body><h1>torchcast report</h1><section class="fix" id="fix">' in page
    fix = section_text(page, "fix")
    assert "What to fix" in fix and ORIGIN_MODULE in fix and "aten::addmm" in fix
    bad = [r for r in data["records"] if r["violations"]]
    assert bad and f"{len(bad)} cast site" in fix
    assert all(", ".join(r["violations"]) in fix for r in bad[:5])
    # The module list opens with the module where NaN started, its output first.
    assert parsed.modules[0].split(" · ")[:2] == [ORIGIN_MODULE, "forward"]


def test_casts_table_fits_and_leads_with_violations(data, page):
    tables = [rows for section, rows in parse(page).tables if section == "casts"]
    header = [c["text"] for c in tables[0][0]]
    assert header[:2] == ["site", "violations"]
    rows = [row for t in tables for row in t[1:]]
    assert len(rows) == len(data["records"]) and len(tables[0]) - 1 <= CAST_ROWS
    cut = 0
    for row, r in zip(rows, data["records"]):
        assert len(row) == len(header) and row[1]["text"] == ", ".join(r["violations"])
        if len(r["site"]) > SITE_CHARS:
            cut += 1
            assert row[0]["title"] == r["site"] and len(row[0]["text"]) <= SITE_CHARS
        else:
            assert row[0]["text"] == r["site"] and row[0]["title"] is None
    assert cut >= 5


def test_long_casts_table_folds_past_the_worst():
    record = {"site": "m a.py:1", "module": "m", "file": "a.py", "line": 1, "via": None,
              "origin": "cast", "name": None, "src_dtype": "torch.float32",
              "dtype": "torch.float16", "calls": 1, "measured": True, "graph_cuts": 0,
              "imag_dropped": 0, "double_rounded": 0, "violations": [],
              "stats": {"numel": 4, "inexact": 0, "nan": 0, "overflow": 0, "underflow": 0,
                        "subnormal": 0, "max_rel_err": 0.0, "sqnr_db": "inf"}}
    records = [dict(record, line=i, site=f"m a.py:{i}") for i in range(CAST_ROWS + 7)]
    records[-1] = dict(records[-1], violations=["1 overflow"])  # folded: counted
    text = render_html({"records": records})
    assert "7 more sites (1 with violations)" in text
    assert text.count("<tr") == len(records) + 2


def test_histograms_not_duplicated(data, page):
    modules = parse(page).modules
    names = [m.split(" · ")[0] for m in modules]
    both = [m for m in modules if m.startswith("lm_head = GPT · forward")]
    assert len(both) == 1
    assert not any(n in ("lm_head", "GPT") for n in names)  # neither drawn on its own
    heads = [tuple(m.split(" · ")[:3]) for m in modules]
    assert len(heads) == len(set(heads))
    assert page.count("<svg") == len(modules) < len(data["health"])


class _Writer:
    """Records every (tag, step) written, scalars and histograms alike."""

    def __init__(self):
        self.written, self.values = [], {}

    def add_scalar(self, tag, value, step):
        self.written.append((tag, step))
        self.values[(tag, step)] = value

    def add_histogram_raw(self, tag, min, max, num, sum, sum_squares, bucket_limits,
                          bucket_counts, global_step):
        self.written.append((tag, global_step))


def repeated(written):
    return {k: n for k, n in collections.Counter(written).items() if n > 1}


def test_tensorboard_tags_unique_on_the_model(data):
    writer = _Writer()
    for step in (0, 1):
        write_tensorboard(data, writer, step)
    assert repeated(writer.written) == {}
    tags = {t for t, _ in writer.written}
    sites = {t.rsplit("/", 1)[0] for t in tags if t.startswith("torchcast/cast/")}
    assert len(sites) == sum(r["measured"] for r in data["records"])  # one per record
    assert not any("/torch.float16/torch.float16/" in t for t in tags)  # no identity headroom


def test_tensorboard_tags_unique_on_colliding_rows(data):
    """Sites differing only in dtype pair, sites whose tags meet once unsafe
    characters are replaced, a record and a health row given twice, modules
    named alike (None and "-", "a b" and "a_b"), health rows of both phases
    and of float16, bfloat16 and float32, with their headroom rows; and the
    records in another order at the next step (the worst changes): each tag
    still follows one record."""
    record = data["records"][0]
    records = [record, dict(record, src_dtype="torch.bfloat16"), dict(record),
               dict(record, site=record["site"] + " "), dict(record, site=record["site"] + ":")]
    records = [dict(r, stats=dict(r["stats"], max_rel_err=float(i if i != 2 else 0)))
               for i, r in enumerate(records)]  # a value per record; the repeat as its first
    health, headroom_rows = [], []
    for module in ("a b", "a_b", None, "-", "a b"):
        for phase in ("forward", "backward"):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                h = torchcast.tensor_health(torch.randn(64).to(dtype) * 300)
                health.append({"module": module, "phase": phase, **h.to_dict()})
                headroom_rows += [HeadroomRow(module, phase, dtype, headroom(h, f, s)).to_dict()
                                  for f in FORMATS for s in (None, "amax")]
    colliding = {"format": "torchcast.track.Report", "records": records, "health": health,
                 "headroom": headroom_rows, "nonfinite": [], "propagated": 0}
    colliding = json.loads(json.dumps(colliding))  # as read back from JSON
    writer = _Writer()
    write_tensorboard(colliding, writer, 3)
    write_tensorboard(dict(colliding, records=records[::-1]), writer, 4)
    assert repeated(writer.written) == {}
    per_step = [t for t, s in writer.written if s == 3]
    cast = [t for t in per_step if "/cast/" in t]
    assert len(cast) == 6 * len(records)  # every record written, none merged away
    histograms = [t for t in per_step if t.endswith("/log2_abs")]
    assert len(histograms) == len(health)
    # The same tags at the next step, each with its record's value: one series each.
    assert sorted(per_step) == sorted(t for t, s in writer.written if s == 4)
    errors = [t for t in cast if t.endswith("/max_rel_err")]
    assert len(set(writer.values[(t, 3)] for t in errors)) == len(records) - 1
    assert all(writer.values[(t, 3)] == writer.values[(t, 4)] for t in errors)


def _layout(page_text, tmp_path, width=1400):
    """The page's scroll width and widest element in Chromium at ``width``
    px, every <details> opened: a probe script added to a copy of the page
    writes them into the DOM, which --dump-dom returns."""
    probe = ("<script>document.querySelectorAll('details').forEach(d => d.open = true);"
             "let right = 0, widest = '';"
             "for (const e of document.querySelectorAll('body *')) {"
             " const r = e.getBoundingClientRect().right;"
             " if (r > right) { right = r; widest = e.tagName + ' ' + e.className; } }"
             "const t = document.querySelector('#casts table').getBoundingClientRect();"
             "document.body.setAttribute('data-layout', JSON.stringify({scroll:"
             " document.documentElement.scrollWidth, inner: innerWidth, right, widest,"
             " casts: t.right}));</script>")
    path = tmp_path / "probe.html"
    path.write_text(page_text.replace("</body>", probe + "</body>"), encoding="utf-8")
    done = subprocess.run([chromium.chromium(), *chromium._FLAGS, f"--window-size={width},900",
                           "--dump-dom", "file://" + str(path)],
                          capture_output=True, text=True, timeout=120, check=True)
    start = done.stdout.index('data-layout="') + len('data-layout="')
    return json.loads(html.unescape(done.stdout[start:done.stdout.index('"', start)]))


@pytest.mark.skipif(chromium.chromium() is None,
                    reason="chromium not installed (apt-get install chromium)")
def test_page_fits_a_1400_px_window(data, page, tmp_path):
    """The model's page, and the same with the sites a user of a library
    model gets (a script deep in a run directory, the library's frame as
    via: the old page's casts table reached 1444 px with these)."""
    script = ("/home/alice/.cache/experiments/2024-06-01_gpt2_small_fp16_autocast_lr3e-4_"
              "warmup2000_cosine_decay_seed1234/runs/nightly/scripts/train_gpt2.py")
    via = "transformers/models/gpt2/modeling_gpt2.py:254"
    records = [dict(r, file=script, via=via, module=f"model.{r['module'] or 'GPT'}",
                    site=f"model.{r['module'] or 'GPT'} {script}:{r['line']} via {via}")
               for r in data["records"]]
    for text in (page, render_html(dict(data, records=records))):
        layout = _layout(text, tmp_path)
        assert layout["inner"] == 1400
        assert layout["scroll"] <= 1400, layout
        assert layout["right"] <= 1400 and layout["casts"] <= 1400, layout


def test_what_to_fix_names_the_modules_closest_to_overflow():
    health = []
    for module, scale in (("far", 1.0), ("near", 3e4), ("nearer", 6e4)):
        h = torchcast.tensor_health((torch.rand(256) * scale).half())
        health.append({"module": module, "phase": "forward", **h.to_dict()})
    fix = section_text(render_html({"records": [], "health": health}), "fix")
    assert "Closest to overflow" in fix and "far" not in fix.replace("nearer", "")
    assert fix.index("nearer") < fix.index("near</code>")  # the closest first
    quiet = section_text(render_html({"records": [], "health": health[:1]}), "fix")
    assert "Nothing found" in quiet
