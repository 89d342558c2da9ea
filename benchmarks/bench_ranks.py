"""Overhead of torchcast.track(nonfinite="record") on a 2-rank DDP training
step (gloo, this CPU), and the collectives it adds (issue 31: none per op).

Two processes, one per rank, each 1 thread. Every round each rank runs one
plain step and one tracked step (a forward, backward with DDP's gradient
all-reduce, and an SGD step of a 4-layer MLP), the order alternating by
round, the same on both ranks so that their collectives pair up. Reported
by rank 0: median step times, the median of the per-round ratios, and the
c10d collectives per step with and without tracking (counted in a separate,
untimed step by a dispatch mode). The copy bandwidth and the load average
are recorded (benchmarks/README.md).

    PYTHONPATH=. python benchmarks/bench_ranks.py [--rounds N] [--width W]
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import protocol  # noqa: E402


class _CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.n += 1
        return func(*args, **(kwargs or {}))


def make(width, rank):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    return model, opt, x


def step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def tracked(model, opt, x):
    import torchcast
    with torchcast.track(nonfinite="record"):
        step(model, opt, x)


def collectives(run, model, opt, x):
    counter = _CountCollectives()
    with counter:
        run(model, opt, x)
    return counter.n


def rank_main(rank, port, rounds, width, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    model, opt, x = make(width, rank)
    runs = (step, tracked)
    for _ in range(3):  # warm-up, both kinds
        for run in runs:
            run(model, opt, x)
    counts = [collectives(run, model, opt, x) for run in runs]
    wall = ([], [])
    for i in range(rounds):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            dist.barrier()
            t0 = time.perf_counter()
            runs[which](model, opt, x)
            wall[which].append(time.perf_counter() - t0)
    ratios = [t / b for b, t in zip(*wall)]
    gathered = [None, None]
    dist.all_gather_object(gathered, (statistics.median(wall[0]), statistics.median(wall[1]),
                                      statistics.median(ratios), counts))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
    # torch 2.13's gloo teardown at interpreter exit sometimes aborts
    # ("terminate called without an active exception"), with or without
    # tracking: the figures are written, so leave without it.
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ranks.md"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)
    parser.add_argument("--partial", help=argparse.SUPPRESS)
    protocol.add_arguments(parser)
    opts = parser.parse_args()
    if opts.rank is not None:
        rank_main(opts.rank, opts.port, opts.rounds, opts.width, opts.partial)
        return
    run = protocol.Run(opts.force)
    torch.set_num_threads(1)
    run.copy_bandwidth(protocol.copy_bandwidth(opts.rounds), 1, 2 * 4 << 25)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    partial = opts.out + ".partial"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", port,
                               "--rounds", str(opts.rounds), "--width", str(opts.width),
                               "--partial", partial], env=env) for rank in (0, 1)]
    if any(p.wait() for p in procs):
        sys.exit("a rank failed")
    with open(partial) as f:
        per_rank = json.load(f)
    os.remove(partial)
    command = "PYTHONPATH=. python " + " ".join(["benchmarks/bench_ranks.py"] + sys.argv[1:])
    lines = [
        f"`{command}` — torch {torch.__version__}, 2 gloo ranks on this machine, 1 thread "
        f"each; a DDP MLP of 4 Linear({opts.width}, {opts.width}) + GELU, batch 32, forward, "
        f"backward and SGD step; {opts.rounds} interleaved rounds (order alternating), "
        f"medians; the tracked step includes entering and leaving the track. {run.summary()}",
        "",
        "| rank | plain step | track(nonfinite=\"record\") step | ratio (median) "
        "| c10d collectives per step, plain | tracked |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, (base, ours, ratio, (n_plain, n_tracked)) in enumerate(per_rank):
        lines.append(f"| {rank} | {base * 1e3:.2f} ms | {ours * 1e3:.2f} ms | {ratio:.2f}x "
                     f"| {n_plain} | {n_tracked} |")
    table = "\n".join(lines)
    print(table)
    run.write(opts.out, table + "\n")


if __name__ == "__main__":
    main()
