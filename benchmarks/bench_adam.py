"""torchcast.optim.Adam/AdamW: speed of one step and accuracy of training.

Speed (follows benchmarks/README.md: one process, baseline and ours
interleaved, medians and the median of the per-round ratios, GB/s against the
copy bandwidth measured in the same run): one AdamW step over about 50M
parameters (48 tensors of 1024 x 1024) and over one 2^12-element tensor,
against torch.optim.AdamW(foreach=True) and (fused=True).

Accuracy: a small character-level language model trained on a text the
script generates, with each params/optimizer pairing of LM_RUNS, reporting
final loss (in float32, on held-out text), distance to the float64 run, and
bytes per parameter; plus a regression whose updates fall below half an ulp
(weights near 1, lr 2e-8).

    PYTHONPATH=. python benchmarks/bench_adam.py [--speed] [--accuracy] [--rounds N]

Writes benchmarks/results/adam.md (speed) and benchmarks/results/adam_accuracy.md,
and with matplotlib installed (``pip install matplotlib``) the accuracy run's
held-out loss against steps as docs/img/adam_accuracy.png (every picture in
the docs is drawn by the script that measured its data).
"""
import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch

import protocol
import torchcast
from torchcast.optim import AdamW

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PICTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "img")
# Held-out loss is read every CURVE_EVERY steps for the loss-against-steps picture.
CURVE_EVERY = 100
# The interval of the sampled update accounting the speed run measures.
EVERY = 16


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------
# Speed

def make_params(shapes, dtype, grads):
    params = []
    for shape, g in zip(shapes, grads):
        p = torch.nn.Parameter(torch.randn(shape).to(dtype))
        p.grad = g.to(dtype) if g.dtype != dtype else g  # shared grads: Adam only reads them
        params.append(p)
    return params


def step_bytes(pbytes, sbytes, cbytes, n):
    """Bytes read + written by one step: param, grad, two moments, compensation."""
    return n * (2 * pbytes + pbytes + 4 * sbytes + 2 * cbytes)


