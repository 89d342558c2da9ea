"""Overhead of torchcast.track on a real training step: all_casts=True, and
with --watch the numerics watch (nonfinite="record", health=True).

One forward and backward of a 4-layer nn.TransformerEncoder (train mode,
dropout on), without and with tracking, interleaved round by round in one
process (benchmarks/README.md). Reported: the median step time of each, the
median of the per-round ratios, the ops the dispatcher hands to the mode per
step and the overhead per op. A bandwidth column does not apply to a model
step; the per-op overhead says where the time goes instead.

Wall-clock time is the measure; the ratio of process CPU time (all threads)
is printed too, since on a machine shared with other jobs it moves less.

Configurations: float32 (no casts: the cost of intercepting every op) and
CPU bfloat16 autocast (autocast's casts, each one measured by the fused op),
at the "small" size the overhead target is stated for and at a "tiny" size
where the per-op cost of the mode dominates. With --models, also models
nobody here wrote (benchmarks/thirdparty.py says how to install them):
torchvision's resnet18 (batch 4 of 3x112x112 images) and a 2-layer GPT-2
(batch 4 of 64 tokens), under bfloat16 autocast. Rows "dispatch mode only"
time a TorchDispatchMode that runs each op and does nothing else: the floor
under any tracking that sees every op from Python, as track(all_casts=True)
does.

    PYTHONPATH=. python benchmarks/bench_track.py [--rounds N] [--threads T] [--models] [--watch]
        [--append]
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import protocol
import thirdparty
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


MODELS = {
    # name: what the table says of it
    "resnet18": "torchvision resnet18, batch 4, 3x112x112",
    "gpt2": "transformers GPT-2, 2 layers, d 128, batch 4, 64 tokens",
}


def make(size):
    torch.manual_seed(0)
    if size == "resnet18":
        return thirdparty.resnet18().train(), torch.randn(4, 3, 112, 112)
    if size == "gpt2":
        return thirdparty.gpt2().train(), torch.randint(0, 1000, (4, 64))
    d, heads, ff, batch, seq = SIZES[size]
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).train()
    return model, torch.randn(batch, seq, d)


def step(model, x, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out = getattr(out, "logits", out)  # transformers returns a ModelOutput
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


# What a row tracks: its label and track()'s arguments. "dispatch mode only":
# a TorchDispatchMode that runs each op and nothing else, the least that any
# interception of every op from Python costs (track(all_casts=True) is one).
TRACKS = {
    "dispatch mode only": None,
    "record": dict(all_casts=True, policy="record"),
    "warn": dict(all_casts=True, policy="warn"),
    "nonfinite": dict(nonfinite="record"),
    "health": dict(health=True),
    "nonfinite+health": dict(nonfinite="record", health=True),
}


def tracked_step(model, x, autocast, options):
    if options is None:
        with _CountOps():
            step(model, x, autocast)
        return None
    with torchcast.track(**options) as report:
        step(model, x, autocast)
    report.health  # reading the module health is part of its cost
    return report


def measure(size, autocast, tracking, rounds):
    options = TRACKS[tracking]
    model, x = make(size)
    counter = _CountOps()
    with counter:
        step(model, x, autocast)
    report = tracked_step(model, x, autocast, options)
    casts = sum(r.calls for r in report.records) if report is not None else 0
    for _ in range(2):  # warm-up
        step(model, x, autocast)
        tracked_step(model, x, autocast, options)
    base, ours, ratios, extra = [], [], [], []
    cpu_ratios = []
    runs = (lambda: step(model, x, autocast), lambda: tracked_step(model, x, autocast, options))
    for i in range(rounds):
        wall, cpu = [0.0, 0.0], [0.0, 0.0]
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate the order: drift cancels
            t0, c0 = time.perf_counter(), time.process_time()
            runs[which]()
            wall[which], cpu[which] = time.perf_counter() - t0, time.process_time() - c0
        base.append(wall[0])
        ours.append(wall[1])
        ratios.append(wall[1] / wall[0])
        extra.append(wall[1] - wall[0])
        cpu_ratios.append(cpu[1] / cpu[0])
    b, o = statistics.median(base), statistics.median(ours)
    return {"size": size, "precision": "bf16 autocast" if autocast else "float32",
            "tracking": tracking, "ops": counter.n, "casts": casts, "base_ms": b * 1e3,
            "ours_ms": o * 1e3, "ratio": statistics.median(ratios),
            "cpu_ratio": statistics.median(cpu_ratios),
            "us_per_op": statistics.median(extra) / counter.n * 1e6}


def plot(rows, path, title):
    """The ratio of each row as a bar (matplotlib; skipped, with a line
    saying so, where it is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn")
        return
    labels = [f"{r['size']}, {r['precision']}: {_TRACK_LABELS[r['tracking']]}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color="#4c78a8")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, r in enumerate(rows):
        ax.text(r["ratio"], i, f" {r['ratio']:.2f}x, {r['us_per_op']:.1f} us/op",
                va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tracked step / plain step (median of interleaved rounds)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(r["ratio"] for r in rows) * 1.35)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


_TRACK_LABELS = {name: ", ".join(f"{k}={v!r}" for k, v in options.items()) if options else name
                 for name, options in TRACKS.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "track.md"))
    parser.add_argument("--append", action="store_true", help="add the table to --out")
    parser.add_argument("--plot", help="also draw the ratios (matplotlib) into this PNG, "
                                       "when the table is written")
    parser.add_argument("--models", action="store_true",
                        help="also resnet18 and GPT-2 (installed as benchmarks/thirdparty.py says)")
    parser.add_argument("--watch", action="store_true",
                        help="the numerics watch (nonfinite='record', health=True, both) "
                             "instead of all_casts tracking")
    protocol.add_arguments(parser)
    opts = parser.parse_args()
    run = protocol.Run(opts.force)
    torch.set_num_threads(opts.threads)
    run.copy_bandwidth(protocol.copy_bandwidth(opts.rounds), opts.threads, 2 * 4 << 25)
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_track.py"] + sys.argv[1:])
    # The float32 "small" step is the slowest by far (no bfloat16 matrix units): last.
    if opts.watch:
        configs = [(size, True, t) for size in ("small", "tiny")
                   for t in ("nonfinite", "health", "nonfinite+health")]
    else:
        configs = [("small", True, "record"), ("small", True, "warn"),
                   ("small", True, "dispatch mode only"), ("tiny", False, "record"),
                   ("tiny", True, "record"), ("small", False, "record")]
    if opts.models:
        if not thirdparty.available():
            sys.exit("--models: resnet18 and GPT-2 are not installed; see benchmarks/thirdparty.py")
        configs += [(m, True, t) for m in ("resnet18", "gpt2")
                    for t in (("nonfinite", "health", "nonfinite+health") if opts.watch
                              else ("record", "dispatch mode only"))]
    rows = [measure(size, autocast, tracking, opts.rounds) for size, autocast, tracking in configs]
    lines = [
        f"`{command}` — torch {torch.__version__}, torch.set_num_threads({opts.threads}), "
        f"{opts.rounds} interleaved rounds (order alternating), medians; model: "
        "nn.TransformerEncoder, 4 layers (size: d_model, heads, ff, batch, seq), or as named; "
        "train mode, forward + backward; the tracked step "
        f"includes entering and leaving track(). {run.summary()}",
        "",
        "| model | precision | tracking | ops/step | casts/step "
        "| plain step | tracked step | ratio (median) | CPU-time ratio (median) "
        "| overhead per op (median) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} {SIZES.get(r['size']) or MODELS[r['size']]} | {r['precision']} "
            f"| {_TRACK_LABELS[r['tracking']]} | {r['ops']} "
            f"| {r['casts']} | {r['base_ms']:.1f} ms | {r['ours_ms']:.1f} ms "
            f"| {r['ratio']:.2f}x | {r['cpu_ratio']:.2f}x | {r['us_per_op']:.1f} us |")
    table = "\n".join(lines)
    print(f"torch.set_num_threads({opts.threads})")
    print(table)
    previous = ""
    if opts.append and os.path.exists(opts.out):
        with open(opts.out) as f:
            previous = f.read() + "\n"
    if run.write(opts.out, previous + table + "\n") and opts.plot:
        plot(rows, opts.plot, f"track() overhead, {protocol.cpu_name()}, "
                              f"{opts.threads} thread(s)\n(benchmarks/bench_track.py)")


if __name__ == "__main__":
    main()
