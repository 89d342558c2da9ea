"""A small GPT-2-like model (embeddings, a 2-layer ``nn.TransformerEncoder``,
a final norm and a head) trained for a few steps under float16 autocast with
every watch on; four feed-forward units of the second layer grow past
float16's range, so NaN starts in ``transformer.h.layers.1.linear1``. Written
as an HTML report (docs/report.png is its screenshot); tests/test_report_scale.py
checks the page and the TensorBoard tags of this very run.

    PYTHONPATH=. python tools/report_example.py [OUT.html [HEADROOM.png]]

With a second argument (and matplotlib installed) it also draws the
headroom chart of docs/numerics.md (docs/img/headroom.png).
"""
import sys

import torch

import torchcast

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 256, 32, 64, 4, 2


def _to(x, dtype):
    # Every explicit cast of the model goes through this one line, as through a
    # helper in a real model: sites that differ only in their dtype pair.
    return x.to(dtype)


class Body(torch.nn.Module):
    """GPT-2's ``transformer``: token and position embeddings, the blocks, ln_f."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, WIDTH)
        self.wpe = torch.nn.Embedding(CONTEXT, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0,
                                                 activation="gelu", batch_first=True,
                                                 norm_first=True)
        self.h = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.ln_f = torch.nn.LayerNorm(WIDTH)

    def forward(self, idx):
        n = idx.shape[1]
        x = _to(self.wte(idx) + self.wpe(torch.arange(n, device=idx.device)), torch.float16)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        return self.ln_f(_to(self.h(x, mask=mask, is_causal=True), torch.float32))


class GPT(torch.nn.Module):
    """The root returns its head's output, as GPT-2's logits are: one tensor,
    two modules (the page shows its histogram once, naming both)."""

    def __init__(self):
        super().__init__()
        self.transformer = Body()
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        return self.lm_head(self.transformer(idx))


def make_model():
    torch.manual_seed(0)
    model = GPT()
    with torch.no_grad():  # four feed-forward units of the second block overflow float16
        model.transformer.h.layers[1].linear1.weight[:4].mul_(1e5)
    return model


def run(steps=3, device="cpu"):
    """``steps`` SGD steps under float16 autocast, tracked; returns the Report."""
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4, CONTEXT + 1), device=device)
    with torchcast.track(all_casts=True, nonfinite="record", health=True,
                         policy="record") as report:
        for _ in range(steps):
            with torch.autocast(device, dtype=torch.float16):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(_to(logits, torch.float32).flatten(0, 1),
                                                     tokens[:, 1:].flatten())
            loss.backward()
            # A step whose gradients hold NaN/inf is skipped, as GradScaler does.
            if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
                opt.step()
            opt.zero_grad()
    return report


def plot_headroom(report, path, entries=12):
    """A bar chart of the report's headroom (matplotlib; skipped, with a line
    saying so, where it is not installed): for the forward outputs that lose
    most, the fraction of elements a cast to each format loses (overflow +
    underflow) at scale 1 and at the amax power-of-two scale."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn")
        return
    from torchcast.tracker.health_rows import headroom_view
    view = [v for v in headroom_view(report.to_dict()["headroom"])
            if v["phase"] == "forward" and v["plain"] is not None]
    modules = []
    for v in view:  # worst first
        if v["module"] not in modules:
            modules.append(v["module"])
    modules = modules[:entries]
    lost = {(v["module"], v["format"]): (
        float(v["plain"]["overflow"]) + float(v["plain"]["underflow"]),
        float((v["scaled"] or v["plain"])["overflow"])
        + float((v["scaled"] or v["plain"])["underflow"])) for v in view}
    # The formats that lose anything for these modules (a float16 model
    # loses nothing to float16: no cast happens).
    formats = sorted({f for (m, f), (plain, scaled) in lost.items()
                      if m in modules and (plain or scaled)})
    fig, axes = plt.subplots(1, len(formats), figsize=(4 * len(formats), 0.35 * len(modules) + 1.6),
                             sharey=True, squeeze=False)
    ys = range(len(modules))
    for ax, fmt in zip(axes[0], formats):
        plain = [100 * lost.get((m, fmt), (0.0, 0.0))[0] for m in modules]
        scaled = [100 * lost.get((m, fmt), (0.0, 0.0))[1] for m in modules]
        ax.barh([y - 0.2 for y in ys], plain, height=0.4, label="scale 1")
        ax.barh([y + 0.2 for y in ys], scaled, height=0.4, label="amax scale (power of two)")
        ax.set_title(fmt.replace("torch.", ""), fontsize=10)
        ax.set_xlabel("% of elements lost (overflow + underflow)")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(list(ys), [m or "-" for m in modules], fontsize=8)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Headroom of each module's forward output (tools/report_example.py, exact "
                 "from tensor_health's histograms)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(out="report.html", picture=None):
    report = run()
    print(report)
    print(report.headroom(torch.float8_e4m3fn, scale="amax"))
    report.to_html(out)
    print(f"wrote {out}")
    if picture is not None:
        plot_headroom(report, picture)
    return report


if __name__ == "__main__":
    main(*sys.argv[1:])
