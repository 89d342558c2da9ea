"""The tracker's host cost of one op that is not a cast, and of one module
call, for each kind of tracking: the figure that transfers to a GPU, where
the device time of a small op is a few microseconds (issue: the tracker core,
at most 1 us an op). bench_track.py's "overhead per op" divides a whole
step's extra time by its ops, so it also holds the module hooks, the casts
and entering and leaving the track; this separates them.

Workloads, one thread, inside one track per measurement: x.add(1.0) of 16
float32 elements (one tensor input); torch.addmm of 4x16 by 16x16 (three);
an nn.Linear(16, 16) module call (the same addmm, plus the tracker's module
hooks). Rounds interleave the plain run and every tracking; each figure is
the median over rounds of (tracked - plain) per call.

    PYTHONPATH=. python benchmarks/bench_track_per_op.py [--rounds 15]
"""
import argparse
import os
import statistics
import sys
import time

import torch

import torchcast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CALLS = 20_000
TRACKS = {
    "plain": None,
    "all_casts=True": dict(all_casts=True),
    'nonfinite="record"': dict(nonfinite="record"),
    "health=True": dict(health=True),
    'nonfinite="record", health=True': dict(nonfinite="record", health=True),
}


def workloads():
    torch.manual_seed(0)
    x = torch.randn(16)
    a, b, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16, 16)
    lin = torch.nn.Linear(16, 16)
    return {
        "x.add(1.0), 16 elements": lambda: x.add(1.0),
        "torch.addmm, 4x16 @ 16x16": lambda: torch.addmm(b, a, w),
        "nn.Linear(16, 16) call": lambda: lin(a),
    }


def per_call_ns(fn, options):
    def loop():
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        return (time.perf_counter() - t0) / CALLS * 1e9
    if options is None:
        return loop()
    with torchcast.track(**options):
        return loop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "track_per_op.md"))
    protocol.add_arguments(ap)
    opts = ap.parse_args()
    run = protocol.Run(opts.force)
    torch.set_num_threads(1)
    rows = []
    with torch.no_grad():
        for name, fn in workloads().items():
            for options in TRACKS.values():  # warm-up: first tracks install their kernels
                per_call_ns(fn, options)
            times = {t: [] for t in TRACKS}
            for r in range(opts.rounds):
                order = list(TRACKS) if r % 2 == 0 else list(reversed(TRACKS))
                for t in order:
                    times[t].append(per_call_ns(fn, TRACKS[t]))
            plain = times["plain"]
            for t in TRACKS:
                extra = statistics.median(a - b for a, b in zip(times[t], plain))
                rows.append((name, t, statistics.median(times[t]),
                             "" if t == "plain" else f"{extra:,.0f} ns"))
    run.copy_bandwidth(protocol.copy_bandwidth(9), 1, 1 << 27)
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_track_per_op.py"] + sys.argv[1:])
    lines = [f"`{command}` — torch {torch.__version__}, one thread, {protocol.cpu_name()}; "
             f"{CALLS:,} calls per measurement, {opts.rounds} interleaved rounds (order "
             f"alternating), medians; under torch.no_grad() (forward ops). {run.summary()}",
             "", "| workload | tracking | time per call | extra per call (median) |",
             "|---|---|---:|---:|"]
    lines += [f"| {w} | {t} | {ns:,.0f} ns | {extra} |" for w, t, ns, extra in rows]
    table = "\n".join(lines)
    print(table)
    run.write(opts.out, table + "\n")


if __name__ == "__main__":
    main()
