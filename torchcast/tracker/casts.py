"""A track's cast recording, as one of its features (features.py): every
safe_to with a recording policy, and with ``all_casts`` every cast PyTorch
performs (mode.py's routes, threads.py's other threads, compiled.py's
compiled graphs), each merged into the report's cast sites at its module
and line, and the policy applied to it.
"""
import sys
import warnings
from typing import Any, Optional

from ..cast import (
    PrecisionLossError, PrecisionWarning, add_other_thread_recorder, add_recorder,
    get_policy, graph_cut_message, is_violation, remove_other_thread_recorder,
    remove_recorder, set_all_casts_track, violation_message,
)
from ..stats import PendingStats
from . import compiled
from .measure import MeasuredCast
from .mode import install, pop_mode, push_mode, take_pending, uninstall
from .modules import current_module
from .records import SiteKey
from .sites import short_path, user_site
from .threads import unwatch_other_threads, warn_if_threads_unseen, watch_other_threads


class CastRecording:
    """The casts of one track entry: where they go (``report.casts``) and the
    policy applied to them.

    Args:
        all_casts: also every cast PyTorch performs, not only safe_to's.
        policy, rtol, atol: as track() takes them.
        workers: the track's WorkersFeature, or None: a forked worker notes
            its id in its spool as it records.
    """

    def __init__(self, all_casts: bool, policy: Optional[str], rtol: Optional[float],
                 atol: Optional[float], workers: Any = None):
        self.all_casts = all_casts
        self.policy, self.rtol, self.atol = policy, rtol, atol
        self.workers = workers
        self.report = None
        self.kinds = None
        self.warned = set()

    # -- a track's feature -------------------------------------------------------
    def start(self, report: Any) -> None:
        """Records into ``report`` until ``stop``."""
        self.report, self.kinds = report, report.kinds
        if self.all_casts:  # warnings first: one raised as an error leaves nothing installed
            compiled.warn_uninstrumented()
            warn_if_threads_unseen()
        install(self.all_casts)
        add_recorder(self.record_safe_to)
        if self.all_casts:
            compiled.install()
            push_mode(self)
            watch_other_threads(self)
            add_other_thread_recorder(self.record_safe_to)
            set_all_casts_track(True)

    def stop(self, error: Optional[BaseException]) -> Optional[BaseException]:
        """Stops recording. Returns what a cast under torch.inference_mode
        deferred (policy "raise") when no other error leaves the block."""
        deferred = None
        try:
            if self.all_casts:
                remove_other_thread_recorder(self.record_safe_to)
                set_all_casts_track(False)
                unwatch_other_threads(self)
                try:
                    pop_mode(self)
                    deferred = take_pending(error)
                finally:
                    compiled.uninstall()
        finally:
            remove_recorder(self.record_safe_to)
            uninstall(self.all_casts)
        return deferred

    def _in_worker(self):
        spool = self.workers.spool if self.workers is not None else None
        if spool is not None and spool.in_worker and spool.worker is None:
            spool.note_worker()

    # -- safe_to's recorder (cast.add_recorder) ------------------------------------
    def record_safe_to(self, pending: PendingStats, name: Optional[str]) -> None:
        """Records a safe_to at the user's line that called it."""
        self._in_worker()
        site = user_site(sys._getframe(1), skip_own=True)
        key = (current_module(), site.file, site.line, "safe_to", name, pending.src_dtype,
               pending.dtype, site.via)
        self.report.casts.add(key, pending.tensor, measured=True)

    # -- the dispatch mode's recorder (mode.CastRecorder) --------------------------
    def add_cast(self, key: SiteKey, cast: MeasuredCast) -> None:
        """Records a cast PyTorch performed, at site ``key``."""
        self._in_worker()
        self.report.casts.add(key, cast.stats, measured=cast.measured,
                              numel=0 if cast.stats is not None else cast.numel,
                              graph_cuts=int(cast.graph_cut), imag=cast.imag,
                              double_rounded=cast.double_rounded)

    def apply_policy(self, key: SiteKey, cast: MeasuredCast,
                     pending: Optional[PendingStats]) -> None:
        """Warns (once per site) or raises if the cast is a violation and
        the policy says so."""
        pol = self.policy or get_policy()
        if pol not in ("warn", "raise"):
            return
        graph_cut = cast.graph_cut and "graph_cut" in self.kinds
        imag_dropped = "imag_dropped" in self.kinds and cast.imag is not None and int(cast.imag)
        s = None
        if not (graph_cut or imag_dropped) and pending is not None and (
                pending.has_loss() or self.rtol is not None or self.atol is not None):
            s = pending.value
            if not is_violation(s, self.rtol, self.atol, self.kinds):
                s = None
        if not (graph_cut or imag_dropped or s is not None):
            return  # the common case: no message to write
        if pol == "warn" and key in self.warned:
            return  # said once per site
        module, file, line, origin = key[:4]
        via = key[7]
        where = f"{module} {short_path(file)}:{line}" if module else f"{short_path(file)}:{line}"
        if via:
            where += f" (via {via})"
        head = f"torchcast.track: {origin} at {where}"
        if graph_cut:
            message = graph_cut_message(head, cast.src_dtype, cast.dtype)
        elif imag_dropped:
            message = (f"{head}: casting {cast.src_dtype} to {cast.dtype} dropped "
                       f"{int(cast.imag)} nonzero imaginary parts. Take .real or .abs() "
                       "explicitly, or keep a complex dtype.")
        else:
            message = violation_message(
                cast.x, cast.y, s, self.rtol, self.atol, None, head=head,
                advice=(f"Keep {s.src_dtype} here, rescale the data, or use "
                        "torchcast.safe_to with an explicit policy at this line."))
        if pol == "raise":
            error = PrecisionLossError(message, pending.value if pending else None)
            error.site = where
            raise error
        self.warned.add(key)
        warnings.warn_explicit(message, PrecisionWarning, file, line or 1)
