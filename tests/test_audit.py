"""torchcast.audit on real models, each finding checked against what torch
actually does (the reported failure really fails, the stated fix really
works), the model and optimizer left untouched; and the
``python -m torchcast track`` command (also named ``audit``)."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import torchcast
from torchcast import cli

HERE = os.path.abspath(__file__)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def kinds(report):
    return sorted({f.kind for f in report.findings})


def snapshot(model, optimizer=None):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [(p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    opt = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    return state, grads, opt, torch.get_rng_state()


def assert_unchanged(before, model, optimizer=None):
    state, grads, opt, rng = before
    now = model.state_dict()
    assert state.keys() == now.keys()
    for k in state:
        assert torch.equal(state[k], now[k]), k
    for (g_obj, g_val), p in zip(grads, model.parameters()):
        assert p.grad is g_obj
        assert (g_val is None) or torch.equal(p.grad, g_val)
    if optimizer is not None:
        after = optimizer.state_dict()
        assert after["param_groups"] == opt["param_groups"]
        assert after["state"].keys() == opt["state"].keys()
        for i in opt["state"]:
            for k, v in opt["state"][i].items():
                assert torch.equal(after["state"][i][k], v)
    assert torch.equal(torch.get_rng_state(), rng)


# --- a float32 MLP fed float64 numpy data -------------------------------------------

def test_float64_numpy_data_into_float32_mlp():
    model = mlp()
    data = np.random.default_rng(0).normal(size=(8, 4))  # numpy's default: float64
    x = torch.from_numpy(data)
    with pytest.raises(RuntimeError, match="same dtype"):  # what the finding is about
        model(x)
    before = snapshot(model)
    report = torchcast.audit(model, x)
    assert_unchanged(before, model)
    assert kinds(report) == ["forward_error", "input_dtype"]
    f = report.of_kind("input_dtype")[0]
    assert (f.severity, f.where) == ("error", "0")
    assert "float64" in f.message and "float32" in f.message and "numpy" in f.message
    assert "torch.as_tensor(array, dtype=torch.float32)" in f.fix
    assert not report.ran_backward and not report.ok
    # the fix, applied, gives a clean audit
    fixed = torchcast.audit(model, torch.as_tensor(data, dtype=torch.float32))
    assert fixed.ok and fixed.findings == [] and fixed.ran_backward


class CastingMLP(torch.nn.Module):
    """Accepts anything and casts it itself, every forward."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return self.body(x.float())  # CAST_LINE


CAST_LINE = next(i + 1 for i, line in enumerate(open(HERE)) if line.rstrip().endswith("# CAST_LINE"))


def test_mlp_casting_float64_data_in_forward():
    model = CastingMLP()
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(8, 4)))
    report = torchcast.audit(model, x)
    (f,) = report.findings
    assert (f.kind, f.severity) == ("rounding", "warning")
    assert f.where.startswith(f"CastingMLP {os.path.relpath(HERE)}:{CAST_LINE}")
    assert "float64->float32" in f.message and "32 elements" in f.message
    rec = report.casts.records[0]
    assert rec.stats.inexact == 32 and rec.module == "CastingMLP"


# --- a model under CPU bfloat16 autocast --------------------------------------------------

def test_model_under_cpu_bf16_autocast():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 5, 16)
    assert torchcast.audit(model, x).ok  # float32: nothing to say
    before = snapshot(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = torchcast.audit(model, x)
    assert_unchanged(before, model)  # dropout's RNG draws included
    assert report.ok and report.ran_backward
    notes = report.of_kind("rounding")
    assert notes and all(f.severity == "info" for f in notes)
    assert any(f.where.startswith("layers.0.linear1 ") for f in notes)
    assert not report.of_kind("input_dtype")  # autocast handles mixed inputs
    origins = {r.origin for r in report.casts.records}
    assert {"autocast", "backward"} <= origins


def test_float16_gradients_underflow_is_a_warning_with_the_fix():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((4,), 1e-3))

        def forward(self, x):
            return (x.half() * self.w.half()).float().sum() * 1e-9  # float16 grads: 0

    report = torchcast.audit(Tiny(), torch.ones(4))
    f = report.of_kind("lossy_cast")
    assert f and f[0].severity == "warning"
    assert "underflow" in f[0].message and "GradScaler" in f[0].fix


# --- a model that casts to int inside forward --------------------------------------------------

