"""The mutation proof of the emulated grid (docs/cuda.md, "The emulated
grid"): in a scratch copy of the checkout, never in it, apply one at a time
a bug the emulation exists to catch, rebuild the emulated kernels there and
run tests/test_cuda_emulated.py's kernel cases (`pytest -q`'s), or for an
out-of-bounds access the same cases on the AddressSanitizer build
(tests/emulated.py's ASAN_COMMAND, CI's), under each of the seeds: they must
fail for each mutation on every seed (and pass for the unmutated copy first).

    PYTHONPATH=. python tools/emulated_mutations.py [--seed N] [--seeds K] [--only LETTERS]
                                                    [--scratch DIR]

Needs the compiled extension (torchcast/_C*.so, copied to the scratch tree)
and what the emulated tests need (a compiler, ninja). Prints a table of the
mutations and their failures; exits 1 if a mutation passed on a seed. Takes
long: each mutation rebuilds the files that include what it changes (MAX_JOBS
as for any torch extension), and each seed runs the cases of the kernels it
touches (the first seed: all of them)."""
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
    kernels: str  # the ops whose cases use the code, a pytest -k expression
    asan: bool = False  # caught by the AddressSanitizer build

MUTATIONS = [
    Mutation("(a) off-by-one in a tail bound: each chunk's last element is skipped",
             "csrc/cuda/cast.cu", "      if (e < n) {", "      if (e < n - 1) {",
             "`if (e < n)` -> `if (e < n - 1)` (scalar_steps)", "cast_with_stats"),
    Mutation("(b) the barrier between the warps' shared-memory writes and thread 0's reads "
             "removed", "csrc/cuda/block_reduce.cuh",
             "  __syncthreads();\n  if (threadIdx.x == 0) {", "  if (threadIdx.x == 0) {",
             "the first `__syncthreads();` of block_reduce deleted",
             "cast_with_stats or kahan_sum or block_cast"),
    Mutation("(c) a wrong shuffle offset in the warp tree", "csrc/cuda/block_reduce.cuh",
             "value.merge(shfl_down(value, offset));", "value.merge(shfl_down(value, offset + 1));",
             "`shfl_down(value, offset)` -> `shfl_down(value, offset + 1)` (warp_reduce)",
             "cast_with_stats or kahan_sum or block_cast"),
    Mutation("(d) the shared histogram's counter added to without an atomic",
             "csrc/cuda/health.cu",
             "atomicAdd(&window[w], static_cast<uint32_t>(__popc(peers)));",
             "window[w] += static_cast<uint32_t>(__popc(peers));",
             "`atomicAdd(&window[w], n)` -> `window[w] += n` (health_kernel)", "tensor_health"),
    Mutation("(e) a late barrier removed: the next grid-stride turn's warps rewrite the "
             "shared partials before thread 0 has read them", "csrc/cuda/block_reduce.cuh",
             "    value = smem[0];\n  }\n  __syncthreads();\n  return value;",
             "    value = smem[0];\n  }\n  return value;",
             "the second `__syncthreads();` of block_reduce deleted",
             "cast_with_stats or kahan_sum or block_cast"),
    Mutation("(f) the barrier before the shared histogram's flush removed", "csrc/cuda/health.cu",
             "  __syncthreads();\n  for (int i = threadIdx.x; i < Win::kBins; i += kThreads) {",
             "  for (int i = threadIdx.x; i < Win::kBins; i += kThreads) {",
             "the `__syncthreads();` before the flush deleted (health_kernel)", "tensor_health"),
    Mutation("(g) a cross-block race: the largest magnitude's atomicMax on a global as a "
             "read-compare-write", "csrc/cuda/health.cu",
             "      atomicMax(extrema + health::kAmax, ",
             "      [](unsigned long long* a, unsigned long long v) { if (*a < v) *a = v; }"
             "(extrema + health::kAmax, ",
             "`atomicMax(a, v)` -> `if (*a < v) *a = v` (health_kernel)", "tensor_health"),
    Mutation("(h) an out-of-bounds read: the last tile loads past n, the value masked off",
             "csrc/cuda/health.cu", "        bits[v] = valid[v] ? x[at] : B(0);",
             "        bits[v] = x[kReading == Reading::kStrided ? at : i];\n"
             "        if (!valid[v]) bits[v] = B(0);",
             "`valid ? x[at] : 0` -> `x[i]`, then masked (health_kernel, flat reading)",
             "tensor_health", asan=True),
    Mutation("(i) the 16-byte path taken without its alignment check", "csrc/cuda/health.cu",
             "    } else if (reinterpret_cast<uintptr_t>(xp) % 16 == 0) {",
             "    } else if (true) {",
             "`xp % 16 == 0` -> `true` (tensor_health's driver)", "tensor_health"),
    Mutation("(j) the 16-byte path taken without its alignment check", "csrc/cuda/cast.cu",
             "        const bool aligned = reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&",
             "        const bool aligned = true || reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&",
             "`aligned = x % 16 == 0 && ...` -> `aligned = true` (cast_with_stats' driver)",
             "cast_with_stats"),
    Mutation("(k) a grid-stride loop that does not wrap: finish_kernel strides by the block",
             "csrc/cuda/reduce.cu", "  for (int64_t o = blockIdx.x; o < k; o += gridDim.x) {",
             "  for (int64_t o = blockIdx.x; o < k; o += blockDim.x) {",
             "`o += gridDim.x` -> `o += blockDim.x` (finish_kernel)", "kahan_sum"),
    Mutation("(l) an element index as int", "csrc/cuda/adam.cu",
             "for (int64_t j = begin + threadIdx.x; j < end; j += kAdamThreads)",
             "for (int j = begin + threadIdx.x; j < end; j += kAdamThreads)",
             "`int64_t j` -> `int j` (adam_kernel): the build fails", "adam_step_"),
    Mutation("(m) the 16-byte path taken for a strided axis", "csrc/cuda/reduce.cu",
             "plan.reduced.size() == 1 && plan.reduced[0].xstride == 1 &&",
             "plan.reduced.size() == 1 &&",
             "`xstride == 1 &&` deleted from the vector path's condition (kahan_sum's driver)",
             "kahan_sum"),
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


def run_tests(scratch: Path, seed: int, kernels: str = "", asan: bool = False) -> tuple[int, str]:
    """(exit status, summary) of the kernel cases (of the kernels named, a
    pytest -k expression; all if none) in the scratch tree, on the
    AddressSanitizer build if asan."""
    select = "test_kernel_matches_cpu_op and not sweep" + (f" and ({kernels})" if kernels else "")
    env = {**os.environ, "PYTHONPATH": str(scratch), "TORCHCAST_EMULATED_SEED": str(seed)}
    if asan:
        libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], check=True,
                                 capture_output=True, text=True).stdout.strip()
        env.update(TORCHCAST_EMULATED_ASAN="1", LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *(["-v", "--capture=sys"] if asan else ["-q"]), "-rfE",
         "-p", "no:cacheprovider", "tests/test_cuda_emulated.py", "-k", select],
        cwd=scratch, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    failed = [re.sub(r"^(FAILED|ERROR) ", "", ln) for ln in lines
              if ln.startswith(("FAILED ", "ERROR "))]
    summary = lines[-1] if lines else "no summary"
    if asan and "ERROR: AddressSanitizer" in proc.stderr:
        report = next(ln for ln in proc.stderr.splitlines() if "ERROR: AddressSanitizer" in ln)
        case = re.findall(r"::(test_kernel_matches_cpu_op\[\S+\])", proc.stdout)
        summary = (f"the process aborted: {re.sub(r'^=+[0-9]+=+ERROR: ', '', report)[:60]} in "
                   f"{case[-1] if case else '?'}")
    elif "error: conversion" in proc.stdout + proc.stderr:
        summary += "; the build failed: `conversion ... may change value [-Werror=conversion]`"
    elif failed:
        kernels_failed = sorted({re.sub(r".*\[(\w+?)-.*", r"\1", f) for f in failed})
        first = re.sub(r".*::", "", failed[0])[:160]
        summary += f"; failing kernels: {', '.join(kernels_failed)}; first: {first}"
    return proc.returncode, summary


