"""track(nonfinite=...): the op that first makes NaN/inf, forward and backward.

Each origin is checked against what the test knows independently: which op
and line made it, numpy's NaN/inf counts of that op's output, float64
reruns of the op."""
import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import torchcast
from torchcast import _ops
from torchcast.tracker import nonfinite

LINE = {}


def _mark(name):
    """The line of the caller, under ``name`` (the lines the origins must name)."""
    LINE[name] = sys._getframe(1).f_lineno


class Wide(torch.nn.Module):
    """A float16 Linear whose output overflows float16 (weights up to 625)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 256)
        with torch.no_grad():
            self.fc.weight.mul_(5000)

    def forward(self, x):
        _mark("fc"); y = self.fc(x)  # noqa: E702
        return y


def log_score(x):
    _mark("log"); return torch.log(x - 1.0)  # noqa: E702  (NaN where x < 1)


class Scorer(torch.nn.Module):
    def forward(self, x):
        return log_score(x).sum()


def _counts(t):
    a = t.detach().double().numpy()
    return int(np.isnan(a).sum()), int(np.isposinf(a).sum()), int(np.isneginf(a).sum())


def test_forward_overflow_in_float16_linear(nonfinite_engine):
    model = Wide().half()
    x = torch.randn(4, 64).half() * 10
    with torchcast.track(nonfinite="record") as report:
        y = model(x)
        y.float().softmax(-1).sum()
    origin = report.first_nonfinite
    assert origin is not None and len(report.nonfinite) == 1
    assert (origin.op, origin.module, origin.phase, origin.line) == \
        ("aten::addmm", "fc", "forward", LINE["fc"])
    assert origin.file == __file__ and origin.via is None
    assert origin.dtype == torch.float16
    assert (origin.nan, origin.posinf, origin.neginf) == _counts(y)
    assert [i.dtype for i in origin.inputs] == [torch.float16] * 3
    assert sorted(i.amax for i in origin.inputs)[-1] == float(model.fc.weight.detach().abs().max())
    exact = (x.double() @ model.fc.weight.detach().double().T + model.fc.bias.detach().double()).abs().max()
    assert float(exact) > 65504
    assert "float16's range overflowed" in origin.note
    assert report.propagated >= 1  # the upcast and softmax of the inf row
    assert "aten::addmm made" in str(report)


def test_nan_from_log_of_a_negative_in_a_user_function(nonfinite_engine):
    x = torch.tensor([[2.0, 0.5, 3.0], [1.5, 4.0, 0.25]], requires_grad=True)
    with torchcast.track(nonfinite="record") as report:
        loss = Scorer()(x)
        loss.backward()
    origins = report.nonfinite
    assert origins[0].op == "aten::log" and origins[0].line == LINE["log"]
    assert origins[0].phase == "forward" and origins[0].module == "Scorer"  # the root, by class
    assert origins[0].nan == 2 and origins[0].posinf == origins[0].neginf == 0
    assert "non-finite in float64 too" in origins[0].note
    # log's backward (grad / (x - 1)) is finite: everything else only propagated the NaN.
    assert all(o.phase == "forward" for o in origins)
    assert torch.isnan(loss)


def test_overflow_only_in_backward(nonfinite_engine):
    model = Wide().half()
    with torch.no_grad():
        model.fc.weight.div_(40)  # forward stays finite
    x = (torch.randn(4, 64) * 0.01).half().requires_grad_()
    with torchcast.track(nonfinite="record") as report:
        y = model(x)
        assert torch.isfinite(y).all()
        _mark("backward"); (y * 3000).sum().backward()  # noqa: E702
    origin = report.first_nonfinite
    assert origin.phase == "backward" and origin.node == "AddmmBackward0"
    assert origin.module == "fc" and origin.op == "aten::mm"
    assert origin.line == LINE["backward"]
    assert torch.isinf(x.grad).any()
    # the mm of the incoming gradient and the weight, in float64:
    grad_in = torch.full((4, 256), 3000.0, dtype=torch.float64) @ model.fc.weight.detach().double()
    assert float(grad_in.abs().max()) > 65504
    assert (origin.nan, origin.posinf, origin.neginf) == _counts(x.grad)


def test_raise_names_the_op_and_stops_there():
    model = Wide().half()
    x = torch.randn(4, 64).half() * 10
    with pytest.raises(torchcast.NonFiniteError) as info:
        with torchcast.track(nonfinite="raise_at_op"):
            model(x)
    e = info.value
    assert isinstance(e, RuntimeError)
    assert (e.op, e.module, e.phase, e.line) == ("aten::addmm", "fc", "forward", LINE["fc"])
    assert "aten::addmm made" in str(e) and "fc" in str(e)


def test_raise_in_backward():
    model = Wide().half()
    with torch.no_grad():
        model.fc.weight.div_(40)
    x = (torch.randn(4, 64) * 0.01).half().requires_grad_()
    with pytest.raises(torchcast.NonFiniteError) as info:
        with torchcast.track(nonfinite="raise_at_op"):
            (model(x) * 3000).sum().backward()
    assert info.value.phase == "backward" and info.value.node == "AddmmBackward0"


def test_warn_once_per_place(nonfinite_engine):
    x = torch.tensor([0.5, 2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchcast.track(nonfinite="warn") as report:
            for _ in range(3):
                log_score(x)
    found = [w for w in caught if issubclass(w.category, torchcast.NonFiniteWarning)]
    assert len(found) == 1 and found[0].lineno == LINE["log"] and found[0].filename == __file__
    assert report.first_nonfinite.count == 3


def test_nonfinite_that_no_watched_op_made_enters_then_propagates(nonfinite_engine):
    x = torch.tensor([1.0, float("nan"), 3.0])  # made before the track
    with torchcast.track(nonfinite="record") as report:
        (x * 2).exp().sum()
        scores = torch.zeros(3, 3).masked_fill(torch.ones(3, 3).triu(1).bool(), float("-inf"))
        scores.softmax(-1)  # no row fully masked: finite
    (entry,) = report.nonfinite  # the -inf masked_fill places is the program's own number
    assert entry.op == "aten::mul" and entry.nan == 1 and entry.reached is not None
    assert entry.entered.startswith("argument 'self': a tensor no watched op made")
    assert report.propagated == 2  # exp, sum: their NaN came from mul's output


def test_a_softmax_of_a_fully_masked_row_enters_or_propagates(nonfinite_engine):
    scores = torch.randn(2, 3)
    scores[0] = float("-inf")  # before the track: the softmax is where -inf enters
    with torchcast.track(nonfinite="record") as report:
        out = scores.softmax(-1)
    assert torch.isnan(out[0]).all() and report.propagated == 0
    (entry,) = report.nonfinite
    assert (entry.op, entry.nan, entry.entered) == (
        "aten::_softmax", 3, "argument 'self': a tensor no watched op made (the block's data, "
        "a literal, a checkpoint's values, or a tensor made before the track)")
    with torchcast.track(nonfinite="record") as report:
        scores = torch.randn(2, 3)
        _mark("fill"); scores[0] = float("-inf")  # noqa: E702 (-inf enters: a tensor of it)
        out = scores.softmax(-1)
    (entry,) = report.nonfinite
    assert (entry.op, entry.line) == ("aten::fill_", LINE["fill"])
    assert entry.entered == ("argument 'value': a 0-d tensor holding -inf, made from a Python "
                             "number (an assignment such as x[i] = -inf, or torch.tensor(-inf))")
    assert report.propagated == 1  # the softmax


def test_in_place_op_reads_its_inputs_before_overwriting_them(nonfinite_engine):
    x = torch.full((5,), 1e30)
    with torchcast.track(nonfinite="record") as report:
        x.mul_(1e10)
        x.mul_(2)  # inf * 2: propagation
    origin = report.first_nonfinite
    assert origin.op == "aten::mul_" and origin.posinf == 5
    assert report.propagated == 1


def test_overflowing_cast_is_an_origin(nonfinite_engine):
    x = torch.tensor([1.0, 7e4, -1e5])
    with torchcast.track(nonfinite="record") as report:
        x.half()
    origin = report.first_nonfinite
    assert origin.op == "aten::_to_copy" and (origin.posinf, origin.neginf) == (1, 1)
    assert "65504" in origin.note


# float8 casts that overflow (torch.isfinite, isnan and max have no kernels
# for most float8 dtypes: the origin is still described, from float32).
FLOAT8_OVERFLOWS = [(torch.float8_e5m2, (0, 1, 1)), (torch.float8_e4m3fnuz, (2, 0, 0)),
                    (torch.float8_e5m2fnuz, (2, 0, 0))]


@pytest.mark.parametrize("dtype, counts", FLOAT8_OVERFLOWS, ids=str)
def test_an_overflowing_float8_cast_is_an_origin(nonfinite_engine, dtype, counts):
    x = torch.tensor([1.0, 1e6, -1e6])
    y = x.to(dtype)
    assert _counts(y.float()) == counts  # what torch's cast makes, read through float32
    for unsupported in (torch.isposinf, torch.isneginf, torch.max):  # why it is read so
        with pytest.raises(NotImplementedError):
            unsupported(y)
    if dtype != torch.float8_e5m2:
        with pytest.raises(NotImplementedError):
            torch.isfinite(y)
    with torchcast.track(nonfinite="record") as report:
        x.to(dtype)
    origin = report.first_nonfinite
    assert (origin.op, origin.dtype, (origin.nan, origin.posinf, origin.neginf)) == \
        ("aten::_to_copy", dtype, counts)
    assert origin.inputs[0].amax == 1e6
    assert f"largest finite value is {torch.finfo(dtype).max:g}" in origin.note
    with pytest.raises(torchcast.NonFiniteError) as caught:
        with torchcast.track(nonfinite="raise_at_op"):
            x.to(dtype)
    assert caught.value.dtype == dtype


def test_float8_origins_on_the_deferred_flags_path(monkeypatch):
    monkeypatch.setattr(nonfinite, "checked_at_once", lambda device: False)
    x = torch.tensor([1.0, 1e6, -1e6])
    with torchcast.track(nonfinite="record") as report:  # one line each: three places
        x.to(torch.float8_e5m2)
        x.to(torch.float8_e4m3fnuz)
        x.to(torch.float8_e5m2fnuz)
    assert [(o.dtype, (o.nan, o.posinf, o.neginf)) for o in report.nonfinite] == \
        FLOAT8_OVERFLOWS


def test_all_casts_and_nonfinite_together(nonfinite_engine):
    x = torch.tensor([1.0, 7e4])
    with torchcast.track(all_casts=True, policy="record", nonfinite="record") as report:
        x.half()
    assert len(report.records) == 1 and report.records[0].stats.overflow == 1
    assert report.first_nonfinite.op == "aten::_to_copy"


def test_without_nonfinite_nothing_is_checked():
    with torchcast.track(all_casts=True) as report:
        torch.log(torch.tensor([-1.0]))
    assert report.nonfinite == [] and report.first_nonfinite is None and report.propagated == 0
    assert "NaN/inf" not in str(report)


def test_program_behaviour_is_unchanged(nonfinite_engine):
    model = Wide().half()
    x = torch.randn(4, 64).half() * 10
    plain = model(x)
    with torchcast.track(nonfinite="record"):
        watched = model(x)
    assert torch.equal(plain.isnan(), watched.isnan())
    assert torch.equal(torch.nan_to_num(plain), torch.nan_to_num(watched))


def test_deferred_flags_path(monkeypatch):
    """The GPU nonfinite_engine (flags on the device, read in batches), run on the CPU."""
    monkeypatch.setattr(nonfinite, "checked_at_once", lambda device: False)
    monkeypatch.setattr(nonfinite, "PENDING_LIMIT", 4)
    model = Wide().half()
    x = torch.randn(4, 64).half() * 10
    with torchcast.track(nonfinite="record") as report:
        y = model(x)
        y.float().softmax(-1).sum()
        z = torch.full((3,), 1e30)
        z.mul_(1e10)
    origins = report.nonfinite
    assert [o.op for o in origins] == ["aten::addmm", "aten::mul_"]
    assert origins[0].line == LINE["fc"] and origins[0].module == "fc"
    assert (origins[0].nan, origins[0].posinf, origins[0].neginf) == _counts(y)
    assert report.propagated >= 1
    with pytest.raises(torchcast.NonFiniteError):
        with torchcast.track(nonfinite="raise_at_op"):
            model(x)


def test_json_round_trip(nonfinite_engine):
    with torchcast.track(nonfinite="record") as report:
        log_score(torch.tensor([0.5, 2.0]))
    data = json.loads(report.to_json())
    assert data["nonfinite"][0]["op"] == "aten::log" and data["propagated"] == 0
    back = torchcast.Report.from_json(report.to_json())
    assert back.first_nonfinite == report.first_nonfinite


def test_bad_action():
    with pytest.raises(ValueError, match="nonfinite must be"):
        torchcast.track(nonfinite="stop")


def test_compiled_function_still_compiles_and_runs(nonfinite_engine):
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()

    @torch.compile(backend="eager")
    def f(x):
        return torch.log(x) * 2

    try:
        with torchcast.track(nonfinite="record"):
            out = f(torch.tensor([1.0, -1.0]))
        assert torch.isnan(out[1])
        assert counts["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()  # later tests' tracks warn about frames compiled outside them


def test_cli_nonfinite_raise(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        w = torch.full((8, 8), 300.0, dtype=torch.float16)
        x = torch.full((2, 8), 30.0, dtype=torch.float16)
        h = x @ w
        print("not reached")
    """))
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", "--nonfinite", "raise_at_op",
                          str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "not reached" not in run.stdout
    assert "NonFiniteError" in run.stderr and "aten::mm made 16 +inf" in run.stderr
    assert "train.py:4" in run.stderr


