"""The CUDA kernels of csrc/cuda/ run on the CPU, on the emulated grid
(csrc/emulated/grid.h, docs/cuda.md "The emulated grid"): every kernel on
the cases of tests/kernel_cases.py (which tests/test_cuda.py runs on a GPU),
checked against the CPU op.

Each case runs at the multiprocessor count it names, so that its grid-stride
loop wraps where it says so (checked from the launches), on a schedule
seeded for the session (TORCHCAST_EMULATED_SEED=N replays one: a failure
names it). Skipped, with the reason, where the emulated kernels cannot be
built (a torchcast without its compiled extension, tests away from the
sources)."""
import os
import random
import zlib

import pytest

import emulated
from kernel_cases import KERNELS, Device

pytestmark = pytest.mark.source_tree

SEED = int(os.environ.get("TORCHCAST_EMULATED_SEED", random.SystemRandom().randrange(2 ** 32)))
CASES = [(kernel, case) for kernel, (cases, _) in KERNELS.items() for case in cases]


@pytest.fixture(scope="module")
def grid():
    try:
        return emulated.load()
    except emulated.Unavailable as e:
        pytest.skip(f"the emulated CUDA kernels cannot be built here: {e}")


@pytest.mark.parametrize("kernel,case", CASES, ids=[f"{k}-{c.id}" for k, c in CASES])
def test_kernel_matches_cpu_op(grid, kernel, case):
    grid.configure(case.multiprocessors, zlib.crc32(f"{SEED}-{kernel}-{case.id}".encode()))
    grid.launches()  # forgets earlier ones
    try:
        KERNELS[kernel][1](case, Device("cpu", grid.ops))
    except (AssertionError, RuntimeError) as e:  # RuntimeError: the grid's (a deadlock)
        raise type(e)(f"{e}\n(schedule: TORCHCAST_EMULATED_SEED={SEED})") from None
    launches = grid.launches()
    assert launches, "no kernel was launched"
    if case.units:
        blocks = launches[0][0]
        assert blocks * case.per_block < case.units, (
            f"{blocks} blocks take all {case.units} units at once: the loop does not wrap")


# ---------------------------------------------------------------------------
# The grid catches what it exists for (csrc/emulated/selftest.cpp)

def test_a_shared_counter_added_to_without_atomics_loses_counts(grid):
    n = 256 * 40
    for seed in range(3):
        grid.configure(1, SEED + seed)
        assert grid.ops.selftest_count(256, n, True) == n
        assert grid.ops.selftest_count(256, n, False) < n


def test_a_missing_barrier_gives_a_sum_that_is_wrong_and_varies_with_the_seed(grid):
    wrong = set()
    for seed in range(6):
        grid.configure(1, SEED + seed)
        salt = 1000 * seed
        want = sum(range(salt, salt + 256))
        assert grid.ops.selftest_block_sum(256, salt, True) == want
        got = grid.ops.selftest_block_sum(256, salt + 1, False)
        if got != want + 256:
            wrong.add(got - 256 - want)
    assert len(wrong) >= 2, f"without its barrier the sum was wrong by {wrong}"


def test_a_barrier_in_divergent_code_is_a_deadlock(grid):
    with pytest.raises(RuntimeError, match=r"deadlock: 1 of 64 threads wait at __syncthreads, "
                                           r"63 have exited"):
        grid.ops.selftest_divergent_barrier()


def test_a_shuffle_whose_mask_leaves_its_caller_out_is_refused(grid):
    with pytest.raises(RuntimeError, match=r"__shfl_down_sync called by lane (1[6-9]|2\d|3[01]) "
                                           r"with a mask that leaves it out"):
        grid.ops.selftest_outside_mask()
