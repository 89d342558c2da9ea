"""A tracker left on: the whole training step (forward, backward and a fused
AdamW step) under track(), over the plain step, and the optimizer step
alone; the table of issue 39's targets.

Models: a 2-layer GPT-2 (transformers, batch 4 of 64 tokens) and
torchvision's resnet18 (batch 4 of 3x112x112), installed as
benchmarks/thirdparty.py says, and the small nn.TransformerEncoder of
bench_track.py; all under bfloat16 autocast, torch.optim.AdamW(fused=True).
Tracking modes: track(), all_casts=True, nonfinite="record", health=True,
nonfinite + health, all three, and torch.autograd.detect_anomaly(check_nan=True)
for comparison.

The track is left on: each round enters it once, runs STEPS tracked steps
(each timed) and leaves it, and runs STEPS plain steps; rounds alternate
which goes first (benchmarks/README.md: one process, interleaved, medians of
per-round ratios). The optimizer step alone is timed the same way, forward
and backward untimed. The first step a track sees (a site's first cast, a
module's first call) is a warm-up, not timed.

    PYTHONPATH=. python benchmarks/bench_track_step.py [--rounds N] [--threads T]
        [--models gpt2,resnet18,small] [--out FILE] [--append]
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

import protocol
import thirdparty
import torchcast

STEPS = 4
MODES = {
    "track()": {},
    "all_casts": {"all_casts": True},
    "nonfinite=record": {"nonfinite": "record"},
    "health": {"health": True},
    "record + health": {"nonfinite": "record", "health": True},
    "all three": {"all_casts": True, "nonfinite": "record", "health": True},
    "detect_anomaly": None,
}
DESCRIBED = {
    "gpt2": "GPT-2, 2 layers, d 128, batch 4 x 64 tokens",
    "resnet18": "resnet18, batch 4 x 3x112x112",
    "small": "nn.TransformerEncoder, 4 layers, d 256, batch 8 x 64",
}


def make(name):
    torch.manual_seed(0)
    if name == "gpt2":
        model, x = thirdparty.gpt2().train(), torch.randint(0, 1000, (4, 64))
    elif name == "resnet18":
        model, x = thirdparty.resnet18().train(), torch.randn(4, 3, 112, 112)
    else:
        layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).train()
        x = torch.randn(8, 64, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, x, opt


def forward_backward(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out = getattr(out, "logits", out)
    out.float().square().mean().backward()


def _context(mode):
    options = MODES[mode]
    if options is None:
        return torch.autograd.detect_anomaly(check_nan=True)
    return torchcast.track(**options)


def _timed_steps(model, x, opt, part):
    """STEPS steps; the time of each (all of it, or the optimizer step alone)."""
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        forward_backward(model, x)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        times.append(t2 - t0 if part == "step" else t2 - t1)
    return times


def measure(name, mode, part, rounds):
    model, x, opt = make(name)
    with contextlib.ExitStack() as warm:  # a warm-up of each, the tracked first
        warm.enter_context(_context(mode))
        _timed_steps(model, x, opt, part)
    _timed_steps(model, x, opt, part)
    ratios, plain_all, tracked_all = [], [], []
    for i in range(rounds):
        runs = {}
        for which in (("plain", "tracked") if i % 2 else ("tracked", "plain")):
            if which == "plain":
                runs[which] = _timed_steps(model, x, opt, part)
            else:
                with _context(mode) as report:
                    runs[which] = _timed_steps(model, x, opt, part)
                if report is not None:
                    report.records, report.nonfinite, report.health  # read: part of the cost
        plain, tracked = statistics.median(runs["plain"]), statistics.median(runs["tracked"])
        ratios.append(tracked / plain)
        plain_all.append(plain)
        tracked_all.append(tracked)
    return {"model": name, "mode": mode, "part": part, "ratio": statistics.median(ratios),
            "plain_ms": statistics.median(plain_all) * 1e3,
            "tracked_ms": statistics.median(tracked_all) * 1e3}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="gpt2,resnet18,small")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "track_step.md"))
    parser.add_argument("--append", action="store_true", help="add the table to --out")
    protocol.add_arguments(parser)
    opts = parser.parse_args()
    run = protocol.Run(opts.force)
    torch.set_num_threads(opts.threads)
    run.copy_bandwidth(protocol.copy_bandwidth(opts.rounds), opts.threads, 2 * 4 << 25)
    models = opts.models.split(",")
    if any(m in ("gpt2", "resnet18") for m in models) and not thirdparty.available():
        sys.exit("GPT-2 and resnet18 are not installed; see benchmarks/thirdparty.py")
    rows = [measure(m, mode, part, opts.rounds) for m in models
            for part in ("step", "optimizer step") for mode in opts.modes.split(",")]
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_track_step.py"] + sys.argv[1:])
    lines = [f"`{command}` — torch {torch.__version__}, torch.set_num_threads({opts.threads}), "
             f"{opts.rounds} interleaved rounds of {STEPS} steps each (order alternating), "
             "medians; bf16 autocast, torch.optim.AdamW(fused=True); the track entered once per "
             f"round and left on for its steps. {run.summary()}", "",
             "| model | timed | tracking | plain | tracked | ratio (median) |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {DESCRIBED[r['model']]} | {r['part']} | {r['mode']} "
                     f"| {r['plain_ms']:.1f} ms | {r['tracked_ms']:.1f} ms | {r['ratio']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    previous = ""
    if opts.append and os.path.exists(opts.out):
        with open(opts.out) as f:
            previous = f.read() + "\n"
    run.write(opts.out, previous + table + "\n")


if __name__ == "__main__":
    main()
