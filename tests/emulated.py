"""The CUDA kernels of csrc/cuda/, built for the emulated grid and loaded as
torch.ops.torchcast_emulated (docs/cuda.md, "The emulated grid"): the
torchcast ops' schemas, with kernels for CPU tensors that run the CUDA host
drivers, launches and kernels on the CPU.

Two libraries, built with torch.utils.cpp_extension.load (ninja, so
incrementally) under build/emulated/ of the checkout, once per torch version:
  - the grid's runtime (csrc/emulated/grid.cpp);
  - each csrc/cuda/*.cu compiled by the host compiler with TORCHCAST_EMULATED
    and -fsanitize=thread, whose hooks before each load and store are the
    runtime's (it switches threads there, and checks the alignment the
    compiler assumed), plus csrc/emulated/settings.cpp and selftest.cpp
    (kernels with the bugs the grid must catch); linked to the runtime and
    to torchcast._C for the host drivers the CUDA files share with the CPU
    kernels (cast_common.cpp, ...).
With TORCHCAST_EMULATED_ASAN=1 the kernels are built a second way, with
AddressSanitizer instead (it cannot share a build with the hooks), under
kernels-asan/: an out-of-bounds load or store is reported where it happens.
The process must have the ASan runtime loaded first (ASAN_COMMAND).
A separate extension rather than a module setup.py builds: no install pays
for it (CI builds torchcast four times), and only a source checkout, where
the tests can run it, has the sources."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from torchcast import _ops
from torchcast._schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "csrc"
BUILD = ROOT / "build" / "emulated" / torch.__version__.replace("+", "-")

# The CPU build's numerics (setup.py): no contraction, no fast math.
NUMERICS = ["-O2", "-g0", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]
KERNEL_FLAGS = NUMERICS + [
    "-DTORCHCAST_EMULATED", "-Wno-unknown-pragmas",
    # The index arithmetic stays 64-bit: an integer conversion that may change
    # a value (an int64_t index into an int) fails the build (float and sign
    # conversions aside; the kernels have none of the first kind, today).
    "-Werror=conversion", "-Wno-float-conversion", "-Wno-sign-conversion"]
# Instrumentation only: the hooks are the runtime's, not a race detector's.
HOOKS = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
ASAN = ["-fsanitize=address", "-fno-omit-frame-pointer"]
# Every emulated case under AddressSanitizer (the CI stage's command).
# -v --capture=sys: the case's name is printed before it runs, and ASan's
# report, which aborts the process, reaches stderr instead of pytest's capture.
ASAN_COMMAND = ("TORCHCAST_EMULATED_ASAN=1 LD_PRELOAD=$(g++ -print-file-name=libasan.so) "
                "ASAN_OPTIONS=detect_leaks=0 python -m pytest -v --capture=sys "
                "-p no:cacheprovider tests/test_cuda_emulated.py")


def asan_requested() -> bool:
    """Whether this process runs the AddressSanitizer build
    (TORCHCAST_EMULATED_ASAN=1)."""
    return os.environ.get("TORCHCAST_EMULATED_ASAN") == "1"


def _asan_loaded() -> bool:
    return "libasan" in Path("/proc/self/maps").read_text()


# grid.h's Policy, in order.
POLICIES = ("mixed", "uniform", "warps", "threads")


class Unavailable(Exception):
    """Why the emulated kernels cannot be built in this environment."""


class Emulated:
    """The loaded emulated kernels.

    Attributes:
        ops: torch.ops.torchcast_emulated, the torchcast ops' CUDA kernels on
            CPU tensors.
    """

    def __init__(self):
        self.ops = torch.ops.torchcast_emulated

    def configure(self, multiprocessors: int, seed: int, policy: str = "mixed",
                  resident: int = 1) -> None:
        """Sets what the host drivers read as the device's multiprocessor
        count (their grid sizes follow it) and the schedule.

        Args:
            multiprocessors: at least 1.
            seed: the seed of the block order and the thread schedule.
            policy: how a block's scheduler picks the next thread, one of
                POLICIES (grid.h's Policy): uniformly, by priorities of
                warps or of threads with change points, or one of these
                drawn per block ("mixed").
            resident: blocks interleaved at once, 1 to 8.
        """
        self.ops.configure(multiprocessors, seed, POLICIES.index(policy), resident)

    def launches(self) -> list[tuple[int, int]]:
        """(grid size, block size) of each launch since the last call."""
        flat = self.ops.launches()
        return list(zip(flat[0::2], flat[1::2]))


_loaded: Emulated | None = None
_schemas = None  # the torch.library.Library holding torchcast_emulated's schemas


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def load() -> Emulated:
    """The emulated kernels, built first where needed.

    Raises:
        Unavailable: where they cannot be built (no compiled torchcast, no
            sources beside the tests, no ninja).
    """
    global _loaded, _schemas
    if _loaded is not None:
        return _loaded
    if not _ops.WITH_EXTENSION:
        raise Unavailable("torchcast was installed without its compiled extension "
                          "(TORCHCAST_NO_EXTENSION=1), whose host drivers the emulated "
                          "kernels link to")
    if not (SOURCES / "cuda").is_dir():
        raise Unavailable(f"no CUDA sources in {SOURCES}: these tests run from a copy, away "
                          "from a source checkout")
    c_library = Path(_ops._C.__file__).resolve()
    if c_library.parent.parent != ROOT:
        raise Unavailable(f"torchcast._C is {c_library}, not the build of the checkout at {ROOT}")
    from torch.utils.cpp_extension import load as build_and_load
    from torch.utils.cpp_extension import verify_ninja_availability
    try:
        verify_ninja_availability()
    except RuntimeError as e:
        raise Unavailable(f"torch.utils.cpp_extension needs ninja: {e}") from None

    asan = asan_requested()
    if asan and not _asan_loaded():
        raise RuntimeError("TORCHCAST_EMULATED_ASAN=1 needs the ASan runtime loaded first: "
                           f"run as {ASAN_COMMAND}")
    kernels = BUILD / ("kernels-asan" if asan else "kernels")
    (BUILD / "grid").mkdir(parents=True, exist_ok=True)
    kernels.mkdir(parents=True, exist_ok=True)
    grid_library = build_and_load(
        "torchcast_emulated_grid", [str(SOURCES / "emulated" / "grid.cpp")],
        extra_cflags=NUMERICS, build_directory=str(BUILD / "grid"), is_python_module=False)
    # One file per CUDA file: their anonymous namespaces share names.
    sources = []
    for cu in sorted((SOURCES / "cuda").glob("*.cu")):
        wrapper = kernels / f"{cu.stem}.cpp"
        _write_if_changed(wrapper, f'#include "{cu}"\n')
        sources.append(str(wrapper))
    sources += [str(SOURCES / "emulated" / f) for f in ("settings.cpp", "selftest.cpp")]
    _schemas = torch.library.Library("torchcast_emulated", "FRAGMENT")
    for schema in SCHEMAS.values():
        _schemas.define(schema)
    build_and_load(
        "torchcast_emulated_asan" if asan else "torchcast_emulated", sources,
        extra_cflags=KERNEL_FLAGS + (ASAN if asan else HOOKS),
        extra_ldflags=[str(grid_library), str(c_library)],
        build_directory=str(kernels), is_python_module=False)
    _loaded = Emulated()
    return _loaded
