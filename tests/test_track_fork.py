"""track() and processes forked inside it: a bare ``os.fork()`` child and
DataLoader workers (the "fork" start method).

A forked child inherits the track. It must neither delete the parent's
spool directory nor report (under ``python -m torchcast track``, a child
that runs on to the script's end prints nothing and writes no --json); what
it records reaches the parent's report, labelled "[worker N]" (N: the
DataLoader worker id, else the child's pid), and so do the non-finite
origins of DataLoader workers, in the order they happened, under "record"
and "raise" alike.

Children forked from the test process never return to pytest: whatever
happens in them ends in os._exit, with a status the parent checks."""
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import torchcast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchcast.__file__)))
LINE = {}
WAIT_S = 60  # for a child or a DataLoader worker: far above what they take


def _mark(name):
    """The line of the caller, under ``name`` (the lines records must name)."""
    LINE[name] = sys._getframe(1).f_lineno


def line_of(func, text):
    """The line of ``func``'s source holding ``text``: a line that only a
    forked child runs, whose mark the parent would not see."""
    lines, first = inspect.getsourcelines(func)
    [line] = [first + i for i, source in enumerate(lines) if text in source]
    return line


def wait_for(pid):
    """The exit code of child ``pid``; kills it and fails after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} did not exit within {WAIT_S} s")


@pytest.fixture
def spool_dir(tmp_path, monkeypatch):
    """Where the track's spool is made (tempfile's directory), so that the
    test sees it, and only its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return lambda: sorted(p.name for p in tmp_path.glob("torchcast-track-*"))


def _block(exit_how, spools):
    """A track in which the parent casts, forks a child that casts and makes
    a NaN, casts again, then leaves by ``exit_how``; the parent waits for it.

    Returns:
        (report, the child's pid, its exit code, ``spools()`` once it exited).
    """
    big = torch.tensor([1e6, 1.0])
    # float64: no rerun in a wider dtype, whose cast all_casts would record
    negative = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    with torchcast.track(all_casts=True, policy="record", nonfinite="record") as report:
        _mark("parent"); big.half()  # noqa: E702
        pid = os.fork()
        if pid == 0:
            big.bfloat16()  # the child's cast
            torch.log(negative)  # the child's NaN: it writes what it has at once
            big.double()  # the child's last cast: written when it leaves the block
            if exit_how == "os._exit":
                os._exit(0)
            sys.exit(0)  # leaves the block through the track's __exit__
        code = wait_for(pid)
        seen = spools()
    return report, pid, code, seen


@pytest.mark.parametrize("exit_how", ["sys.exit", "os._exit"])
def test_fork_child_leaves_the_parents_spool_and_report(exit_how, spool_dir):
    parent = os.getpid()
    try:
        report, pid, code, seen = _block(exit_how, spool_dir)
    except SystemExit:  # the child, out of the block: its track's exit did not raise
        os._exit(0)
    except BaseException:  # the child's exit raised (or the parent's)
        if os.getpid() != parent:
            os._exit(1)
        raise
    finally:
        if os.getpid() != parent:
            os._exit(2)  # the child never returns to pytest
    assert code == 0
    assert len(seen) == 1  # the spool outlived the child
    assert spool_dir() == []  # removed by the parent's exit
    sites = {(r.origin, r.line): r for r in report.records}
    mine = sites.pop(("cast", LINE["parent"]))
    assert (mine.calls, mine.stats.overflow, mine.dtype) == (1, 1, torch.float16)
    child = sites.pop((f"cast [worker {pid}]", line_of(_block, "the child's cast")))
    assert (child.calls, child.dtype, child.file) == (1, torch.bfloat16, __file__)
    if exit_how == "sys.exit":
        last = sites.pop((f"cast [worker {pid}]", line_of(_block, "the child's last cast")))
        assert (last.calls, last.dtype) == (1, torch.float64)
    # else os._exit: nothing runs in the child at its exit; what it wrote at
    # its origin is all the parent gets.
    assert sites == {}
    overflow = ("aten::_to_copy", LINE["parent"], None, 0)  # the parent's cast is an origin too
    origins = [(o.op, o.line, o.worker, o.nan) for o in report.nonfinite]
    assert origins == [overflow, ("aten::log", line_of(_block, "the child's NaN"), pid, 1)]
    assert f"[worker {pid}]" in report.nonfinite[1].describe()


