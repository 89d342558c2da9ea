"""DataLoader workers started with "spawn" or "forkserver": tracked too.

A forked worker inherits the tracks (threads.py). A spawned one starts a new
interpreter that knows nothing of them. While a track that follows workers
is active, the worker loop a DataLoader hands to its processes is
``TrackedWorkerLoop``: in a forked worker it is the loop itself; when a
worker is spawned, multiprocessing pickles it in the tracking process (the
moment the spools are given a directory), and in the new process it runs
the loop inside a track of its own with the same features, which leaves
its records, labelled "[worker N]", in each track's spool for the tracking
process to merge when its track exits (as a forked worker's).
"""
import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.utils.data._utils.worker as _worker_module

from .threads import WorkerSpool, close_spool, open_spool

_lock = threading.Lock()
# (spool, features, track class) per active track that follows workers.
_followed: List[Tuple[WorkerSpool, Dict[str, Any], Callable]] = []
_original = _worker_module._worker_loop


class TrackedWorkerLoop:
    """The DataLoader worker loop while tracks follow workers (see the module
    docstring); a picklable stand-in for torch's ``_worker_loop``.

    Args:
        spools: (spool directory, track features) per active track, filled
            when it is pickled for a spawned worker.
        track: the track class to run the loop in (torchcast.track).
    """

    def __init__(self, spools: Tuple[Tuple[str, Dict[str, Any]], ...] = (),
                 track: Callable = None):
        self.spools, self.track = spools, track

    def __reduce__(self):
        # Pickled for a spawned worker, in the tracking process.
        with _lock:
            followed = list(_followed)
        for spool, _, _ in followed:
            spool.make_dir()
        spools = tuple((spool.path, features) for spool, features, _ in followed)
        return (TrackedWorkerLoop, (spools, followed[0][2] if followed else None))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.spools:  # torch's loop, as a forked worker runs it
            return _original(*args, **kwargs)
        return _run_tracked(self.track, self.spools, args, kwargs)


def _run_tracked(track: Callable, spools, args, kwargs) -> Any:
    """In a spawned worker: the loop inside a track with every feature the
    tracks asked for, its records left in each spool."""
    bound = inspect.signature(_original).bind(*args, **kwargs)
    worker_id = bound.arguments.get("worker_id")
    features = {"all_casts": any(f["all_casts"] for _, f in spools),
                "nonfinite": next((f["nonfinite"] for _, f in spools if f["nonfinite"]), None)}
    tracked = track(**features)
    report = tracked.__enter__()
    left = []
    for path, _ in spools:
        spool = WorkerSpool(report)
        spool.path, spool.in_worker, spool.worker = path, True, worker_id
        left.append(spool)
    watch = tracked.nonfinite_watch
    if watch is not None:
        watch.forked(lambda: worker_id, lambda: [s.leave() for s in left])
    try:
        return _original(*args, **kwargs)
    finally:
        try:
            tracked.__exit__(None, None, None)
        finally:
            for spool in left:
                spool.leave()


def follow_workers(spool: WorkerSpool, features: Dict[str, Any], track: Callable) -> None:
    """From now until ``unfollow_workers(spool)``, DataLoaders hand their
    workers ``TrackedWorkerLoop``.

    Args:
        spool: where the track's workers leave their records.
        features: the track's {"all_casts": bool, "nonfinite": action or None}.
        track: the track class a spawned worker runs its loop in.
    """
    with _lock:
        _followed.append((spool, features, track))
        _worker_module._worker_loop = TrackedWorkerLoop()


def unfollow_workers(spool: WorkerSpool) -> None:
    """Undoes ``follow_workers(spool, ...)``."""
    with _lock:
        _followed[:] = [f for f in _followed if f[0] is not spool]
        if not _followed:
            _worker_module._worker_loop = _original


class WorkersFeature:
    """The worker processes of a track (a feature, features.py): those forked
    in the block inherit it (threads.py), those spawned run their loop in a
    track of their own; both leave their records in its spool, merged into
    the report when it stops.

    Args:
        features: the track's {"all_casts": bool, "nonfinite": action or None}.
        track: the track class a spawned worker runs its loop in.
        watch: the track's NonFiniteWatch, if it has one (a forked worker's
            origins are its).
    """

    def __init__(self, features: Dict[str, Any], track: Callable, watch: Any = None):
        self.features, self.track, self.watch = features, track, watch
        self.spool: Optional[WorkerSpool] = None

    def start(self, report: Any) -> None:
        self.spool = open_spool(report, self.watch)
        follow_workers(self.spool, self.features, self.track)

    def stop(self, error: Optional[BaseException]) -> None:
        spool, self.spool = self.spool, None
        unfollow_workers(spool)
        close_spool(spool)  # in a forked child: leaves its records for the parent
