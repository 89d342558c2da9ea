"""track(nonfinite=...): each origin's step, and whether its NaN/inf reached
the block's outputs, the loss or the gradients, or were absorbed.

The model is built so that the test knows each step independently: in step
1, gelu_new's cube overflows float16 and its tanh absorbs the inf (the
outputs stay finite); in step 3 the head's matmul overflows and the inf is
the model's output and the loss."""
import inspect
import json
import math
import sys

import pytest
import torch

import torchcast
from torchcast.tracker import nonfinite
from torchcast.tracker.html import render_html

LINE = {}
HALF = torch.float16


def _mark(name):
    LINE[name] = sys._getframe(1).f_lineno


def gelu_new(x):
    # GPT-2's gelu: x ** 3 overflows float16 for |x| > 40; tanh(inf) is 1.
    _mark("pow"); cube = torch.pow(x, 3.0)  # noqa: E702
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * cube)))


class Net(torch.nn.Module):
    """fc is the identity; the head sums its 4 inputs times 600."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4))
            self.fc.bias.zero_()
            self.head.weight.fill_(600.0)
            self.head.bias.zero_()

    def forward(self, x):
        h = gelu_new(self.fc(x))
        _mark("head"); return self.head(h)  # noqa: E702


# Step 1: 50 ** 3 overflows (absorbed by tanh; the head gives 600 * 50 = 3e4).
# Step 3: 30 ** 3 does not; the head gives 4 * 600 * 30 = 7.2e4: +inf.
INPUTS = {1: [50.0, 0.0, 0.0, 0.0], 2: [1.0] * 4, 3: [30.0] * 4, 4: [1.0] * 4}


def train(action, steps=4, optimizer=True):
    """Runs the training loop in a track; returns (report, losses, error)."""
    model = Net().half()
    # lr 0: every step runs on the weights above, which make the values the
    # test knows; the optimizer's step still runs (and its hooks).
    opt = torch.optim.SGD(model.parameters(), lr=0.0) if optimizer else None
    losses, error = [], None
    try:
        with torchcast.track(nonfinite=action) as report:
            for step in range(1, steps + 1):
                x = torch.tensor([INPUTS[step]] * 2, dtype=HALF)
                out = model(x)
                loss = out.float().mean()
                losses.append(loss.item())
                if opt is not None:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    except torchcast.NonFiniteError as raised:
        error = raised
    return report, losses, error


def _step1_pow(o):
    return (o.op, o.module, o.phase, o.line) == ("aten::pow", "Net", "forward", LINE["pow"])


def _step3_addmm(o):
    return (o.op, o.module, o.phase, o.line) == ("aten::addmm", "head", "forward", LINE["head"])


def test_steps_and_reach_in_a_training_loop(nonfinite_engine):
    report, losses, _ = train("record")
    assert math.isfinite(losses[0]) and math.isfinite(losses[1])  # step 1's inf was absorbed
    assert losses[2] == math.inf and math.isfinite(losses[3])
    pow_, addmm = report.nonfinite  # time order
    assert _step1_pow(pow_) and _step3_addmm(addmm)
    assert (pow_.step, pow_.step_kind, pow_.reached, pow_.reached_at) == \
        (1, "optimizer step", False, None)
    assert pow_.absorbed_steps == 1 and pow_.count == 1
    assert (addmm.step, addmm.step_kind, addmm.reached, addmm.reached_step) == \
        (3, "optimizer step", True, 3)
    assert addmm.reached_at == "the output of Net"
    assert report.first_nonfinite is addmm
    assert "in optimizer step 3. Reached the output of Net at optimizer step 3." in \
        addmm.describe()
    assert "in optimizer step 1. Absorbed (the step's outputs" in pow_.describe()
    lines = str(report).splitlines()
    assert "(1 reached the outputs, loss or gradients, listed first; 1 absorbed" in lines[0]
    assert lines[1].startswith("  aten::addmm made") and lines[2].startswith("  aten::pow made")

    back = torchcast.Report.from_json(report.to_json())
    assert back.nonfinite == report.nonfinite and back.first_nonfinite == addmm
    data = json.loads(report.to_json())["nonfinite"]
    assert [(d["op"], d["step"], d["step_kind"], d["reached"], d["reached_at"]) for d in data] \
        == [("aten::pow", 1, "optimizer step", False, None),
            ("aten::addmm", 3, "optimizer step", True, "the output of Net")]
    page = render_html(report.to_dict())
    section = page[page.index("Where NaN/inf first appeared"):]
    assert section.index("aten::addmm") < section.index("aten::pow")  # the one that reached
    assert "optimizer step 3: <b>reached the output of Net</b> at step 3" in page
    assert "optimizer step 1: absorbed (the step" in page


def test_a_harmless_origin_that_recurs_is_listed_after_the_cause(nonfinite_engine, monkeypatch):
    # Step 3 overflows the cube again (50 ** 3) beside the head's matmul
    # (600 * (50 + 3 * 30) = 8.4e4): both are undecided when the output is
    # inf, and both are marked reached; the cube, absorbed in step 1, is
    # listed after the matmul, and "raise" names the matmul.
    monkeypatch.setitem(INPUTS, 3, [50.0, 30.0, 30.0, 30.0])
    report, _, _ = train("record")
    pow_, addmm = report.nonfinite
    assert _step1_pow(pow_) and pow_.count == 2 and _step3_addmm(addmm)
    assert (pow_.reached, pow_.reached_step, pow_.absorbed_steps) == (True, 3, 1)
    assert "but was absorbed in 1 other step" in pow_.describe()
    assert report.first_nonfinite is addmm
    _, _, error = train("raise")
    assert _step3_addmm(error.origin) and "1 other origins of the step (aten::pow)" in str(error)


def test_an_origin_in_the_optimizer_step_reaches_what_it_wrote(nonfinite_engine):
    # AdamW in float16: step 1's squared gradients (1.5e4 ** 2) overflow its
    # second moment; the cube's inf (absorbed, gradients finite) stays absorbed.
    model = Net().half()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    with torchcast.track(nonfinite="record") as report:
        model(torch.tensor([INPUTS[1]] * 2, dtype=HALF)).float().mean().backward()
        opt.step()
    first, *in_step = report.nonfinite
    assert _step1_pow(first) and first.reached is False
    assert in_step and all(o.reached and o.step == 1 for o in in_step)
    assert {o.reached_at for o in in_step} <= {"the parameters AdamW.step() wrote",
                                               "the state AdamW.step() keeps"}


def test_without_an_optimizer_a_step_is_a_call_of_the_first_top_level_module(nonfinite_engine):
    report, _, _ = train("record", optimizer=False)
    pow_, addmm = report.nonfinite
    assert (pow_.step, pow_.step_kind, pow_.reached) == (1, "call of Net", False)
    assert (addmm.step, addmm.step_kind, addmm.reached, addmm.reached_step) == \
        (3, "call of Net", True, 3)
    assert ", in call 3 of Net." in addmm.describe()
    assert report.first_nonfinite is addmm


def test_a_loss_module_called_beside_the_model_is_no_step_of_its_own(nonfinite_engine):
    model, criterion = Net(), torch.nn.MSELoss()
    batches = [torch.rand(2, 4) * 0.01 for _ in range(3)]
    batches[2][0, 0] = float("nan")  # the data of step 3: enters at its first op
    with torchcast.track(nonfinite="record") as report:
        for x in batches:
            criterion(model(x), torch.zeros(2, 1)).backward()
    (entry,) = report.nonfinite
    assert (entry.step, entry.step_kind, entry.reached, entry.op) == (3, "call of Net", True,
                                                                      "aten::addmm")
    assert entry.entered.startswith("argument 'mat1': the input of Net (the top-level module)")


def test_raise_still_stops_at_the_first_origin():
    report, losses, error = train("raise_at_op")
    assert losses == [] and error is not None
    assert _step1_pow(error.origin) and error.step == 1 and error.reached is None
    assert "whether its NaN/inf would reach the outputs, the loss or the gradients is not " \
        "known yet" in str(error)


def test_raise_stops_where_the_step_3_origin_reaches(nonfinite_engine):
    report, losses, error = train("raise")
    assert len(losses) == 2  # steps 1 and 2 ran to the end; step 3 stopped at the output
    assert error is not None and _step3_addmm(error.origin)
    assert (error.step, error.step_kind, error.reached_at) == (3, "optimizer step",
                                                               "the output of Net")
    assert "Raised where NaN/inf reached the output of Net." in str(error)
    assert "aten::addmm made 2 +inf" in str(error)
    assert [o.reached for o in report.nonfinite] == [False, True]


def test_an_origin_in_the_loss_reaches_the_loss(nonfinite_engine):
    model = Net().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with torchcast.track(nonfinite="record") as report:
        for scale in (-100.0, 100.0):  # exp(-100 * 2.2e4) is 0, exp(100 * 2.2e4) +inf
            out = model(torch.tensor([[1.0] * 4], dtype=HALF))
            _mark("exp"); loss = torch.exp(out.float() * scale).mean()  # noqa: E702
            opt.zero_grad()
            loss.backward()
            opt.step()
    [exp] = [o for o in report.nonfinite if o.line == LINE["exp"]]
    assert exp.op == "aten::exp" and exp.step == 2 and exp.reached
    assert exp.reached_at == "the loss (a tensor backward() ran from)"
    assert report.first_nonfinite is exp
    with pytest.raises(torchcast.NonFiniteError, match="reached the loss"):
        with torchcast.track(nonfinite="raise"):
            # A new model: SGD's step wrote the NaN gradients into the first one's.
            out = Net().half()(torch.tensor([[1.0] * 4], dtype=HALF))
            torch.exp(out.float() * 100.0).mean().backward()


class Caster(torch.nn.Module):
    """Widens a float16 input: in backward, the gradient (1e5) is cast back
    to float16 by ToCopyBackward0, and overflows."""

    def forward(self, x):
        return x.float() * 1e5


def test_a_backward_origin_names_the_forward_that_made_its_node(nonfinite_engine):
    x = torch.ones(4, dtype=HALF, requires_grad=True)
    with torchcast.track(nonfinite="record") as report:
        _mark("backward"); Caster()(x).sum().backward()  # noqa: E702
    [origin] = report.nonfinite
    assert (origin.op, origin.phase, origin.node, origin.module) == \
        ("aten::_to_copy", "backward", "ToCopyBackward0", "Caster")
    assert (origin.forward, origin.forward_file, origin.forward_line) == \
        ("Caster.forward", __file__, inspect.getsourcelines(Caster.forward)[1])
    text = origin.describe()
    assert ("from finite inputs in backward, in the gradient of ToCopyBackward0, made by "
            f"Caster's forward (Caster.forward, ") in text
    assert f"test_track_nonfinite_steps.py:{LINE['backward']} (the line that ran backward)" in text
    assert origin.step == 1 and origin.step_kind == "call of Caster"
    back = torchcast.Report.from_json(report.to_json())
    assert back.nonfinite == report.nonfinite


def test_a_gradient_the_step_leaves_is_checked_at_the_exit(nonfinite_engine):
    model = Net().half()
    with torch.no_grad():
        model.head.weight.fill_(1.0)
    x = torch.tensor([[1.0] * 4], dtype=HALF)
    with torchcast.track(nonfinite="record") as report:
        (model(x).float() * 1e5).sum().backward()  # head's weight gradient: 1e5 in float16
    [origin] = [o for o in report.nonfinite if o.phase == "backward"]
    assert origin.reached and origin.reached_at == "the gradients of Net's parameters"
    assert origin.node == "ToCopyBackward0" and origin.module is None  # .float() is outside Net
    assert "in the gradient of ToCopyBackward0, made outside any tracked module's forward" in \
        origin.describe()
    model.zero_grad()
    with pytest.raises(torchcast.NonFiniteError, match="reached the gradients of Net's"):
        with torchcast.track(nonfinite="raise"):
            (model(x).float() * 1e5).sum().backward()


def test_deferred_flags_are_read_before_each_check(monkeypatch):
    """The GPU nonfinite_engine (flags read in batches), run on the CPU: the pending
    flags are read before a step's checks, so origins are known there."""
    monkeypatch.setattr(nonfinite, "checked_at_once", lambda device: False)
    monkeypatch.setattr(nonfinite, "checked_in_cpp", lambda action: False)
    report, _, _ = train("record")
    assert [(o.op, o.step, o.reached) for o in report.nonfinite] == \
        [("aten::pow", 1, False), ("aten::addmm", 3, True)]
    _, losses, error = train("raise")
    assert len(losses) == 2 and _step3_addmm(error.origin)


