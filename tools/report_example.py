"""A small GPT-2-like model (embeddings, a 2-layer ``nn.TransformerEncoder``,
a final norm and a head) trained for a few steps under float16 autocast with
every watch on; four feed-forward units of the second layer grow past
float16's range, so NaN starts in ``transformer.h.layers.1.linear1``. Written
as an HTML report (docs/report.png is its screenshot); tests/test_report_scale.py
checks the page and the TensorBoard tags of this very run.

    PYTHONPATH=. python tools/report_example.py [OUT.html]
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


def main(out="report.html"):
    report = run()
    print(report)
    print(report.headroom(torch.float8_e4m3fn, scale="amax"))
    report.to_html(out)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main(*sys.argv[1:])
