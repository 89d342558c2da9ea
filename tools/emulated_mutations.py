"""The mutation proof of the emulated grid (docs/cuda.md, "The emulated
grid"): in a scratch copy of the checkout, never in it, apply one at a time
a bug the emulation exists to catch, rebuild the emulated kernels there and
run tests/test_cuda_emulated.py's kernel cases, which must fail for each
(and pass for the unmutated copy first).

    PYTHONPATH=. python tools/emulated_mutations.py [--seed N] [--scratch DIR]

Needs the compiled extension (torchcast/_C*.so, copied to the scratch tree)
and what the emulated tests need (a compiler, ninja). Prints a table of the
mutations and their failures; exits 1 if a mutation passed. Takes a few
minutes: each mutation rebuilds the files that include what it changes
(MAX_JOBS as for any torch extension)."""
import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str    # in the checkout
    old: str     # exactly once in the file
    new: str
    change: str  # old -> new, as the table shows it


MUTATIONS = [
    Mutation("(a) off-by-one in a tail bound: each chunk's last element is skipped",
             "csrc/cuda/cast.cu", "      if (e < n) {", "      if (e < n - 1) {",
             "`if (e < n)` -> `if (e < n - 1)` (scalar_steps)"),
    Mutation("(b) the barrier between the warps' shared-memory writes and thread 0's reads "
             "removed", "csrc/cuda/block_reduce.cuh",
             "  __syncthreads();\n  if (threadIdx.x == 0) {", "  if (threadIdx.x == 0) {",
             "the first `__syncthreads();` of block_reduce deleted"),
    Mutation("(c) a wrong shuffle offset in the warp tree", "csrc/cuda/block_reduce.cuh",
             "value.merge(shfl_down(value, offset));", "value.merge(shfl_down(value, offset + 1));",
             "`shfl_down(value, offset)` -> `shfl_down(value, offset + 1)` (warp_reduce)"),
    Mutation("(d) the shared histogram's counter added to without an atomic",
             "csrc/cuda/health.cu",
             "atomicAdd(&window[w], static_cast<uint32_t>(__popc(peers)));",
             "window[w] += static_cast<uint32_t>(__popc(peers));",
             "`atomicAdd(&window[w], n)` -> `window[w] += n` (health_kernel)"),
]


def copy_checkout(scratch: Path) -> None:
    """The checkout's files (tracked, and untracked ones git does not
    ignore), and the compiled extension, into scratch: each one whose
    content differs, with a new mtime, so that a scratch tree kept from an
    earlier run rebuilds what a mutation left behind."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    files = [f.decode() for f in files if f]
    files += [str(p.relative_to(ROOT)) for p in (ROOT / "torchcast").glob("_C*.so")]
    files.append("torchcast/_build_info.py")
    for f in files:
        source, copy = ROOT / f, scratch / f
        if source.is_file() and not (copy.is_file() and copy.read_bytes() == source.read_bytes()):
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, copy)


def run_tests(scratch: Path, seed: int) -> tuple[int, str]:
    """(exit status, summary) of the kernel cases in the scratch tree."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
         "tests/test_cuda_emulated.py", "-k", "test_kernel_matches_cpu_op"],
        cwd=scratch, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(scratch), "TORCHCAST_EMULATED_SEED": str(seed)})
    lines = proc.stdout.strip().splitlines()
    failed = [ln[len("FAILED "):] for ln in lines if ln.startswith("FAILED ")]
    summary = lines[-1] if lines else proc.stderr.strip().splitlines()[-1]
    if failed:
        kernels = sorted({re.sub(r".*\[(\w+?)-.*", r"\1", f) for f in failed})
        first = re.sub(r".*::", "", failed[0])[:160]
        summary += f"; failing kernels: {', '.join(kernels)}; first: {first}"
    return proc.returncode, summary


def line_of(text: str, snippet: str) -> int:
    return text[:text.index(snippet)].count("\n") + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2 ** 32),
                        help="the schedule seed of every run (default: drawn)")
    parser.add_argument("--scratch", type=Path, help="the scratch tree (default: a temporary one, "
                        "removed at the end; one given is kept, with its build)")
    args = parser.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="torchcast-mutations-"))
    try:
        copy_checkout(scratch)
        print(f"scratch tree {scratch}, schedule seed {args.seed}", flush=True)
        status, summary = run_tests(scratch, args.seed)
        print(f"unmutated: {summary}", flush=True)
        if status != 0:
            return 1
        print("\n| mutation | where | change | emulated tests |\n|---|---|---|---|")
        survived = False
        for m in MUTATIONS:
            path = scratch / m.path
            original = path.read_text()
            assert original.count(m.old) == 1, f"{m.path}: the text to mutate is not there once"
            path.write_text(original.replace(m.old, m.new))
            try:
                status, summary = run_tests(scratch, args.seed)
            finally:
                path.write_text(original)
            survived |= status == 0
            print(f"| {m.name} | {m.path}:{line_of(original, m.old)} | {m.change} | "
                  f"{'PASSED: not caught' if status == 0 else summary} |", flush=True)
        return 1 if survived else 0
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
