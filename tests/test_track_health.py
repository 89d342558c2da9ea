"""track(health=True): each module's outputs and the gradients flowing into
it, measured and merged; checked against tensor_health of the very tensors
(captured by the test's own hooks and retain_grad) and, for headroom,
against casting them."""
import json

import ml_dtypes
import numpy as np
import pytest
import torch

import torchcast


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 64)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(64, 4)
        with torch.no_grad():
            self.up.weight.mul_(4000)  # outputs near float16's range

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def captured_run(model, x, backward=True):
    """Runs model under track(health=True), keeping every module's output
    (with retain_grad) through the test's own hooks."""
    outputs = {}

    def keep(name):
        def hook(module, args, out):
            if out.requires_grad:
                out.retain_grad()
            outputs.setdefault(name, []).append(out)
        return hook

    names = {m: n for n, m in model.named_modules()}
    handles = [m.register_forward_hook(keep(n or type(m).__name__)) for m, n in names.items()]
    with torchcast.track(health=True) as report:
        y = model(x)
        if backward:
            y.square().mean().backward()
    for h in handles:
        h.remove()
    return report, outputs


def merged(tensors):
    h = torchcast.tensor_health(tensors[0])
    for t in tensors[1:]:
        h.add_(torchcast.tensor_health(t))
    return h


def same(a, b):
    return (torch.equal(a.counts, b.counts) and torch.equal(a.hist, b.hist)
            and torch.equal(a.extrema, b.extrema))


def test_forward_outputs_and_backward_gradients_per_module():
    model = Net()
    report, outputs = captured_run(model, torch.randn(8, 16))
    rows = {(r.module, r.phase): r for r in report.health}
    assert set(rows) == {(m, p) for m in ("up", "act", "down", "Net")
                         for p in ("forward", "backward")}
    for name in ("up", "act", "down"):
        assert same(rows[(name, "forward")].health, merged([t.detach() for t in outputs[name]]))
        assert same(rows[(name, "backward")].health, merged([t.grad for t in outputs[name]]))
    assert rows[("up", "forward")].dtype == torch.float32


def test_calls_merge():
    model = Net()
    outputs = []
    handle = model.act.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    with torch.no_grad(), torchcast.track(health=True) as report:
        model(torch.randn(3, 16))
        model(torch.randn(5, 16) * 100)
    handle.remove()
    (row,) = [r for r in report.health if r.module == "act"]
    assert row.phase == "forward" and same(row.health, merged(outputs))
    assert row.health.numel == 8 * 64
    assert all(r.phase == "forward" for r in report.health)  # no_grad: no backward rows


def test_many_calls_merge_as_one_and_rows_are_independent():
    """A module called often enough that the watch merges its measures
    while recording (every 256 KiB of histograms), a container sharing its
    child's measure, and rows read twice or changed by the caller."""
    model = Net()
    outputs = []
    handle = model.down.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    with torch.no_grad(), torchcast.track(health=True) as report:
        for i in range(21):
            model(torch.randn(2 + i % 3, 16) * 10.0 ** (i % 5))
    handle.remove()
    rows = {r.module: r for r in report.health}
    expected = merged(outputs)
    assert same(rows["down"].health, expected) and same(rows["Net"].health, expected)
    rows["down"].health.add_(torchcast.tensor_health(torch.ones(4)))
    again = {r.module: r for r in report.health}
    assert same(again["Net"].health, expected)  # the container's row is its own


def test_headroom_matches_casting_the_outputs():
    model = Net()
    report, outputs = captured_run(model, torch.randn(8, 16) * 40)
    up = torch.cat([t.detach().reshape(-1) for t in outputs["up"]]).double().numpy()
    table = report.headroom(torch.float16)
    (row,) = [r for r in table.rows if (r.module, r.phase) == ("up", "forward")]
    with np.errstate(over="ignore"):
        y = up.astype(np.float16)
    assert row.result.overflow == int((~np.isfinite(y)).sum()) > 0
    assert table.rows[0].result.overflow_fraction == max(r.result.overflow_fraction for r in table)
    e4m3 = report.headroom(torch.float8_e4m3fn, scale="amax")
    (row,) = [r for r in e4m3.rows if (r.module, r.phase) == ("up", "forward")]
    scaled = up * row.result.scale
    y = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert row.result.overflow == 0
    assert row.result.underflow == int(((scaled != 0) & (y == 0)).sum())
    text = str(e4m3)
    assert "headroom in float8_e4m3fn" in text and "up" in text


def test_table_and_json():
    model = Net()
    report, _ = captured_run(model, torch.randn(8, 16))
    text = str(report)
    assert "numeric health of 8 module outputs and gradients" in text
    first = report.health[0]
    assert first.binades_to_overflow() == min(r.binades_to_overflow() for r in report.health)
    data = json.loads(report.to_json())
    assert {(h["module"], h["phase"]) for h in data["health"]} == \
        {(r.module, r.phase) for r in report.health}
    assert {r["format"] for r in data["headroom"]} == \
        {"torch.float16", "torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"}
    back = torchcast.Report.from_json(report.to_json())
    for a, b in zip(back.health, report.health):
        assert (a.module, a.phase) == (b.module, b.phase) and same(a.health, b.health)
    assert str(back.headroom(torch.bfloat16)) == str(report.headroom(torch.bfloat16))


def test_health_and_nonfinite_together():
    model = Net().half()
    with torchcast.track(health=True, nonfinite="record") as report:
        model(torch.randn(8, 16).half() * 40)
    assert report.first_nonfinite.module == "up"
    assert report.propagated > 0 and len(report.nonfinite) == 1  # health's own ops unseen
    up = [r for r in report.health if r.module == "up"][0]
    assert up.health.posinf + up.health.neginf > 0
    assert report.health[0].health.nan + report.health[0].health.posinf + \
        report.health[0].health.neginf > 0  # non-finite rows first


def test_headroom_needs_health():
    with torchcast.track() as report:
        pass
    with pytest.raises(RuntimeError, match="health=True"):
        report.headroom(torch.float16)
    assert report.health == []
