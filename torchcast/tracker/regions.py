"""The torch.compile'd regions a track could not watch inside, so that a
report names them instead of missing them silently.

Inside a region compiled by Inductor, the ops it fuses into its kernels
never reach the dispatcher: the non-finite watch checks only the ops it
calls as kernels of their own (matmuls, convolutions), the hooks of the
modules inside do not run (no health rows), and casts are measured only if
the region was compiled while a track(all_casts=True) was active
(compiled.py's graph pass).

Which regions: Dynamo's compilation metrics list every compiled frame with
its compile id and function. A region compiled during the track ran in it
(Dynamo compiles at the first call); one compiled before may have run in it
(no record of its runs exists outside the profiler), and the report says
which of the two each is. Frames of torchcast's own code (its module hooks,
which Dynamo compiles as frames of their own around a graph break) are left
out.
"""
import dataclasses
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .sites import short_path

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# The frames (_compiled_functions' keys) compiled while some
# track(all_casts=True) was active: their casts are measured (compiled.py
# instruments them).
_instrumented = set()


@dataclasses.dataclass(frozen=True)
class CompiledRegion:
    """A torch.compile'd region around a track, and what the track could not
    watch inside it.

    ``compile_id`` is Dynamo's ("0/0"); ``function``, ``file``, ``line`` the
    compiled code's; ``compiled_in_track``: compiled in the block, so it ran
    there (else compiled before it, and it may have run there);
    ``unwatched`` what the track could not see inside it.
    """

    compile_id: str
    function: Optional[str]
    file: Optional[str]
    line: Optional[int]
    compiled_in_track: bool
    unwatched: Tuple[str, ...]

    def describe(self) -> str:
        """One line: which region, whether it ran, and what was not watched."""
        if self.file and _torch_code(self.file):
            # torch.compile(module) under global module hooks (a track's)
            # compiles a wrapper of torch's around the module's call.
            where = (f"a compiled module's call (through torch's {self.function}, "
                     f"{short_path(self.file)}:{self.line})")
        elif self.file:
            where = f"{self.function} ({short_path(self.file)}:{self.line})"
        else:
            where = self.function or "a compiled graph"
        ran = "compiled and run in this track" if self.compiled_in_track else \
            "compiled before this track (if it ran in it)"
        return (f"compiled region {self.compile_id}, {where}, {ran}: not watched: "
                + "; ".join(self.unwatched))

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["unwatched"] = list(self.unwatched)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CompiledRegion":
        return cls(d["compile_id"], d.get("function"), d.get("file"), d.get("line"),
                   bool(d.get("compiled_in_track")), tuple(d.get("unwatched", ())))


_INDUCTOR_METRICS = ("inductor_compile_time_s", "inductor_cumulative_compile_time_us",
                     "inductor_fx_local_cache_hit_count", "inductor_fx_local_cache_miss_count",
                     "inductor_fx_remote_cache_hit_count", "inductor_fx_remote_cache_miss_count")


def _compiled_functions() -> Dict[tuple, Tuple[str, str, int, bool]]:
    """{(compile id, start time): (function, file, first line, whether
    Inductor compiled it)} of the
    frames Dynamo compiled into guarded code, from its compilation metrics
    (empty where Dynamo is not imported). The start time keys them: compile
    ids start again from 0/0 after torch.compiler.reset()."""
    if "torch._dynamo" not in sys.modules:
        return {}
    try:
        from torch._dynamo.utils import get_compilation_metrics
        metrics = get_compilation_metrics()
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        return {}
    regions, named = {}, set()
    for m in sorted(metrics, key=lambda m: m.start_time or 0.0):
        if m.compile_id is None or m.has_guarded_code is False:
            continue
        compile_id = str(m.compile_id)
        if m.co_name is None and compile_id in named:
            continue  # the backward of a frame compiled before: the same region
        if m.co_name is not None:
            named.add(compile_id)
        # (aot_eager and eager leave Inductor's times and cache counts unset or
        # 0: their graphs dispatch every op; a cache hit has counts, no times)
        inductor = any(getattr(m, name, None) for name in _INDUCTOR_METRICS)
        regions[(compile_id, m.start_time)] = (m.co_name, m.co_filename, m.co_firstlineno,
                                               inductor)
    return regions


class RegionWatch:
    """The compiled regions around one track: those compiled before it
    (which may run in it) and those compiled in it."""

    def __init__(self, all_casts: bool, nonfinite: bool, health: bool,
                 instrumenting: Callable[[], bool]):
        """Args: the track's features, and what says whether compiled.py's
        cast pass is installed (then the casts of what it compiles are
        measured)."""
        self.features = (all_casts, nonfinite, health)
        self.instrumenting = instrumenting
        self.instrumented = False  # compiled.py's pass was installed at the start
        self.compiled_before = set()
        self.report = None

    def start(self, report: Any) -> None:
        """Notes what was compiled before the track; ``stop`` writes the
        regions into ``report.compiled_regions``."""
        self.report = report
        self.instrumented = self.instrumenting()
        self.compiled_before = set(_compiled_functions())

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Writes into the report the regions with something this track
        could not watch inside, in the order they were compiled."""
        self.report.compiled_regions = self.regions()

    def regions(self) -> List[CompiledRegion]:
        """The regions with something this track could not watch inside,
        in the order they were compiled."""
        functions = _compiled_functions()
        compiled_here = set(functions) - self.compiled_before
        all_casts, nonfinite, health = self.features
        if all_casts and self.instrumented:
            _instrumented.update(compiled_here)
        regions = []
        for key in sorted(functions, key=lambda k: (k[1] or 0.0, _id_order(k[0]))):
            function, file, line, inductor = functions[key]
            missed = _unwatched(key, all_casts, nonfinite and inductor, health)
            if missed and not _own_code(file):
                regions.append(CompiledRegion(key[0], function, file, line, key in compiled_here,
                                              missed))
        return regions


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _torch_code(file: str) -> bool:
    return os.path.abspath(file).startswith(_TORCH_DIR)


def _own_code(file: Optional[str]) -> bool:
    return file is not None and os.path.abspath(file).startswith(_PACKAGE_DIR)


def _id_order(compile_id: str):
    parts = compile_id.split("/")
    return tuple(int(p) if p.isdigit() else 0 for p in parts)


def _unwatched(key: tuple, all_casts: bool, nonfinite: bool, health: bool) -> Tuple[str, ...]:
    missed = []
    if all_casts and key not in _instrumented:
        missed.append("its casts (compiled outside any track(all_casts=True), or inside one "
                      "entered before torch.compile was first used: Inductor's kernels cast "
                      "without dispatching; torch.compiler.reset() before a track entered after "
                      "torch.compile has it compiled again, measured)")
    if nonfinite:
        missed.append("NaN/inf made inside the kernels Inductor fuses (the ops it runs as kernels "
                      "of their own, such as matmuls, are checked)")
    if health:
        missed.append("the health of the modules inside it (their hooks do not run)")
    return tuple(missed)


__all__ = ["CompiledRegion", "RegionWatch"]
