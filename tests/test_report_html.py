"""Report.to_html and Report.to_tensorboard on a real tracked step (a float16
model whose Linear overflows), and the page in headless Chromium: it loads
without console errors and its SVGs have one bar per populated binade and
four format windows per histogram."""
import html.parser
import json
import os
import struct
import sys
import zlib

import pytest
import torch

import torchcast
from torchcast.tracker.health_rows import headroom_view
from torchcast.tracker.html import OPEN_ENTRIES, render_html
from torchcast.tracker.tensorboard import write_tensorboard

import chromium  # tests/chromium.py

needs_chromium = pytest.mark.skipif(chromium.chromium() is None,
                                    reason="chromium not installed (apt-get install chromium)")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 4)
        with torch.no_grad():
            self.up.weight.mul_(4000)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture(scope="module")
def report():
    model = Block().half()
    with torchcast.track(all_casts=True, policy="record", nonfinite="record",
                         health=True) as rep:
        y = model(torch.randn(8, 16).half() * 40)
        y.float().square().mean().backward()
    return rep


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.classes, self.urls, self.text = [], [], [], []
        self.details = []  # (class, open) of each <details>

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        self.classes.append((tag, attrs.get("class", "")))
        if tag == "details":
            self.details.append((attrs.get("class", ""), "open" in attrs))
        for name in ("src", "href", "xlink:href"):
            if name in attrs:
                self.urls.append(attrs[name])

    def handle_data(self, data):
        self.text.append(data)


def parse(text):
    page = _Page()
    page.feed(text)
    return page


def distinct(health):
    """The health entries the page draws: one per equal measures (a
    container returning its last child's output is its child's tensor)."""
    seen = {}
    for h in health:
        seen.setdefault(json.dumps({k: v for k, v in h.items() if k != "module"},
                                   sort_keys=True), h)
    return list(seen.values())


def expected_bars(data):
    return sum(sum(1 for n in h["hist"] if n) + (1 if h["nan"] + h["posinf"] + h["neginf"] else 0)
               for h in distinct(data["health"]))


def test_page_is_self_contained_and_complete(report, tmp_path):
    path = tmp_path / "report.html"
    report.to_html(str(path))
    text = path.read_text(encoding="utf-8")
    page = parse(text)
    assert "script" not in page.tags and page.urls == []  # nothing to run, nothing fetched
    data = report.to_dict()
    bars = [c for t, c in page.classes if t == "rect" and c.split()[0] == "bar"]
    windows = [c for t, c in page.classes if t == "rect" and c.startswith("window normal")]
    assert len(bars) == expected_bars(data) > 0
    # Block returns down's output: one histogram for both (it was drawn twice).
    assert len(windows) == 4 * len(distinct(data["health"])) == 4 * (len(data["health"]) - 2)
    body = " ".join(page.text)
    assert "aten::addmm" in body and "Where NaN/inf first appeared" in body
    assert all(r["site"] in body for r in data["records"])
    assert "float8_e4m3fn" in body


def test_a_long_report_folds_past_the_worst_entries():
    """A model with more module entries than OPEN_ENTRIES: the worst ones
    (NaN/inf first) open, the rest folded with every histogram still on the
    page; headroom rows that lose nothing folded below the table."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(10)])
    with torch.no_grad():
        model[-1].weight.fill_(1e38)  # the last layer overflows
    with torchcast.track(health=True) as rep:
        model(torch.randn(4, 8) * torch.tensor([1e-30, 1.0, 1e30, 1.0] * 2))
    data = rep.to_dict()
    page = parse(render_html(data))
    modules = [opened for cls, opened in page.details if cls == "module"]
    # The root returns the last Linear's output: one entry for both.
    assert len(modules) == len(distinct(data["health"])) == len(data["health"]) - 1
    assert len(modules) > OPEN_ENTRIES
    nonfinite = [h["nan"] + h["posinf"] + h["neginf"] > 0 for h in distinct(data["health"])]
    assert modules == [i < OPEN_ENTRIES for i in range(len(modules))]
    assert nonfinite[0] and all(modules[i] for i, bad in enumerate(nonfinite) if bad)
    assert sum(1 for t, c in page.classes if t == "svg") == len(modules)
    lossless = [r for r in data["headroom"]
                if r["overflow"] == r["underflow"] == r["subnormal"] == 0]
    assert 0 < len(lossless) < len(data["headroom"])
    assert [cls for cls, opened in page.details if not opened].count("lossless") == 1
    headroom_only = parse(render_html({"headroom": data["headroom"]}))
    # One row per module, phase and format (the amax scale beside scale 1), a
    # header row per table.
    assert headroom_only.tags.count("tr") == \
        len(headroom_view(data["headroom"])) + headroom_only.tags.count("table")
    assert len(headroom_view(data["headroom"])) == len(data["headroom"]) // 2


def test_user_text_is_escaped():
    data = {"records": [], "nonfinite": [{
        "op": "aten::log", "module": "<script>alert(1)</script>", "phase": "forward",
        "node": None, "file": "a&b.py", "line": 3, "via": None, "dtype": "torch.float32",
        "nan": 1, "posinf": 0, "neginf": 0, "count": 1, "inputs": [], "note": "<b>x</b>"}]}
    text = render_html(data)
    page = parse(text)
    assert "script" not in page.tags and "<b>x</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "a&amp;b.py" in text
    assert "&lt;b&gt;x&lt;/b&gt;" in text


def test_renders_from_saved_json(report):
    again = torchcast.Report.from_json(report.to_json())
    data = json.loads(report.to_json())
    assert expected_bars(again.to_dict()) == expected_bars(data)


def test_shows_a_precision_plan(report, tmp_path):
    """to_html(plan=...): per recipe the layers kept in bf16 with their
    reasons, and a row per layer and recipe, failing cells marked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    x = torch.randn(64, 64)
    x[:, 0] = 1e5  # flushes most of layer 0's input in tensorwise float8
    plan = torchcast.precision_plan(model, lambda: model(x).sum().backward(),
                                    recipes=("tensorwise", "mxfp8"))
    path = tmp_path / "report.html"
    report.to_html(str(path), plan=plan)
    text = path.read_text(encoding="utf-8")
    page = parse(text)
    assert "script" not in page.tags and page.urls == []
    body = " ".join(page.text)
    assert "Precision plan" in body and "tensorwise: SQNR" in body
    why = plan.keep_in_bf16("tensorwise")
    assert [layer for layer, _ in why] == ["0"] and f"({why[0][1]})" in body
    assert "1 of 2 layers in low precision" in body
    rows = [c for t, c in page.classes if t == "tr" and c == "violation"]
    assert len(rows) == sum(1 for r in ("tensorwise", "mxfp8") for layer in plan.layers
                            if not plan.passes(layer, r))
    assert "Precision plan" not in render_html(report.to_dict())


