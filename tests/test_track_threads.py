"""track() under concurrency: threads entering and leaving tracks while
others cast, under autocast and not, must neither crash nor disturb any
thread's results or another track's records.

The stress runs in a subprocess, so that a crash (a segfault in the
dispatcher) fails the test instead of killing the test run."""
import subprocess
import sys
import textwrap

STRESS = textwrap.dedent("""
    import threading
    import torch
    import torchcast

    TRACKERS, CASTERS, ENTRIES = 3, 3, {entries}
    errors = []
    done = threading.Event()

    def tracker(i):
        try:
            x = torch.full((8,), 1e5 + i, dtype=torch.float32)
            for n in range(ENTRIES):
                with torchcast.track(all_casts=True, policy="record") as report:
                    if n % 2:
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            x.float().half()
                # the thread's own casts, and only them
                if n % 2:
                    kinds = sorted((r.origin, str(r.dtype)) for r in report.records)
                    assert kinds == [("cast", "torch.float16")], kinds
                    assert report.records[0].stats.overflow == 8
                else:
                    assert len(report) == 0, report
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    def caster(i):
        try:
            x = torch.randn(64, dtype=torch.float64)
            w = torch.nn.Linear(64, 4)
            casts = 0
            while not done.is_set() or casts < 100:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = x.float()
                    assert y.dtype == torch.float32 and torch.equal(y, x.to(torch.float32))
                    assert w(y).dtype == torch.bfloat16
                z = x.half()
                assert torch.equal(z, x.to(torch.float16))
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


def test_tracks_entered_and_left_while_other_threads_cast():
    """3 threads each enter and leave track(all_casts=True) 1500 times, half
    of them casting under autocast inside, while 3 threads cast under
    autocast and not, untracked: no crash, every cast equal to x.to's, and
    each track holds exactly its own thread's casts."""
    run = subprocess.run([sys.executable, "-c", STRESS.format(entries=1500)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])
    assert run.stdout.split() == ["ok", "4500"], run.stdout
