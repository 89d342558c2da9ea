"""safe_to(x, dtype, policy="record") against x.to(dtype) on one thread, for
every lossy pair, at the sizes models cast (2^10, 2^18 in cache, 2^22), as
benchmarks/README.md asks: one process, both interleaved round by round,
medians and the median of the per-round ratios, a one-thread float32 copy's
bandwidth at 2^22 measured in the same rounds, the load average recorded.
A second table: the amax-scaled float8 cast, safe_to(x, dtype, scale="amax")
against torchao's composite (x * (max / amax)).to(dtype), and
cast_with_stats(x, dtype, out=y) against the allocating call, at 2^12 and
2^22.

    python benchmarks/bench_safe_to.py [--rounds 11]
    python benchmarks/bench_safe_to.py --quick     # the second table at 2^12,
                                                   # 5 rounds, written nowhere

Prints markdown tables and writes them to benchmarks/results/safe_to_cpu.md.
"""
import argparse
import os
import statistics

import torch

import protocol
import torchcast
from bench_cast import Timer, inner_calls, run_rounds
from torchcast._reference.cast import LOSSY_PAIRS

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (1 << 10, 1 << 18, 1 << 22)
SCALED_SIZES = (1 << 12, 1 << 22)
SCALED_PAIRS = ((torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
                (torch.float64, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2))
OUT_PAIRS = ((torch.float32, torch.float16), (torch.float32, torch.float8_e4m3fn))


def torchao_scaled(x, dtype):
    """torchao's dynamic float8 recipe as a composite: scale max / amax,
    multiply, cast (the cast saturates float8_e4m3fn)."""
    return (x * (torch.finfo(dtype).max / x.abs().amax())).to(dtype)


def scaled_table(timer, rounds, sizes):
    """Rows of the second table: (name, pair, cells per size)."""
    lines = ["| cast | pair | " + " | ".join(f"2^{n.bit_length() - 1}: baseline, torchcast, ratio"
                                            for n in sizes) + " |",
             "|---|---|" + "---:|" * len(sizes)]
    rows = [("safe_to(scale=\"amax\") vs torchao composite", src, dst) for src, dst in SCALED_PAIRS]
    rows += [("cast_with_stats(out=y) vs allocating", src, dst) for src, dst in OUT_PAIRS]
    for what, src, dst in rows:
        cells = []
        for n in sizes:
            x = (torch.randn(n, dtype=torch.float64) * 100).to(src)
            y = torch.empty(n, dtype=dst)
            if what.startswith("safe_to"):
                cases = {"base": lambda: torchao_scaled(x, dst),
                         "ours": lambda: torchcast.safe_to(x, dst, scale="amax", policy="record")}
            else:
                cases = {"base": lambda: torchcast.cast_with_stats(x, dst),
                         "ours": lambda: torchcast.cast_with_stats(x, dst, out=y)}
            inner = {k: inner_calls(timer, f, 2e-3) for k, f in cases.items()}
            t = run_rounds(timer, cases, rounds, inner)
            ratio = statistics.median(a / b for a, b in zip(t["ours"], t["base"]))
            cells.append(f"{statistics.median(t['base']) * 1e6:,.1f} µs, "
                         f"{statistics.median(t['ours']) * 1e6:,.1f} µs, **{ratio:.2f}x**")
        lines.append(f"| {what} | {str(src)[6:]} → {str(dst)[6:]} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11, help="interleaved rounds per measurement")
    ap.add_argument("--quick", action="store_true",
                    help="only the scaled and out= table at 2^12, 5 rounds; writes nothing")
    protocol.add_arguments(ap)
    args = ap.parse_args()
    run = protocol.Run(args.force)
    torch.set_num_threads(1)
    timer = Timer(torch.device("cpu"))
    if args.quick:
        print(f"# quick: one thread, 5 interleaved rounds, 1-minute load average "
              f"{protocol.load_average():.2f} before (not a figure to publish)", flush=True)
        scaled_table(timer, 5, SCALED_SIZES[:1])
        print(f"# 1-minute load average {protocol.load_average():.2f} after")
        return
    command = "python benchmarks/bench_safe_to.py" + (
        f" --rounds {args.rounds}" if args.rounds != 11 else "")
    print(f"# {command}", flush=True)

    src32 = torch.randn(SIZES[-1])
    dst32 = torch.empty_like(src32)
    header = ("| pair | " + " | ".join(f"2^{n.bit_length() - 1}: x.to, safe_to, ratio" for n in SIZES)
              + " |")
    lines = [header, "|---|" + "---:|" * len(SIZES)]
    bandwidths = []
    for src, dst in LOSSY_PAIRS:
        cells = []
        for n in SIZES:
            x = (torch.randn(n, dtype=torch.float64) * 100).to(src)
            cases = {
                "to": lambda: x.to(dst),
                "safe_to": lambda: torchcast.safe_to(x, dst, policy="record"),
                "copy32": lambda: dst32.copy_(src32),
            }
            inner = {k: inner_calls(timer, f, 2e-3) for k, f in cases.items()}  # also warms up
            t = run_rounds(timer, cases, args.rounds, inner)
            ratio = statistics.median(a / b for a, b in zip(t["safe_to"], t["to"]))
            bandwidths.append(2 * src32.numel() * 4 / statistics.median(t["copy32"]) / 1e9)
            cells.append(f"{statistics.median(t['to']) * 1e6:,.1f} µs, "
                         f"{statistics.median(t['safe_to']) * 1e6:,.1f} µs, **{ratio:.2f}x**")
        lines.append(f"| {str(src)[6:]} → {str(dst)[6:]} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    print()
    scaled = scaled_table(timer, args.rounds, SCALED_SIZES)
    run.copy_bandwidth(min(bandwidths), 1, 2 * 4 * src32.numel())
    text = (f"`{command}` — {protocol.cpu_name()}, torch {torch.__version__}, one thread, "
            f"{args.rounds} interleaved rounds, medians (ratio: median of the per-round ratios); "
            f"{run.summary()}\n\n" + "\n".join(lines) + "\n\nThe amax-scaled float8 cast "
            "against torchao's composite `(x * (max / x.abs().amax())).to(dtype)`, and "
            "`cast_with_stats` into a preallocated `out=` against the allocating call:\n\n"
            + "\n".join(scaled) + "\n")
    print()
    print(text)
    run.write(os.path.join(HERE, "results", "safe_to_cpu.md"), text)


if __name__ == "__main__":
    main()