class Bucketize(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(4.0))
        self.emb = torch.nn.Embedding(10, 3)

    def forward(self, x):
        idx = (x * self.scale).long()  # INT_LINE
        return self.emb(idx.clamp(0, 9)).sum(-1) + x


INT_LINE = next(i + 1 for i, line in enumerate(open(HERE)) if line.rstrip().endswith("# INT_LINE"))


def test_cast_to_int_inside_forward():
    model = Bucketize()
    x = torch.rand(6)
    report = torchcast.audit(model, x)
    (f,) = report.of_kind("graph_cut")
    assert f.severity == "error"
    assert f.where.startswith(f"Bucketize {os.path.relpath(HERE)}:{INT_LINE}")
    assert "straight-through" in f.fix
    # what the finding says is true: scale gets no gradient through the cut
    model(x).sum().backward()
    assert model.scale.grad is None and model.emb.weight.grad is not None


# --- parameters, buffers, targets, optimizers ----------------------------------------------------

def test_mixed_dtypes_and_the_fix():
    model = mlp()
    model[2].double()
    report = torchcast.audit(model, torch.randn(2, 4))
    (f,) = report.of_kind("mixed_dtypes")
    assert "float32: 0.weight, 0.bias" in f.message and "float64: 2.weight, 2.bias" in f.message
    assert "model.to(torch.float32)" in f.fix
    assert report.of_kind("input_dtype")[0].where == "2"
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 4))
    model.to(torch.float32)
    assert torchcast.audit(model, torch.randn(2, 4)).ok


def test_mixed_devices():
    model = mlp()
    model[2] = torch.nn.Linear(16, 3, device="meta")
    report = torchcast.audit(model, torch.randn(2, 4))
    (f,) = report.of_kind("mixed_devices")
    assert f.severity == "error" and "cpu" in f.message and "meta" in f.message
    assert report.of_kind("input_device")[0].where == "2"


@pytest.mark.parametrize("loss_fn", [torch.nn.CrossEntropyLoss(), torch.nn.functional.cross_entropy,
                                     torch.nn.NLLLoss()], ids=["module", "function", "nll"])
def test_int32_class_targets(loss_fn):
    model, x = mlp(), torch.randn(5, 4)
    target = torch.tensor([0, 2, 1, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Long"):
        loss_fn(model(x), target)
    report = torchcast.audit(model, x, target=target, loss_fn=loss_fn)
    assert kinds(report) == ["loss_error", "target_dtype"]
    assert "target.long()" in report.of_kind("target_dtype")[0].fix
    assert torchcast.audit(model, x, target=target.long(), loss_fn=loss_fn).ok


def test_float_class_indices_and_float64_probabilities():
    model, x = mlp(), torch.randn(5, 4)
    idx = torch.tensor([0.0, 2, 1, 1, 0])
    report = torchcast.audit(model, x, target=idx, loss_fn=torch.nn.CrossEntropyLoss())
    assert report.of_kind("target_dtype")[0].severity == "error"
    probs = torch.softmax(torch.randn(5, 3, dtype=torch.float64), -1)
    assert torch.nn.functional.cross_entropy(model(x), probs).dtype == torch.float64  # promoted
    report = torchcast.audit(model, x, target=probs, loss_fn=torch.nn.CrossEntropyLoss())
    (f,) = report.of_kind("target_dtype")
    assert f.severity == "warning" and "torch.float32" in f.fix
    assert report.ran_backward


def test_binary_and_regression_targets():
    model, x = mlp(), torch.randn(5, 4)
    bce = torch.nn.BCEWithLogitsLoss()
    ints = torch.randint(0, 2, (5, 3))
    with pytest.raises(RuntimeError):
        bce(model(x), ints)
    report = torchcast.audit(model, x, target=ints, loss_fn=bce)
    assert kinds(report) == ["loss_error", "target_dtype"]
    assert torchcast.audit(model, x, target=ints.float(), loss_fn=bce).ok
    report = torchcast.audit(model, x, target=torch.randn(5, 3, dtype=torch.float64),
                             loss_fn=torch.nn.functional.mse_loss)
    (f,) = report.of_kind("target_dtype")
    assert f.severity == "warning" and report.ran_backward


def test_optimizer_state_of_another_dtype_and_the_fix():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.double()  # after the optimizer made float32 states
    x = torch.randn(3, 4, dtype=torch.float64)
    model(x).sum().backward()
    with pytest.raises(RuntimeError):  # the step the finding warns about
        opt.step()
    opt.zero_grad()
    before = snapshot(model, opt)
    report = torchcast.audit(model, x, opt)
    assert_unchanged(before, model, opt)
    found = report.of_kind("optimizer_state")
    assert len(found) == 8  # exp_avg and exp_avg_sq of 4 parameters; "step" is a scalar
    assert found[0].where == "0.weight state['exp_avg']"
    assert "optimizer.load_state_dict(optimizer.state_dict())" in found[0].fix
    opt.load_state_dict(opt.state_dict())  # the stated fix
    assert torchcast.audit(model, x, opt).ok
    model(x).sum().backward()
    opt.step()


def test_optimizer_of_another_model():
    model = mlp()
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)  # a fresh model's parameters
    (f,) = torchcast.audit(model, torch.randn(2, 4), opt).of_kind("optimizer_params")
    assert "4 of the optimizer's tensors" in f.message


def test_audit_leaves_batchnorm_grads_and_rng_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).train()
    model(torch.randn(6, 4)).sum().backward()  # existing gradients must survive
    x = torch.randn(6, 4)
    before = snapshot(model)
    report = torchcast.audit(model, x)
    assert_unchanged(before, model)
    assert report.ran_backward and model.training


