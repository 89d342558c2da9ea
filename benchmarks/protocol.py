"""The quiet-machine rule of benchmarks/README.md, in code: every benchmark
records the load average before and after it, the copy bandwidth it
measured, and writes its results file only when the machine was quiet.

    run = protocol.Run(args.force, device)     # before measuring anything
    run.copy_bandwidth(gbs, threads, nbytes)   # each copy bandwidth measured
    run.write(path, table)                     # refuses on a loaded machine
"""
import json
import os
import platform
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BEST = os.path.join(HERE, "results", "copy_bandwidth.json")
MAX_LOAD_PER_CORE = 1.0
MIN_BANDWIDTH_FRACTION = 0.5


def add_arguments(parser):
    parser.add_argument("--force", action="store_true",
                        help="write the results even when the machine was not quiet "
                             "(the table then says so)")


def load_average():
    return os.getloadavg()[0]


def copy_bandwidth(rounds, n=1 << 25):
    """The CPU's streaming bandwidth in GB/s (bytes read + written): the
    median of rounds preallocated float32 copies of n elements."""
    import torch
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n * src.element_size() / statistics.median(times) / 1e9


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Run:
    """One benchmark run: its load average, its copy bandwidths, its verdict."""

    def __init__(self, force=False, device="cpu"):
        self.force = force
        self.device = str(device)
        self.load_before = load_average()
        self.cores = os.cpu_count() or 1
        self.bandwidths = {}  # (threads, bytes copied) -> lowest GB/s measured in this run

    def machine(self, threads, nbytes):
        """The key of a copy bandwidth: machine, threads and size (a copy's
        bandwidth depends on its size even far past the caches)."""
        if self.device.startswith("cuda"):
            import torch
            return f"{torch.cuda.get_device_name()}, {nbytes} bytes"
        return f"{cpu_name()}, {self.cores} cores, {threads} threads, {nbytes} bytes"

    def copy_bandwidth(self, gbs, threads, nbytes):
        """Records a copy bandwidth (GB/s, read + write) of nbytes measured in
        this run."""
        key = (threads, nbytes)
        self.bandwidths[key] = min(gbs, self.bandwidths.get(key, gbs))

    def _best(self):
        try:
            with open(BEST) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def problems(self):
        """Why this run's figures cannot be trusted (empty when it was quiet)."""
        found = []
        if self.load_before > MAX_LOAD_PER_CORE * self.cores:
            found.append(f"the 1-minute load average was {self.load_before:.2f} before the run, "
                         f"over {MAX_LOAD_PER_CORE:g} per core ({self.cores} cores)")
        best = self._best()
        for (threads, nbytes), gbs in sorted(self.bandwidths.items()):
            seen = best.get(self.machine(threads, nbytes))
            if seen and gbs < MIN_BANDWIDTH_FRACTION * seen:
                found.append(f"the copy bandwidth was {gbs:.1f} GB/s with {threads} threads, under "
                             f"half of the best this machine has shown ({seen:.1f} GB/s)")
        return found

    def summary(self):
        """One line for the table: load before and after, copy bandwidth."""
        bandwidth = "; ".join(f"{gbs:.1f} GB/s with {t} threads, {nbytes / 2**20:g} MiB copied"
                              for (t, nbytes), gbs in sorted(self.bandwidths.items()))
        return (f"1-minute load average {self.load_before:.2f} before, {load_average():.2f} "
                f"after ({self.cores} cores); copy bandwidth in this run: {bandwidth or 'n/a'}.")

    def write(self, path, text):
        """Writes text (a results table) to path if the machine was quiet or
        --force was given; otherwise prints why and writes nothing. Returns
        whether it wrote."""
        problems = self.problems()
        if problems and not self.force:
            print("\n" + "!" * 78)
            print("NOT WRITTEN: this machine was not quiet, so the table above is wrong, not "
                  "noisy:")
            for p in problems:
                print(f"  - {p}")
            print(f"Re-run on a quiet machine (benchmarks/README.md), or pass --force to write "
                  f"{os.path.relpath(path)} anyway.")
            print("!" * 78)
            return False
        if problems:
            text = ("**Forced (--force) on a machine that was not quiet: "
                    + "; ".join(problems) + ".**\n\n" + text)
        else:
            self._remember_bandwidth()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"written to {os.path.relpath(path)}")
        return True

    def _remember_bandwidth(self):
        best = self._best()
        changed = False
        for (threads, nbytes), gbs in self.bandwidths.items():
            key = self.machine(threads, nbytes)
            if gbs > best.get(key, 0.0):
                best[key] = round(gbs, 2)
                changed = True
        if changed:
            os.makedirs(os.path.dirname(BEST), exist_ok=True)
            with open(BEST, "w") as f:
                json.dump(best, f, indent=1, sort_keys=True)
                f.write("\n")
