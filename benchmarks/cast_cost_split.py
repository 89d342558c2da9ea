"""Where a CPU cast_with_stats.out call spends its time, on one thread.

Two figures per lossy pair, each against ``dst.copy_(x)`` measured the same way
in the same process:

* per-element cost with the data in cache: the time difference between
  2^17 and 2^16 elements (both fit in L2), divided by 2^16. This is the
  arithmetic of the loop, without memory bandwidth or per-call costs.
* the fixed cost of one call: the time for 16 elements.

If the per-element cost times the elements per thread exceeds the copy's time
at the size of interest, the loop is compute-bound there, and no memory-side
change can bring it to the copy's speed.

    python benchmarks/cast_cost_split.py [--reps 300]
"""
import argparse
import time

import torch

import torchcast  # noqa: F401  (loads the ops)
from torchcast._reference import cast as cast_ref

op = torch.ops.torchcast.cast_with_stats.out


def best_time(fn, reps, samples=7):
    fn()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| pair | ours ns/element (in cache) | copy_ ns/element | ratio | ours µs @16 | copy_ µs @16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for src, dst in cast_ref.LOSSY_PAIRS:
        per_call = {}
        for n in (16, 1 << 16, 1 << 17):
            x = (torch.randn(n, dtype=torch.float64) * 100).to(src)
            y = torch.empty(n, dtype=dst)
            per_call[n] = (best_time(lambda: op(x, dst, out=y), args.reps),
                           best_time(lambda: y.copy_(x), args.reps))
        ours = (per_call[1 << 17][0] - per_call[1 << 16][0]) / (1 << 16) * 1e9
        base = (per_call[1 << 17][1] - per_call[1 << 16][1]) / (1 << 16) * 1e9
        print(f"| {str(src)[6:]} → {str(dst)[6:]} | {ours:.3f} | {base:.3f} | {ours / base:.1f} | "
              f"{per_call[16][0] * 1e6:.2f} | {per_call[16][1] * 1e6:.2f} |")


if __name__ == "__main__":
    main()
