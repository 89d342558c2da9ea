import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings

from torchcast import _ops
from torchcast.tracker import nonfinite

settings.register_profile("torchcast", deadline=None, print_blob=True)
settings.load_profile("torchcast")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda_cases: cases written for the CUDA kernels (sizes past a block, a chunk, "
        "a warp run; layouts; the GPU's autocast, compile and backward); the device fixture "
        "runs them on CUDA only")
    config.addinivalue_line(
        "markers", "source_tree: reads csrc/ of the checkout these tests came from")
    config.addinivalue_line(
        "markers", "slow: a case of a slow family (sweeps, fuzzing, fresh processes, ranks); "
        "`pytest -q` deselects it and runs the family's fixed slice, TORCHCAST_TESTS=slow "
        "runs only these (.ci/run's slow stage), TORCHCAST_TESTS=all runs everything")
    config.addinivalue_line(
        "markers", "sweep: a property or sweep run in every selection, with a small budget in "
        "`pytest -q` and its whole budget under TORCHCAST_TESTS=slow or all")


_DESELECTED = {}
# Which cases run: "fast" (the default, `pytest -q`), "slow" (only the cases
# marked slow: .ci/run's slow stage) or "all".
SELECTION = os.environ.get("TORCHCAST_TESTS", "fast")
if SELECTION not in ("fast", "slow", "all"):
    raise ValueError(f"TORCHCAST_TESTS={SELECTION!r}: expected 'fast', 'slow' or 'all'")
# csrc/ beside tests/: absent where a copy of the tests runs against an installed wheel.
_HAS_SOURCES = os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "csrc"))


def _deselect_reason(item):
    """Why a collected case is not run on this machine, or None: cases that
    can only skip here are deselected (and counted in one summary line)
    rather than listed as hundreds of skips."""
    cuda = torch.cuda.is_available()
    params = getattr(item, "callspec", None)
    device = params.params.get("device") if params is not None else None
    if device == "cuda" and not cuda:
        return "CUDA cases: no CUDA device on this machine"
    if device == "cpu" and item.get_closest_marker("cuda_cases"):
        return "cases written for the CUDA kernels, on the CPU (it runs its own cases)"
    if item.module.__name__ == "test_cuda" and not cuda:
        return "tests/test_cuda.py: no CUDA device on this machine"
    if item.get_closest_marker("source_tree") and not _HAS_SOURCES:
        return "cases that read csrc/, absent beside this copy of the tests (run from the checkout)"
    if item.get_closest_marker("sweep") is not None:
        return None
    slow = item.get_closest_marker("slow") is not None
    if slow and SELECTION == "fast":
        return "slow cases (their fixed slice ran): TORCHCAST_TESTS=slow runs them (.ci/run)"
    if not slow and SELECTION == "slow":
        return "fast cases: TORCHCAST_TESTS=slow runs only the slow ones"
    return None


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one worker per core, at most 4. Each worker
    imports torch and builds nothing of its own (the emulated kernels are
    built once, under a file lock), so more would only add memory."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    for item in items:
        reason = _deselect_reason(item)
        if reason is None:
            keep.append(item)
        else:
            dropped.append(item)
            _DESELECTED[reason] = _DESELECTED.get(reason, 0) + 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


_FROM_WORKERS = {}  # under xdist: what the workers deselected (each collects the whole suite)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the counts to the controller
        workeroutput["torchcast_deselected"] = dict(_DESELECTED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    counts = getattr(node, "workeroutput", {}).get("torchcast_deselected")
    if counts and not _FROM_WORKERS:
        _FROM_WORKERS.update(counts)


def pytest_terminal_summary(terminalreporter):
    if _FROM_WORKERS and not _DESELECTED:
        # The controller collected nothing itself: count the workers'
        # deselections on its closing line, as a serial run does.
        terminalreporter.stats.setdefault("deselected", []).extend(
            SimpleNamespace() for _ in range(sum(_FROM_WORKERS.values())))
    for reason, n in sorted((_DESELECTED or _FROM_WORKERS).items()):
        terminalreporter.write_line(f"torchcast: {n} deselected: {reason}")


@pytest.fixture(params=["cpp", "mode"])
def nonfinite_engine(request, monkeypatch):
    """Which check serves track(nonfinite=...) but "raise_at_op": the C++ per-op
    callback (CPU programs, with the extension) or the dispatch mode (what
    "raise" and CUDA programs take), forced here on the CPU."""
    if request.param == "cpp" and not _ops.WITH_EXTENSION:
        pytest.skip("the C++ check is part of the compiled extension")
    if request.param == "mode":
        monkeypatch.setattr(nonfinite, "checked_in_cpp", lambda action: False)
    return request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    """The device a test runs its op on. The references stay on the CPU; off
    the CPU the op's results must also equal the CPU op's, bit for bit.

    Cases marked cuda_cases are not run on the CPU (pytest_collection_modifyitems
    deselects them), which keeps its own cases and its time; they pass there
    too, should they ever be wanted."""
    return request.param
