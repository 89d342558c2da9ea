"""The CUDA kernels of csrc/cuda/ run on the CPU, on the emulated grid
(csrc/emulated/grid.h, docs/cuda.md "The emulated grid"): every kernel on
the cases of tests/kernel_cases.py (which tests/test_cuda.py runs on a GPU),
checked against the CPU op.

Each case runs at the multiprocessor count it names, so that its grid-stride
loops wrap where it says so (checked from the launches), under SCHEDULES:
warps running far ahead by priority, and uniform picks, with several blocks
resident at once; each seeded for the session
(TORCHCAST_EMULATED_SEED=N replays one: a failure names it). The slow sweep
runs every case under more seeds, each block's policy drawn (threads by
priority among them). Skipped, with
the reason, where the emulated kernels cannot be built (a torchcast without
its compiled extension, tests away from the sources).

Under the AddressSanitizer build (emulated.ASAN_COMMAND) the cases run once
each, and the checks of the scheduler, which needs the other build's
hooks, are skipped."""
import os
import random
import zlib

import pytest

import emulated
from kernel_cases import KERNELS, Device

pytestmark = pytest.mark.source_tree

SEED = int(os.environ.get("TORCHCAST_EMULATED_SEED", random.SystemRandom().randrange(2 ** 32)))
CASES = [(kernel, case) for kernel, (cases, _) in KERNELS.items() for case in cases]
ASAN = emulated.asan_requested()
# (policy, resident blocks) of each run of a case.
SCHEDULES = [("warps", 2), ("uniform", 4)][:1 if ASAN else None]
SWEEP = 6  # more seeds of the slow sweep, policies drawn per block
# Under ASan: no scheduling hooks, and the grid's errors cannot be thrown (a
# preloaded libasan's __cxa_throw interceptor is unset: "CHECK failed:
# asan_interceptors.cpp:320"; a kernel that fails there aborts the run).
needs_hooks = pytest.mark.skipif(ASAN, reason="the AddressSanitizer build has no scheduling "
                                 "hooks and cannot throw the grid's errors")


@pytest.fixture(scope="module")
def grid():
    try:
        return emulated.load()
    except emulated.Unavailable as e:
        pytest.skip(f"the emulated CUDA kernels cannot be built here: {e}")


def run_case(grid, kernel, case, seed, policy, resident):
    """Runs one case on one schedule; a failure names the schedule."""
    grid.configure(case.multiprocessors, zlib.crc32(f"{seed}-{kernel}-{case.id}".encode()),
                   policy, resident)
    grid.launches()  # forgets earlier ones
    replay = f"schedule: TORCHCAST_EMULATED_SEED={seed}, policy {policy}, {resident} resident"
    try:
        KERNELS[kernel][1](case, Device("cpu", grid.ops))
    except (AssertionError, RuntimeError) as e:  # RuntimeError: the grid's (a deadlock)
        raise type(e)(f"{e}\n({replay})") from None
    launches = grid.launches()
    assert launches, "no kernel was launched"
    if case.units:
        blocks = launches[0][0]
        assert blocks * case.per_block < case.units, (
            f"{blocks} blocks take all {case.units} units at once: the loop does not wrap")
    if case.finish_units:
        blocks = launches[-1][0]
        assert blocks < case.finish_units, (
            f"the finishing kernel's {blocks} blocks take all {case.finish_units} outputs at "
            "once: its loop does not wrap")


@pytest.mark.parametrize("schedule", SCHEDULES, ids=[f"{p}{r}" for p, r in SCHEDULES])
@pytest.mark.parametrize("kernel,case", CASES, ids=[f"{k}-{c.id}" for k, c in CASES])
def test_kernel_matches_cpu_op(grid, kernel, case, schedule):
    run_case(grid, kernel, case, SEED, *schedule)


@pytest.mark.slow
@pytest.mark.parametrize("sweep", range(SWEEP))
@pytest.mark.parametrize("kernel,case", CASES, ids=[f"{k}-{c.id}" for k, c in CASES])
def test_kernel_matches_cpu_op_sweep(grid, kernel, case, sweep):
    run_case(grid, kernel, case, SEED + 1 + sweep, "mixed", 1 + sweep % 4)


# ---------------------------------------------------------------------------
# The grid catches what it exists for (csrc/emulated/selftest.cpp)

@needs_hooks
def test_a_shared_counter_added_to_without_atomics_loses_counts(grid):
    n = 256 * 40
    for seed in range(3):
        grid.configure(1, SEED + seed, "uniform")
        assert grid.ops.selftest_count(256, n, True) == n
        assert grid.ops.selftest_count(256, n, False) < n