def speed(rounds, copy_gbs, threads, args, run):
    rows = []
    costs = []  # (size, track_updates setting, median per-round ratio to the untracked step)
    for label, shapes in [("48 x 1024^2 (50.3M)", [(1024, 1024)] * 48),
                          ("2^12", [(1 << 12,)])]:
        n = sum(math.prod(s) for s in shapes)
        g32 = [torch.randn(s) for s in shapes]
        g16 = [g.bfloat16() for g in g32]

        def opt(cls, dtype, **kw):
            params = make_params(shapes, dtype, g32 if dtype == torch.float32 else g16)
            o = cls(params, lr=1e-3, **kw)
            o.step()  # creates the state
            return o.step

        cases = {}
        cases["torch fused, f32"] = (opt(torch.optim.AdamW, torch.float32, fused=True),
                                     step_bytes(4, 4, 0, n))
        cases["torch foreach, f32"] = (opt(torch.optim.AdamW, torch.float32, foreach=True),
                                       step_bytes(4, 4, 0, n))
        cases["ours, f32"] = (opt(AdamW, torch.float32, compensated=False),
                              step_bytes(4, 4, 0, n))
        cases["ours, f32 kahan"] = (opt(AdamW, torch.float32, compensated=True),
                                    step_bytes(4, 4, 4, n))
        cases["torch fused, bf16"] = (opt(torch.optim.AdamW, torch.bfloat16, fused=True),
                                      step_bytes(2, 2, 0, n))
        cases["ours, bf16 kahan"] = (opt(AdamW, torch.bfloat16), step_bytes(2, 4, 2, n))
        cases["ours, bf16 remainder"] = (opt(AdamW, torch.bfloat16, compensation="remainder"),
                                         step_bytes(2, 4, 2, n))
        cases["ours, bf16 stochastic"] = (
            opt(AdamW, torch.bfloat16, compensation="stochastic", seed=0), step_bytes(2, 4, 0, n))
        # The update accounting's cost: the same step, counting lost updates.
        cases["ours, bf16 kahan, track_updates"] = (
            opt(AdamW, torch.bfloat16, track_updates=True), step_bytes(2, 4, 2, n))
        cases["ours, bf16 kahan, bf16 states"] = (
            opt(AdamW, torch.bfloat16, state_dtype=torch.bfloat16), step_bytes(2, 2, 2, n))
        # 8-bit moments (a byte a moment; the block scales, 8 bytes per 256
        # elements, are left out of the bytes): 4 and 5 bytes per parameter.
        cases["ours, bf16 stochastic, 8-bit states"] = (
            opt(AdamW, torch.bfloat16, compensation="stochastic", state_dtype="8bit", seed=0),
            step_bytes(2, 1, 0, n))
        cases["ours, bf16 remainder8, 8-bit states"] = (
            opt(AdamW, torch.bfloat16, compensation="remainder8", state_dtype="8bit", seed=0),
            step_bytes(2, 1, 1, n))
        # The usual fix: float32 master weights stepped by torch's fused
        # AdamW, the bfloat16 model refreshed from them (grads cast up).
        mparams = make_params(shapes, torch.float32, [g.clone() for g in g32])
        master = torch.optim.AdamW(mparams, lr=1e-3, fused=True)
        model = [p.detach().bfloat16() for p in mparams]

        def master_step():
            torch._foreach_copy_([p.grad for p in mparams], g16)
            master.step()
            torch._foreach_copy_(model, mparams)
        master_step()
        cases["torch fused, f32 master + bf16 copy"] = (
            master_step, step_bytes(4, 4, 0, n) + n * (2 + 4 + 4 + 2))

        times = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (step, _) in cases.items():
                times[name].append(timed(step))
        base = times["torch fused, f32"]
        base16 = times["torch fused, bf16"]
        for name, (_, nbytes) in cases.items():
            t = statistics.median(times[name])
            r32 = statistics.median(a / b for a, b in zip(times[name], base))
            r16 = statistics.median(a / b for a, b in zip(times[name], base16))
            gbs = nbytes / t / 1e9
            rows.append((label, name, t * 1e3, r32, r16, gbs, 100 * gbs / copy_gbs))
        # The accounting's cost, every step and every EVERY-th: runs of
        # EVERY consecutive steps of each, interleaved with untracked runs.
        runs = {setting: opt(AdamW, torch.bfloat16, track_updates=setting)
                for setting in (False, True, EVERY)}
        run_times = {setting: [] for setting in runs}
        for _ in range(max(3, rounds // 3)):
            for setting, step in runs.items():
                run_times[setting].append(timed(lambda: [step() for _ in range(EVERY)]))
        for setting in (True, EVERY):
            costs.append((label, setting, statistics.median(
                a / b for a, b in zip(run_times[setting], run_times[False]))))
        del cases, master, model, mparams, g32, g16, runs
    head = (f"One AdamW step (lr 1e-3, wd 1e-2), torch {torch.__version__}, "
            f"torch.set_num_threads({threads}), {rounds} interleaved rounds, medians; "
            f"{run.summary()} Command: `PYTHONPATH=. python "
            f"benchmarks/bench_adam.py --speed --rounds {rounds} --threads "
            f"{' '.join(map(str, args.threads))}`")
    lines = [head, "",
             "| size | optimizer, params | ms/step | vs torch fused f32 | "
             "vs torch fused bf16 | GB/s | % of copy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for label, name, ms, r32, r16, gbs, pct in rows:
        lines.append(f"| {label} | {name} | {ms:.3f} | {r32:.2f}x | {r16:.2f}x | "
                     f"{gbs:.1f} | {pct:.0f}% |")
    lines += ["", f"The update accounting's cost: {EVERY} consecutive bfloat16 Kahan steps "
              "with it against as many untracked ones, interleaved, median of the per-round "
              f"ratios (`track_updates={EVERY}` counts one step of the {EVERY}).", "",
              "| size | setting | vs untracked steps |", "|---|---|---:|"]
    lines += [f"| {label} | `track_updates={setting}` | {ratio:.3f}x |"
              for label, setting, ratio in costs]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Accuracy

def make_text(n_chars, seed=0):
    """Pseudo-English: 300 words of 1-3 syllables, each with five favoured
    successors (70% of the time) or a Zipf-distributed word, and sentences."""
    import random
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.choice([1, 1, 2, 2, 3])))
             for _ in range(300)]
    successors = {w: rng.sample(words, 5) for w in words}
    out, w, n = [], words[0], 0
    while n < n_chars:
        if rng.random() < 0.7:
            w = rng.choice(successors[w])
        else:
            w = words[min(int(rng.paretovariate(1.1)) - 1, len(words) - 1)]
        out.append(w + ("." if rng.random() < 0.1 else ""))
        n += len(out[-1]) + 1
    return " ".join(out)


