"""track(): the casts of a block, measured with the fused op, attributed to the
module and source line that did them, and merged by site; and, as asked, the
ops that make NaN/inf, module health, optimizer updates.

``with track() as report`` collects every safe_to (policies record/warn/raise).
``track(all_casts=True)`` also intercepts, at the dispatcher, every cast that
PyTorch itself performs while the block runs: in its thread (mode.py), in
the program's other threads and in processes forked from it (threads.py);
the program's behaviour does not change under track.

A track is a list of features (features.py: each starts, subscribes to the
events it needs and writes its records into the report, then stops), which
track() composes from its arguments; the report is data (report.py, its
dict form report_dict.py, its writers report_table.py, html.py,
tensorboard.py). docs/architecture.md maps the rest of the package.

The stats stay tensors on the cast's device (merged per site by
``merge_stats_tensors``) until the report is read, unless the policy is "warn"
or "raise", which must read each cast's stats: one synchronization per cast.
"""
from typing import Any, Optional, Sequence

from ..cast import check_policy, check_tolerance
from ..violations import Violations, ViolationsSpec
from . import compiled
from .block_headroom import check_block_formats
from .casts import CastRecording
from .features import NonFiniteFeature, start_all, stop_all
from .health import HealthWatch
from .nonfinite import check_action
from .nonfinite_origin import NonFiniteError, NonFiniteWarning
from .origin import NonFiniteOrigin
from .records import Record
from .regions import RegionWatch
from .report import Report
from .sites import library_dirs, set_library_dirs
from .updates import UpdateWatch
from .workers import WorkersFeature


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
            "raise_at_op": check every aten op the block runs in this
            thread, forward and backward, casts included, and report each
            op that makes NaN or ±inf from finite inputs (an origin), and
            each op where NaN/inf that no watched op made enter (an entry:
            the data, a worker's batch, a checkpoint, a literal;
            ``origin.entered`` names the argument): ``report.nonfinite`` in
            time order, ``report.first_nonfinite``, each with its step and
            whether its NaN/inf reached the block's outputs, the loss or the
            gradients the step leaves, or were absorbed (docs/numerics.md).
            "warn" warns once per place, NonFiniteWarning. "raise" raises
            ``torchcast.NonFiniteError`` at the first check that sees an
            origin's NaN/inf reach (a top-level module's output, the tensor
            backward() runs from, the gradients an optimizer reads before it
            writes, the block's exit), naming the origin and where it
            reached: a harmless overflow (one a tanh absorbs) or an
            intentional -inf mask never stops the run. "raise_at_op" raises
            at the first origin or entry, before the program uses its
            result, so before anyone can know whether it matters. Ops whose
            inputs already held NaN/inf a watched op made are counted
            (``report.propagated``). Each op's output is read once (in C++
            for all but "raise_at_op" in a program without CUDA); on a GPU
            the flags stay on the device and are read every 256 ops, at each
            top-level call, backward and optimizer step, and at exit
            ("raise_at_op": after every op). Ops inside torch.compile'd
            graphs are not seen; the report names those regions.
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
        self._features = None  # the features of the entry now active
        self._report = None
        self.nonfinite_watch = None  # the NonFiniteWatch of the entry now active

    def __enter__(self) -> Report:
        if self._features is not None:
            raise RuntimeError("torchcast.track: this track() is already active; nest a new "
                               "one instead: create a new torchcast.track()")
        report = Report(self.rtol, self.atol, self.violations)
        features = self._compose()
        start_all(features, report)
        self._features, self._report = features, report
        return report

    def _compose(self) -> list:
        """This entry's features, in the order they start (they stop in the
        reverse order: the workers' records are merged last)."""
        nonfinite = NonFiniteFeature(self.nonfinite_action) \
            if self.nonfinite_action is not None else None
        self.nonfinite_watch = nonfinite.watch if nonfinite is not None else None
        workers = None
        if self.all_casts or nonfinite is not None:
            # Where worker processes leave their casts and origins.
            workers = WorkersFeature({"all_casts": self.all_casts,
                                      "nonfinite": self.nonfinite_action}, track,
                                     self.nonfinite_watch)
        features = [workers] if workers is not None else []
        features.append(CastRecording(self.all_casts, self.policy, self.rtol, self.atol,
                                      workers))
        if nonfinite is not None:
            features.append(nonfinite)
        if self.health:
            features.append(HealthWatch(self.block_formats))
        features.append(UpdateWatch())
        features.append(RegionWatch(self.all_casts, nonfinite is not None, self.health,
                                    compiled.instrumenting))
        return features

    def __exit__(self, *exc: Any) -> bool:
        features, self._features = self._features, None
        report, self._report = self._report, None
        report.ended_by = _ended_early(exc[1])
        error = stop_all(features, exc[1] if report.ended_by is not None else None)
        if error is not None:
            raise error
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
