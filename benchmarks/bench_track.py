"""Overhead of torchcast.track(all_casts=True) on a real training step.

One forward and backward of a 4-layer nn.TransformerEncoder (train mode,
dropout on), without and with tracking, interleaved round by round in one
process (shared/BENCHMARKS.md). Reported: the median step time of each, the
median of the per-round ratios, the ops the dispatcher hands to the mode per
step and the overhead per op. A bandwidth column does not apply to a model
step; the per-op overhead says where the time goes instead.

Configurations: float32 (no casts: the cost of intercepting every op) and
CPU bfloat16 autocast (autocast's casts, each one measured by the fused op),
at the "small" size the overhead target is stated for and at a "tiny" size
where the per-op cost of the mode dominates.

    PYTHONPATH=. python benchmarks/bench_track.py [--rounds N] [--threads T]
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchcast

SIZES = {
    # name: (d_model, nhead, dim_feedforward, batch, seq)
    "small": (256, 8, 1024, 8, 64),
    "tiny": (64, 4, 128, 4, 16),
}


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def make(size):
    d, heads, ff, batch, seq = SIZES[size]
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).train()
    return model, torch.randn(batch, seq, d)


def step(model, x, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def tracked_step(model, x, autocast, policy):
    with torchcast.track(all_casts=True, policy=policy):
        step(model, x, autocast)


def measure(size, autocast, policy, rounds):
    model, x = make(size)
    counter = _CountOps()
    with counter:
        step(model, x, autocast)
    with torchcast.track(all_casts=True, policy=policy) as report:
        step(model, x, autocast)
    casts = sum(r.calls for r in report.records)
    for _ in range(2):  # warm-up
        step(model, x, autocast)
        tracked_step(model, x, autocast, policy)
    base, ours, ratios, extra = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step(model, x, autocast)
        t1 = time.perf_counter()
        tracked_step(model, x, autocast, policy)
        t2 = time.perf_counter()
        base.append(t1 - t0)
        ours.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
        extra.append((t2 - t1) - (t1 - t0))
    b, o = statistics.median(base), statistics.median(ours)
    return {"size": size, "precision": "bf16 autocast" if autocast else "float32",
            "policy": policy, "ops": counter.n, "casts": casts, "base_ms": b * 1e3,
            "ours_ms": o * 1e3, "ratio": statistics.median(ratios),
            "us_per_op": statistics.median(extra) / counter.n * 1e6}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "track.md"))
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_track.py"] + sys.argv[1:])
    configs = [("small", False, "record"), ("small", True, "record"), ("small", True, "warn"),
               ("tiny", False, "record"), ("tiny", True, "record")]
    rows = [measure(size, autocast, policy, opts.rounds) for size, autocast, policy in configs]
    lines = [
        f"`{command}` — torch {torch.__version__}, torch.set_num_threads({opts.threads}), "
        f"{opts.rounds} interleaved rounds, medians; model: nn.TransformerEncoder, 4 layers, "
        "train mode, forward + backward.",
        "",
        "| size (d_model, heads, ff, batch, seq) | precision | policy | ops/step | casts/step "
        "| plain step | tracked step | ratio (median) | overhead per op (median) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} {SIZES[r['size']]} | {r['precision']} | {r['policy']} | {r['ops']} "
            f"| {r['casts']} | {r['base_ms']:.1f} ms | {r['ours_ms']:.1f} ms "
            f"| {r['ratio']:.2f}x | {r['us_per_op']:.1f} us |")
    table = "\n".join(lines)
    print(f"torch.set_num_threads({opts.threads})")
    print(table)
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