def test_safe_to_overflow_is_an_origin_and_its_stats_are_not(nonfinite_engine):
    x = torch.tensor([1.0, 7e4])
    with torchcast.track(nonfinite="record") as report:
        torchcast.safe_to(x, torch.float16, policy="ignore")
    assert [o.op for o in report.nonfinite] == ["torchcast::cast_with_stats"]
    assert report.first_nonfinite.posinf == 1


def test_record_and_warn_take_the_cpp_check_raise_the_mode(nonfinite_engine):
    tracked = torchcast.track(nonfinite="record")
    with tracked:
        served = tracked.nonfinite_watch in getattr(nonfinite._cpp, "watches", ())
    assert served == (nonfinite_engine == "cpp")
    tracked = torchcast.track(nonfinite="raise_at_op")
    with tracked:
        assert tracked.nonfinite_watch not in getattr(nonfinite._cpp, "watches", ())


def _finite_reference(t):
    """torch.isfinite, read through float64 for the dtypes it has no kernel for."""
    if t.is_complex():
        return _finite_reference(torch.view_as_real(t.resolve_conj().resolve_neg()))
    return bool(torch.isfinite(t.double()).all())


def test_all_finite_reads_every_dtype_as_torch_isfinite_does():
    """_ops.all_finite (the per-op check of the C++ watch) against torch.isfinite:
    every bit pattern of the 8- and 16-bit dtypes one at a time in a finite
    tensor, wide dtypes and complex ones with NaN/inf in either part, views
    it reads through at::isfinite, and dtypes it has no bit test for."""
    from values import every_value
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        values = every_value(dtype)
        # A sample of the finite patterns, and every non-finite one; torch.isfinite
        # read through float32, which holds every value of these dtypes.
        nonfinite = ~torch.isfinite(values.float())
        picked = (torch.arange(values.numel()) % 97 == 0) | nonfinite
        t = torch.zeros(40_000, dtype=dtype)  # past one block of the C++ loop
        for i in picked.nonzero().flatten().tolist():
            t[-1] = values[i]
            assert _ops.all_finite(t) == (not nonfinite[i]), (dtype, i)
    for dtype in (torch.float64, torch.float32, torch.complex128, torch.complex64,
                  torch.complex32):
        for bad in (None, float("nan"), float("inf"), -float("inf"), complex(0, float("nan"))):
            if bad is not None and isinstance(bad, complex) and not dtype.is_complex:
                continue
            t = torch.ones(70_000, dtype=dtype)
            if bad is not None:
                t[12_345] = bad
            square = t[:250 * 250].view(250, 250)
            for view in (t, t[::3], t.conj() if dtype.is_complex else -t,
                         square.t(), square.t()[:, :100], square[None].expand(2, -1, -1),
                         t[:24_000].view(2, 3, 40, 100).permute(0, 2, 3, 1)):
                assert _ops.all_finite(view) == _finite_reference(view), (dtype, bad)
    for t in (torch.tensor([1, 2]), torch.tensor([True]), torch.empty(0)):
        assert _ops.all_finite(t) == _finite_reference(t)
    for dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):  # no bit test, no isfinite
        for values in ([1.0, 2.0], [1.0, float("nan")]):
            t = torch.tensor(values * 3).to(dtype)
            for view in (t, t[::2]):
                assert _ops.all_finite(view) == _finite_reference(view), (dtype, values)


