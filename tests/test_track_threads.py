"""track() and the rest of the program: threads entering and leaving tracks
while others cast must neither crash nor disturb any thread's results; a
track records the casts of every thread (started before or inside the block)
and of DataLoader worker processes.

The stress runs in a subprocess, so that a crash (a segfault in the
dispatcher) fails the test instead of killing the test run."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import torchcast

from track_ref import assert_stats_match, stats_of_cast

needs_extension = pytest.mark.skipif(
    not torchcast._ops.WITH_EXTENSION,
    reason="other threads' casts reach track through the compiled extension's kernel; "
           "a build without it records the entering thread only (and says so)")


def env_importing_torchcast():
    """The environment, with the torchcast under test importable from any
    directory (a source tree's, or the installed one)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(torchcast.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}

STRESS = textwrap.dedent("""
    import threading
    import torch
    import torchcast

    import sys

    TRACKERS, CASTERS, ENTRIES = 3, 3, {entries}
    # without the extension the program's casts under autocast read as autocast's
    OWN = "cast" if torchcast._ops.WITH_EXTENSION else "autocast"
    LINES = open(__file__).read().splitlines()
    CASTER_LINES = [n for n, text in enumerate(LINES, 1) if text.endswith("# caster")]
    LINEAR_LINE = next(n for n in CASTER_LINES if "w(y)" in LINES[n - 1])
    errors = []
    done = threading.Event()

    def tracker(i):
        try:
            x = torch.full((8,), 1e5 + i, dtype=torch.float32)
            for n in range(ENTRIES):
                with torchcast.track(all_casts=True, policy="record") as report:
                    if n % 2:
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            x.float().half(); line = sys._getframe().f_lineno  # noqa: E702
                # the thread's own cast, once; the casters' casts may join it
                own = [r for r in report.records if r.line == line]
                if n % 2:
                    assert [(r.origin, r.dtype, r.calls, r.stats.overflow) for r in own] == \
                        [(OWN, torch.float16, 1, 8)], own
                else:
                    assert own == [], own
                others = [r for r in report.records if r not in own]
                assert all(r.line in CASTER_LINES for r in others), others
                # the casters' module stacks survive tracks starting and ending
                # mid-forward: no module outside the forward (a forward that was
                # already running when the track started has none)
                assert all(r.module is None or r.line == LINEAR_LINE for r in others), others
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    def caster(i):
        try:
            x = torch.randn(64, dtype=torch.float64)
            w = torch.nn.Linear(64, 4)
            casts = 0
            while not done.is_set() or casts < 100:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = x.float()  # caster
                    assert y.dtype == torch.float32 and torch.equal(y, x.to(torch.float32))  # caster
                    assert w(y).dtype == torch.bfloat16  # caster
                z = x.half()  # caster
                assert torch.equal(z, x.to(torch.float16))  # caster
                casts += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    trackers = [threading.Thread(target=tracker, args=(i,)) for i in range(TRACKERS)]
    casters = [threading.Thread(target=caster, args=(i,)) for i in range(CASTERS)]
    for t in casters + trackers:
        t.start()
    for t in trackers:
        t.join()
    done.set()
    for t in casters:
        t.join()
    assert not errors, errors[:3]
    print("ok", TRACKERS * ENTRIES)
""")


def test_tracks_entered_and_left_while_other_threads_cast(tmp_path):
    """3 threads each enter and leave track(all_casts=True) 1500 times, half
    of them casting under autocast inside, while 3 threads cast under
    autocast and not, untracked: no crash, every cast equal to x.to's, each
    track holds its own thread's cast once, and the other casts it holds are
    the casting threads'."""
    script = tmp_path / "stress.py"
    script.write_text(STRESS.format(entries=1500))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env=env_importing_torchcast())
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])
    assert run.stdout.split() == ["ok", "4500"], run.stdout


