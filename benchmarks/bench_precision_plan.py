"""Verifies torchcast.precision_plan by training: one model, one task, three
ways (bf16, every nn.Linear in float8 by torchao, the Linears the plan
passes in float8), same seeds; writes benchmarks/results/precision_plan.md.

The task (generated here, nothing downloaded): 63 standard normal features
and a fixed teacher MLP (63 -> 64 -> tanh -> 8, targets standardized); the
model's input has one more feature, channel 0, held at ``--outlier`` for
every example (a massive activation, as LLM residual streams carry). The
student is Linear(64, 128) -> GELU -> Linear(128, 128) -> GELU ->
Linear(128, 8); the outlier channel carries nothing, and its weight column
in the first Linear is held at zero (its gradient masked), so in bf16 the
outlier changes no output: only the scaled casts of float8 see it.

Training: float32 parameters, AdamW (lr 2e-3), batches of 128, forward under
torch.autocast("cpu", torch.bfloat16) in all three ways (the "bf16" run is
autocast; converted layers run torchao's Float8Linear, whose
torch._scaled_mm runs on this CPU). The plan is made from one training step
of a fresh copy of the model. Loss: mean squared error over the last 20
steps. The claim: the plan's loss is within ``--margin`` (relative) of
bf16's, the all-float8 one is not.

    python benchmarks/bench_precision_plan.py [--steps 300] [--outlier 1e5]
"""
import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchcast  # noqa: E402

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

D, H, OUT, BATCH, LR, TAIL = 64, 128, 8, 128, 2e-3, 20
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "precision_plan.md")


class Task:
    """Batches of (x, y): x's channel 0 is the outlier, y the teacher's
    standardized output on the other channels."""

    def __init__(self, outlier: float):
        torch.manual_seed(0)
        self.outlier = outlier
        self.teacher = nn.Sequential(nn.Linear(D - 1, 64), nn.Tanh(), nn.Linear(64, OUT))
        with torch.no_grad():
            ys = self.teacher(torch.randn(4096, D - 1))
        self.mu, self.sd = ys.mean(0), ys.std(0)

    def batch(self, gen: torch.Generator):
        x = torch.randn(BATCH, D, generator=gen)
        x[:, 0] = self.outlier
        with torch.no_grad():
            y = (self.teacher(x[:, 1:]) - self.mu) / self.sd
        return x, y


def student() -> nn.Module:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, H), nn.GELU(), nn.Linear(H, OUT))
    with torch.no_grad():
        m[0].weight[:, 0] = 0
    # Channel 0's column stays zero: the outlier reaches only the casts.
    m[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), 0.0))
    return m


def step(model, opt, task, gen):
    x, y = task.batch(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = (out.float() - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train(task, steps, recipe=None, module_filter_fn=None):
    model = student()
    if recipe is not None:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=module_filter_fn)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(2)
    losses = [step(model, opt, task, gen) for _ in range(steps)]
    tail = losses[-TAIL:]
    return sum(tail) / len(tail), converted


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--outlier", type=float, default=1e5)
    ap.add_argument("--margin", type=float, default=0.05,
                    help="largest loss gap to bf16 that counts as matching, relative")
    ap.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = Task(args.outlier)

    model = student()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(2)
    plan = torchcast.precision_plan(model, lambda: step(model, opt, task, gen),
                                    recipes=args.recipes)
    print(plan)

    t0 = time.time()
    base, _ = train(task, args.steps)
    rows, verdicts = [], []
    for recipe in args.recipes:
        for how, fn in (("all nn.Linear", None), ("the plan's", plan.module_filter_fn(recipe))):
            loss, converted = train(task, args.steps, recipe, fn)
            gap = loss / base - 1
            rows.append((recipe, how, ", ".join(converted) or "none", loss, gap))
            print(rows[-1], flush=True)
        all_gap, plan_gap = rows[-2][4], rows[-1][4]
        holds = abs(plan_gap) <= args.margin < all_gap
        verdicts.append(f"{recipe}: the plan's loss is {plan_gap:+.1%} from bf16's, all-float8's "
                        f"{all_gap:+.1%}: the claim {'holds' if holds else 'does NOT hold'}")
    seconds = time.time() - t0

    lines = [f"Outlier channel at {args.outlier:g}, {args.steps} steps, batches of {BATCH}; loss: "
             f"mean squared error over the last {TAIL} steps; margin: {args.margin:.0%} of "
             "bf16's loss.", "",
             "| recipe | float8 layers chosen by | layers in float8 | final loss | vs bf16 |",
             "|---|---|---|---|---|",
             f"| - (bf16 autocast) | - | none | {base:.4f} | - |"]
    lines += [f"| {r} | {how} | {conv} | {loss:.4f} | {gap:+.1%} |"
              for r, how, conv, loss, gap in rows]
    lines += ["", "Layers the plan keeps in bf16, and why:", ""]
    for recipe in args.recipes:
        for layer, why in plan.keep_in_bf16(recipe) or [("none", "")]:
            lines.append(f"- {recipe}: `{layer}`" + (f": {why}" if why else ""))
    lines += ["", "The claim:", ""] + [f"- {v}" for v in verdicts]
    lines += ["", "The plan (one training step; `print(plan)`):", "", "```", str(plan), "```"]
    lines += ["", f"torch {torch.__version__}, torchao "
              f"{__import__('torchao').__version__}, CPU, {seconds:.0f} s of training. Command: "
              f"`python benchmarks/bench_precision_plan.py --steps {args.steps} --outlier "
              f"{args.outlier:g} --margin {args.margin:g} --recipes {' '.join(args.recipes)}`"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
