"""The tracker's own work, which nothing of the tracker watches."""
import threading

from . import native


class unwatched:
    """``with unwatched():`` the ops this thread runs are the tracker's own
    (health.py's merges of extrema that start at inf, the wider rerun of a
    non-finite origin, collectives' bookkeeping): not checked for NaN/inf,
    their casts not recorded, nor their promotions (csrc/cpu/nonfinite_watch.cpp,
    csrc/thread_casts.cpp, csrc/dtype_watch.cpp; the dispatch mode checks
    ``active()``)."""

    _local = threading.local()

    def __enter__(self):
        self.saved = unwatched.active()
        unwatched._local.on = True
        self.saved_nonfinite = native.pause_nonfinite_watch(True)
        self.saved_dtypes = native.pause_dtype_watch(True)
        self.saved_casts = native.pause_thread_casts(True)

    def __exit__(self, *exc):
        unwatched._local.on = self.saved
        native.pause_nonfinite_watch(self.saved_nonfinite)
        native.pause_dtype_watch(self.saved_dtypes)
        native.pause_thread_casts(self.saved_casts)

    @staticmethod
    def active() -> bool:
        """Whether this thread is inside ``with unwatched()``."""
        return getattr(unwatched._local, "on", False)
