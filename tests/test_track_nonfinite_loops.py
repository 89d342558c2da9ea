"""track(nonfinite=...) on the loops real scripts write (issue 46): a
parameter-free module called on the data before the model (torchvision's
Normalize), an update written by hand instead of an optimizer's step
(pytorch/examples' word_language_model), BatchNorm's running statistics,
and what the reports say of them.
"""
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

import torchcast

LINE = {}


def _mark(name):
    LINE[name] = sys._getframe(1).f_lineno


def _nan_state_dict():
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 2).state_dict()
    saved["weight"][1, 2] = float("nan")
    return saved


def _identity_first(nonfinite, steps=3):
    """A script run whole under the track (python -m torchcast track): a
    checkpoint with a NaN weight loaded, then an SGD loop whose data pass
    through nn.Identity (a transform, as torchvision's Normalize) first."""
    model, saved = torch.nn.Linear(4, 2), _nan_state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchcast.track(nonfinite=nonfinite) as report:
        _mark("load"); model.load_state_dict(saved)  # noqa: E702
        for _ in range(steps):
            x = torch.nn.Identity()(torch.randn(8, 4))
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return report


def test_a_parameter_free_module_before_the_model_does_not_end_the_step(nonfinite_engine):
    report = _identity_first("record")
    (entry,) = report.nonfinite
    assert (entry.op, entry.line) == ("aten::copy_", LINE["load"])
    assert entry.reached and entry.absorbed_steps == 0, entry.describe()
    assert entry.reached_at == "the output of Linear"
    assert "absorbed" not in entry.describe().lower()
    with pytest.raises(torchcast.NonFiniteError, match="entered at aten::copy_") as raised:
        _identity_first("raise")
    # stopped at the first forward's output, before the optimizer wrote anything
    assert raised.value.reached_at == "the output of Linear"


def test_without_an_optimizer_the_model_not_the_transform_is_the_step(nonfinite_engine):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with torchcast.track(nonfinite="record") as report:
        for step in range(3):
            x = torch.nn.Identity()(torch.randn(2, 4))
            if step == 1:
                _mark("inf"); x = x * torch.tensor(float("inf"))  # noqa: E702
            model(x).sum().backward()
    (entry,) = report.nonfinite
    # (outside any module, between calls 1 and 2: in call 1, the last one begun)
    assert (entry.line, entry.step_kind, entry.step) == (LINE["inf"], "call of Linear", 1)
    assert entry.reached


class _RNNish(torch.nn.Module):
    """A model whose backward alone makes inf: d sqrt(h * 0) = inf at 0."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)
        self.decoder = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        h = h + torch.sqrt(h * 0)
        return self.decoder(h)


def _hand_written_sgd(model, nonfinite, lr=0.1, steps=2):
    """word_language_model's default loop: no optimizer, p.data.add_(...)."""
    with torchcast.track(nonfinite=nonfinite) as report:
        for _ in range(steps):
            model.zero_grad()
            loss = model(torch.randn(3, 4)).square().mean()
            _mark("backward"); loss.backward()  # noqa: E702
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
    return report


def test_raise_stops_before_a_hand_written_update_writes_a_parameter(nonfinite_engine):
    torch.manual_seed(0)
    model = _RNNish()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(torchcast.NonFiniteError) as raised:
        _hand_written_sgd(model, "raise")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), f"{name} was written"
    # the guard and the track's dispatch mode left in order: nothing stays on
    from torch.utils import _python_dispatch
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not _python_dispatch._is_in_torch_dispatch_mode
    origin = raised.value.origin  # d sqrt(u)/du = 1 / (2 sqrt(u)): 1/0 at u = 0
    assert (origin.op, origin.phase, origin.node, origin.module, origin.forward) == \
        ("aten::div", "backward", "SqrtBackward0", "_RNNish", "_RNNish.forward")
    assert origin.line == LINE["backward"]
    assert origin.reached_at == ("the gradients of _RNNish's parameters, which aten::add_ was "
                                 "about to write into them")
    assert "Raised where NaN/inf reached the gradients of _RNNish's parameters" in \
        str(raised.value)