def test_report_text_and_json():
    report = torchcast.audit(Bucketize(), torch.rand(4))
    text = str(report)
    assert text.startswith("torchcast.audit: 1 errors")
    assert "fix:" in text and "casts on the way" in text
    data = json.loads(report.to_json())
    assert data["findings"][0]["kind"] == "graph_cut"
    assert data["casts"]["records"][0]["graph_cuts"] == 1


def test_argument_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        torchcast.audit(lambda x: x, torch.randn(2))
    with pytest.raises(TypeError, match="together"):
        torchcast.audit(mlp(), torch.randn(2, 4), target=torch.zeros(2))


# --- python -m torchcast track (or audit) ---------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.as_tensor(np.random.default_rng(0).normal(size=(5, 3)), dtype=torch.float32)
    y = model(x).half() * 1e5
    big = (y.float() * 1e3).half()
    print("args", sys.argv[1:])
    if "--fail" in sys.argv:
        raise ValueError("the script failed")
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_cli_prints_report_and_returns_the_scripts_exit_code(script, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["--json", str(out), str(script), "3", "x"]) == 3
    captured = capsys.readouterr()
    assert "args ['3', 'x']" in captured.out
    assert "torchcast.track: 4 cast sites" in captured.err
    assert "train.py:7" in captured.err and "float64->float32" in captured.err
    report = torchcast.Report.from_json(out.read_text())
    assert [r.line for r in report.records if r.violations()] == [9]  # the overflow
    assert sys.argv[0] != str(script)  # restored


def test_cli_report_printed_when_the_script_raises(script, capsys):
    assert cli.main([str(script), "--fail"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: the script failed" in err
    assert err.index("ValueError") < err.index("torchcast.track:")
    assert 'File "' in err and "runpy" not in err  # the traceback starts in the script


def test_cli_policy_raise_stops_at_the_first_violation(script, capsys):
    assert cli.main(["--policy", "raise", str(script)]) == 1
    captured = capsys.readouterr()
    assert "PrecisionLossError" in captured.err and "train.py:9" in captured.err
    assert "args" not in captured.out  # stopped before
    # the traceback ends at the script's line, not in torch's or torchcast's internals
    frames = [line for line in captured.err.splitlines() if line.startswith('  File "')]
    assert frames and all("train.py" in line for line in frames)


def test_cli_bad_arguments(tmp_path, capsys):
    assert cli.main([str(tmp_path / "missing.py")]) == 2
    with pytest.raises(SystemExit):
        cli.main(["--policy", "loud", "x.py"])


@pytest.mark.parametrize("command", ["track", "audit"])
def test_python_dash_m_torchcast_track(script, command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(torchcast.__file__)), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "torchcast", command, "--top", "1", str(script),
                          "--fail"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1
    assert "ValueError: the script failed" in run.stderr
    assert "... 3 more sites" in run.stderr


def test_target_checked_even_when_forward_fails():
    x = torch.from_numpy(np.random.default_rng(2).normal(size=(4, 4)))  # float64
    target = torch.tensor([0, 1, 2, 0], dtype=torch.int32)
    report = torchcast.audit(mlp(), x, target=target, loss_fn=torch.nn.CrossEntropyLoss())
    assert [f.kind for f in report.findings] == ["input_dtype", "forward_error", "target_dtype"]
    assert report.findings[1].fix == "see the findings above for its cause"