def line_of(text: str, snippet: str) -> int:
    return text[:text.index(snippet)].count("\n") + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2 ** 32),
                        help="the schedule seed of every run (default: drawn)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="seeds per mutation: --seed, --seed + 1, ... (default 5)")
    parser.add_argument("--only", help="the letters of the mutations to run, e.g. 'ek' "
                        "(default: all)")
    parser.add_argument("--scratch", type=Path, help="the scratch tree (default: a temporary one, "
                        "removed at the end; one given is kept, with its build)")
    args = parser.parse_args()
    seeds = [args.seed + i for i in range(args.seeds)]
    mutations = [m for m in MUTATIONS if args.only is None or m.name[1] in args.only]
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="torchcast-mutations-"))
    try:
        copy_checkout(scratch)
        print(f"scratch tree {scratch}, schedule seeds {seeds}", flush=True)
        for asan in sorted({False} | {m.asan for m in mutations}):
            status, summary = run_tests(scratch, seeds[0], asan=asan)
            print(f"unmutated{' (AddressSanitizer)' if asan else ''}: {summary}", flush=True)
            if status != 0:
                return 1
        print("\n| mutation | where | change | emulated tests, first seed | seeds caught |\n"
              "|---|---|---|---|---|")
        survived = False
        for m in mutations:
            path = scratch / m.path
            original = path.read_text()
            assert original.count(m.old) == 1, f"{m.path}: the text to mutate is not there once"
            path.write_text(original.replace(m.old, m.new))
            try:
                results = [run_tests(scratch, seed, "" if k == 0 else m.kernels, m.asan)
                           for k, seed in enumerate(seeds)]
            finally:
                path.write_text(original)
            caught = sum(status != 0 for status, _ in results)
            survived |= caught < len(seeds)
            build = " (AddressSanitizer build)" if m.asan else ""
            print(f"| {m.name} | {m.path}:{line_of(original, m.old)} | {m.change} | "
                  f"{results[0][1] if results[0][0] else 'PASSED: not caught'}{build} | "
                  f"{caught} of {len(seeds)} |", flush=True)
        return 1 if survived else 0
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
