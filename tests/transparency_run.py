"""One configuration of the transparency matrix (tests/test_transparency.py),
run in a fresh process: a small transformer block with an intentional -inf
causal mask, trained (or run under no_grad) for a few steps, plain or under
one of track()'s configurations. Prints one JSON line: the losses as exact
float hex, a digest of every parameter and optimizer state's bits, the
graphs Dynamo compiled and the reasons of its graph breaks, and, for
tracked runs, what the report says in a few numbers.

    python tests/transparency_run.py BACKEND DTYPE MODE FEATURE [MODEL]

BACKEND: eager, aot_eager, inductor; DTYPE: float32, autocast (bfloat16
autocast over float32 weights), bf16 (bfloat16 weights); MODE: train,
no_grad; FEATURE: one of FEATURES; MODEL: one of MODELS (default "block").
"""
import hashlib
import json
import math
import sys

import torch
from torch import nn

FEATURES = {
    "plain": None,
    "track": {},
    "all_casts": {"all_casts": True},
    "record": {"nonfinite": "record"},
    "raise": {"nonfinite": "raise"},
    "health": {"health": True},
    "all": {"all_casts": True, "nonfinite": "raise", "health": True},
}
BACKENDS = ("eager", "aot_eager", "inductor")
DTYPES = ("float32", "autocast", "bf16")
MODES = ("train", "no_grad")
STEPS = 3


class Block(nn.Module):
    """A pre-norm transformer block and a head: attention with the causal
    mask made as many codebases make it, log(tril(ones)): 0 on and below the
    diagonal, -inf above, absorbed by the softmax."""

    def __init__(self, vocab=64, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        b, n = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        mask = torch.log(torch.tril(torch.ones(n, n, device=tokens.device, dtype=q.dtype)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
        attn = scores.softmax(dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


class AttentionBlock(nn.Module):
    """nn.MultiheadAttention (4 heads, d 32) with the mask
    log(tril(ones(6, 6))), LayerNorm, an MLP (32 -> 64 -> 32, GELU) and a
    Linear head: the model of issue 47, whose compiled casts under bf16
    autocast Inductor fuses (a tracker that kept them in buffers of their
    dtype rounded where the program does not)."""

    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        n = tokens.shape[1]
        mask = torch.log(torch.tril(torch.ones(n, n, device=tokens.device, dtype=x.dtype)))
        a, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        x = self.norm(x + a)
        x = x + self.mlp(x)
        return self.head(x)


MODELS = {"block": Block, "mha": AttentionBlock}


def digest(tensors):
    """sha256 of the tensors' bits, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()


def run(backend: str, dtype: str, mode: str, feature: str, model_name: str = "block") -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = model if backend == "eager" else torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 9), generator=g) for _ in range(STEPS)]

    def steps():
        losses = []
        for tokens in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
                logits = forward(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                   tokens[:, 1:].flatten())
            if mode == "train":
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses

    config = FEATURES[feature]
    summary = {}
    if config is None:
        with torch.set_grad_enabled(mode == "train"):
            losses = steps()
    else:
        import torchcast
        with torch.set_grad_enabled(mode == "train"):
            with torchcast.track(**config) as report:
                losses = steps()
        summary = {"records": len(report.records), "origins": len(report.nonfinite),
                   "measured_sites": sum(r.measured for r in report.records),
                   "fused_sites": sum("fused by inductor" in r.origin for r in report.records),
                   "absorbed": sum(o.reached is False for o in report.nonfinite),
                   "text": len(str(report))}
        report.to_dict()  # every writer's input builds
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    compiled = torch._dynamo.utils.counters
    return {"losses": [float(v).hex() for v in losses],
            "weights": digest(list(model.parameters()) + state),
            "graphs": compiled["stats"]["unique_graphs"],
            "graph_breaks": sorted(compiled["graph_break"]), **summary}


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:6])))
