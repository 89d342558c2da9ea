"""kahan_sum against torch's float32 and float64 sums (follows
benchmarks/README.md: one process, interleaved rounds, medians).

For each case: the median time of torchcast.kahan_sum and of each baseline,
the median of the per-round time ratios (ours / baseline), GB/s (bytes read
plus bytes written) against the copy bandwidth measured in the same run, and
the relative error of every result against math.fsum of the exact values.

    PYTHONPATH=. python benchmarks/bench_reduce.py [--rounds N] [--threads T]
"""
import argparse
import itertools
import math
import os
import statistics
import sys
import time

import torch

import protocol
import torchcast

LOG2_N = 25


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def exact_sums(x2d):
    """The exact sum of each row of a 2-D float tensor as a pair hi + lo of
    float64 (math.fsum is correctly rounded, so lo is the exact residual,
    rounded once); fed in pieces to keep the Python lists small."""
    def values(row):
        return (v for piece in row.split(1 << 20) for v in piece.double().tolist())

    pairs = []
    for row in x2d:
        hi = math.fsum(values(row))
        pairs.append((hi, math.fsum(itertools.chain(values(row), [-hi]))))
    return pairs


def rel_error(result, exact):
    """Largest |result - exact| / |exact| over the outputs. result - hi is
    exact (Sterbenz) for any result within a factor 2 of the sum."""
    got = result.double().reshape(-1).tolist()
    return max(abs((g - hi) - lo) / abs(hi) for g, (hi, lo) in zip(got, exact))


# Each input dtype against its own baselines: the wider accumulations torch offers it.
def float32_cases(x, args):
    return [
        ("torchcast.kahan_sum", lambda: torchcast.kahan_sum(x, *args)),
        ("torchcast.kahan_sum(dtype=float64)",
         lambda: torchcast.kahan_sum(x, *args, dtype=torch.float64)),
        ("torch.sum", lambda: torch.sum(x, *args)),
        ("torch.sum(dtype=float64)", lambda: torch.sum(x, *args, dtype=torch.float64)),
        ("x.double().sum()", lambda: x.double().sum(*args)),
    ]


def half_cases(x, args):
    return [
        ("torchcast.kahan_sum", lambda: torchcast.kahan_sum(x, *args)),
        ("torchcast.kahan_sum(dtype=float32)",
         lambda: torchcast.kahan_sum(x, *args, dtype=torch.float32)),
        ("torch.sum", lambda: torch.sum(x, *args)),
        ("torch.sum(dtype=float32)", lambda: torch.sum(x, *args, dtype=torch.float32)),
        ("torch.sum(dtype=float64)", lambda: torch.sum(x, *args, dtype=torch.float64)),
    ]


def bench_case(label, x, dim, rounds, copy_gbs, make_cases):
    """Rows of the table for one reduction of x over dim (None: all); the
    first of make_cases' ops is ours, the time ratios are against it."""
    args = () if dim is None else (dim,)
    # The exact result of every output, as a 2-D (outputs, reduced) view.
    if dim is None:
        rows_view = x.reshape(1, -1)
    else:
        rows_view = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    exact = exact_sums(rows_view)
    cases = make_cases(x, args)
    results = {name: fn() for name, fn in cases}  # warm-up, and the values
    times = {name: [] for name, _ in cases}
    for _ in range(rounds):
        for name, fn in cases:
            times[name].append(timed(fn))
    ours = times[cases[0][0]]
    out_bytes = results[cases[0][0]].numel() * x.element_size()
    in_bytes = x.numel() * x.element_size()
    rows = []
    for name, _ in cases:
        t = statistics.median(times[name])
        ratio = statistics.median(a / b for a, b in zip(ours, times[name]))
        gbs = (in_bytes + out_bytes) / t / 1e9
        rows.append((label, name, t * 1e3, ratio, gbs, 100 * gbs / copy_gbs,
                     rel_error(results[name], exact)))
    return rows


