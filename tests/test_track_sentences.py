"""What the tracker says must be what happened: each sentence here misled
before (issue 37, item 5), and compiled code must be named once and
quietly (item 4)."""
import math
import subprocess
import sys

import pytest
import torch

import torchcast

LINE = {}


def _mark(name):
    LINE[name] = sys._getframe(1).f_lineno


def test_an_overflow_of_exp_in_float64_too_is_not_called_a_nan_of_log(nonfinite_engine):
    x = torch.tensor([1000.0, 1.0])
    with torchcast.track(nonfinite="record") as report:
        torch.exp(x)
        torch.log(torch.tensor([-1.0, 1.0]))
    exp, log = report.nonfinite
    assert exp.note == ("The result is non-finite in float64 too, so float32's range is not "
                        "the cause: ±inf where the value is infinite or beyond float64's range "
                        "as well (log(0), x/0, exp of a large number).")
    assert "negative" not in exp.note
    assert log.note.endswith("NaN where it is undefined (a log or sqrt of a negative number, "
                             "0/0, inf - inf).")


def test_an_op_in_a_forward_hook_is_the_hooked_module_s(nonfinite_engine):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def hook(module, args, output):
        _mark("hook"); return torch.exp(output * 0 + 1000)  # noqa: E702

    model[1].register_forward_hook(hook)
    with torchcast.track(nonfinite="record", health=True) as report:
        out = model(torch.ones(2, 4))
    (origin,) = report.nonfinite
    assert (origin.op, origin.module, origin.line) == ("aten::exp", "1", LINE["hook"])
    # The module's output is what its hooks left: health measured the +inf.
    row = next(r for r in report.health if r.module == "1" and r.phase == "forward")
    assert int(row.health.counts[1]) == out.numel() == int(torch.isposinf(out).sum())
    # The hooks are gone with the track.
    assert list(model[1]._forward_hooks.values()) == [hook]


def test_the_casts_table_says_inf_for_a_site_that_overflowed():
    x = torch.linspace(-1e5, 1e5, 101)
    with torchcast.track(all_casts=True) as report:
        x.half()
    (record,) = report.records
    overflowed = int((x.abs() > 65519.99).sum())
    assert record.stats.overflow == overflowed > 0
    assert record.stats.max_rel_err < 1e-3 and record.stats.worst_rel_err == math.inf
    lines = str(report).splitlines()
    header = next(line for line in lines if line.startswith("site "))
    row = lines[lines.index(header) + 1]
    column = header.index("max rel err")
    assert row[column:column + len("max rel err")].strip() == "inf"
    # as safe_to says it
    torchcast.safe_to(x, torch.float16, policy="record")
    assert "max rel err inf" in str(torchcast.last_stats())


def _regions_of(backend, tmp_path, *flags):
    script = tmp_path / "compiled.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())\n"
        f"compiled = torch.compile(model, backend={backend!r}, dynamic=True)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for n in (4, 5, 6):\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "        loss = compiled(torch.randn(n, 16)).float().sum()\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", *flags, str(script)],
                         capture_output=True, text=True, timeout=600)
    return run


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_module_is_one_region_named_once_and_quietly(backend, tmp_path):
    run = _regions_of(backend, tmp_path, "--nonfinite", "record", "--health")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
    # No C++ stack trace (a tensor with symbolic sizes read by the watch)...
    assert "symbolic sizes" not in run.stderr and "frame #" not in run.stderr, run.stderr[-3000:]
    regions = [line for line in run.stderr.splitlines() if line.startswith("  compiled region")]
    # ... one region per compiled frame, its backward not a second "?" one,
    # and torch's wrapper named as the compiled module's call.
    assert regions and all(", ?," not in r and "a compiled graph," not in r for r in regions)
    assert len({r.split(",")[0] for r in regions}) == len(regions), regions
    assert not any(r.split(", ")[1].startswith("inner (") for r in regions), regions