CLI_SCRIPT = textwrap.dedent("""\
    import os
    import torch
    big = torch.tensor([1e6, 1.0])
    big.half()  # line 4: the parent's cast
    pid = os.fork()
    if pid == 0:
        big.bfloat16()  # line 7: the child's cast
    else:
        _, status = os.waitpid(pid, 0)
        print("child", pid, os.waitstatus_to_exitcode(status), flush=True)
    # both fall off the end here
""")


def test_cli_child_that_runs_to_the_end_does_not_report(tmp_path):
    script = tmp_path / "forks.py"
    script.write_text(CLI_SCRIPT)
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "torchcast", "track", "--json", str(out),
                           str(script)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    _, pid, code = done.stdout.split()
    assert code == "0"
    assert done.stderr.count("torchcast.track: 2 cast sites,") == 1, done.stderr
    assert done.stderr.count("cast sites,") == 1, done.stderr  # no other report
    assert done.stderr.count("report written to") == 1, done.stderr
    assert "Traceback" not in done.stderr
    records = torchcast.Report.from_json(out.read_text()).records
    assert sorted((r.origin, r.line) for r in records) == \
        [("cast", 4), (f"cast [worker {pid}]", 7)]


# -- DataLoader workers under track(nonfinite=...) ----------------------------------
BAD = 3  # the item whose __getitem__ makes a NaN: with 2 workers, worker 1's second


class Logs(torch.utils.data.Dataset):
    """log(1 + i) of 2 values; item BAD takes the log of a negative."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = torch.tensor([float(i) + 1.0, -1.0 if i == BAD else 2.0])
        return torch.log(x)  # the worker's NaN


NAN_LINE = line_of(Logs.__getitem__, "the worker's NaN")


def _loader():
    return torch.utils.data.DataLoader(Logs(), batch_size=1, num_workers=2, timeout=WAIT_S,
                                       multiprocessing_context="fork")


def test_worker_origin_listed_in_order_under_record(nonfinite_engine, spool_dir):
    loader = _loader()
    negative = torch.tensor([-1.0])
    with torchcast.track(nonfinite="record") as report:
        _mark("before"); torch.sqrt(negative)  # noqa: E702
        batches = [b for b in loader]
        _mark("after"); torch.log(negative)  # noqa: E702
    assert [bool(torch.isnan(b).any()) for b in batches] == [i == BAD for i in range(4)]
    origins = report.nonfinite
    assert [(o.op, o.line, o.worker) for o in origins] == [
        ("aten::sqrt", LINE["before"], None),
        ("aten::log", NAN_LINE, 1),  # item BAD, made in worker 1
        ("aten::log", LINE["after"], None)]
    worker = origins[1]
    assert worker.file == __file__ and (worker.nan, worker.posinf, worker.neginf) == (1, 0, 0)
    assert worker.phase == "forward" and worker.count == 1
    assert f"test_track_fork.py:{NAN_LINE} [worker 1]. Inputs" in worker.describe()
    assert "aten::log made 1 NaN" in str(report) and "[worker 1]" in str(report)
    assert spool_dir() == []
    again = torchcast.Report.from_json(report.to_json()).nonfinite
    assert again == origins and [o.worker for o in again] == [None, 1, None]


def test_worker_origin_stops_the_run_and_is_reported_under_raise(spool_dir):
    loader = _loader()
    with pytest.raises(RuntimeError) as info:
        with torchcast.track(nonfinite="raise_at_op") as report:
            for _ in loader:
                pass
    # DataLoader re-raises a worker's error as a RuntimeError quoting it.
    message = str(info.value)
    assert "Caught NonFiniteError in DataLoader worker process 1" in message
    assert "aten::log made 1 NaN" in message and "[worker 1]" in message
    [origin] = report.nonfinite
    assert (origin.op, origin.line, origin.file, origin.worker) == \
        ("aten::log", NAN_LINE, __file__, 1)
    assert "1 op made NaN/inf" in str(report) and "0 ops" not in str(report)
    assert spool_dir() == []