def run_in_thread(fn):
    """Runs fn in a new thread; returns what it returned or raises what it raised."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


@needs_extension
def test_threads_started_before_and_inside_the_block_are_recorded():
    x = torch.tensor([1.0, 1e5, 1 / 3, 2.0 ** -30], dtype=torch.float64)
    go, done = threading.Event(), threading.Event()
    lines = {}

    def before():
        go.wait()
        lines["before"] = sys._getframe().f_lineno + 1
        x.half()
        done.set()

    early = threading.Thread(target=before)
    early.start()  # before the block
    with torchcast.track(all_casts=True, policy="record") as report:
        go.set()
        done.wait()

        def inside():
            lines["inside"] = sys._getframe().f_lineno + 1
            return x.bfloat16()

        run_in_thread(inside)
    early.join()
    by_line = {r.line: r for r in report.records}
    assert set(by_line) == {lines["before"], lines["inside"]}
    half, bf16 = by_line[lines["before"]], by_line[lines["inside"]]
    assert (half.origin, half.dtype, half.calls) == ("cast", torch.float16, 1)
    assert (bf16.origin, bf16.dtype, bf16.calls) == ("cast", torch.bfloat16, 1)
    assert_stats_match(half.stats, stats_of_cast(x, x.half()))
    assert_stats_match(bf16.stats, stats_of_cast(x, x.bfloat16()))
    assert half.violations() == ["1 overflow", "1 underflow"]  # 1e5 and 2**-30
    # after the block, other threads' casts are not recorded
    run_in_thread(lambda: x.half())
    assert sum(r.calls for r in report.records) == 2


@needs_extension
def test_another_threads_module_and_autocast_casts():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x = torch.randn(2, 8)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    with torchcast.track(all_casts=True, policy="record") as report:
        out = run_in_thread(forward)
    assert out.dtype == torch.bfloat16
    (record,) = report.records
    assert (record.module, record.origin, record.calls) == ("0", "autocast", 3)
    assert record.stats.numel == 16 + 32 + 4  # input, weight, bias


@needs_extension
def test_policy_raise_raises_in_the_thread_that_cast():
    x = torch.tensor([1e6])
    with torchcast.track(all_casts=True, policy="raise"):
        with pytest.raises(torchcast.PrecisionLossError, match="1 overflowed to inf"):
            run_in_thread(lambda: x.half())


class Overflowing(torch.utils.data.Dataset):
    """Items made in float64 and cast to float16 in the worker: item i holds
    4 values, i of them above float16's range."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        values = torch.ones(4, dtype=torch.float64)
        values[:i % 5] = 1e5
        return values.half()


def test_dataloader_workers_ship_their_casts_back():
    loader = torch.utils.data.DataLoader(Overflowing(), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    with torchcast.track(all_casts=True, policy="record") as report:
        batches = [b for b in loader]
    assert sum(torch.isinf(b).sum().item() for b in batches) == sum(i % 5 for i in range(8))
    workers = {r.origin: r for r in report.records}
    assert set(workers) == {"cast [worker 0]", "cast [worker 1]"}
    assert sum(r.calls for r in workers.values()) == 8
    assert sum(r.stats.overflow for r in workers.values()) == sum(i % 5 for i in range(8))
    assert all(r.file.endswith("test_track_threads.py") for r in workers.values())


def test_safe_to_and_cast_modules_of_other_threads_are_recorded():
    # safe_to dispatches torchcast's own op, not aten::_to_copy: its other-thread
    # calls reach the track through the other-thread recorders (cast.py).
    x = torch.linspace(-1e5, 1e5, 100)
    cast = torchcast.nn.Cast(torch.float16, policy="record")
    seen = {}

    def work():
        torchcast.safe_to(x, torch.float16, policy="record")
        cast(x)
        with torchcast.track() as own:  # recorded by its own track and the all_casts one
            torchcast.safe_to(x, torch.bfloat16, policy="record")
        seen["own"] = own
        with torchcast.track(all_casts=True) as covered:  # by its own all_casts track alone
            torchcast.safe_to(x, torch.float64, policy="record")
        seen["covered"] = covered

    with torchcast.track(all_casts=True, policy="record") as report:
        t = threading.Thread(target=work)
        t.start()
        t.join(timeout=60)
    want = stats_of_cast(x, x.half())
    origins = sorted((r.origin, r.module or "", str(r.dtype)) for r in report.records)
    assert origins == [("safe_to", "", "torch.bfloat16"), ("safe_to", "", "torch.float16"),
                       ("safe_to", "Cast", "torch.float16")]
    for r in report.records:
        if r.dtype == torch.float16:
            assert_stats_match(r.stats, want)
    assert [(r.origin, r.dtype) for r in seen["own"].records] == [("safe_to", torch.bfloat16)]
    assert [(r.origin, r.dtype) for r in seen["covered"].records] == [("safe_to", torch.float64)]