def other_shapes(x, rounds):
    """kahan_sum against torch.sum on other layouts of the same 2^25 values:
    short rows, few rows, and the other input dtypes."""
    grid = x.view(1 << 12, 1 << 13)
    cases = [
        ("[2^19, 64], dim=1", x.view(-1, 64), 1), ("[2^20, 32], dim=1", x.view(-1, 32), 1),
        ("[2^22, 8], dim=1", x.view(-1, 8), 1), ("[8, 2^22], dim=0", x.view(8, -1), 0),
        ("[2^12, 2^13] bfloat16, dim=1", grid.bfloat16(), 1),
        ("[2^12, 2^13] bfloat16, dim=0", grid.bfloat16(), 0),
        ("2^25 float16, full", x.half(), None), ("2^25 float64, full", x.double(), None),
    ]
    lines = ["| layout | kahan_sum ms | torch.sum ms | kahan_sum time / torch.sum time |",
             "|---|---:|---:|---:|"]
    for name, y, dim in cases:
        args = () if dim is None else (dim,)
        ours, theirs = [], []
        torchcast.kahan_sum(y, *args)
        torch.sum(y, *args)
        for _ in range(rounds):
            ours.append(timed(lambda: torchcast.kahan_sum(y, *args)))
            theirs.append(timed(lambda: torch.sum(y, *args)))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        lines.append(f"| {name} | {statistics.median(ours) * 1e3:.1f} | "
                     f"{statistics.median(theirs) * 1e3:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "reduce.md"))
    protocol.add_arguments(parser)
    args = parser.parse_args()
    run = protocol.Run(args.force)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = 1 << LOG2_N
    copy_gbs = protocol.copy_bandwidth(args.rounds, n)
    run.copy_bandwidth(copy_gbs, torch.get_num_threads(), 2 * 4 * n)
    # Uniform [0, 1) drawn in float64 and rounded, so that every value has a
    # full 24-bit mantissa (torch.rand's float32 values are multiples of
    # 2^-24, whose sum float64 holds exactly). The sum grows to 2^24, where
    # float32 keeps no fractional bits (condition number 1).
    x = torch.rand(n, dtype=torch.float64).float()
    grid = x.view(1 << 12, 1 << 13)
    small = torch.rand(1 << 12, dtype=torch.float64).float()
    rows = []
    rows += bench_case(f"full, 2^{LOG2_N}", x, None, args.rounds, copy_gbs, float32_cases)
    rows += bench_case("dim=1 (inner), 4096x8192", grid, 1, args.rounds, copy_gbs,
                       float32_cases)
    rows += bench_case("dim=0 (outer), 4096x8192", grid, 0, args.rounds, copy_gbs,
                       float32_cases)
    rows += bench_case("full, 2^12", small, None, max(args.rounds, 200), copy_gbs,
                       float32_cases)
    rows += bench_case(f"bfloat16, full, 2^{LOG2_N}", x.bfloat16(), None, args.rounds, copy_gbs,
                       half_cases)

    shapes = other_shapes(x, args.rounds)
    command = "PYTHONPATH=. python benchmarks/bench_reduce.py " + " ".join(sys.argv[1:])
    lines = [
        f"`{command.strip()}` -- torch {torch.__version__}, "
        f"torch.set_num_threads({torch.get_num_threads()}), input uniform in [0, 1) with full "
        "float32 mantissas (the bfloat16 rows round it), "
        f"{args.rounds} interleaved rounds, copy bandwidth {copy_gbs:.1f} GB/s "
        f"(read + write, `dst.copy_(src)`, 2^25 float32); {run.summary()}",
        "",
        "| case | op | median ms | kahan_sum time / op time | GB/s | % of copy "
        "| max rel. error vs math.fsum |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, name, ms, ratio, gbs, pct, err in rows:
        lines.append(f"| {label} | {name} | {ms:.3f} | {ratio:.2f} | {gbs:.1f} | {pct:.0f}% | "
                     f"{err:.2e} |")
    table = "\n".join(lines) + "\n\nOther layouts (same values):\n\n" + shapes
    print(f"torch.set_num_threads({torch.get_num_threads()})")
    print(table)
    run.write(args.out, table + "\n")


if __name__ == "__main__":
    main()