class CharMLP(torch.nn.Module):
    """Next character from the previous CTX: embedding, one tanh layer."""
    CTX = 8

    def __init__(self, vocab, emb=24, hidden=256):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, emb)
        self.fc = torch.nn.Linear(self.CTX * emb, hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(self.emb(x).flatten(1))))


def lm_data(steps, batch=64):
    text = make_text(400_000)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    split = int(0.9 * len(ids))
    gen = torch.Generator().manual_seed(0)

    def windows(lo, hi, n):
        starts = torch.randint(lo, hi - CharMLP.CTX - 1, (n,), generator=gen)
        idx = starts[:, None] + torch.arange(CharMLP.CTX + 1)
        w = ids[idx]
        return w[:, :-1], w[:, -1]
    train = [windows(0, split, batch) for _ in range(steps)]
    held = windows(split, len(ids), 4096)
    return len(chars), train, held


# (label, param dtype, optimizer, bytes per param: param + optimizer state)
LM_RUNS = [
    ("float64, torch Adam", torch.float64, "torch", 24),
    ("float32, torch Adam (reference)", torch.float32, "torch", 12),
    ("float32, ours", torch.float32, {"compensated": False}, 12),
    ("float32, ours compensated", torch.float32, {"compensated": True}, 16),
    ("bfloat16, torch Adam", torch.bfloat16, "torch", 6),
    ("bfloat16, ours uncompensated", torch.bfloat16, {"compensated": False}, 10),
    ("bfloat16, ours kahan", torch.bfloat16, {}, 12),
    ("bfloat16, ours kahan, bf16 states", torch.bfloat16,
     {"state_dtype": torch.bfloat16}, 8),
    ("bfloat16, ours remainder", torch.bfloat16, {"compensation": "remainder"}, 12),
    ("bfloat16, ours stochastic", torch.bfloat16, {"compensation": "stochastic", "seed": 0}, 10),
    ("bfloat16 + float32 master, torch Adam", torch.bfloat16, "master", 14),
]


def train_lm(vocab, train, dtype, kind, lr, held):
    """(init, trained model, [(step, held-out loss)] every CURVE_EVERY steps)."""
    torch.manual_seed(0)
    init = CharMLP(vocab).double()
    model = copy.deepcopy(init).to(dtype)
    if kind == "torch":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif kind == "master":
        master = [p.detach().float().requires_grad_() for p in model.parameters()]
        opt = torch.optim.Adam(master, lr=lr)
    else:
        opt = torchcast.optim.Adam(model.parameters(), lr=lr, **kind)
    curve = [(0, held_out_loss(vocab, model, held))]
    for step, (x, y) in enumerate(train, 1):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        if kind == "master":
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)
        else:
            opt.step()
            opt.zero_grad()
        if step % CURVE_EVERY == 0:
            curve.append((step, held_out_loss(vocab, model, held)))
    return init, model, curve


def flat(model):
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def held_out_loss(vocab, model, held):
    m32 = CharMLP(vocab)
    m32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(m32(held[0]), held[1]).item()