def _profiled_ops(call):
    """The names of the ops torch.profiler records while ``call`` runs."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        call()
    return {e.name for e in prof.events()}


def test_the_cpp_watch_leaves_the_profiler_every_op():
    """The C++ watch switches RecordFunction off inside the ops whose callees
    it ignores, only while it is the thread's sole observer: a profiler in
    the block still sees the ops inside _to_copy, and after an op that
    raised inside the watch RecordFunction is on again."""
    if not _ops.WITH_EXTENSION:
        pytest.skip("the C++ watch is part of the compiled extension")
    x = torch.randn(8)
    alone = _profiled_ops(x.half)
    assert {"aten::_to_copy", "aten::copy_"} <= alone
    with torchcast.track(nonfinite="record"):
        assert _profiled_ops(x.half) == alone
        with pytest.raises(RuntimeError):
            torch.mm(torch.randn(2, 3), torch.randn(2, 3))
        assert _profiled_ops(x.half) == alone
    assert _profiled_ops(x.half) == alone


@pytest.mark.parametrize("action", ["record", "warn"])
def test_the_wider_rerun_is_not_recorded_as_a_cast(action):
    # The note's rerun in float64 is the tracker's work, not the program's:
    # an all_casts track beside the watch must not record its casts.
    x = torch.full((3,), 3e38)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torchcast.track(all_casts=True, nonfinite=action) as report:
            x * 10
    assert report.records == []
    assert "float32's range overflowed" in report.first_nonfinite.note
