"""The casts of the rest of the program: threads without a track's dispatch
mode, and worker processes.

Threads. A dispatch mode is per thread, so a track's mode only sees the
thread that entered it. Every other thread's casts (threads started before
or inside the block, thread pools, the autograd engine's device threads)
reach ``_other_thread_cast`` through a kernel for aten::_to_copy at the
ADInplaceOrView key (csrc/thread_casts.cpp), which calls it while an
all_casts track is active anywhere. They are recorded into every active
all_casts track. ``copy_`` into a lower-precision tensor in those threads is
not seen (ADInplaceOrView's copy_ kernel is PyTorch's own).

Worker processes. A process forked inside a block (DataLoader workers with
the "fork" start method) inherits the tracks, and records into copies of
their reports. When it exits (multiprocessing's finalizers run as a
DataLoader worker ends), each copy is written to its track's spool
directory, with ``[worker N]`` added to every origin; the track merges the
files when it exits.
"""
import json
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import threading
import warnings
from typing import List, Optional

import torch

from .. import _ops
from .._inputs import PLAIN_TENSOR_TYPES
from .mode import CastRecorder, locate_cast, report_cast
from .report import Report

_lock = threading.Lock()
_recorders: List[CastRecorder] = []


def _other_thread_cast(src: torch.Tensor, out: torch.Tensor) -> None:
    """Called, with the GIL, after a cast in a thread no track's mode covers."""
    recorders = list(_recorders)
    if not recorders or type(src) not in PLAIN_TENSOR_TYPES or src.device.type == "meta":
        return
    where = locate_cast(sys._getframe(1), src, copy=False)
    if where is not None:
        report_cast(recorders, where, src, out.dtype, out)


_warned_threads = False


def warn_if_threads_unseen() -> None:
    """Says once, in a build without the compiled extension, that other
    threads' casts are not recorded."""
    global _warned_threads
    if _ops.set_cast_callback is None and not _warned_threads:
        _warned_threads = True
        warnings.warn("torchcast was installed without its compiled extension: "
                      "track(all_casts=True) records the casts of the thread that entered "
                      "it (and of processes forked from it), not of other threads, and "
                      "under autocast it labels the program's own casts as autocast's.",
                      RuntimeWarning, stacklevel=3)


def watch_other_threads(recorder: CastRecorder) -> None:
    """Reports the casts of every thread without a track's dispatch mode to
    ``recorder`` until ``unwatch_other_threads(recorder)``."""
    if _ops.set_cast_callback is None:
        return
    with _lock:
        _recorders.append(recorder)
        if len(_recorders) == 1:
            _ops.set_cast_callback(_other_thread_cast)


def unwatch_other_threads(recorder: CastRecorder) -> None:
    """Undoes ``watch_other_threads(recorder)``."""
    if _ops.set_cast_callback is None:
        return
    with _lock:
        _recorders.remove(recorder)
        if not _recorders:
            _ops.set_cast_callback(None)


class WorkerSpool:
    """Where processes forked during a track leave their records: a
    directory, made at the first fork, that the track reads back when it
    exits."""

    def __init__(self, report: Report):
        self.report = report
        self.path: Optional[str] = None
        self.in_worker = False  # set in a forked process
        self.worker: Optional[int] = None

    def note_worker(self) -> None:
        """In a forked process, while it records: notes its DataLoader worker
        id (torch clears it before the process's exit functions run)."""
        info = torch.utils.data.get_worker_info()
        self.worker = info.id if info is not None else os.getpid()

    def _flush(self) -> None:
        records = self.report.to_dict()["records"]
        if not records or self.path is None:
            return
        label = f"worker {self.worker if self.worker is not None else os.getpid()}"
        for record in records:
            record["origin"] = f"{record['origin']} [{label}]"
        target = os.path.join(self.path, f"{os.getpid()}.json")
        with open(target + ".tmp", "w") as f:
            json.dump(records, f)
        os.replace(target + ".tmp", target)

    def collect(self) -> None:
        """In the track's process: merges the records its workers left,
        then removes the spool."""
        if self.path is None:
            return
        try:
            for name in sorted(os.listdir(self.path)):
                if name.endswith(".json"):
                    with open(os.path.join(self.path, name)) as f:
                        self.report.merge_records(json.load(f))
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


_spools: List[WorkerSpool] = []


def open_spool(report: Report) -> WorkerSpool:
    """Starts collecting the records of processes forked from now on into
    ``report``, until ``close_spool``."""
    spool = WorkerSpool(report)
    with _lock:
        _spools.append(spool)
    # A multiprocessing child clears the finalizers it inherits, then runs
    # its after-fork callbacks: the place to ask for the flush at its exit.
    multiprocessing.util.register_after_fork(spool, _flush_at_exit)
    return spool


def close_spool(spool: WorkerSpool) -> None:
    """Stops forwarding forks to ``spool`` and merges what its workers left
    (workers still running then are not waited for)."""
    with _lock:
        _spools.remove(spool)
    spool.collect()


def _before_fork() -> None:
    for spool in list(_spools):
        if spool.path is None:
            spool.path = tempfile.mkdtemp(prefix="torchcast-track-")


def _after_fork_in_child() -> None:
    for spool in _spools:
        spool.report.clear()  # the parent's records stay the parent's
        spool.in_worker = True


def _flush_at_exit(spool: WorkerSpool) -> None:
    # multiprocessing's exit function runs it when the process ends (a
    # DataLoader worker, a multiprocessing.Process).
    if spool in _spools:
        multiprocessing.util.Finalize(spool, spool._flush, exitpriority=100)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
