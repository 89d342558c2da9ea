"""track(): the casts of a block, measured with the fused op, attributed to the
module and source line that did them, and merged by site.

``with track() as report`` collects every safe_to (policies record/warn/raise).
``track(all_casts=True)`` also intercepts, at the dispatcher, every cast that
PyTorch itself performs while the block runs: in its thread (mode.py), in
the program's other threads and in processes forked from it (threads.py);
the program's behaviour does not change under track.

The package, by concern: sites.py (which file:line a cast comes from),
modules.py (which module is running, autocast's state), origins.py (the
program's cast, autocast's or an op's own), measure.py (the stats of one
cast as PyTorch performs it), mode.py (the dispatch mode and the global
state it installs), compiled.py (the casts inside Inductor-compiled
graphs), threads.py (other threads, worker processes),
report.py (Record and Report: merging, reading; their dict form and JSON
in report_dict.py, their text table in report_table.py). This module holds
track() itself.

The stats stay tensors on the cast's device (merged per site by
``merge_stats_tensors``) until the report is read, unless the policy is "warn"
or "raise", which must read each cast's stats: one synchronization per cast.
"""
import sys
import warnings
from typing import Any, Optional, Sequence

from ..cast import (
    PrecisionLossError, PrecisionWarning, add_other_thread_recorder, add_recorder, check_policy,
    check_tolerance, get_policy, graph_cut_message, is_violation, remove_other_thread_recorder,
    remove_recorder, set_all_casts_track, violation_message,
)
from ..stats import PendingStats
from ..violations import Violations, ViolationsSpec
from .measure import MeasuredCast
from . import compiled
from .mode import install, pop_mode, push_mode, take_pending, uninstall
from .modules import current_module
from .health import HealthWatch
from . import nonfinite, ranks
from .nonfinite import NonFiniteWatch, check_action
from .nonfinite_origin import NonFiniteError, NonFiniteOrigin, NonFiniteWarning
from .block_headroom import check_block_formats
from .regions import RegionWatch
from .updates import UpdateWatch
from .workers import follow_workers, unfollow_workers
from .report import Record, Report, SiteKey, merge_into
from .sites import library_dirs, set_library_dirs, short_path, user_site
from .threads import (close_spool, open_spool, unwatch_other_threads, warn_if_threads_unseen,
                      watch_other_threads)


