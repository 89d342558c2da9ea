"""tensor_health against torch.amax alone, which reads x once as it does
(follows benchmarks/README.md: one process, interleaved rounds, medians, the
copy bandwidth of the same run, the load average).

For each dtype and size: the median time of torchcast.tensor_health and of
torch.amax(x.abs())'s reading cost, torch.amax(x) (the issue's baseline), the
median of the per-round ratios, and GB/s read against the copy bandwidth.

    PYTHONPATH=. python benchmarks/bench_health.py [--rounds N] [--threads T]
"""
import argparse
import os
import statistics
import sys
import time

import torch

import protocol
from torchcast import _ops

CASES = [(torch.float32, 25), (torch.float32, 20), (torch.float32, 14), (torch.bfloat16, 25),
         (torch.float16, 25), (torch.float64, 24)]


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(dtype, log2_n, rounds):
    x = torch.randn(1 << log2_n, dtype=torch.float32).to(dtype)
    repeat = max(1, (1 << 22) >> log2_n)  # small cases: several calls per timing
    ours = lambda: [_ops.tensor_health(x) for _ in range(repeat)]  # noqa: E731
    base = lambda: [torch.amax(x) for _ in range(repeat)]  # noqa: E731
    for _ in range(3):
        ours(), base()
    t_ours, t_base, ratios = [], [], []
    for i in range(rounds):
        pair = (ours, base) if i % 2 == 0 else (base, ours)
        times = {fn: timed(fn) / repeat for fn in pair}
        t_ours.append(times[ours])
        t_base.append(times[base])
        ratios.append(times[ours] / times[base])
    o, b = statistics.median(t_ours), statistics.median(t_base)
    nbytes = x.numel() * x.element_size()
    return {"dtype": str(dtype).replace("torch.", ""), "n": log2_n, "ours_us": o * 1e6,
            "base_us": b * 1e6, "ratio": statistics.median(ratios), "gbs": nbytes / o / 1e9}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "health.md"))
    protocol.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = protocol.Run(args.force)
    n = 1 << 25
    run.copy_bandwidth(protocol.copy_bandwidth(args.rounds, n), args.threads, 2 * 4 * n)
    rows = [measure(dtype, log2_n, args.rounds) for dtype, log2_n in CASES]
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_health.py"] + sys.argv[1:])
    lines = [
        f"`{command}` — torch {torch.__version__}, torch.set_num_threads({args.threads}), "
        f"{args.rounds} interleaved rounds, medians. GB/s: bytes of x read per second. "
        f"{run.summary()}", "",
        "| dtype | elements | tensor_health | torch.amax(x) | ratio (median) | GB/s read |",
        "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | 2^{r['n']} | {r['ours_us']:.1f} us | {r['base_us']:.1f} us "
                     f"| {r['ratio']:.2f}x | {r['gbs']:.1f} |")
    table = "\n".join(lines)
    print(table)
    run.write(args.out, table + "\n")


if __name__ == "__main__":
    main()