def test_a_step_gradscaler_skips_is_not_stopped(nonfinite_engine):
    """Overflowed gradients a GradScaler finds and skips write no parameter:
    "raise" lets the run go on (skips before any optimizer step, and in the
    block's last iteration: the tests below)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scales = []
    with torchcast.track(nonfinite="raise") as report:
        for step in range(3):
            if step in (1, 2):  # step 2's gradients overflow float16, step 3's do not
                scaler.update(new_scale=2.0 ** 60 if step == 1 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            if step == 1:  # skipped
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            scaler.update()
            scales.append(scaler.get_scale())
    assert scales[1] < 2.0 ** 60  # step 2 overflowed and was skipped
    assert report.ended_by is None and all(torch.isfinite(p).all() for p in model.parameters())


_AMP_OPTIMIZERS = {  # the last two take GradScaler's found_inf and skip themselves
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-4),
    "fused Adam": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    "torchcast AdamW": lambda params: torchcast.optim.AdamW(params, lr=1e-3),
}


def _amp_loop(nonfinite, x, steps, load=None, optimizer="SGD", **scaler_args):
    """A float16 autocast loop with GradScaler (zero_grad between forward
    and backward, as torch's AMP examples) and ``optimizer`` (of
    _AMP_OPTIMIZERS); under ``nonfinite`` None, the plain run. Returns
    (report, model's parameters, each step's scale)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = _AMP_OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **scaler_args)
    scales = []
    with (torchcast.track(nonfinite=nonfinite) if nonfinite else nullcontext()) as report:
        if load is not None:
            model.load_state_dict(load)
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return report, [p.detach().clone() for p in model.parameters()], scales


def _skipped(scales, init):
    """How many steps GradScaler skipped (each lowered the scale)."""
    return sum(b < a for a, b in zip([init] + scales, scales))


@pytest.mark.parametrize("skips", ["first", "later", "default scale", "first, fused Adam",
                                   "first, torchcast AdamW"])
def test_gradscaler_skips_before_or_after_a_step_are_absorbed(nonfinite_engine, skips):
    """Gradients GradScaler finds overflowed (and skips the step of) are no
    NaN/inf reaching: "raise" runs on with the plain run's bits, "record"
    calls them absorbed, whether the skip comes before the first optimizer
    step or after one, and in the block's last iteration."""
    torch.manual_seed(1)
    x, steps, optimizer = torch.randn(4, 8), 4, skips.partition(", ")[2] or "SGD"
    if skips.startswith("first"):  # 2**60, 2**40 and 2**20 overflow float16, then 1 does not
        args = dict(init_scale=2.0 ** 60, backoff_factor=2.0 ** -20, growth_interval=1)
    elif skips == "later":  # 2**12 does not; then 2**32, 2**31, 2**30 do
        args = dict(init_scale=2.0 ** 12, growth_factor=2.0 ** 20, growth_interval=1)
    else:  # the default 65536 on inputs of ~10: halved 5 times until the gradients fit
        x, steps, args = x * 10, 8, dict(init_scale=2.0 ** 16)
    _, plain, scales = _amp_loop(None, x, steps, optimizer=optimizer, **args)
    assert 1 <= _skipped(scales, args["init_scale"]) < steps, scales
    for nonfinite in ("raise", "record"):
        report, params, tracked_scales = _amp_loop(nonfinite, x, steps, optimizer=optimizer,
                                                   **args)
        assert tracked_scales == scales
        assert all(torch.equal(a, b) for a, b in zip(params, plain)), nonfinite
        assert report.ended_by is None
        assert report.nonfinite, "the overflow is an origin"
        for origin in report.nonfinite:
            assert origin.phase == "backward" and origin.reached is False, origin.describe()
            assert "or GradScaler skipped the step" in origin.describe()


def test_a_nan_gradscaler_cannot_skip_still_raises(nonfinite_engine):
    """A NaN weight from a checkpoint reaches the output before any scaler
    decides: "raise" stops there, as without GradScaler."""
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).state_dict()
    saved["0.weight"][3, 2] = float("nan")
    x = torch.randn(4, 8)
    with pytest.raises(torchcast.NonFiniteError) as raised:
        _amp_loop("raise", x, 2, load=saved, init_scale=2.0 ** 60)
    assert raised.value.reached_at == "the output of Sequential"
    data = x.clone()
    data[0, 0] = float("nan")
    with pytest.raises(torchcast.NonFiniteError) as raised:
        _amp_loop("raise", data, 2, init_scale=2.0 ** 60)
    assert raised.value.reached_at == "the output of Sequential"