@needs_hooks
def test_a_missing_barrier_gives_a_sum_that_is_wrong_and_varies_with_the_seed(grid):
    wrong = set()
    for seed in range(6):
        grid.configure(1, SEED + seed, "uniform")
        salt = 1000 * seed
        want = sum(range(salt, salt + 256))
        assert grid.ops.selftest_block_sum(256, salt, True) == want
        got = grid.ops.selftest_block_sum(256, salt + 1, False)
        if got != want + 256:
            wrong.add(got - 256 - want)
    assert len(wrong) >= 2, f"without its barrier the sum was wrong by {wrong}"


@needs_hooks
def test_a_barrier_in_divergent_code_is_a_deadlock(grid):
    with pytest.raises(RuntimeError, match=r"deadlock: 1 of 64 threads wait at __syncthreads, "
                                           r"63 have exited"):
        grid.ops.selftest_divergent_barrier()


@needs_hooks
def test_a_shuffle_whose_mask_leaves_its_caller_out_is_refused(grid):
    with pytest.raises(RuntimeError, match=r"__shfl_down_sync called by lane (1[6-9]|2\d|3[01]) "
                                           r"with a mask that leaves it out"):
        grid.ops.selftest_outside_mask()


@needs_hooks
def test_blocks_resident_at_once_lose_counts_of_a_global_counter_without_atomics(grid):
    blocks, n = 8, 2000
    for seed in range(5):
        grid.configure(1, SEED + seed, "uniform", 1)
        assert grid.ops.selftest_global_count(blocks, n, False) == blocks * n  # one at a time
        grid.configure(1, SEED + seed, "uniform", 4)
        assert grid.ops.selftest_global_count(blocks, n, True) == blocks * n
        assert grid.ops.selftest_global_count(blocks, n, False) < blocks * n


@needs_hooks
def test_a_warp_running_ahead_rewrites_shared_memory_before_a_missing_late_barrier(grid):
    threads, turns = 256, 6
    for seed in range(5):
        grid.configure(1, SEED + seed, "warps")
        salt = 1000 * seed
        want = sum(range(salt, salt + threads * turns)) % 2 ** 32
        assert grid.ops.selftest_late_barrier(threads, turns, salt, True) == want
        got = grid.ops.selftest_late_barrier(threads, turns, salt, False)
        assert got != want, f"seed {SEED + seed}: the late barrier's race went unseen"


def warp_intrinsics_reference(x, mask, width):
    """grid.h's __shfl_sync, __ballot_sync and a __syncwarp-ordered
    exchange, lane by lane, as selftest.cpp's warp_intrinsics_kernel asks."""
    lanes = [lane for lane in range(32) if mask >> lane & 1]
    ballot = sum(1 << lane for lane in lanes if x[lane] % 2)
    out = [0] * 96
    for lane in lanes:
        src = lane // width * width + (lane * 7 + 3) % 32 % width
        nxt = next(j % 32 for j in range(lane + 1, lane + 33) if mask >> (j % 32) & 1)
        out[3 * lane:3 * lane + 3] = [x[src] if mask >> src & 1 else None, ballot, x[nxt]]
    return out


@needs_hooks
@pytest.mark.parametrize("mask,width", [(0xFFFFFFFF, 32), (0xFFFFFFFF, 8), (0x0000FFFF, 16),
                                        (0xF0F0F0F0, 4), (0x80000001, 32)])
def test_warp_intrinsics_honour_their_mask(grid, mask, width):
    x = [random.Random(mask + width).randrange(2 ** 32) for _ in range(32)]
    for policy in ("uniform", "threads"):
        grid.configure(1, SEED, policy)
        got = grid.ops.selftest_warp_intrinsics(x, mask, width)
        want = warp_intrinsics_reference(x, mask, width)
        # A source lane outside the mask reads garbage: not compared.
        assert [g if w is not None else None for g, w in zip(got, want)] == want


@needs_hooks
def test_a_misaligned_vector_load_is_reported_naming_the_kernel(grid):
    grid.ops.selftest_vector_load(16)
    with pytest.raises(RuntimeError, match=r"kernel .*vector_load_kernel.*: block \(0, 0, 0\).*"
                                           r"a 16-byte load at 0x[0-9a-f]+, which is not "
                                           r"16-byte aligned"):
        grid.ops.selftest_vector_load(8)
