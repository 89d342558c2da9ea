"""What importing torchcast costs a program that never tracks: nothing
should (the tracker's kernels on aten::_to_copy are registered by the first
track(), not at import; tests/test_idle_import.py checks the dispatch
tables); this measures it.

Times x.half() of 16 elements, on one thread, in processes that import
torch alone and torch with torchcast, alternating (one process each
measurement: an import cannot be undone), median over processes of each
one's best of 7 runs of 20,000 casts.

    PYTHONPATH=. python benchmarks/bench_idle.py [--processes N]
"""
import argparse
import os
import statistics
import subprocess
import sys

CODE = """
import sys, time, torch
if sys.argv[1] == "torchcast":
    import torchcast
torch.set_num_threads(1)
x = torch.randn(16)
for _ in range(2000):
    x.half()
runs = []
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(20000):
        x.half()
    runs.append((time.perf_counter() - t0) / 20000 * 1e9)
print(min(runs))
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=6)
    opts = parser.parse_args()
    times = {"torch": [], "torchcast": []}
    for i in range(opts.processes):
        for which in (("torch", "torchcast") if i % 2 == 0 else ("torchcast", "torch")):
            out = subprocess.run([sys.executable, "-c", CODE, which], capture_output=True,
                                 text=True, check=True, env=os.environ.copy())
            times[which].append(float(out.stdout.split()[-1]))
    load = os.getloadavg()[0]
    print(f"`PYTHONPATH=. python benchmarks/bench_idle.py --processes {opts.processes}`, "
          f"1-minute load average {load:.2f} after ({os.cpu_count()} cores): x.half() of 16 "
          f"elements, one thread: torch alone {statistics.median(times['torch']):.0f} ns, with "
          f"torchcast imported {statistics.median(times['torchcast']):.0f} ns per call.")


if __name__ == "__main__":
    main()
