"""The casts that reach the tracker through csrc/thread_casts.cpp's kernels:
the tracking thread's on the direct route (mode.py), the program's other
threads, and worker processes.

Threads. Every cast (aten::_to_copy, and aten::copy_ into another dtype,
reported before it writes) reaches ``_kernel_cast`` through kernels at the
ADInplaceOrView key while an all_casts track is active anywhere, except in
a thread whose casts a track's dispatch mode sees. A tracking thread's
casts go to its own tracks; every other thread's (threads started before or
inside the block, thread pools, the autograd engine's device threads) into
every active all_casts track.

Worker processes. A process forked inside a block (DataLoader workers with
the "fork" start method, a bare ``os.fork()``) inherits the tracks, and
records into copies of their reports, emptied at the fork. It writes each
copy to its track's spool directory, with ``[worker N]`` added to every
cast site's origin and ``worker`` set in every non-finite origin (N: the
DataLoader worker id, else the pid): when it exits through multiprocessing
(a DataLoader worker's end), when it leaves the block itself (a bare fork
whose child runs on to the block's end or calls sys.exit in it), and at
each new non-finite origin (the error of "raise" reaches the parent while
the worker runs). A child that ends with ``os._exit`` inside the block
leaves only what it wrote at its origins. The process that opened the
spool, and only it, merges the files when its track exits and removes the
directory; in a forked child the track's exit only writes.
"""
import json
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import threading
import warnings
from typing import Any, List, Optional

import torch

from . import native
from .._inputs import PLAIN_TENSOR_TYPES
from .mode import CastRecorder, direct_recorders, locate_cast, report_cast

_lock = threading.Lock()
_recorders: List[CastRecorder] = []


def _kernel_cast(src: torch.Tensor, out: Optional[torch.Tensor], dtype: torch.dtype,
                 when: str) -> Optional[torch.Tensor]:
    """Called, with the GIL, at a cast of ``src`` to ``dtype``
    (csrc/thread_casts.h: ``when`` "to_copy", before a _to_copy whose result
    this returns; "to_copy_done", after one, ``out`` its result; "copy_",
    before a copy_ writes). Its errors (policy "raise") leave the cast."""
    recorders = direct_recorders()
    if recorders is None:
        recorders = list(_recorders)
    if not recorders or type(src) not in PLAIN_TENSOR_TYPES or src.device.type == "meta" \
            or torch.compiler.is_compiling():
        return None
    where = locate_cast(sys._getframe(1), src, copy=when == "copy_")
    if where is None:
        return None
    if when == "to_copy":
        # The measuring op's result stands in for PyTorch's where it has its
        # bits (mode.py's _tracked_cast): one cast instead of two.
        return report_cast(recorders, where, src, dtype, None, torch_cast=lambda: src.to(dtype))
    report_cast(recorders, where, src, dtype, out)
    return None


_warned_threads = False


def warn_if_threads_unseen() -> None:
    """Says once, in a build without the compiled extension, that other
    threads' casts are not recorded."""
    global _warned_threads
    if native.set_cast_callback is None and not _warned_threads:
        _warned_threads = True
        warnings.warn("torchcast was installed without its compiled extension: "
                      "track(all_casts=True) records the casts of the thread that entered "
                      "it (and of processes forked from it), not of other threads, and "
                      "under autocast it labels the program's own casts as autocast's.",
                      RuntimeWarning, stacklevel=5)


def watch_other_threads(recorder: CastRecorder) -> None:
    """Reports the casts of every thread without a track's dispatch mode to
    ``recorder`` until ``unwatch_other_threads(recorder)``."""
    if native.set_cast_callback is None:
        return
    with _lock:
        _recorders.append(recorder)
        if len(_recorders) == 1:
            native.set_cast_callback(_kernel_cast)


def unwatch_other_threads(recorder: CastRecorder) -> None:
    """Undoes ``watch_other_threads(recorder)``."""
    if native.set_cast_callback is None:
        return
    with _lock:
        _recorders.remove(recorder)
        if not _recorders:
            native.set_cast_callback(None)


