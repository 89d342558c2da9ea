"""Cast throughput against size: cast_with_stats (the cast and its
statistics in one pass), x.to(dtype) and a same-dtype copy, float32 ->
bfloat16 on the CPU, from 2^10 to 2^26 elements; GB/s counts the bytes read
and written (benchmarks/README.md: one process, the three interleaved round
by round, medians). Writes benchmarks/results/cast_sizes.md and, with
matplotlib, docs/img/cast_sizes.png from the same figures.

    PYTHONPATH=. python benchmarks/bench_cast_sizes.py [--rounds N] [--threads T]
"""
import argparse
import os
import statistics
import sys

import torch

import protocol
import torchcast  # noqa: F401  (registers torch.ops.torchcast)
from bench_cast import Timer, inner_calls, run_rounds

HERE = os.path.dirname(os.path.abspath(__file__))
OP = torch.ops.torchcast.cast_with_stats
SRC, DST = torch.float32, torch.bfloat16
LABELS = {"cast_with_stats": "torchcast cast_with_stats (cast + statistics)",
          "x.to": "x.to(torch.bfloat16)",
          "copy": "same-dtype copy_ (float32, preallocated)"}


def measure(n, rounds, timer):
    x = torch.randn(n, dtype=SRC)
    out = torch.empty_like(x)
    cases = {"cast_with_stats": lambda: OP(x, DST), "x.to": lambda: x.to(DST),
             "copy": lambda: out.copy_(x)}
    inner = {name: inner_calls(timer, fn, 0.02) for name, fn in cases.items()}
    times = run_rounds(timer, cases, rounds, inner)
    moved = {"cast_with_stats": n * (4 + 2), "x.to": n * (4 + 2), "copy": n * 8}
    return {name: moved[name] / statistics.median(t) / 1e9 for name, t in times.items()}


def plot(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = [n for n, _ in rows]
    for name, label in LABELS.items():
        ax.plot(sizes, [gbs[name] for _, gbs in rows], marker="o", label=label,
                linestyle="--" if name == "copy" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("elements")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cast_sizes.md"))
    ap.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "img", "cast_sizes.png"))
    protocol.add_arguments(ap)
    opts = ap.parse_args()
    run = protocol.Run(opts.force)
    torch.set_num_threads(opts.threads)
    timer = Timer(torch.device("cpu"))
    rows = [(1 << k, measure(1 << k, opts.rounds, timer)) for k in range(10, 27, 2)]
    run.copy_bandwidth(rows[-1][1]["copy"], opts.threads, 8 << 26)
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_cast_sizes.py"] + sys.argv[1:])
    head = (f"`{command}` — torch {torch.__version__}, torch.set_num_threads({opts.threads}), "
            f"{protocol.cpu_name()}; float32 -> bfloat16, fresh outputs (the copy: "
            f"preallocated), {opts.rounds} interleaved rounds, medians. {run.summary()}")
    lines = [head, "", "| elements | " + " | ".join(LABELS.values()) + " |",
             "|---:|" + "---:|" * len(LABELS)]
    for n, gbs in rows:
        lines.append(f"| 2^{n.bit_length() - 1} | "
                     + " | ".join(f"{gbs[name]:.1f} GB/s" for name in LABELS) + " |")
    table = "\n".join(lines)
    print(table)
    if run.write(opts.out, table + "\n"):
        plot(rows, opts.plot, f"float32 -> bfloat16 on {protocol.cpu_name()}, "
                              f"{opts.threads} threads (benchmarks/bench_cast_sizes.py)")


if __name__ == "__main__":
    main()
