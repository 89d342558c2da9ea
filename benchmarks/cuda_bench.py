"""cast_with_stats on CUDA against torch's own cast and the device's copy bandwidth.

Follows benchmarks/README.md: one process, ours and the baseline interleaved
in every round after a warm-up, CUDA events, medians of each and the median of
the per-round ratios; GB/s counts bytes read plus bytes written, and is set
against the device-to-device copy bandwidth measured in the same run.
Rows: every lossy pair with fresh outputs (ours vs ``x.to(dtype)``) and with
preallocated ones (ours ``out=`` vs ``out.copy_(x)``), plus the scalar paths
(x misaligned by one element, x strided) and a small size for launch overhead.

    python benchmarks/cuda_bench.py [--log2-size 28] [--rounds 15]

Also torchcast.kahan_sum against torch.sum (full, inner and outer dims), and
one torchcast.optim.Adam step on 50M parameters against
torch.optim.Adam(fused=True).

Targets: at least 85% of the copy bandwidth and at most 1.1x the time of
torch's own cast, for every pair. Reported, never asserted.
"""
import argparse
import os
import shlex
import statistics
import sys

import torch

import protocol
import torchcast
import torchcast.optim
from torchcast._reference import cast as cast_ref

op = torch.ops.torchcast.cast_with_stats
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def short(dtype):
    return str(dtype)[6:]


