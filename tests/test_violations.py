"""Which losses are violations (torchcast.violations): the specification,
the thresholds, and their use by track(), its report and the CLI."""
import json
import math

import pytest
import torch

import torchcast
from torchcast import cli
from torchcast.stats import CastStats
from torchcast.violations import ALL, DEFAULT, KINDS, STRICT, Violations


def stats(dtype=torch.float16, **counts):
    numel = counts.pop("numel", 1000)
    return CastStats(torch.float32, dtype, numel=numel, **counts)


@pytest.mark.parametrize("spec, thresholds", [
    ("overflow", {"overflow": 0.0}),
    ("underflow>1%, overflow", {"overflow": 0.0, "underflow": 0.01}),
    ("subnormal>0.25", {"subnormal": 0.25}),
    ("all", {k: 0.0 for k in KINDS}),
    ("none", {}), ("", {}),
    ({"nan": 0, "underflow": 0.5}, {"nan": 0.0, "underflow": 0.5}),
    (["graph_cut", "overflow"], {"overflow": 0.0, "graph_cut": 0.0}),
    (None, {"overflow": 0.0, "saturated": 0.0, "underflow": 0.01, "graph_cut": 0.0,
            "imag_dropped": 0.0}),
])
def test_specifications_parse_and_print_back(spec, thresholds):
    v = Violations(spec)
    assert v.thresholds == thresholds
    assert Violations(str(v)) == v and Violations(v) == v


@pytest.mark.parametrize("spec, match", [
    ("overflow,inexact", r"unknown kind 'inexact' in violations='overflow,inexact'; the kinds "
                         r"are overflow, saturated, nan, underflow"),
    ("underflow>100%", r"must be a fraction of the elements in \[0, 1\).*got 1\.0"),
    ("underflow>-0.1", r"must be a fraction.*got -0\.1"),
    ("underflow>x", r"cannot read 'underflow>x'.*KIND>FRACTION"),
    ("underflow>1e", r"must be a fraction.*got nan"),
    ({"overflow": True}, r"must be a fraction.*got True"),
    ({"overflow": 1.5}, r"got 1\.5"),
])
def test_bad_specifications_name_the_spec_and_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        Violations(spec)
    with pytest.raises(ValueError, match=match):
        torchcast.track(violations=spec)


def test_a_spec_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="violations must be a str, a dict"):
        Violations(3)


def test_thresholds_are_strict_fractions_of_the_elements():
    v = Violations("underflow>1%")
    assert v.found(stats(underflow=10)) == []           # exactly 1%: not above it
    assert v.found(stats(underflow=11)) == ["11 underflow"]
    assert Violations("underflow").found(stats(underflow=1)) == ["1 underflow"]
    assert v.found(stats(underflow=0, numel=0)) == []


def test_default_flags_what_breaks_training_and_notes_the_rest():
    v = Violations()
    s = stats(overflow=1, subnormal=900, nan=5, underflow=3)
    assert v.found(s) == ["1 overflow"]
    assert v.notes(s) == ["5 nan", "3 underflow", "900 subnormal"]
    assert v.found(None, graph_cuts=2, imag_dropped=1) == ["2 graph cuts",
                                                           "1 imaginary parts dropped"]
    assert Violations("overflow").found(None, graph_cuts=2) == []


def test_integer_targets_count_nan_and_out_of_range_as_overflow():
    """NaN cast to an integer is an arbitrary integer: the overflow kind
    covers NaN, infinite and out-of-range values for integer targets."""
    s = stats(torch.int8, nan=1, overflow=2, numel=10)
    assert Violations("overflow").found(s) == ["1 nan", "2 overflow"]
    assert Violations("overflow>50%").found(s) == []
    assert Violations("nan,underflow").found(s) == []


def test_strict_is_safe_to_rule():
    assert torchcast.cast.is_violation(stats(subnormal=1), None, None)
    assert not torchcast.cast.is_violation(stats(nan=3), None, None)
    assert torchcast.cast.is_violation(stats(torch.int32, nan=1), None, None)
    assert Violations(STRICT).thresholds.keys() == set(KINDS) - {"nan"}
    assert Violations(ALL).thresholds.keys() == set(KINDS)


class TinyWeights(torch.nn.Module):
    """A look-alike of a model.half() whose weights hold a few values below
    float16's normal range, and an activation that overflows float16."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        with torch.no_grad():
            self.fc.weight.fill_(0.01)
            self.fc.bias.fill_(0.01)
            self.fc.weight[0, :5] = 1e-6  # 5 of 4160 params subnormal in float16

    def forward(self, x):
        return self.fc(x)


def test_model_half_subnormal_weights_are_notes_by_default():
    model = TinyWeights()
    with torchcast.track(all_casts=True, policy="raise") as report:
        model.half()  # 5 subnormal weights: a note, not a reason to stop
    (weight,) = report.records  # weight and bias: one site, model.half()'s line
    assert weight.stats.numel == 4160 and weight.calls == 2
    assert weight.stats.subnormal == 5 and weight.violations() == []
    assert weight.notes() == ["5 subnormal"]
    assert "0 with violations" in str(report)
    with pytest.raises(torchcast.PrecisionLossError, match="5 became subnormal"):
        with torchcast.track(all_casts=True, policy="raise", violations="subnormal"):
            TinyWeights().half()
    with pytest.raises(torchcast.PrecisionLossError, match="1 overflowed to inf"):
        with torchcast.track(all_casts=True, policy="raise"):
            torch.tensor([1.0, 1e6]).half()


def test_nan_gradients_in_a_backward_cast_are_counted_and_selectable():
    x = torch.ones(32000, requires_grad=True)
    for kinds, flagged in ((None, False), ("nan", True)):
        with torchcast.track(all_casts=True, policy="record", violations=kinds) as report:
            x.half().float().backward(torch.full((32000,), math.nan))
        back = [r for r in report.records if r.origin == "backward"]
        assert back and all(r.stats.nan == 32000 for r in back)
        assert all(bool(r.violations(kinds=kinds)) == flagged for r in back)
        row = next(line for line in str(report).splitlines() if " backward " in line)
        assert " 32000 " in row
        data = json.loads(report.to_json())
        assert data["violations"] == str(Violations(kinds))
        rows = [r for r in data["records"] if r["origin"] == "backward"]
        assert all(r["stats"]["nan"] == 32000 for r in rows)
        assert all((r["violations"] == ["32000 nan"]) == flagged for r in rows)
        assert torchcast.Report.from_json(report.to_json()).kinds == Violations(kinds)


@pytest.fixture
def subnormal_script(tmp_path):
    script = tmp_path / "weights.py"
    script.write_text("import torch\n"
                      "w = torch.full((1000,), 1e-6)\n"
                      "w.half()\n")
    return script


def test_cli_violations_option(subnormal_script, capsys):
    assert cli.main(["--policy", "raise", str(subnormal_script)]) == 0
    assert cli.main(["--policy", "raise", "--violations", "subnormal>50%",
                     str(subnormal_script)]) == 1
    assert "1000 became subnormal" in capsys.readouterr().err
    assert cli.main(["--policy", "raise", "--violations", "all", str(subnormal_script)]) == 1
    with pytest.raises(SystemExit) as e:
        cli.main(["--violations", "subnormal>2", str(subnormal_script)])
    assert e.value.code == 2
    assert "must be a fraction of the elements" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["x.py"]).violations == Violations(DEFAULT)
