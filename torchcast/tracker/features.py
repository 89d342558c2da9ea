"""The features a track() is made of, and how it composes them.

A feature has two methods: ``start(report)``, where it subscribes to the
events it needs (the dispatcher's casts, every op's result, module calls,
optimizer steps and backward passes: mode.py, nonfinite.py, modules.py,
events.py) and begins writing its section of the report (records, which
report.py holds as data); and ``stop(error)``, where it unsubscribes,
writes its last records, and returns an error for the track to raise once
every feature has stopped (or None). ``error`` is the exception leaving the
block, None when it ended normally.

The features: CastRecording (casts.py), NonFiniteFeature (below),
HealthWatch (health.py), UpdateWatch (updates.py), RegionWatch
(regions.py), WorkersFeature (workers.py). track() builds the list from its
arguments and runs ``start_all`` and ``stop_all``; it knows no feature by
what it does.
"""
from typing import Any, List, Optional, Protocol

from . import nonfinite, ranks
from .mode import pop_mode, push_mode
from .nonfinite import NonFiniteWatch


class Feature(Protocol):
    def start(self, report: Any) -> None:
        """Starts writing into ``report``."""

    def stop(self, error: Optional[BaseException]) -> Optional[BaseException]:
        """Stops; returns an error to raise once every feature stopped."""


class NonFiniteFeature:
    """track(nonfinite=...): the watch (nonfinite.py), checked per op in C++
    or by the dispatch mode, and the collectives it follows (ranks.py).

    Args:
        action: "record", "warn", "raise" or "raise_at_op".
    """

    def __init__(self, action: str):
        self.watch = NonFiniteWatch(action)
        self.in_cpp = False
        self.ranks = None
        self.report = None

    def start(self, report: Any) -> None:
        self.report = report
        self.in_cpp = nonfinite.checked_in_cpp(self.watch.action)
        if self.in_cpp:
            nonfinite.start_cpp(self.watch)
        else:
            push_mode(watch=self.watch)
        self.watch.start(report)
        self.ranks = ranks.start(self.watch)

    def stop(self, error: Optional[BaseException]) -> Optional[BaseException]:
        failed = error is not None
        # A guard reach.py entered after the dispatch mode (param_writes.py) leaves first.
        self.watch.steps.leave_guard()
        if self.in_cpp:
            nonfinite.stop_cpp(self.watch)
        else:
            pop_mode(watch=self.watch)
        arrived = ranks.finish(self.ranks, self.report, failed=failed)
        return self.watch.finish(failed=failed) or arrived


def start_all(features: List[Feature], report: Any) -> None:
    """Starts each feature in order; if one fails, stops those started
    (in reverse) and raises its error."""
    started = []
    try:
        for feature in features:
            feature.start(report)
            started.append(feature)
    except BaseException as error:
        stop_all(started, error)
        raise


def stop_all(features: List[Feature], error: Optional[BaseException]) -> Optional[BaseException]:
    """Stops every feature, in reverse order, each even if another failed
    to; returns the first error one returned (a failure to stop raises,
    after all have stopped)."""
    returned, failure = None, None
    for feature in reversed(features):
        try:
            found = feature.stop(error)
        except BaseException as e:  # noqa: BLE001 - raised once the others stopped
            failure = failure or e
            continue
        returned = returned or found
    if failure is not None:
        raise failure
    return returned