def time_pair(ours, base, rounds, warmup, reps):
    """Median ms per call of ours and base, and the median per-round ratio.
    reps calls per timed sample (for sizes where one call is launch-bound)."""
    def sample(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    for _ in range(warmup):
        sample(ours)
        sample(base)
    t_ours, t_base, ratios = [], [], []
    for r in range(rounds):
        # alternate which goes first, so neither always follows the other
        if r % 2:
            b, o = sample(base), sample(ours)
        else:
            o, b = sample(ours), sample(base)
        t_ours.append(o)
        t_base.append(b)
        ratios.append(o / b)
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


def copy_bandwidth(nbytes, rounds, warmup):
    """Device-to-device copy GB/s (read + write) for nbytes of float32."""
    n = nbytes // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms, _, _ = time_pair(lambda: dst.copy_(src), lambda: dst.copy_(src), rounds, warmup, 1)
    return 2 * n * 4 / ms / 1e6


def rows_for(args, copy_gbs):
    n = 1 << args.log2_size
    small = 1 << args.log2_small
    rows = []

    def add(kind, pair, size, layout, ours, base, nbytes, reps=1):
        o, b, ratio = time_pair(ours, base, args.rounds, args.warmup, reps)
        gbs = nbytes / o / 1e6
        rows.append({
            "kind": kind, "pair": f"{short(pair[0])}->{short(pair[1])}", "size": size,
            "layout": layout, "ours_us": o * 1e3, "base_us": b * 1e3, "ratio": ratio,
            "gbs": gbs, "pct": 100 * gbs / copy_gbs,
        })

    g = torch.Generator(device="cuda").manual_seed(0)
    for src, dst in cast_ref.LOSSY_PAIRS:
        x = torch.randn(n, generator=g, device="cuda", dtype=src) * 100
        nbytes = n * (x.element_size() + torch.empty((), dtype=dst).element_size())
        out = torch.empty(n, device="cuda", dtype=dst)
        add("fresh", (src, dst), f"2^{args.log2_size}", "contiguous",
            lambda: op(x, dst), lambda: x.to(dst), nbytes)
        add("out=", (src, dst), f"2^{args.log2_size}", "contiguous",
            lambda: op.out(x, dst, out=out), lambda: out.copy_(x), nbytes)
        xs = x[:small]
        add("fresh", (src, dst), f"2^{args.log2_small}", "contiguous",
            lambda: op(xs, dst), lambda: xs.to(dst),
            small * nbytes // n, reps=100)
        del x, out
    # The scalar paths: misaligned x (no 16-byte loads) and strided x (offset calculator).
    src, dst = torch.float32, torch.bfloat16
    base = torch.randn(2 * n + 1, generator=g, device="cuda", dtype=src) * 100
    nbytes = n * (4 + 2)
    mis = base[1:n + 1]
    add("fresh", (src, dst), f"2^{args.log2_size}", "x[1:] misaligned",
        lambda: op(mis, dst), lambda: mis.to(dst), nbytes)
    strided = base[: 2 * n : 2]
    add("fresh", (src, dst), f"2^{args.log2_size}", "x[::2] strided",
        lambda: op(strided, dst), lambda: strided.to(dst), nbytes)
    return rows


def adam_rows(args, copy_gbs):
    """One optimizer step over args.adam_params parameters (one tensor):
    torchcast.optim.Adam against torch.optim.Adam(fused=True) on float32
    params. GB/s counts every operand read and written once."""
    n = args.adam_params
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)

    def make(dtype, cls, **kw):
        p = torch.nn.Parameter(torch.randn(n, generator=g, device="cuda").to(dtype))
        p.grad = (torch.randn(n, generator=g, device="cuda") * 1e-3).to(dtype)
        opt = cls([p], lr=1e-4, **kw)
        opt.step()  # creates the state
        return opt

    base = make(torch.float32, torch.optim.Adam, fused=True)
    # bfloat16 param, grad and compensation with float32 moments: read 2+2+2+4+4, write 2+2+4+4
    bf16 = 26
    # (params, states, compensation) bytes per element, read + written
    for label, dtype, kw, nbytes in [
            ("float32, none", torch.float32, dict(compensated=False), 4 * (4 + 3)),
            ("float32, kahan", torch.float32, dict(compensated=True), 4 * (5 + 4)),
            ("bfloat16 + float32 states, kahan", torch.bfloat16, {}, bf16),
            ("bfloat16 + float32 states, remainder", torch.bfloat16,
             dict(compensation="remainder"), bf16)]:
        ours = make(dtype, torchcast.optim.Adam, **kw)
        o, b, ratio = time_pair(ours.step, base.step, args.rounds, args.warmup, 1)
        gbs = n * nbytes / o / 1e6
        rows.append({"kind": "adam", "pair": label, "size": f"{n / 1e6:.0f}M", "layout": "one tensor",
                     "ours_us": o * 1e3, "base_us": b * 1e3, "ratio": ratio, "gbs": gbs,
                     "pct": 100 * gbs / copy_gbs})
        del ours
    return rows


def reduce_rows(args, copy_gbs):
    """torchcast.kahan_sum against torch.sum on float32 (and bfloat16) at the
    cast size: full, inner dim (warp lanes) and outer dim (one lane). GB/s
    counts x read once."""
    n = 1 << args.log2_size
    rows = []
    g = torch.Generator(device="cuda").manual_seed(2)
    x32 = torch.randn(n, generator=g, device="cuda")
    cases = [("full", torch.float32, x32, None),
             ("full", torch.bfloat16, x32.bfloat16(), None),
             ("dim=1 (inner)", torch.float32, x32.view(1 << 12, -1), 1),
             ("dim=0 (outer)", torch.float32, x32.view(1 << 12, -1), 0)]
    for layout, dtype, x, dim in cases:
        o, b, ratio = time_pair(lambda: torchcast.kahan_sum(x, dim), lambda: torch.sum(x, dim),
                                args.rounds, args.warmup, 1)
        gbs = x.numel() * x.element_size() / o / 1e6
        rows.append({"kind": "sum", "pair": short(dtype), "size": f"2^{args.log2_size}",
                     "layout": f"{layout}, {'x'.join(map(str, x.shape))}", "ours_us": o * 1e3,
                     "base_us": b * 1e3, "ratio": ratio, "gbs": gbs, "pct": 100 * gbs / copy_gbs})
        del x
    return rows


def markdown(rows, copy_gbs, command):
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"Command: `{command}`  ",
        f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, torch.set_num_threads({torch.get_num_threads()}) (host side only)  ",
        f"Device-to-device copy bandwidth (read + write, same run): {copy_gbs:.0f} GB/s  ",
        "Targets: >= 85% of copy bandwidth and <= 1.1x torch's cast (cast rows); GB/s of a sum counts x read once.",
        "",
        "| op | pair | size | layout | ours (us) | baseline | baseline (us) | ratio | ours GB/s | % of copy BW |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        base, opname = {
            "fresh": ("x.to(dtype)", "cast_with_stats"),
            "out=": ("out.copy_(x)", "cast_with_stats(out=)"),
            "adam": ("torch.optim.Adam(fused=True), float32", "torchcast.optim.Adam.step"),
            "sum": ("torch.sum(x, dim)", "torchcast.kahan_sum"),
        }[r["kind"]]
        lines.append(
            f"| {opname} | {r['pair']} | {r['size']} | {r['layout']} | {r['ours_us']:.1f} | {base} | "
            f"{r['base_us']:.1f} | {r['ratio']:.2f} | {r['gbs']:.0f} | {r['pct']:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log2-size", type=int, default=28)
    p.add_argument("--log2-small", type=int, default=12)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--adam-params", type=int, default=50_000_000)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cuda.md"))
    protocol.add_arguments(p)
    args = p.parse_args(argv)
    run = protocol.Run(args.force, "cuda")
    if not torch.cuda.is_available():
        print("cuda_bench: no CUDA device here; nothing measured")
        return 0
    torch.set_num_threads(min(os.cpu_count() or 1, 16))
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    copy_gbs = copy_bandwidth((1 << args.log2_size) * 4, args.rounds, args.warmup)
    run.copy_bandwidth(copy_gbs, torch.get_num_threads(), 2 * (4 << args.log2_size))
    rows = rows_for(args, copy_gbs) + reduce_rows(args, copy_gbs) + adam_rows(args, copy_gbs)
    table = markdown(rows, copy_gbs, command) + "\n" + run.summary() + "\n"
    print(table)
    run.write(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
