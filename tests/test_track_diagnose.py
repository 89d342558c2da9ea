"""Dtype mistakes that are not casts (tracker/diagnose.py): a failing op of
the dtype-mismatch family gets a note naming op, module, dtypes, the
variables holding each operand and the fix; a float64 operand promoting an
op's result is recorded as a promotion site."""
import json
import textwrap

import pytest
import torch

import torchcast
from torchcast import cli


def diagnosis(call):
    """The note torchcast adds to the error ``call`` raises under track."""
    with torchcast.track(all_casts=True):
        with pytest.raises(RuntimeError) as caught:
            call()
    error = caught.value
    # the program sees torch's own exception, its message untouched
    assert type(error) is RuntimeError and "torchcast" not in str(error)
    (note,) = error.__notes__
    return note


def test_a_failing_module_names_op_module_dtypes_holders_and_fix():
    model, x = torch.nn.Linear(4, 2), torch.randn(3, 4, dtype=torch.float64)

    def forward():
        return model(x)

    note = diagnosis(forward)
    assert note.startswith("torchcast: aten::addmm at ") and ", in module Linear " in note
    assert "torch.float64 (3, 4)" in note and "torch.float32 (4, 2)" in note  # weight.t()
    assert "held by variable x of forward" in note
    assert "fix: make the torch.float64 operand torch.float32" in note


def test_a_failing_function_names_op_and_both_operands():
    a, b = torch.randn(2, 3), torch.randn(3, 2, dtype=torch.float16)

    def product():
        return torch.mm(a, b)

    note = diagnosis(product)
    assert note.startswith("torchcast: aten::mm at ") and "in module" not in note
    assert "torch.float32 (2, 3), held by variable a of product" in note
    assert "torch.float16 (3, 2), held by variable b of product" in note
    assert "make the torch.float32 operand torch.float16" in note


def test_outside_track_and_for_other_errors_nothing_is_added():
    lin = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError) as caught:
        lin(torch.randn(3, 4, dtype=torch.float64))
    assert not getattr(caught.value, "__notes__", [])
    with torchcast.track(all_casts=True), pytest.raises(RuntimeError) as caught:
        torch.mm(torch.randn(2, 3), torch.randn(2, 3))  # shapes, not dtypes
    assert not getattr(caught.value, "__notes__", [])


def test_a_float64_target_promoting_a_loss_is_a_promotion_site():
    model = torch.nn.Linear(4, 2)
    x, target = torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.float64)
    with torchcast.track(all_casts=True) as report:
        loss = torch.nn.functional.mse_loss(model(x), target)
    assert loss.dtype == torch.float64
    (record,) = [r for r in report.records if r.origin.startswith("promotion")]
    assert (record.origin, record.src_dtype, record.dtype) == \
        ("promotion (mse_loss)", torch.float32, torch.float64)
    assert record.measured is False and record.calls == 1
    assert "a float64 operand made the result float64" in str(report)
    back = torchcast.Report.from_json(report.to_json())
    assert [r.key for r in back.records] == [r.key for r in report.records]
    # float64 end to end is no promotion; nor is a 0-d float64 scalar
    with torchcast.track(all_casts=True) as plain:
        torch.randn(3, dtype=torch.float64) * 2
        torch.randn(3) * torch.tensor(2.0, dtype=torch.float64)
    assert len(plain) == 0
    audit = torchcast.audit(model, (x,), target=target,
                            loss_fn=torch.nn.functional.mse_loss)
    (finding,) = audit.of_kind("promotion")
    assert finding.severity == "warning" and "torch.as_tensor" in finding.fix


def test_the_cli_prints_the_diagnosis_of_a_float64_leak(tmp_path, capsys):
    script = tmp_path / "leak.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        x = torch.from_numpy(np.ones((3, 4)))
        out = model(x)
    """))
    out_json = tmp_path / "report.json"
    assert cli.main(["--json", str(out_json), str(script)]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: mat1 and mat2 must have the same dtype" in err
    assert "torchcast: aten::addmm at " in err and "leak.py:6, in module 0 " in err
    assert "held by variable x of <module>" in err
    assert "numpy arrays are float64 unless told otherwise" in err
    assert json.loads(out_json.read_text())["format"] == "torchcast.track.Report"