class WorkerSpool:
    """Where processes forked during a track leave their records: a
    directory, made at the first fork, that the track reads back when it
    exits."""

    def __init__(self, report: Any, watch: Any = None):
        self.report = report
        self.watch = watch  # the track's NonFiniteWatch, if it has one
        self.path: Optional[str] = None
        self.owner = os.getpid()  # the tracking process: it alone merges and removes
        self.in_worker = False  # set in a forked process
        self.worker: Optional[int] = None
        self.left: Optional[str] = None  # what this process last wrote

    def make_dir(self) -> None:
        """Makes the spool's directory, before a worker process starts."""
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="torchcast-track-")

    def note_worker(self) -> None:
        """In a forked process, while it records: notes its DataLoader worker
        id (torch clears it before the process's exit functions run)."""
        info = torch.utils.data.get_worker_info()
        self.worker = info.id if info is not None else os.getpid()

    def worker_id(self) -> int:
        """In a forked process: its DataLoader worker id, else its pid."""
        if self.worker is None:
            self.note_worker()
        return self.worker

    def leave(self) -> None:
        """In a forked process: writes everything it recorded so far into
        the spool, for the tracking process (again at each call, replacing
        the file)."""
        if self.path is None:
            return
        report = self.report
        records = [r.to_dict() for r in report.records]
        origins = [o.to_dict() for o in report.nonfinite]  # labelled by the watch (forked())
        propagated = report.propagated
        if not (records or origins or propagated):
            return
        label = f"worker {self.worker_id()}"
        for record in records:
            record["origin"] = f"{record['origin']} [{label}]"
        payload = {"records": records}
        if report.nonfinite_tracked:  # (a track without nonfinite= has no such section)
            payload.update(nonfinite=origins, propagated=propagated)
        text = json.dumps(payload)
        if text == self.left:
            return  # delivered already (at an origin), perhaps to a track that has ended
        target = os.path.join(self.path, f"{os.getpid()}.json")
        try:
            with open(target + ".tmp", "w") as f:
                f.write(text)
            os.replace(target + ".tmp", target)
        except FileNotFoundError:  # the spool is gone: the tracking process has reported
            warnings.warn(f"torchcast.track: process {os.getpid()}, forked inside a track, "
                          f"ended after that track had reported: its {len(records)} cast sites "
                          f"and {len(origins)} non-finite origins are in no report",
                          RuntimeWarning)
            return
        self.left = text

    def collect(self) -> None:
        """In the track's process: merges the records its workers left,
        then removes the spool."""
        if self.path is None:
            return
        try:
            for name in sorted(os.listdir(self.path)):
                if name.endswith(".json"):
                    with open(os.path.join(self.path, name)) as f:
                        left = json.load(f)
                    self.report.merge(left)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


_spools: List[WorkerSpool] = []


def open_spool(report: Any, watch: Any = None) -> WorkerSpool:
    """Starts collecting the records of processes forked from now on into
    ``report`` (with the origins of ``watch``, a NonFiniteWatch), until
    ``close_spool``."""
    spool = WorkerSpool(report, watch)
    with _lock:
        _spools.append(spool)
    # A multiprocessing child clears the finalizers it inherits, then runs
    # its after-fork callbacks: the place to ask for the flush at its exit.
    multiprocessing.util.register_after_fork(spool, _flush_at_exit)
    return spool


def close_spool(spool: WorkerSpool) -> None:
    """Stops forwarding forks to ``spool``. In the process that opened it:
    merges what its workers left (workers still running then are not waited
    for) and removes it. In a process forked since: leaves this process's
    records there, for that process."""
    with _lock:
        _spools.remove(spool)
    if os.getpid() == spool.owner:
        spool.collect()
    else:
        spool.leave()


def _before_fork() -> None:
    for spool in list(_spools):
        spool.make_dir()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for spool in _spools:
        spool.report.clear()  # the parent's records stay the parent's
        spool.in_worker = True
        if spool.watch is not None:
            spool.watch.forked(spool.worker_id, spool.leave)


def _flush_at_exit(spool: WorkerSpool) -> None:
    # multiprocessing's exit function runs it when the process ends (a
    # DataLoader worker, a multiprocessing.Process).
    if spool in _spools:
        multiprocessing.util.Finalize(spool, spool.leave, exitpriority=100)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