def test_an_exception_leaves_the_step_undecided(nonfinite_engine):
    with pytest.raises(KeyError):
        with torchcast.track(nonfinite="record") as report:
            torch.log(torch.tensor([-1.0]))
            raise KeyError("out")
    [origin] = report.nonfinite
    assert origin.reached is None and origin.step is None  # no module ran: no steps
    assert "Absorbed" not in origin.describe() and "reached" not in origin.describe()


def _zero_grad_adamw(fused):
    """A fused or for-each AdamW with eps=0 whose third step meets a zero
    gradient on a weight it never moved: 0/0 (its second moment 0, its
    square root 0) makes NaN in the update it writes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, eps=0.0, fused=fused,
                            foreach=None if fused else False)
    with torchcast.track(nonfinite="record") as report:
        for step in range(1, 5):
            x = torch.ones(2, 4)
            x[:, 3] = 0.0  # weight 3's gradient is 0: 0/0 in the update
            model(x).sum().backward()
            _mark("opt step"); opt.step()  # noqa: E702
            opt.zero_grad()
    return report


@pytest.mark.parametrize("fused", [True, False])
def test_an_optimizer_step_s_origin_is_named_alike_read_later_or_at_once(fused, monkeypatch):
    # The C++ watch reads a healthy optimizer step's writes where they are
    # next read (nonfinite.py, optimizer_step); the dispatch mode reads each
    # op as it returns. Both name the same op, line and step.
    deferred = _zero_grad_adamw(fused)
    monkeypatch.setattr(nonfinite, "checked_in_cpp", lambda action: False)
    at_once = _zero_grad_adamw(fused)
    named = [[(o.op, o.module, o.phase, o.file, o.line, o.step, o.step_kind, o.reached)
              for o in report.nonfinite[:1]] for report in (deferred, at_once)]
    assert named[0] == named[1] and named[0][0][4] == LINE["opt step"]
    assert named[0][0][5] == 1 and named[0][0][7]
