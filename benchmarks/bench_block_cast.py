"""block_cast against torchao's MX reference (torchao.prototype.mx_formats
to_mx, pure PyTorch on the CPU) for MXFP8 (e4m3, blocks of 32, "floor"
scales), and beside a plain x.to(torch.float8_e4m3fn) and a same-dtype
copy: float32 input at 2^22 and 2^25 elements, one process, all of them
interleaved round by round, medians and the median of the per-round ratios
to to_mx (benchmarks/README.md). block_cast does more per element (the
statistics of cast_with_stats and the per-block facts) in one pass.

    PYTHONPATH=. python benchmarks/bench_block_cast.py [--rounds N] [--threads T]

Needs torchao (requirements.txt installs it for the tests); writes
benchmarks/results/block_cast_cpu.md.
"""
import argparse
import os
import statistics
import sys

import torch

import protocol
import torchcast
from bench_cast import Timer, fmt_time, inner_calls, run_rounds

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "block_cast_cpu.md"))
    protocol.add_arguments(ap)
    opts = ap.parse_args()
    try:
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    except ImportError as e:
        sys.exit(f"torchao is not importable ({e}); pip install --no-deps torchao==0.18.0")
    run = protocol.Run(opts.force)
    torch.set_num_threads(opts.threads)
    timer = Timer(torch.device("cpu"))
    rows = []
    for k in (22, 25):
        n = 1 << k
        x = torch.randn(n // 256, 256) * 10
        out = torch.empty_like(x)
        cases = {
            "torchao to_mx": lambda: to_mx(x, torch.float8_e4m3fn, 32,
                                           ScaleCalculationMode.FLOOR),
            "torchcast block_cast": lambda: torchcast.block_cast(x, "mxfp8_e4m3"),
            "x.to(float8_e4m3fn)": lambda: x.to(torch.float8_e4m3fn),
            "copy_ (float32)": lambda: out.copy_(x),
        }
        inner = {name: inner_calls(timer, fn, 0.05) for name, fn in cases.items()}
        times = run_rounds(timer, cases, opts.rounds, inner)
        base = times["torchao to_mx"]
        copy_gbs = 8 * n / statistics.median(times["copy_ (float32)"]) / 1e9
        run.copy_bandwidth(copy_gbs, opts.threads, 8 * n)
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, base))
            rows.append((f"2^{k}", name, fmt_time(statistics.median(t)), f"{ratio:.2f}x"))
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_block_cast.py"] + sys.argv[1:])
    lines = [f"`{command}` — torch {torch.__version__}, torch.set_num_threads({opts.threads}), "
             f"{protocol.cpu_name()}; float32 input, MXFP8 e4m3 with floor scales, blocks of 32 "
             f"along the last dimension; {opts.rounds} interleaved rounds, medians; ratio: the "
             f"median of the per-round ratios to to_mx. {run.summary()}",
             "", "| elements | what | time | vs torchao to_mx |", "|---|---|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    table = "\n".join(lines)
    print(table)
    run.write(opts.out, table + "\n")


if __name__ == "__main__":
    main()
