"""``python -m torchcast track`` as a user runs it (a subprocess on a script
written to tmp_path): its help, --health's headroom table, --top's range,
output paths checked before the script runs, and --json on non-finite data."""
import os
import subprocess
import sys
import textwrap

import pytest

import torchcast
from torchcast import __main__ as entry
from torchcast import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchcast.__file__)))
OPTIONS = ("--json", "--html", "--policy", "--violations", "--nonfinite", "--health", "--top")

SCRIPT = textwrap.dedent("""\
    import sys
    import torch
    open(sys.argv[1], "w").write("ran")  # the marker: the script ran
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with torch.no_grad():
        model[0].weight.fill_(300.0)
    model(torch.full((2, 8), 30.0)).sum().backward()
    h = torch.ones(3, dtype=torch.float16)
    h.mul_(1e5)  # an op that makes inf from finite inputs
    torch.full((3,), 1e6).half()  # a cast whose every element overflows
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "torchcast", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_track_help_names_every_option():
    done = run("track", "--help")
    assert done.returncode == 0, done.stderr
    assert all(option in done.stdout for option in OPTIONS)
    assert "underflow>1%" in done.stdout  # the default, "%" and all


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_each_command_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        entry.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(option in out for option in OPTIONS)


def test_top_level_help_names_every_option(capsys):
    assert entry.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(option in out for option in OPTIONS)
    assert "python -m torchcast demo" in out and "SCRIPT.py" in out


def test_health_prints_the_headroom_table(script, tmp_path):
    marker = tmp_path / "ran"
    done = run("track", "--health", "--policy", "record", script, marker)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "numeric health of" in err and "torchcast headroom of" in err
    table = err[err.index("torchcast headroom of"):].splitlines()
    header = next(line for line in table if line.startswith("module"))
    assert all(name in header for name in ("float16", "bfloat16", "float8_e4m3fn",
                                           "float8_e5m2"))
    # Linear 0's outputs (72000) overflow float16 and float8 at scale 1, not once scaled.
    row = next(line for line in table if line.startswith("0 ") and " forward " in line)
    assert row.count("100%/0, 2^-") == 3 and " 0/0 " in row  # bfloat16 holds them


@pytest.mark.slow
def test_top_refuses_a_negative_count(script, tmp_path):
    marker = tmp_path / "ran"
    done = run("track", "--top", "-1", script, marker)
    assert done.returncode == 2
    assert "argument --top" in done.stderr and "-1" in done.stderr
    assert not marker.exists()
    done = run("track", "--top", "0", "--policy", "record", script, marker)
    assert done.returncode == 0, done.stderr
    # no site row (the build without the extension also warns, at train.py:10)
    rows = [line.split()[0] for line in done.stderr.splitlines() if line.strip()]
    assert "more sites" in done.stderr and "train.py:10" not in rows


@pytest.mark.parametrize("option", ["--json", pytest.param("--html", marks=pytest.mark.slow)])
def test_unwritable_output_refused_before_the_script_runs(option, script, tmp_path):
    marker = tmp_path / "ran"
    missing = tmp_path / "no" / "such" / "dir" / "report.out"
    done = run("track", option, missing, script, marker)
    assert done.returncode == 2
    assert f"{option} {missing}" in done.stderr and "no such directory" in done.stderr
    assert not marker.exists()
    done = run("track", option, tmp_path, script, marker)  # a directory
    assert done.returncode == 2 and "is a directory" in done.stderr
    assert not marker.exists()


def test_unwritable_directory_refused(script, tmp_path):
    marker = tmp_path / "ran"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root writes there: sysfs refuses even root
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("running as root, and no sysfs to stand for an unwritable directory")
        locked = "/sys"
    try:
        done = run("track", "--json", os.path.join(locked, "r.json"), script, marker)
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert done.returncode == 2, done.stderr
    assert f"cannot write in {locked}" in done.stderr
    assert not marker.exists()


def test_json_and_html_of_nonfinite_data(script, tmp_path):
    """Issue 25.4: --json left a 0-byte file on a non-finite origin."""
    marker, out, page = tmp_path / "ran", tmp_path / "report.json", tmp_path / "report.html"
    done = run("track", "--nonfinite", "record", "--health", "--policy", "record",
               "--json", out, "--html", page, script, marker)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    report = torchcast.Report.from_json(out.read_text())
    assert "aten::mul_" in {o.op for o in report.nonfinite}
    assert any(r.stats.max_rel_err == float("inf") for r in report.records)
    assert "<td>inf</td>" in page.read_text(encoding="utf-8")
    assert sorted(os.listdir(tmp_path)) == ["ran", "report.html", "report.json", "train.py"]