def test_a_step_on_gradients_the_scaler_found_inf_in_still_raises(nonfinite_engine):
    """An optimizer's step() called on the gradients after scaler.unscale_
    found inf in them (not through scaler.step, which would skip it) reads
    them: "raise" stops before it writes the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(torchcast.NonFiniteError) as raised:
        with torchcast.track(nonfinite="raise"):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().square().mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            opt.step()
    assert raised.value.reached_at == "the gradients SGD.step() read"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_record_names_the_backward_origin_of_a_hand_written_loop(nonfinite_engine):
    torch.manual_seed(0)
    report = _hand_written_sgd(_RNNish(), "record", steps=1)
    first = report.first_nonfinite
    assert first.phase == "backward" and first.reached and first.step == 1
    assert first.reached_at == "the gradients of _RNNish's parameters"  # (at the block's end)


class _ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).mean()


def test_batchnorm_running_stats_are_no_entries(nonfinite_engine):
    torch.manual_seed(0)
    model = _ConvBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(2, 3, 6, 6) for _ in range(3)]
    batches[1][0, 1, 2, 2] = float("nan")
    with torchcast.track(nonfinite="record") as report:
        for x in batches:
            _mark("forward"); loss = model(x)  # noqa: E702
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        model(batches[0])  # reads the NaN the training forward wrote into running_mean
    assert not torch.isfinite(model.bn.running_mean).all()
    entries = [o for o in report.nonfinite if o.entered is not None]
    assert [(o.op, o.module, o.step) for o in entries] == [("aten::convolution", "conv", 2)], \
        [o.describe() for o in report.nonfinite]
    assert all("running" not in o.entered for o in entries)


def test_a_checkpoint_nan_in_running_var_is_still_an_entry(nonfinite_engine):
    torch.manual_seed(0)
    model = _ConvBN().eval()
    model.bn.running_var[2] = float("nan")
    with torchcast.track(nonfinite="record") as report:
        model(torch.randn(2, 3, 6, 6))
    (entry,) = report.nonfinite
    assert "the buffer bn.running_var of _ConvBN" in entry.entered


# -- the sentences --------------------------------------------------------------


def test_a_load_outside_any_module_is_not_said_to_be_in_forward(nonfinite_engine):
    saved = torch.nn.Linear(4, 2).state_dict()
    saved["weight"][0, 0] = float("nan")
    model = torch.nn.Linear(4, 2)
    with torchcast.track(nonfinite="record") as report:
        model.load_state_dict(saved)
    (entry,) = report.nonfinite
    assert entry.op == "aten::copy_"
    text = entry.describe()
    assert "in forward" not in text and "outside any tracked module" in text


def test_a_run_stopped_before_the_first_call_says_so(nonfinite_engine):
    model, saved = torch.nn.Linear(4, 2), _nan_state_dict()
    with pytest.raises(torchcast.NonFiniteError) as raised:
        with torchcast.track(nonfinite="raise"):
            model.load_state_dict(saved)
            model(torch.ones(2, 4)).sum().backward()
    text = str(raised.value)
    assert "call 0 of" not in text
    assert "in the time before the first call of Linear" in text and \
        "Reached the output of Linear at call 1 of Linear" in text


def test_step_zero_is_said_as_the_time_before_the_first_call():
    from torchcast.tracker.origin import step_phrase
    assert step_phrase("call of Net", 0) == "the time before the first call of Net"
    assert step_phrase("call of Net", 3) == "call 3 of Net"
    assert step_phrase("optimizer step", 2) == "optimizer step 2"


@pytest.mark.slow
def test_an_aot_eager_region_is_not_said_to_hide_nan_made_in_fused_kernels(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())\n"
        "compiled = torch.compile(model, backend='aot_eager')\n"
        "compiled(torch.randn(4, 16)).sum().backward()\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", "--nonfinite", "record",
                          "--health", str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
    regions = [line for line in run.stderr.splitlines() if line.startswith("  compiled region")]
    assert regions, run.stderr[-3000:]  # (the health inside it is not watched)
    assert not any("kernels Inductor fuses" in r for r in regions), regions


def test_the_regions_of_inductor_alone_hide_nan_made_in_fused_kernels(monkeypatch):
    from torchcast.tracker import regions
    functions = {("0/0", 1.0): ("f", "/x/a.py", 3, False), ("1/0", 2.0): ("g", "/x/a.py", 9, True)}
    monkeypatch.setattr(regions, "_compiled_functions", lambda: functions)
    watch = regions.RegionWatch(False, True, False, lambda: False)
    watch.compiled_before = set()
    (region,) = watch.regions()
    assert region.function == "g" and "kernels Inductor fuses" in region.unwatched[0]


def test_a_worker_s_casts_bring_no_nonfinite_section(tmp_path):
    """A track without nonfinite= whose forked workers recorded casts: no
    "0 ops made NaN/inf" line."""
    script = tmp_path / "workers.py"
    script.write_text(
        "import torch\n"
        "class D(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return torch.full((4,), 0.1 * i, dtype=torch.float64)"
        ".float()\n"
        "if __name__ == '__main__':\n"
        "    loader = torch.utils.data.DataLoader(D(), batch_size=2, num_workers=1,\n"
        "                                         multiprocessing_context='fork')\n"
        "    for x in loader: x.sum()\n"
        "    print('ok')\n")
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", str(script)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
    assert "worker" in run.stderr, run.stderr[-3000:]  # its casts were merged
    assert "made NaN/inf" not in run.stderr, run.stderr[-3000:]