def lm_table(steps, lrs):
    """(the table's text, {lr: {label: curve}})."""
    vocab, train, held = lm_data(steps)
    rows, curves = [], {}
    for lr in lrs:
        results = {}
        for label, dtype, kind, nbytes in LM_RUNS:
            t0 = time.perf_counter()
            init, model, curve = train_lm(vocab, train, dtype, kind, lr, held)
            results[label] = (model, nbytes, time.perf_counter() - t0)
            curves.setdefault(lr, {})[label] = curve
        ref64 = flat(results["float64, torch Adam"][0])
        moved = (ref64 - flat(init)).norm().item()
        base = held_out_loss(vocab, results["float32, torch Adam (reference)"][0], held)
        for label, (model, nbytes, secs) in results.items():
            loss = held_out_loss(vocab, model, held)
            dist = (flat(model) - ref64).norm().item() / moved
            rows.append((lr, label, loss, 100 * (loss / base - 1), dist, nbytes, secs))
            print(f"  lr {lr:g} {label}: loss {loss:.4f} dist {dist:.3e} ({secs:.1f} s)",
                  flush=True)
    lines = [f"Character-level MLP language model ({sum(p.numel() for p in CharMLP(vocab).parameters())}"
             f" params, context {CharMLP.CTX}, vocabulary {vocab}) on generated text, "
             f"{steps} Adam steps of batch 64, the same batches and float64 initialization "
             "for every run; forward and backward in the params' dtype, loss in float32. "
             "Final loss: float32 cross-entropy on 4096 held-out windows, with the run's "
             "weights. Distance: |theta - theta_float64| / |theta_float64 - theta_0| at the end. "
             "Bytes: param + optimizer state per parameter (the gradient adds the param's "
             "size; the master-weight recipe also keeps a float32 gradient copy).", "",
             "| lr | params, optimizer | final loss | vs float32 reference | distance to float64 | "
             "bytes/param | s |", "|---|---|---:|---:|---:|---:|---:|"]
    for lr, label, loss, pct, dist, nbytes, secs in rows:
        lines.append(f"| {lr:g} | {label} | {loss:.4f} | {pct:+.2f}% | {dist:.2e} | {nbytes} "
                     f"| {secs:.1f} |")
    return "\n".join(lines), curves


# The runs the picture draws: the references, plain 16-bit and the compensated ones.
PLOTTED = ("float32, torch Adam (reference)", "bfloat16, torch Adam",
           "bfloat16, ours uncompensated", "bfloat16, ours kahan", "bfloat16, ours remainder",
           "bfloat16, ours stochastic", "bfloat16 + float32 master, torch Adam")


