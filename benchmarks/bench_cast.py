"""cast_with_stats against the plain cast and against the same statistics
written with composite PyTorch ops, following benchmarks/README.md: one
process, baseline and ours interleaved round by round, medians and the
median of the per-round ratios, GB/s (bytes read + written) against the
streaming bandwidth of a preallocated same-dtype copy measured in the same run,
fresh and preallocated outputs, a large and a small size.

    python benchmarks/bench_cast.py                  # CPU: 2^25 and 2^12 elements
    python benchmarks/bench_cast.py --device cuda    # CUDA: 2^28 and 2^12 elements

Prints a markdown table and writes it to benchmarks/results/cast_<device>.md.
"""
import argparse
import os
import statistics
import sys
import time

import torch

import protocol
import torchcast  # noqa: F401  (registers torch.ops.torchcast)
from torchcast import _ops
from torchcast._reference.cast import LOSSY_PAIRS

HERE = os.path.dirname(os.path.abspath(__file__))
OP = torch.ops.torchcast.cast_with_stats


def composite_stats(x, dtype):
    """The statistics as one would write them by hand with PyTorch ops: the same
    counts and maxima as cast_with_stats (saturation aside), plain float32 sums
    of the error terms."""
    y = x.to(dtype)
    back = y.to(x.dtype)
    x_finite, y_finite = torch.isfinite(x), torch.isfinite(back)
    measured = x_finite & y_finite
    err = torch.where(measured, (x - back).abs(), 0.0)
    rel = err / torch.where(measured & (x != 0), x.abs(), 1.0)
    stats = torch.stack([
        x.new_full((), x.numel(), dtype=torch.float64),
        torch.isnan(x).sum().double(),
        torch.isinf(x).sum().double(),
        (x_finite & (back != x)).sum().double(),
        (x_finite & ~y_finite).sum().double(),
        ((x != 0) & (back == 0)).sum().double(),
        ((back != 0) & (back.abs() < torch.finfo(dtype).tiny)).sum().double(),
        err.max().double(),
        rel.max().double(),
        torch.where(x_finite, x.abs(), 0.0).max().double(),
        err.float().sum().double(),
        (err * err).float().sum().double(),
        torch.where(measured, x * x, 0.0).float().sum().double(),
    ])
    return y, stats


def torchao_style_cast(x, dtype):
    """A float8 cast as torchao's dynamic scaling makes it (amax, scale in
    float64 then float32, multiply, clamp, cast): no statistics but amax."""
    amax = x.abs().amax().to(torch.float64)
    big = torch.finfo(dtype).max
    scale = (big / amax.clamp(min=1e-12)).to(torch.float32)
    return (x.float() * scale).clamp(-big, big).to(dtype), scale


def scaled_cast_with_stats(x, dtype):
    """The same recipe with torchcast: amax_scale, then one fused pass that
    casts, saturates and measures."""
    scale = torchcast.scaling.amax_scale(x, dtype)
    return OP(x, dtype, scale, saturate=True), scale


