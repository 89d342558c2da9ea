"""torchcast's AdamW beside its peers on one task, in one run (issue 29 item 3).

Accuracy: a small GPT-2 (pre-LayerNorm causal transformer blocks, learned
positions, GELU MLP, tied output head; written here, so nothing is
downloaded) trained on a fixed character stream the script generates
(bench_adam.make_text), the same float64 initialization and batches for
every run, forward and backward in the params' dtype, loss in float32; at
two learning rates, final held-out loss against the float32 run's.

Speed: one optimizer step over about 50M parameters (48 tensors of 1024 x
1024), every run's optimizer interleaved round by round, medians, and the
median of per-round ratios to torch's fused float32 AdamW. One table: bytes
per parameter, final loss at both learning rates, step time.

Runs: torch AdamW float32 (reference), bfloat16 with a float32 master copy
(torch AdamW on the master), torch AdamW on bfloat16 params, torchcast
kahan / remainder / stochastic / kahan with bfloat16 states / remainder8 and
stochastic with 8-bit states (5 and 4 bytes per parameter), optimi's AdamW
with Kahan summation (torch-optimi), torchao's _AdamW with
bf16_stochastic_round=True. A peer that is not installed or fails on this
torch is listed with the reason instead of figures.

    PYTHONPATH=. python benchmarks/bench_adam_peers.py [--steps N] [--rounds N]
    PYTHONPATH=. python benchmarks/bench_adam_peers.py --smoke   # tiny: checks it runs
    PYTHONPATH=. python benchmarks/bench_adam_peers.py --seeds 5 --steps N [--runs TEXT ...]

Writes benchmarks/results/adam_peers.md and, with matplotlib installed,
docs/img/adam_peers.png (held-out loss against steps); --smoke writes nothing.
--seeds N (N >= 2) runs the accuracy part only, once per seed (the seed
draws the initialization and the batches), for the runs whose label
contains one of the --runs texts (default: every run), and writes the final
losses as mean +- sample standard deviation over the seeds, and each seed's
loss against the float32 run of the same seed, to
benchmarks/results/adam_peers_seeds.md (the losses do not depend on the
machine's load: written whatever the load).
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

import protocol
import torchcast
from bench_adam import PICTURES, RESULTS, make_text, timed

LRS = (1e-3, 1e-4)
WEIGHT_DECAY = 0.01
CURVE_EVERY = 25


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc, self.out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(torch.nn.Module):
    """GPT-2's architecture at a small size."""

    def __init__(self, vocab, ctx, dim, layers, heads):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(ctx, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        # GPT-2's initialization: N(0, 0.02) weights, zero biases, the
        # residual projections scaled by 1 / sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln"):
                continue
            std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "out.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
        for name, p in self.named_parameters():
            if name.endswith("bias") and ".ln" not in name:
                torch.nn.init.zeros_(p)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for blk in self.blocks:
            h = blk(h)
        return self.ln(h) @ self.tok.weight.t()  # tied head


def token_stream(n_chars):
    text = make_text(n_chars)
    chars = sorted(set(text))
    return len(chars), torch.tensor([chars.index(c) for c in text])


def batches(ids, lo, hi, n, batch, ctx, gen):
    starts = torch.randint(lo, hi - ctx - 1, (n, batch), generator=gen)
    idx = starts[..., None] + torch.arange(ctx + 1)
    w = ids[idx]
    return list(zip(w[..., :-1], w[..., 1:]))


class MasterAdamW:
    """The usual recipe: a float32 master copy stepped by torch's AdamW,
    copied back into the bfloat16 model after each step."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.master = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, **kw)

    def step(self):
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _optimi(params, **kw):
    import optimi
    return optimi.AdamW(params, kahan_sum=True, foreach=False, **kw)


def _torchao(params, **kw):
    from torchao.optim import _AdamW
    return _AdamW(params, bf16_stochastic_round=True, **kw)


def _ours(**options):
    return lambda params, **kw: torchcast.optim.AdamW(params, **options, **kw)


# (label, param dtype, make(params, lr=, betas=, eps=, weight_decay=), bytes per param:
# param + optimizer state, the gradient left out)
RUNS = [
    ("torch AdamW, float32 (reference)", torch.float32, torch.optim.AdamW, 12),
    ("torch AdamW, bfloat16 + float32 master", torch.bfloat16, MasterAdamW, 14),
    ("torch AdamW, bfloat16", torch.bfloat16, torch.optim.AdamW, 6),
    ("torchcast kahan", torch.bfloat16, _ours(), 12),
    ("torchcast remainder", torch.bfloat16, _ours(compensation="remainder"), 12),
    ("torchcast stochastic", torch.bfloat16, _ours(compensation="stochastic", seed=0), 10),
    ("torchcast kahan, bfloat16 states", torch.bfloat16, _ours(state_dtype=torch.bfloat16), 8),
    ("torchcast remainder8, 8-bit states", torch.bfloat16,
     _ours(compensation="remainder8", state_dtype="8bit", seed=0), 5 + 8 / 256),
    ("torchcast stochastic, 8-bit states", torch.bfloat16,
     _ours(compensation="stochastic", state_dtype="8bit", seed=0), 4 + 8 / 256),
    ("optimi AdamW, kahan_sum", torch.bfloat16, _optimi, 8),
    ("torchao _AdamW, bf16_stochastic_round", torch.bfloat16, _torchao, 6),
]
REFERENCE = RUNS[0][0]
HYPER = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)


def held_out_loss(model, held):
    with torch.no_grad():
        x, y = held
        logits = model(x).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def train(init, dtype, make, lr, train_batches, held):
    """[(step, held-out loss)], or the reason the run failed."""
    model = copy.deepcopy(init).to(dtype)
    try:
        opt = make(model.parameters(), lr=lr, **HYPER)
        curve = [(0, held_out_loss(model, held))]
        for step, (x, y) in enumerate(train_batches, 1):
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % CURVE_EVERY == 0 or step == len(train_batches):
                curve.append((step, held_out_loss(model, held)))
        return curve
    except Exception as e:  # a peer that does not run on this torch: say why
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def accuracy(steps, size, seed=0, runs=RUNS):
    vocab, ids = token_stream(300_000)
    split = int(0.9 * len(ids))
    gen = torch.Generator().manual_seed(seed)
    ctx = size["ctx"]
    train_batches = batches(ids, 0, split, steps, 16, ctx, gen)
    held = batches(ids, split, len(ids), 1, 256, ctx, gen)[0]
    torch.manual_seed(seed)
    init = GPT2(vocab, **size).double()
    n_params = sum(p.numel() for p in init.parameters())
    curves, rows = {}, []
    for lr in LRS:
        for label, dtype, make, nbytes in runs:
            t0 = time.perf_counter()
            curves.setdefault(lr, {})[label] = train(init, dtype, make, lr, train_batches, held)
            print(f"  lr {lr:g} {label}: {time.perf_counter() - t0:.1f} s", flush=True)
        base = curves[lr][REFERENCE][-1][1]
        for label, _, _, nbytes in runs:
            c = curves[lr][label]
            rows.append((lr, label, c if isinstance(c, str) else c[-1][1], base, nbytes))
    head = (f"GPT-2 architecture ({size['layers']} layers, width {size['dim']}, "
            f"{size['heads']} heads, context {ctx}; {n_params} params) on a generated "
            f"character stream (vocabulary {vocab}), {steps} AdamW steps of 16 x {ctx} tokens "
            f"(betas 0.9/0.999, eps 1e-8, weight decay {WEIGHT_DECAY}), the same float64 "
            "initialization and batches for every run; final loss: float32 cross-entropy on "
            "256 held-out windows. Bytes: param + optimizer state per parameter (8-bit "
            "states: with their block scales).")
    return head, rows, curves


def table(head, rows, timings, speed_label):
    """One table: each run's bytes/param, final loss at each lr (and against
    float32's), and its step time."""
    by_run = {}
    for lr, label, loss, base, nbytes in rows:
        by_run.setdefault(label, {"bytes": nbytes})[lr] = (loss, base)
    cols = " | ".join(f"loss, lr {lr:g} | vs float32" for lr in LRS)
    lines = [head, "", f"| optimizer, params | bytes/param | {cols} | ms/step ({speed_label}) "
             "| vs torch fused float32 |",
             "|---|---:|" + "---:|---:|" * len(LRS) + "---:|---:|"]
    for label, cells in by_run.items():
        row = [label, f"{cells['bytes']:.4g}"]
        for lr in LRS:
            loss, base = cells[lr]
            row += ([f"not run: {loss}", ""] if isinstance(loss, str)
                    else [f"{loss:.4f}", f"{100 * (loss / base - 1):+.2f}%"])
        t = timings.get(label)
        row += ([f"not run: {t}", ""] if isinstance(t, str) else
                [f"{t[0]:.2f}", f"{t[1]:.2f}x"] if t else ["", ""])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def speed(rounds, shapes):
    """Median ms per step and median ratio to torch's fused float32 AdamW."""
    g32 = [torch.randn(s) for s in shapes]
    steps = {}
    for label, dtype, make, _ in RUNS:
        params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
        for p, g in zip(params, g32):
            p.grad = g.to(dtype)
        try:
            torch_step = make in (torch.optim.AdamW, MasterAdamW)  # torch's fastest CPU step
            kw = dict(HYPER, fused=True) if torch_step else HYPER
            opt = make(params, lr=1e-3, **kw)
            opt.step()  # creates the state (and compiles, for torchao)
            steps[label] = opt.step
        except Exception as e:
            steps[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    times = {k: [] for k, v in steps.items() if not isinstance(v, str)}
    for _ in range(rounds):
        for label in times:
            times[label].append(timed(steps[label]))
    base = times[REFERENCE]
    out = {}
    for label, v in steps.items():
        out[label] = v if isinstance(v, str) else (
            1e3 * statistics.median(times[label]),
            statistics.median(a / b for a, b in zip(times[label], base)))
    return out


def seeds_table(head, per_seed, seeds):
    """Final loss per run and lr as mean +- standard deviation over the
    seeds, and each seed's loss against its own float32 run (paired)."""
    cells = {}
    for rows in per_seed:
        for lr, label, loss, base, nbytes in rows:
            c = cells.setdefault(label, {"bytes": nbytes})
            c.setdefault(lr, []).append((loss, base))
    cols = " | ".join(f"loss, lr {lr:g} | vs float32, lr {lr:g}" for lr in LRS)
    lines = [head + f" Mean +- sample standard deviation over {seeds} seeds (0 to {seeds - 1}: "
             "the initialization and the batches); 'vs float32' pairs each seed with the "
             "float32 run of that seed.", "",
             f"| optimizer, params | bytes/param | {cols} |",
             "|---|---:|" + "---:|---:|" * len(LRS)]
    for label, c in cells.items():
        row = [label, f"{c['bytes']:.4g}"]
        for lr in LRS:
            got = c[lr]
            failed = [x for x, _ in got if isinstance(x, str)]
            if failed:
                row += [f"not run: {failed[0]}", ""]
                continue
            losses = [x for x, _ in got]
            rel = [100 * (x / b - 1) for x, b in got]
            row += [f"{statistics.mean(losses):.4f} +- {statistics.stdev(losses):.4f}",
                    f"{statistics.mean(rel):+.3f}% +- {statistics.stdev(rel):.3f}%"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(curves, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn")
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.2), squeeze=False)
    for ax, (lr, runs) in zip(axes[0], sorted(curves.items(), reverse=True)):
        for label, curve in runs.items():
            if not isinstance(curve, str):
                ax.plot(*zip(*curve), label=label,
                        linestyle="--" if label == REFERENCE else "-")
        ax.set_title(f"lr {lr:g}")
        ax.set_xlabel("AdamW steps")
        ax.set_ylabel("held-out loss (float32)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Small GPT-2, bfloat16 weights: torchcast and its peers "
                 "(benchmarks/bench_adam_peers.py)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, 3 steps, a 2^12-element speed case; writes nothing")
    ap.add_argument("--seeds", type=int, default=1,
                    help="N >= 2: the accuracy part only, mean +- std over N seeds")
    ap.add_argument("--runs", nargs="+", default=None,
                    help="with --seeds: only the runs whose label contains one of these")
    protocol.add_arguments(ap)
    args = ap.parse_args()
    run = protocol.Run(args.force)
    torch.set_num_threads(args.threads)
    size = dict(ctx=64, dim=128, layers=4, heads=4)
    shapes, speed_label = [(1024, 1024)] * 48, "48 x 1024^2 (50.3M)"
    if args.smoke:
        size, args.steps, args.rounds = dict(ctx=8, dim=16, layers=1, heads=2), 3, 1
        shapes, speed_label = [(1 << 12,)], "2^12"
    if args.seeds > 1:
        runs = [r for r in RUNS if r[0] == REFERENCE or args.runs is None
                or any(t in r[0] for t in args.runs)]
        per_seed = []
        for seed in range(args.seeds):
            head, rows, _ = accuracy(args.steps, size, seed, runs)
            per_seed.append(rows)
        runs_arg = (" --runs " + " ".join(f"'{t}'" for t in args.runs)) if args.runs else ""
        text = (seeds_table(head, per_seed, args.seeds) + "\n\n"
                f"torch {torch.__version__}, torch.set_num_threads({args.threads}). Command: "
                f"`PYTHONPATH=. python benchmarks/bench_adam_peers.py --seeds {args.seeds} "
                f"--steps {args.steps} --threads {args.threads}{runs_arg}`\n")
        print(text)
        if not args.smoke:
            with open(os.path.join(RESULTS, "adam_peers_seeds.md"), "w") as f:
                f.write(text)
        return 0
    head, rows, curves = accuracy(args.steps, size)
    timings = speed(args.rounds, shapes)
    copy_gbs = protocol.copy_bandwidth(args.rounds, 1 << 26)
    run.copy_bandwidth(copy_gbs, args.threads, 2 * 4 << 26)
    text = (table(head, rows, timings, speed_label) + "\n\n"
            f"Step times: one AdamW step over {speed_label} parameters, torch "
            f"{torch.__version__}, torch.set_num_threads({args.threads}), {args.rounds} "
            f"interleaved rounds, medians; {run.summary()}\n\n"
            f"Command: `PYTHONPATH=. python benchmarks/bench_adam_peers.py --steps {args.steps} "
            f"--rounds {args.rounds} --threads {args.threads}`\n")
    print(text)
    if args.smoke:
        return 0
    plot(curves, os.path.join(PICTURES, "adam_peers.png"))
    run.write(os.path.join(RESULTS, "adam_peers.md"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