def plot_curves(curves, path):
    """Held-out loss against steps, one panel per lr (matplotlib; skipped,
    with a line saying so, where it is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn")
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.2), squeeze=False)
    for ax, (lr, runs) in zip(axes[0], sorted(curves.items(), reverse=True)):
        for label in PLOTTED:
            steps, losses = zip(*runs[label])
            ax.plot(steps, losses, label=label,
                    linestyle="--" if "float32" in label and "master" not in label else "-")
        ax.set_title(f"lr {lr:g}")
        ax.set_xlabel("Adam steps")
        ax.set_ylabel("held-out loss (float32)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Character-level LM: bfloat16 weights with and without compensation "
                 "(benchmarks/bench_adam.py --accuracy)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def regression_case(steps, lr, hidden=None):
    """float32 with and without compensation against float64: a linear
    regression with weights near 1 (hidden=None) or a 32-hidden-1 MLP."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen, dtype=torch.float64)
    if hidden is None:
        w_true = 1 + 0.1 * torch.randn(32, 1, generator=gen, dtype=torch.float64)
        y = x @ w_true + 0.01 * torch.randn(256, 1, generator=gen, dtype=torch.float64)
        w0 = (1 + 0.1 * torch.randn(32, 1, generator=gen, dtype=torch.float64)).float()

        def make():
            return torch.nn.Linear(32, 1, bias=False), [w0.t()]
    else:
        y = torch.sin(x[:, :1] * 2) + x[:, 1:2] ** 2
        torch.manual_seed(0)
        init = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, 1))
        init_state = [p.detach().clone() for p in init.parameters()]

        def make():
            return copy.deepcopy(init), init_state
    results = {}
    for label, dtype, kw in [("float64", torch.float64, None),
                             ("float32", torch.float32, {"compensated": False}),
                             ("float32 compensated", torch.float32, {"compensated": True})]:
        model, start = make()
        model = model.to(dtype)
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)
        opt = (torch.optim.Adam(model.parameters(), lr=lr) if kw is None
               else torchcast.optim.Adam(model.parameters(), lr=lr, **kw))
        xd, yd = x.to(dtype), y.to(dtype)
        for _ in range(steps):
            torch.nn.functional.mse_loss(model(xd), yd).backward()
            opt.step()
            opt.zero_grad()
        results[label] = flat(model)
        if label == "float64":
            theta0 = torch.cat([s.double().flatten() for s in start])
    moved = (results["float64"] - theta0).norm().item()
    return {k: (v - results["float64"]).norm().item() / moved for k, v in results.items()
            if k != "float64"}


def accuracy(steps=2000):
    print("language model:", flush=True)
    lm, curves = lm_table(steps, [1e-3, 1e-5])
    # Drawn whatever the load: the losses do not depend on it (the table's
    # seconds do, and protocol.Run decides whether the table is written).
    plot_curves(curves, os.path.join(PICTURES, "adam_accuracy.png"))
    cases = [("linear regression, weights near 1 (updates below half an ulp)", 3000, 2e-8,
              None),
             ("32-64-1 MLP, ordinary lr", 3000, 1e-3, 64)]
    lines = ["", "float32 with and without compensation against float64 (Adam, full batch "
             "of 256): distance |theta - theta_float64| / |theta_float64 - theta_0| at the "
             "end.", "",
             "| case | steps | lr | float32 | float32 compensated | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, n, lr, hidden in cases:
        d = regression_case(n, lr, hidden)
        ratio = d["float32"] / d["float32 compensated"]
        lines.append(f"| {label} | {n} | {lr:g} | {d['float32']:.2e} | "
                     f"{d['float32 compensated']:.2e} | {ratio:.0f}x closer |")
    cmd = ("Command: `PYTHONPATH=. python benchmarks/bench_adam.py --accuracy`, "
           f"torch {torch.__version__}, torch.set_num_threads({torch.get_num_threads()}).")
    return cmd + "\n\n" + lm + "\n" + "\n".join(lines)


# ---------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count()],
                    help="thread counts for the speed tables")
    protocol.add_arguments(ap)
    args = ap.parse_args()
    run = protocol.Run(args.force)
    if not (args.speed or args.accuracy):
        args.speed = args.accuracy = True
    os.makedirs(RESULTS, exist_ok=True)
    if args.speed:
        tables = []
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"torch.set_num_threads({threads})")
            copy_gbs = protocol.copy_bandwidth(args.rounds, 1 << 26)
            run.copy_bandwidth(copy_gbs, threads, 2 * 4 << 26)
            tables.append(speed(args.rounds, copy_gbs, threads, args, run))
            print(tables[-1], flush=True)
        run.write(os.path.join(RESULTS, "adam.md"), "\n\n".join(tables) + "\n")
    if args.accuracy:
        # Small models: one thread runs them fastest on a shared machine, and
        # the figures do not depend on it.
        torch.set_num_threads(1)
        print("accuracy: torch.set_num_threads(1)")
        table = accuracy() + "\n\n" + run.summary()
        print(table)
        run.write(os.path.join(RESULTS, "adam_accuracy.md"), table + "\n")


if __name__ == "__main__":
    sys.exit(main())