@needs_chromium
def test_chromium_loads_it(report, tmp_path):
    path, png = tmp_path / "report.html", tmp_path / "report.png"
    report.to_html(str(path))
    rendered = chromium.render(str(path), str(png), size="1000,1400")
    assert rendered.console_errors == []
    dom = parse(rendered.dom)
    data = report.to_dict()
    bars = [c for t, c in dom.classes if t == "rect" and c.split()[0] == "bar"]
    assert len(bars) == expected_bars(data)
    assert sum(1 for t, c in dom.classes if t == "svg") == len(distinct(data["health"]))
    width, height, pixels = _read_png(png.read_bytes())
    assert (width, height) == (1000, 1400)
    assert len(set(pixels)) > 10  # not a blank page


def _read_png(blob):
    """(width, height, set of distinct rows' bytes): enough to tell a page
    from a blank one, without an image library."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", None
    while pos < len(blob):
        length, kind = struct.unpack(">I4s", blob[pos:pos + 8])
        chunk = blob[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = len(raw) // height
    rows = [raw[i * stride + 1:(i + 1) * stride] for i in range(height)]
    return width, height, rows


class _Writer:
    def __init__(self):
        self.scalars, self.histograms = {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)

    def add_histogram_raw(self, tag, min, max, num, sum, sum_squares, bucket_limits,
                          bucket_counts, global_step):
        self.histograms[tag] = (num, bucket_limits, bucket_counts, global_step)


class _PlainWriter(_Writer):
    add_histogram_raw = None

    def __getattribute__(self, name):
        if name == "add_histogram_raw":
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def add_histogram(self, tag, values, step):
        self.histograms[tag] = (len(values), step)


def test_tensorboard_scalars_and_histograms(report):
    writer = _Writer()
    report.to_tensorboard(writer, step=7)
    data = report.to_dict()
    assert writer.scalars["torchcast/nonfinite/origins"] == (1, 7)
    up = [h for h in data["health"] if (h["module"], h["phase"]) == ("up", "forward")][0]
    num, limits, counts, step = writer.histograms["torchcast/health/up/forward/torch.float16/log2_abs"]
    assert num == sum(up["hist"]) and counts == [n for n in up["hist"] if n] and step == 7
    assert all(" " not in tag and ":" not in tag for tag in writer.scalars)
    assert any(t.startswith("torchcast/headroom/up/forward") for t in writer.scalars)
    plain = _PlainWriter()
    write_tensorboard(data, plain, 3, prefix="run1")
    assert plain.histograms["run1/health/up/forward/torch.float16/log2_abs"][0] == sum(up["hist"])


def test_tensorboard_summary_writer(report, tmp_path):
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is not installed")
    writer = tb.SummaryWriter(str(tmp_path))
    report.to_tensorboard(writer, 1)
    writer.close()
    assert any(name.startswith("events.out") for name in os.listdir(tmp_path))


def test_cli_health_and_html(tmp_path):
    import subprocess
    import textwrap
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).half()
        with torch.no_grad():
            model[0].weight.fill_(300.0)
        model(torch.full((2, 8), 30.0, dtype=torch.float16)).float().sum().backward()
    """))
    out = tmp_path / "report.html"
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", "--nonfinite", "record",
                          "--health", "--html", str(out), str(script)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "aten::addmm made 16 +inf" in run.stderr
    assert "numeric health of" in run.stderr and f"HTML report written to {out}" in run.stderr
    page = parse(out.read_text(encoding="utf-8"))
    assert [c for t, c in page.classes if t == "rect" and c.split()[0] == "bar"]
