"""A report's writers on the data it exists for: inf, -inf and NaN in every
float field that can hold them (cast stats, rtol/atol, the inputs of
non-finite origins, module health) survive ``to_json`` -> ``from_json``
field by field, the JSON is strict (any parser reads it without options),
and ``to_html``/``to_tensorboard`` show them instead of raising. Also the
violation thresholds, which JSON must keep exactly."""
import dataclasses
import json
import math
import os

import pytest
import torch

import torchcast
from torchcast.stats import STAT_FIELDS
from torchcast.tracker.health_rows import ModuleHealth
from torchcast.tracker.html import render_html
from torchcast.tracker.origin import InputInfo, NonFiniteOrigin
from torchcast.tracker.report import Report
from torchcast.tracker.report_dict import write_text
from torchcast.tracker.tensorboard import write_tensorboard
from torchcast.violations import Violations
from scalar_writer import ScalarWriter

NONFINITE = (math.inf, -math.inf, math.nan)
FLOAT_STATS = tuple(f.name for f in dataclasses.fields(torchcast.CastStats)
                    if f.name in STAT_FIELDS and f.type is float)


def _same(a, b, where="report"):
    """a == b, NaN equal to NaN, recursing into dataclasses, tuples, lists
    and dicts; the assertion names the first field that differs."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), (where, a, b)
    else:
        assert a == b and type(a) is type(b), (where, a, b)


def _health_rows(report):
    return [(r.module, r.phase, r.dtype, tuple(r.health.read()), r.health.hist.tolist())
            for r in report.health]


def assert_same_report(a: Report, b: Report) -> None:
    """Every field of the two reports, NaN compared as NaN."""
    _same((a.rtol, a.atol), (b.rtol, b.atol), "rtol, atol")
    assert a.kinds == b.kinds
    _same(sorted(a.records, key=repr), sorted(b.records, key=repr), "records")
    _same(a.nonfinite, b.nonfinite, "nonfinite")
    assert a.propagated == b.propagated
    _same(_health_rows(a), _health_rows(b), "health")


def _strict_loads(text):
    """json.loads that fails on NaN/Infinity: what a strict parser reads."""
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant} in the report")
    return json.loads(text, parse_constant=refuse)


def nonfinite_report(value: float) -> Report:
    """A report whose every float field that can hold a non-finite value
    holds ``value``: rtol and atol; every float stat of a cast site (and so
    its SQNR); an origin's input amax; a health row's extrema (amax: not
    +inf, which a measure over finite elements never gives and the health
    table's ordering does not take)."""
    report = Report(rtol=value, atol=value, violations="overflow,underflow>0.5")
    # No overflow: the table would show the max rel err as inf (CastStats.worst_rel_err).
    stats = torch.tensor([value if name in FLOAT_STATS else 0.0 if name == "overflow" else 3.0
                          for name in STAT_FIELDS], dtype=torch.float64)
    key = ("block.fc", "/x/train.py", 12, "cast", None, torch.float32, torch.float16, None)
    report.casts.add(key, stats, measured=True, calls=2, imag=1, double_rounded=2)
    unmeasured = ("block", "/x/train.py", 13, "cast", None, torch.float32, torch.int8, None)
    report.casts.add(unmeasured, None, measured=False, numel=5, graph_cuts=1)
    origin = NonFiniteOrigin(
        "aten::mul_", "block.fc", "forward", None, "/x/train.py", 14, None, torch.float16,
        nan=1, posinf=2, neginf=0, inputs=[InputInfo(torch.float16, (3,), value),
                                           InputInfo(torch.float32, (), 2.0)],
        note="a note", count=3)
    report.set_origins([origin], propagated=4)
    measured = torchcast.tensor_health(torch.tensor([0.5, 3.0, 0.0]))
    measured.extrema.copy_(torch.tensor([value if value != math.inf else math.nan, value]))
    report.set_health([ModuleHealth("block.fc", "forward", measured),
                       # min_nonzero inf: no nonzero
                       ModuleHealth("block", "backward", torchcast.tensor_health(torch.zeros(4)))])
    return report


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
def test_json_round_trip_keeps_every_nonfinite_field(value):
    report = nonfinite_report(value)
    text = report.to_json()
    data = _strict_loads(text)
    # The chosen encoding: the strings "inf", "-inf", "nan" in float fields.
    name = str(value)
    stats = next(r["stats"] for r in data["records"] if r["measured"])
    assert all(stats[f] == name for f in FLOAT_STATS)
    assert data["rtol"] == data["atol"] == name
    assert data["nonfinite"][0]["inputs"][0]["amax"] == name
    fc = next(h for h in data["health"] if h["module"] == "block.fc")
    # min_nonzero's inf ("no nonzero element") is null, as it was before the strings
    assert fc["min_nonzero"] == (None if value == math.inf else name)
    back = Report.from_json(text)
    assert_same_report(report, back)
    assert back.to_json() == text  # and again


def test_json_round_trip_of_a_tracked_overflow(tmp_path):
    """The data of issue 25.4: a cast whose every element overflowed (max
    errors inf, SQNR -inf), origins, an all-zero module output."""
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    with torchcast.track(all_casts=True, policy="record", nonfinite="record",
                         health=True) as report:
        h = torch.ones(3, dtype=torch.float16)
        h.mul_(1e5)
        torch.full((3,), 1e6).half()
        model(torch.ones(2, 4))
    cast = next(r for r in report.records if r.stats.overflow == 3)
    assert cast.stats.max_rel_err == math.inf and cast.stats.sqnr_db == -math.inf
    assert report.nonfinite
    assert any(r.health.min_nonzero == math.inf for r in report.health)  # the zero output
    text = report.to_json()
    data = _strict_loads(text)
    record = next(r for r in data["records"] if r["stats"]["overflow"] == 3)
    assert record["stats"]["max_rel_err"] == "inf" and record["stats"]["sqnr_db"] == "-inf"
    assert_same_report(report, Report.from_json(text))
    out = tmp_path / "report.json"
    report.write_json(str(out), indent=1)
    assert_same_report(report, Report.from_json(out.read_text()))


def test_from_json_names_a_bad_float_field():
    data = nonfinite_report(math.inf).to_dict()
    data["nonfinite"][0]["inputs"][0]["amax"] = "huge"
    with pytest.raises(ValueError, match="amax must be a number or one of 'inf'"):
        Report.from_dict(data)


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
def test_html_shows_nonfinite_values(value, tmp_path):
    report = nonfinite_report(value)
    out = tmp_path / "report.html"
    report.to_html(str(out))
    page = out.read_text(encoding="utf-8")
    assert f"<td>{value}</td>" in page  # the cast's max rel err and SQNR
    assert f"amax {value}" in page  # the origin's input and the health row
    assert render_html(json.loads(report.to_json())) == page  # from saved JSON: the same


def test_html_of_a_cast_whose_every_element_overflowed(tmp_path):
    with torchcast.track(all_casts=True, policy="record") as report:
        torch.full((3,), 1e6).half()
    out = tmp_path / "report.html"
    report.to_html(str(out))
    assert "<td>inf</td>" in out.read_text(encoding="utf-8")



@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
def test_tensorboard_writes_nonfinite_values(value):
    report = nonfinite_report(value)
    writer = ScalarWriter()
    report.to_tensorboard(writer, step=1)
    scalars = writer.scalars
    site = next(t for t in scalars if t.endswith("/max_rel_err"))
    _same(scalars[site], value, site)
    sqnr = scalars[site.replace("max_rel_err", "sqnr_db")]
    assert not math.isfinite(sqnr)
    assert all(isinstance(v, (int, float)) for v in scalars.values())
    # the same from the saved JSON
    again = ScalarWriter()
    write_tensorboard(json.loads(report.to_json()), again, 1)
    _same(sorted(again.scalars.items()), sorted(scalars.items()), "scalars")


def test_tensorboard_summary_writer_keeps_inf(tmp_path):
    tb = pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with torchcast.track(all_casts=True, policy="record") as report:
        torch.full((3,), 1e6).half()
    writer = tb.SummaryWriter(str(tmp_path))
    report.to_tensorboard(writer, 1)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tag = next(t for t in events.Tags()["scalars"] if t.endswith("/max_rel_err"))
    assert events.Scalars(tag)[0].value == math.inf


def test_write_text_is_atomic(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("the old report")
    with pytest.raises(TypeError):
        write_text(str(out), object())  # fails while writing
    assert out.read_text() == "the old report"
    assert os.listdir(tmp_path) == ["report.json"]  # no temporary file left
    write_text(str(out), "new")
    assert out.read_text() == "new" and os.listdir(tmp_path) == ["report.json"]


# --- violation thresholds (issue 26.7) ----------------------------------------------------------

THRESHOLDS = (0.9999999, 0.123456789, 1e-300, 5e-324, 0.01, 0.1 + 0.2, 1 - 2 ** -53, 0.5)


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_violation_thresholds_are_written_exactly(threshold):
    spec = Violations({"overflow": 0.0, "underflow": threshold})
    assert Violations(str(spec)).thresholds["underflow"] == threshold
    with torchcast.track(all_casts=True, violations=spec) as report:
        torch.ones(2).half()
    back = Report.from_json(report.to_json())
    assert back.kinds.thresholds["underflow"] == threshold
    assert back.kinds == report.kinds


def test_violation_threshold_string_form():
    assert str(Violations("underflow>0.9999999")) == "underflow>0.9999999"
    assert str(Violations("underflow>0.123456789")) == "underflow>0.123456789"
    assert str(Violations("underflow>1%")) == "underflow>0.01"
