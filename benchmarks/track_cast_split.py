"""Where one cast under track(all_casts=True) spends its work, in CPU
instructions counted by valgrind (callgrind), which the machine's load does
not change: the figure to watch when making the per-cast path cheaper.

Each variant runs in its own process under valgrind; only the instructions
executed inside one call (a ctypes callback, collected with
``--toggle-collect=PyCFuncPtr_call``) count, so importing torch does not.
Per cast: (instructions of N casts - instructions of 0 casts) / N, for
``x.to(torch.bfloat16)`` of a float32 tensor of 4 x 16 x 64 elements, one
thread, policy "record":

* ``untracked``: the cast alone;
* ``measuring kernel``: untracked, ``cast_with_stats`` (the cast and its
  statistics in one pass, which a tracked cast runs instead of the cast);
* ``callback only``: tracked, the Python callback of the cast kernels
  (tracker/threads.py) returning at once: the route's own cost;
* ``place known``: tracked, the cast's module, site and origin given
  (locate_cast skipped): measuring and recording;
* ``tracked``: everything.

Valgrind runs the AVX2 clones of torchcast's kernels (it has no AVX-512), so
the measuring kernel's share is larger here than on an AVX-512 machine.

    PYTHONPATH=. python benchmarks/track_cast_split.py [--casts 200]

Writes benchmarks/results/track_cast_split.md. Needs ``valgrind`` on PATH;
takes a few minutes (each process imports torch under valgrind).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("untracked", "measuring kernel", "callback only", "place known", "tracked")

# What each process runs: the casts inside one ctypes callback.
CHILD = r'''
import ctypes, sys, torch, torchcast
from torchcast.tracker import mode, threads
torch.set_num_threads(1)
x = torch.randn(4, 16, 64)
n, variant = int(sys.argv[1]), sys.argv[2]

def casts(k):
    if variant == "measuring kernel":
        for _ in range(k):
            torchcast._ops.cast_with_stats(x, torch.bfloat16)
        return
    for _ in range(k):
        x.to(torch.bfloat16)

with torchcast.track(all_casts=True, policy="record"):
    casts(50)  # the first track installs the kernels; caches warm
if variant == "callback only":
    threads._kernel_cast = lambda *args: None  # what the next track installs
elif variant == "place known":
    with torchcast.track(all_casts=True, policy="record"):
        place = mode.locate_cast(sys._getframe(), x, copy=False)
    threads.locate_cast = lambda *args, **kwargs: place

def run(a, b):
    if variant in ("untracked", "measuring kernel"):
        casts(n)
    else:
        with torchcast.track(all_casts=True, policy="record"):
            casts(n)
    return 0

compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(run)
libc = ctypes.CDLL(None)
libc.bsearch.restype = ctypes.c_void_p
key, table = ctypes.c_int(0), (ctypes.c_int * 1)(0)
libc.bsearch(ctypes.byref(key), table, 1, 4, compare)  # calls run once
'''


def instructions(script, casts, variant, env):
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
             "--toggle-collect=PyCFuncPtr_call", sys.executable, script, str(casts), variant],
            env=env, capture_output=True, text=True, check=True)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise RuntimeError(f"valgrind printed no count for {variant!r}:\n{out.stderr[-2000:]}")
    return int(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--casts", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "track_cast_split.md"))
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("track_cast_split.py needs valgrind on PATH")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
        script = f.name
    try:
        per_cast = {}
        for variant in VARIANTS:
            many = instructions(script, args.casts, variant, env)
            none = instructions(script, 0, variant, env)
            per_cast[variant] = (many - none) / args.casts
            print(f"{variant}: {per_cast[variant]:,.0f} instructions per cast", flush=True)
    finally:
        os.unlink(script)
    base = per_cast["untracked"]
    rows = [("the cast (x.to)", base),
            ("the route: kernel to Python callback and back",
             per_cast["callback only"] - base),
            ("locating it: module, site, origin (locate_cast)",
             per_cast["tracked"] - per_cast["place known"]),
            ("measuring it: cast_with_stats beyond the cast it replaces",
             per_cast["measuring kernel"] - base),
            ("recording it: the rest of report_cast",
             per_cast["place known"] - per_cast["callback only"]
             - (per_cast["measuring kernel"] - base)),
            ("total, tracked", per_cast["tracked"])]
    lines = [f"`PYTHONPATH=. python benchmarks/track_cast_split.py --casts {args.casts}` "
             f"(valgrind callgrind; torch {torch.__version__}): instructions per "
             "`x.to(torch.bfloat16)` of 4 x 16 x 64 float32 elements, one thread, "
             "track(all_casts=True, policy=\"record\"). Counts, not times: the load does not "
             "change them; valgrind runs the AVX2 clones of the kernels.", "",
             "| part | instructions per cast |", "|---|---:|"]
    lines += [f"| {name} | {value:,.0f} |" for name, value in rows]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"written to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