class Timer:
    """Seconds per call of fn, averaged over `inner` calls."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, inner):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def run_rounds(timer, cases, rounds, inner, limit=None):
    """Runs the named callables round by round (order reversed every other
    round, so drift hits them alike), inner[name] calls per timing, and a name
    in `limit` only in the first limit[name] rounds; returns the per-round
    times per call, by name."""
    limit = limit or {}
    times = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if r < limit.get(name, rounds):
                times[name].append(timer(cases[name], inner[name]))
    return times


def inner_calls(timer, fn, target_s):
    """Calls per timing so that one timing lasts about target_s."""
    fn()
    timer.sync()
    once = timer(fn, 1)
    return max(1, min(10_000, int(target_s / max(once, 1e-7))))


def fmt_time(s):
    us = s * 1e6
    return f"{us:,.0f} µs" if us >= 100 else f"{us:.1f} µs"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=11, help="interleaved rounds per measurement")
    ap.add_argument("--composite-rounds", type=int, default=3,
                    help="of those, rounds that also time the (slow) composite PyTorch statistics")
    protocol.add_arguments(ap)
    args = ap.parse_args()
    run = protocol.Run(args.force, args.device)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_cast.py --device cuda: no CUDA device is visible")
        if not _ops.has_kernel("cast_with_stats", device):
            sys.exit("bench_cast.py --device cuda: torchcast was built without its CUDA kernels "
                     "(build with TORCHCAST_CUDA=1)")
        sizes = (1 << 28, 1 << 12)
        machine = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        sizes = (1 << 25, 1 << 12)
        machine = f"{protocol.cpu_name()}, {os.cpu_count()} cores"
    threads = torch.get_num_threads()
    timer = Timer(device)
    command = "python benchmarks/bench_cast.py" + (" --device cuda" if device.type == "cuda" else "") + (
        f" --rounds {args.rounds}" if args.rounds != 11 else "") + (
        f" --composite-rounds {args.composite_rounds}" if args.composite_rounds != 3 else "")
    print(f"# {command}\n# device: {machine}; torch {torch.__version__}; "
          f"torch.get_num_threads() = {threads}; {args.rounds} rounds", flush=True)

    rows = []
    floors = []
    copy_bw = {}
    for n in sizes:
        # A call per timing at the large size; at the small one enough calls to
        # last ~2 ms, so that the timer and the machine's jitter do not dominate.
        target = 2e-3 if n < (1 << 20) else 0.0
        # The streaming bandwidth: a preallocated float32 copy, timed in the
        # same rounds as each pair so that it sees the same machine.
        src32 = torch.randn(n, device=device)
        dst32 = torch.empty_like(src32)
        for src_dtype, dst_dtype in LOSSY_PAIRS:
            x = torch.randn(n, dtype=torch.float64, device=device).to(src_dtype)
            out = torch.empty(n, dtype=dst_dtype, device=device)
            cases = {
                "fresh_ours": lambda: OP(x, dst_dtype),
                "fresh_base": lambda: x.to(dst_dtype),
                "out_ours": lambda: OP.out(x, dst_dtype, out=out),
                "out_base": lambda: out.copy_(x),
                "composite": lambda: composite_stats(x, dst_dtype),
                "copy32": lambda: dst32.copy_(src32),
            }
            float8 = dst_dtype.itemsize == 1
            if float8:
                cases["scaled_ours"] = lambda: scaled_cast_with_stats(x, dst_dtype)
                cases["scaled_base"] = lambda: torchao_style_cast(x, dst_dtype)
            if n < (1 << 20):
                # The same Python -> dispatcher path as torch.ops.torchcast: the
                # floor of any custom op's call at this size.
                cases["out_floor"] = lambda: torch.ops.aten.copy_.default(out, x)
            inner = {k: inner_calls(timer, f, target) for k, f in cases.items()}  # also warms up
            t = run_rounds(timer, cases, args.rounds, inner, {"composite": args.composite_rounds})
            if "out_floor" in t:
                floors.append(statistics.median(t["out_floor"]) / statistics.median(t["out_base"]))
            bandwidth = 2 * n * 4 / statistics.median(t["copy32"])
            copy_bw.setdefault(n, []).append(bandwidth)
            if n >= (1 << 25):
                run.copy_bandwidth(bandwidth / 1e9, threads, 2 * 4 * n)
            moved = n * (x.element_size() + out.element_size())
            pair = f"{str(src_dtype)[6:]} → {str(dst_dtype)[6:]}"
            comparisons = [
                ("cast_with_stats vs x.to (fresh)", "fresh_ours", "fresh_base"),
                ("cast_with_stats.out vs dst.copy_ (preallocated)", "out_ours", "out_base"),
                ("cast_with_stats vs composite PyTorch stats", "fresh_ours", "composite"),
            ]
            if float8:
                comparisons.append(("amax_scale + scaled cast_with_stats vs torchao-style "
                                    "amax + scale + clamp + cast", "scaled_ours", "scaled_base"))
            for label, ours, base in comparisons:
                ratio = statistics.median(a / b for a, b in zip(t[ours], t[base]))
                med = statistics.median(t[ours])
                gbs = moved / med / 1e9
                rows.append((label, pair, f"2^{n.bit_length() - 1}", fmt_time(med),
                             fmt_time(statistics.median(t[base])), f"{ratio:.2f}",
                             f"{gbs:.1f}", f"{100 * gbs * 1e9 / bandwidth:.0f}%"))
                print(" | ".join(rows[-1]), flush=True)
            del x, out
        del src32, dst32

    bw = "; ".join(f"2^{n.bit_length() - 1}: {min(copy_bw[n]) / 1e9:.1f}-{max(copy_bw[n]) / 1e9:.1f} GB/s"
                   for n in sizes)
    lines = [
        f"`{command}` — {machine}, torch {torch.__version__}, "
        f"torch.get_num_threads() = {threads}, {args.rounds} interleaved rounds "
        f"({args.composite_rounds} for the composite), medians; {run.summary()}",
        "",
        f"Copy bandwidth (preallocated float32 `dst.copy_(src)`, bytes read + written, timed in "
        f"the same rounds as each pair): {bw}.",
        "Ratio = median over rounds of ours / baseline (lower is better); GB/s = bytes of x read "
        "+ y written per second by ours; % copy = that against the copy bandwidth of the same rounds.",
        "",
        "| comparison | pair | size | ours | baseline | ratio | GB/s | % copy |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if floors:
        lines += ["", f"At 2^12 a call's fixed cost dominates: `torch.ops.aten.copy_.default(dst, x)`, the "
                  f"same Python-to-dispatcher path that `torch.ops.torchcast` ops take, already costs "
                  f"{min(floors):.1f}-{max(floors):.1f}x `dst.copy_(x)` there."]
    table = "\n".join(lines) + "\n"
    print()
    print(table)
    run.write(os.path.join(HERE, "results", f"cast_{device.type}.md"),
              f"# cast_with_stats benchmark ({device.type})\n\n{table}")


if __name__ == "__main__":
    main()