class _Recording:
    """One entry of a track(): where its casts go, and the policy applied
    to them."""

    def __init__(self, report, policy, rtol, atol):
        self.report = report
        self.policy, self.rtol, self.atol = policy, rtol, atol
        self.kinds = report.kinds
        self.warned = set()
        self.spool = None  # where a forked worker leaves its records (threads.py)
        self.watch = None  # the non-finite watch of track(nonfinite=...)
        self.watch_in_cpp = False  # served by the C++ watch (nonfinite.checked_in_cpp)
        self.health = None  # the module health of track(health=True)
        self.regions = None  # the compiled regions that run in the block (regions.py)
        self.ranks = None  # the collectives the non-finite watch follows (ranks.py)
        self.updates = UpdateWatch()  # the optimizers that count their updates (updates.py)

    def _in_worker(self):
        spool = self.spool
        if spool is not None and spool.in_worker and spool.worker is None:
            spool.note_worker()

    # -- safe_to's recorder (cast.add_recorder) ------------------------------------
    def record_safe_to(self, pending: PendingStats, name: Optional[str]) -> None:
        """Records a safe_to at the user's line that called it."""
        self._in_worker()
        site = user_site(sys._getframe(1), skip_own=True)
        key = (current_module(), site.file, site.line, "safe_to", name, pending.src_dtype,
               pending.dtype, site.via)
        merge_into(self.report, key, pending.tensor, measured=True)

    # -- the dispatch mode's recorder (mode.CastRecorder) --------------------------
    def add_cast(self, key: SiteKey, cast: MeasuredCast) -> None:
        """Records a cast PyTorch performed, at site ``key``."""
        self._in_worker()
        merge_into(self.report, key, cast.stats, measured=cast.measured,
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


class track:
    """``with torchcast.track(all_casts=False) as report:`` records casts in
    the block into ``report`` (a Report).

    Always: every ``safe_to`` whose policy is "record", "warn" or "raise".
    With ``all_casts=True`` also every dtype-changing cast PyTorch performs,
    in code that never mentions torchcast (see the module docstring); the
    cast returns exactly what PyTorch returns.

    A track is reusable like torch.autocast: each entry records into a fresh
    Report. Tracks nest (each records what happens inside it); entering the
    same object twice at once raises RuntimeError.

    Args:
        all_casts: also intercept every cast PyTorch performs, not only
            safe_to's.
        policy: "record", "warn" or "raise" (default:
            ``torchcast.get_policy()`` at each cast): what a violating tracked
            cast does. What is a violation: ``violations``, and
            ``max_rel_err > rtol`` or ``max_abs_err > atol`` when given.
            "warn" warns once per site
            (PrecisionWarning); "raise" raises PrecisionLossError at the first
            one, naming its site. Tracked casts are always recorded ("ignore"
            acts like "record" here). "warn" and "raise" read each cast's
            stats: one device synchronization per cast.
        rtol, atol: None or a real number >= 0: the largest relative and
            absolute error that is not a violation (None: not checked).
        violations: which losses are violations, each with the fraction of
            a cast's elements above which it counts: a string such as
            ``"overflow,nan,underflow>1%"``, ``"all"``, a dict kind ->
            fraction, or an iterable of kinds (see torchcast.violations).
            Default ``"overflow,saturated,underflow>1%,graph_cut,imag_dropped"``:
            what breaks training. The other losses (subnormal results, NaN
            passing through a cast) are listed as notes.
        nonfinite: None (default), "record", "warn", "raise" or
            "raise_reached": check every aten op the block runs in this
            thread, forward and backward, casts included, and report each
            op that makes NaN or ±inf from finite inputs (an origin:
            ``report.nonfinite`` in time order, ``report.first_nonfinite``),
            with its step and whether its NaN/inf reached the block's
            outputs, the loss or the gradients the step leaves, or were
            absorbed (docs/numerics.md). "warn" warns once per place,
            NonFiniteWarning. "raise" raises ``torchcast.NonFiniteError`` at
            the first origin, before the program uses its result, so before
            anyone can know whether it matters: kept as it was, for
            stopping at the very first NaN/inf. "raise_reached" raises at
            the first check that sees an origin's NaN/inf reach (a top-level
            module's output, the tensor backward() runs from, the gradients
            an optimizer reads or the parameters it wrote, the block's exit),
            naming the origin and where it reached: the one to choose for a
            training loop, where a harmless overflow (one a tanh absorbs)
            must not stop the run. Ops whose inputs already held NaN/inf
            are counted (``report.propagated``). Each op's output is read
            once (in C++ for all but "raise" in a program without CUDA); on
            a GPU the flags stay on the device and are read every 256 ops,
            at each top-level call, backward and optimizer step, and at exit
            ("raise": after every op). Ops inside torch.compile'd graphs are
            not seen.
        health: measure, per module, its forward outputs and the gradients
            flowing into it in backward (``torchcast.tensor_health``, merged
            per module, phase and dtype, kept on the device): ``report.health``
            and ``report.headroom(dtype, scale)``, what a cast to float16,
            bfloat16 or float8 would overflow or flush.
        block_formats: with ``health=True``, block formats ("mxfp8_e4m3",
            "mxfp8_e5m2", "mxfp4", "nvfp4") each measured tensor is also cast
            to (``torchcast.block_cast``, blocks along its last dimension;
            one pass per tensor and format): ``report.headroom(format)``
            gives what those real casts flushed to zero, left subnormal or
            saturated, and their SQNR.

    Returns (on entry):
        The Report the block's casts are recorded into; read it after the
        block (``str(report)``, ``report.records``, ``report.to_json()``).

    Raises:
        TypeError: ``all_casts`` or ``health`` is not a bool (a numpy bool
            included), or rtol or atol is not a number.
        ValueError: an unknown policy, nonfinite action, violation kind or
            block format, block_formats without health=True, or
            a negative or NaN rtol or atol.
    """

    def __init__(self, all_casts: bool = False, *, policy: Optional[str] = None,
                 rtol: Optional[float] = None, atol: Optional[float] = None,
                 violations: ViolationsSpec = None, nonfinite: Optional[str] = None,
                 health: bool = False, block_formats: Sequence[str] = ()):
        for arg, value in (("all_casts", all_casts), ("health", health)):
            # bool(value) would take any object, the string "no" included, as on.
            if not isinstance(value, bool):
                kind = type(value)
                kind = kind.__name__ if kind.__module__ == "builtins" else (
                    f"{kind.__module__}.{kind.__qualname__}")  # numpy.bool, not bool
                raise TypeError(f"torchcast.track: {arg} must be True or False, got {kind} "
                                f"{value!r}; pass a bool (bool(x) for a numpy bool)")
        self.nonfinite_action = check_action(nonfinite)
        self.health = health
        self.block_formats = check_block_formats(block_formats)
        if self.block_formats and not health:
            raise ValueError("torchcast.track: block_formats casts what health=True measures; "
                             "pass health=True too")
        if policy is not None:
            check_policy(policy)
        rtol = check_tolerance(rtol, "rtol", "torchcast.track")
        atol = check_tolerance(atol, "atol", "torchcast.track")
        self.all_casts = all_casts
        self.policy, self.rtol, self.atol = policy, rtol, atol
        self.violations = Violations(violations)
        self._recording = None
        self._spool = None

    def __enter__(self) -> Report:
        if self._recording is not None:
            raise RuntimeError("torchcast.track: this track() is already active; nest a new "
                               "one instead: create a new torchcast.track()")
        recording = _Recording(Report(self.rtol, self.atol, self.violations), self.policy,
                               self.rtol, self.atol)
        if self.all_casts:  # warnings first: one raised as an error leaves nothing installed
            compiled.warn_uninstrumented()
            warn_if_threads_unseen()
        install(self.all_casts)
        add_recorder(recording.record_safe_to)
        if self.all_casts:
            compiled.install()
            push_mode(recording)
            watch_other_threads(recording)
            add_other_thread_recorder(recording.record_safe_to)
            set_all_casts_track(True)
        if self.nonfinite_action is not None:
            watch = NonFiniteWatch(self.nonfinite_action)
            recording.watch = recording.report.nonfinite_watch = watch
            if nonfinite.checked_in_cpp(self.nonfinite_action):
                recording.watch_in_cpp = True
                nonfinite.start_cpp(recording.watch)
            else:
                push_mode(watch=recording.watch)
            watch.start()
            recording.ranks = ranks.start(watch)
        if self.health:
            recording.health = recording.report.health_watch = HealthWatch(self.block_formats)
            recording.health.start()
        recording.updates.start()
        recording.regions = RegionWatch(self.all_casts, self.nonfinite_action is not None,
                                        self.health, compiled.instrumenting())
        if self.all_casts or self.nonfinite_action is not None:
            # Where processes forked in the block (DataLoader workers) leave
            # their casts and non-finite origins for this one.
            self._spool = recording.spool = open_spool(recording.report)
            follow_workers(self._spool, {"all_casts": self.all_casts,
                                         "nonfinite": self.nonfinite_action}, track)
        self._recording = recording
        return recording.report

    def __exit__(self, *exc: Any) -> bool:
        recording, self._recording = self._recording, None
        reached = None  # nonfinite "raise": an origin found to reach at the exit
        deferred = None  # policy "raise" of a cast under torch.inference_mode
        recording.report.ended_by = _ended_early(exc[1])
        failed = recording.report.ended_by is not None
        try:
            recording.report.compiled_regions = recording.regions.stop()
            recording.report.updates = recording.updates.stop()
            if recording.health is not None:
                recording.health.stop()
            if recording.watch is not None:
                if recording.watch_in_cpp:
                    nonfinite.stop_cpp(recording.watch)
                else:
                    pop_mode(watch=recording.watch)
                arrived = ranks.finish(recording.ranks, recording.report, failed=failed)
                reached = recording.watch.finish(failed=failed) or arrived
            if self.all_casts:
                remove_other_thread_recorder(recording.record_safe_to)
                set_all_casts_track(False)
                unwatch_other_threads(recording)
                try:
                    pop_mode(recording)
                    deferred = take_pending(exc[1])
                finally:
                    compiled.uninstall()
        finally:
            remove_recorder(recording.record_safe_to)
            uninstall(self.all_casts)
            spool, self._spool = self._spool, None
            if spool is not None:
                unfollow_workers(spool)
                close_spool(spool)  # in a forked child: leaves its records for the parent
        if reached is not None:
            raise reached
        if deferred is not None:
            raise deferred
        return False


def _ended_early(error: Optional[BaseException]) -> Optional[str]:
    """How the block ended, for Report.ended_by: None when it ran to its end
    (sys.exit with status 0 too), else the exception, e.g.
    "KeyboardInterrupt", "NonFiniteError: ..."."""
    if error is None or (isinstance(error, SystemExit) and error.code in (0, None)):
        return None
    text = str(error).split("\n", 1)[0]
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


__all__ = ["NonFiniteError", "NonFiniteOrigin", "NonFiniteWarning", "Record", "Report",
           "library_dirs", "set_library_dirs", "track"]
