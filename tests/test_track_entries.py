"""track(nonfinite=...) and NaN/inf that no watched op made: they are named
where they enter (the first watched op that receives them, which argument,
the step, the line), and "raise" stops there once they reach the loss, the
gradients or the optimizer, before any parameter is written. The entries:
the block's data, a DataLoader worker's batch (fork and spawn), a
checkpoint's weights, a literal. One rank of two: tests/test_track_ranks.py.
"""
import io
import os
import sys

import pytest
import torch

import torchcast

LINE = {}


def _mark(name):
    LINE[name] = sys._getframe(1).f_lineno


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _batches(bad_step=3):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4)]
    batches[bad_step - 1][1, 3] = float("nan")
    return batches


def _train(model, batches, nonfinite=None):
    """SGD steps on ``batches``; returns (losses, report or None, error or None)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, report, error = [], None, None

    def steps():
        for x in batches:
            _mark("forward"); loss = model(x).square().mean()  # noqa: E702
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    if nonfinite is None:
        steps()
        return losses, None, None
    try:
        with torchcast.track(nonfinite=nonfinite) as report:
            steps()
    except torchcast.NonFiniteError as e:
        error = e
    return losses, report, error


def test_nan_in_the_data_is_an_entry_the_plain_record_misses(nonfinite_engine):
    losses, report, error = _train(_model(), _batches(), "record")
    assert error is None and report.propagated > 0
    entry = report.first_nonfinite
    assert [o.op for o in report.nonfinite] == ["aten::addmm"]
    assert (entry.op, entry.module, entry.line, entry.step, entry.step_kind) == \
        ("aten::addmm", "0", LINE["forward"], 3, "optimizer step")
    assert entry.entered == "argument 'mat1': the input of Sequential (the top-level module)"
    assert entry.nan == 8 and entry.reached and entry.rank is None
    assert "1 entry of NaN/inf no watched op made" in str(report)
    text = entry.describe()
    assert text.startswith("8 NaN entered at aten::addmm in 0's forward") and \
        "through argument 'mat1': the input of Sequential" in text


def test_raise_stops_at_the_data_s_nan_before_any_weight_is_written(nonfinite_engine):
    plain = _model()
    _train(plain, _batches()[:2])  # what the weights are after steps 1 and 2
    model = _model()
    losses, report, error = _train(model, _batches(), "raise")
    assert error is not None and error.origin.entered is not None
    assert error.step == 3 and error.reached_at == "the output of Sequential"
    assert len(losses) == 2  # step 3 stopped at the model's output
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)  # bit for bit: nothing of step 3 was written
    assert report.ended_by.startswith("NonFiniteError: 8 NaN entered at aten::addmm")
    assert str(report).startswith("torchcast.track: The block ended early (NonFiniteError")


def test_raise_at_op_stops_at_the_entry(nonfinite_engine):
    losses, _, error = _train(_model(), _batches(), "raise_at_op")
    assert len(losses) == 2 and error.op == "aten::addmm" and error.reached is None
    assert "Raised at the op (nonfinite=\"raise_at_op\")" in str(error)


def test_a_checkpoint_with_a_nan_weight(nonfinite_engine, tmp_path):
    saved = _model().state_dict()
    saved["2.weight"][0, 5] = float("nan")
    torch.save(saved, tmp_path / "ckpt.pt")
    # Loaded before the track: the weight enters where the forward reads it.
    model = _model()
    model.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    _, report, error = _train(model, _batches(bad_step=4)[:1], "raise")
    assert error is not None
    entry = error.origin
    assert (entry.op, entry.module, entry.step) == ("aten::addmm", "2", 1)
    assert entry.entered == "argument 'mat2': the parameter 2.weight of Sequential"
    # Loaded inside it: the load's copy is where it enters.
    model = _model()
    with torchcast.track(nonfinite="record") as report:
        _mark("load"); model.load_state_dict(torch.load(tmp_path / "ckpt.pt"))  # noqa: E702
    (entry,) = report.nonfinite
    assert (entry.op, entry.line, entry.entered.split(":")[0]) == \
        ("aten::copy_", LINE["load"], "argument 'src'")


def test_a_literal_enters_where_it_is_made(nonfinite_engine):
    x = torch.ones(3)
    with torchcast.track(nonfinite="record") as report:
        _mark("literal"); y = x * torch.tensor(float("inf"))  # noqa: E702
        y.sum()
    (entry,) = report.nonfinite
    assert (entry.op, entry.line, entry.posinf) == ("aten::mul", LINE["literal"], 3)
    assert entry.entered.startswith("argument 'other': a 0-d tensor holding inf, made from a "
                                    "Python number")
    assert report.propagated == 1  # the sum


def test_an_intentional_mask_is_no_entry_and_raise_lets_it_run(nonfinite_engine):
    scores = torch.randn(4, 4, requires_grad=True)
    with torchcast.track(nonfinite="raise") as report:
        for _ in range(3):
            masked = scores.masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
            full = torch.full((4, 4), float("-inf")).triu(1) + masked
            full.softmax(-1).sum().backward()
    assert report.nonfinite == [] and report.ended_by is None


class _Data(torch.utils.data.Dataset):
    """8 items of 8 floats; item 5 holds a NaN its worker wrote."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        x = torch.full((8,), 0.1 * i, dtype=torch.float64).float()  # a cast in the worker
        if i == 5:
            x[2] = float("nan")  # WORKER_NAN
        return x


WORKER_LINE = next(i for i, line in enumerate(open(__file__), 1) if "# WORKER_NAN" in line
                   and "next(" not in line)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_s_batch(context):
    loader = torch.utils.data.DataLoader(_Data(), batch_size=4, num_workers=2,
                                         multiprocessing_context=context)
    model = _model()
    with torchcast.track(all_casts=True, nonfinite="record") as report:
        for x in loader:
            model(x).sum()
    worker, parent = report.nonfinite
    assert (worker.line, worker.file, worker.worker) == (WORKER_LINE, __file__, 1)
    assert worker.entered.startswith("argument 'src': a 0-d tensor holding nan")
    assert parent.worker is None and parent.op == "aten::addmm"
    assert parent.entered == ("argument 'mat1': the input of Sequential (the top-level module), "
                              "in shared memory: a DataLoader worker's batch?")
    casts = [r for r in report.records if r.origin.startswith("cast [worker")]
    assert sum(r.calls for r in casts) == 8  # every item's cast, in both workers


def test_a_report_after_ctrl_c_says_it_was_interrupted(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text("import torch\nx = torch.randn(4).half()\nraise KeyboardInterrupt\n")
    import subprocess
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", "--json",
                          str(tmp_path / "r.json"), str(script)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 130, run.stderr
    assert "torchcast.track: The block ended early (KeyboardInterrupt)" in run.stderr
    report = torchcast.Report.from_json((tmp_path / "r.json").read_text())
    assert report.ended_by == "KeyboardInterrupt" and len(report.records) == 1
