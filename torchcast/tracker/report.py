"""Report: what a track() recorded, as data. Its sections (the cast sites,
the non-finite origins and entries, module health and block headroom,
optimizer updates, compiled regions, how the block ended) are records;
the features of a track write them (features.py), and while the track runs
a feature may also attach a refresh, which brings its section up to date
before a read. Everything that leaves a report goes through its dict form
(report_dict.py): JSON, the text table, the HTML page, TensorBoard, and
the merge of ranks, which merges dicts.
"""
import json
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..violations import Violations, ViolationsSpec
from .block_headroom import BlockHeadroomRow, BlockHeadroomTable
from .health_rows import HeadroomTable, ModuleHealth, headroom_lines, headroom_table, severity
from .html import render_html
from .json_floats import float_from_json
from .origin import NonFiniteOrigin, reach_rank
from .records import CastSites, Record, SiteKey, undone_upcasts
from .regions import CompiledRegion
from .report_dict import (check_format, merge_dict, merge_ranks_dicts, report_to_dict,
                          write_text)
from .report_table import render_table
from .tensorboard import write_tensorboard


class Report:
    """The casts recorded by ``torchcast.track``, merged by site, and what
    its other features found.

    ``records`` lists the casts worst first (violations first, then by max
    rel err); ``str(report)`` is the whole report as text; ``to_dict`` /
    ``to_json`` for loggers (``Report.from_dict`` / ``from_json`` read them
    back, equal); ``merge_ranks()`` makes one report of every
    torch.distributed rank's. Reading the report synchronizes with the device
    once; recording never does under policy "record".

    Args:
        rtol, atol: the tolerances that make a site a violation (None: not
            checked), as given to track().
        violations: which losses make a site a violation, as given to
            track() (None: ``torchcast.violations.DEFAULT``).

    Attributes:
        kinds (torchcast.violations.Violations): ``violations``, parsed.
        casts (CastSites): the cast sites as they accumulate.
        updates: what rounding did to the updates of the torchcast
            optimizers that stepped with track_updates=True (rows).
        compiled_regions: the torch.compile'd regions a track could not
            watch inside (regions.py).
        ended_by: the exception that left the block, if one did.
        ranks: the ranks a merged report holds (merge_ranks), else None.
    """

    def __init__(self, rtol: Optional[float] = None, atol: Optional[float] = None,
                 violations: ViolationsSpec = None):
        self.rtol, self.atol = rtol, atol
        self.kinds = Violations(violations)
        self.casts = CastSites()
        self.nonfinite_tracked = False
        self.health_tracked = False
        self.block_formats: Tuple[str, ...] = ()
        self.block_rows: List[BlockHeadroomRow] = []
        self.updates: List[Dict[str, Any]] = []
        self.compiled_regions: List[CompiledRegion] = []
        self.ended_by: Optional[str] = None
        self.ranks: Optional[List[int]] = None
        # The ids of the collectives this rank sent NaN/inf into (ranks.py).
        self.sent_nonfinite: List[str] = []
        self._origins: List[NonFiniteOrigin] = []
        self._propagated = 0
        self._health: List[ModuleHealth] = []
        self._refreshes: List[Callable[[], None]] = []
        self._lock = threading.Lock()

    # -- what the features write --------------------------------------------------
    def attach(self, refresh: Callable[[], None]) -> None:
        """Calls ``refresh()`` before each read until ``detach(refresh)``: a
        running feature bringing its section up to date."""
        self._refreshes.append(refresh)

    def detach(self, refresh: Callable[[], None]) -> None:
        """Undoes ``attach(refresh)``."""
        self._refreshes.remove(refresh)

    def _refresh(self) -> None:
        for refresh in list(self._refreshes):
            refresh()

    def set_origins(self, origins: Sequence[NonFiniteOrigin], propagated: int) -> None:
        """The non-finite section: its origins and entries in the order they
        happened, and the op calls that only passed NaN/inf on."""
        with self._lock:
            self.nonfinite_tracked = True
            self._origins, self._propagated = list(origins), propagated

    def add_origins(self, origins: Sequence[NonFiniteOrigin], propagated: int = 0) -> None:
        """Merges origins (a worker's, a rank's) into the non-finite section:
        one already here adds its count; all stay in the order they happened
        (``time``, the machine's clock; those without one last)."""
        with self._lock:
            self.nonfinite_tracked = True
            known = {o.key: o for o in self._origins}
            for origin in origins:
                if origin.key in known:
                    known[origin.key].count += origin.count
                else:
                    known[origin.key] = origin
                    self._origins.append(origin)
            self._origins.sort(key=lambda o: (o.time is None, o.time or 0.0))
            self._propagated += propagated

    def set_health(self, rows: Sequence[ModuleHealth]) -> None:
        """The health section: one row per module, phase and dtype."""
        self.health_tracked = True
        self._health = sorted(rows, key=severity)

    def add_health(self, rows: Sequence[ModuleHealth]) -> None:
        """Adds rows (another rank's) to the health section."""
        self.set_health(self._health + list(rows))

    def add_block_rows(self, formats: Sequence[str], rows: Sequence[BlockHeadroomRow]) -> None:
        """Adds block formats and their rows to the block headroom section."""
        self.health_tracked = True
        self.block_formats = tuple(dict.fromkeys(self.block_formats + tuple(formats)))
        self.block_rows = self.block_rows + list(rows)

    # -- reading ----------------------------------------------------------------
    @property
    def records(self) -> List[Record]:
        """The cast sites as Records, worst first (one synchronization per device)."""
        self._refresh()
        return sorted(self.casts.records(), key=self._severity, reverse=True)

    def _severity(self, r: Record) -> tuple:
        s = r.stats
        return (bool(r.violations(self.rtol, self.atol, self.kinds)), r.graph_cuts, r.imag_dropped,
                s.overflow, s.underflow, s.subnormal, s.max_rel_err, s.inexact, s.numel)

    @property
    def violations(self) -> List[Record]:
        """The records that are violations under this report's rtol, atol
        and kinds."""
        return [r for r in self.records if r.violations(self.rtol, self.atol, self.kinds)]

    def undone_upcasts(self) -> List[Tuple[Record, Record]]:
        """The program's upcasts that autocast undoes at the same line: a
        ``cast`` A -> B (``x.float()``) and an ``autocast`` B -> A in the same
        module and line (``x.float() @ w.float()`` under bfloat16 autocast:
        the matmul runs in bfloat16 all the same).

        Returns:
            (the program's cast, autocast's cast) pairs.
        """
        return undone_upcasts(self.records)

    @property
    def nonfinite(self) -> List[NonFiniteOrigin]:
        """The ops that made NaN/inf from finite inputs and the entries of
        NaN/inf no watched op made, in the order they happened
        (``track(nonfinite=...)``; empty without it)."""
        self._refresh()
        with self._lock:
            return list(self._origins)

    @property
    def first_nonfinite(self) -> Optional[NonFiniteOrigin]:
        """The origin most likely to be the cause, or None: the first (in
        time) whose NaN/inf reached the block's outputs, the loss or the
        gradients (one never absorbed before one also absorbed in other
        steps); where none did, the first undecided, then the first absorbed
        one (``NonFiniteOrigin.reached``, ``reach_rank``). ``nonfinite[0]``
        is the first in time."""
        origins = self.nonfinite
        if not origins:
            return None
        return min(origins, key=lambda o: reach_rank(o.reached, o.absorbed_steps))  # the first

    @property
    def propagated(self) -> int:
        """How many op calls made NaN/inf only because an input held some."""
        self._refresh()
        return self._propagated

    @property
    def health(self) -> List[ModuleHealth]:
        """Per module, phase ("forward": its outputs; "backward": the
        gradients flowing into it) and dtype, the merged
        ``torchcast.TensorHealth`` (``track(health=True)``; empty without
        it), worst first: non-finite values, then the fewest binades between
        amax and the dtype's largest value, then the most zero and subnormal
        elements."""
        self._refresh()
        return list(self._health)

    def headroom(self, dtype: Union[torch.dtype, str],
                 scale: Union[None, float, str] = None) -> Union[HeadroomTable,
                                                                  BlockHeadroomTable]:
        """What casting each module's outputs and gradients to ``dtype``
        would do, exactly: from their histograms (``track(health=True)``),
        or for a block-scaled format from real block casts of them
        (``track(health=True, block_formats=...)``).

        Args:
            dtype: torch.float16, torch.bfloat16, torch.float8_e4m3fn or
                torch.float8_e5m2; or a block format: "mxfp8_e4m3",
                "mxfp8_e5m2", "mxfp4" or "nvfp4" (blocks along the last
                dimension, each block scaled by its format's rule).
            scale: None (no scaling), a power of two, or "amax": per entry,
                the scale ``safe_to(..., scale="amax_pow2")`` would use, the
                largest power of two s with ``amax * s <= finfo(dtype).max``
                (docs/scaling.md). None for a block format (its scales are
                its own).

        Returns:
            A HeadroomTable, or for a block format a BlockHeadroomTable
            (``str()`` prints it, worst first; ``.rows``).

        Raises:
            RuntimeError: the report has no module health.
            ValueError: a block format that was not measured, or a scale
                given with one.
        """
        self._check_health("headroom")
        if isinstance(dtype, str):
            if scale is not None:
                raise ValueError(f"torchcast.Report.headroom: {dtype} scales each block by its "
                                 "own rule; leave scale=None")
            if dtype not in self.block_formats:
                raise ValueError(f"torchcast.Report.headroom: {dtype!r} was not measured; "
                                 f"track(health=True, block_formats=({dtype!r},)) measures it")
            return BlockHeadroomTable(dtype, [r for r in self.block_rows if r.format == dtype])
        return headroom_table(self.health, dtype, scale)

    def headroom_summary(self) -> str:
        """Every module entry's headroom in every format, as one compact
        table (what ``python -m torchcast track --health`` prints): per
        format, the elements a cast loses to overflow and to underflow at
        scale 1, and where it loses any, at the entry's power-of-two amax
        scale; entries that lose nothing anywhere are counted, not listed.
        ``headroom(dtype, scale)`` gives one format's full table.

        Returns:
            The table's text.
        """
        self._check_health("headroom_summary")
        return "\n".join(headroom_lines(self.health))

    def _check_health(self, method: str) -> None:
        self._refresh()
        if not self.health_tracked:
            raise RuntimeError(f"torchcast.Report.{method}: this report has no module "
                               "health; record it with torchcast.track(health=True)")

    def __len__(self) -> int:
        self._refresh()
        return len(self.casts)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def table(self, limit: Optional[int] = None) -> str:
        """The report as text: the non-finite origins, the cast sites worst
        first, module health, updates and compiled regions.

        Args:
            limit: show only the ``limit`` worst sites (None: all).

        Returns:
            A summary line, then one line per site, then the other sections.
        """
        return render_table(self.to_dict(), limit)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<torchcast.Report: {len(self)} sites>"

    # -- the dict form ----------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-ready values, for ``from_dict`` (report_dict.py
        lists the sections).

        Returns:
            {"format", "version", "rtol", "atol", "violations", "records":
            [Record.to_dict()]}; each record also lists its "violations".
            With non-finite tracking, "nonfinite" (the origins) and
            "propagated"; with health, "health" and "headroom" rows. Every
            non-finite float is the string "inf", "-inf" or "nan" (see
            ``to_json``).
        """
        self._refresh()
        return report_to_dict(self)

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as strict JSON (RFC 8259), which any JSON parser
        reads without options.

        Strict JSON has no inf or NaN, and they are this report's data (a
        cast whose every element overflowed has an infinite max rel err; an
        origin's input may hold inf): every float field holds either a
        number or one of the strings "inf", "-inf", "nan", which
        ``float()`` turns back into the float and ``from_json`` reads back
        as floats. One exception, older than this rule: a health row's
        "min_nonzero" is null when no element is nonzero (the float is inf).

        Args:
            **kwargs: passed to json.dumps (e.g. ``indent``).
        """
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    def write_json(self, path: str, **kwargs: Any) -> None:
        """Writes ``to_json()`` to ``path``, atomically: the text is made
        first, so a failure leaves no empty or partial file.

        Args:
            path: the file to write (replaced if it exists).
            **kwargs: passed to json.dumps (e.g. ``indent``).
        """
        write_text(path, self.to_json(**kwargs))

    def to_html(self, path: str, plan: Any = None) -> None:
        """Writes the report as one self-contained HTML page (inline CSS and
        SVG; no script, nothing fetched): non-finite origins, the cast sites,
        each module's exponent histogram over the formats' windows, headroom,
        and a precision plan when one is given.

        Args:
            path: the file to write (atomically: the page is rendered first,
                so a failure leaves no empty or partial file).
            plan: a ``torchcast.PrecisionPlan`` (from ``precision_plan``) to
                show: which nn.Linear to keep in bf16 per recipe, and why.
        """
        write_text(path, render_html(self.to_dict(),
                                     plan.to_dict() if plan is not None else None))

    def to_tensorboard(self, writer: Any, step: int, prefix: str = "torchcast") -> None:
        """Writes the report's figures as scalars and histograms at ``step``
        (torchcast.tracker.tensorboard lists the tags).

        Args:
            writer: anything with ``add_scalar`` and ``add_histogram`` (or
                ``add_histogram_raw``): torch.utils.tensorboard.SummaryWriter.
            step: the global step.
            prefix: the first component of every tag.
        """
        write_tensorboard(self.to_dict(), writer, step, prefix)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Report":
        """Reads a report back from ``to_dict``'s form.

        Args:
            data: what ``to_dict`` returned (ValueError for anything else).

        Returns:
            A Report equal to the one written, section by section.
        """
        check_format(data)
        report = cls(float_from_json(data.get("rtol"), "rtol"),
                     float_from_json(data.get("atol"), "atol"), data.get("violations"))
        merge_dict(report, data)
        report.ranks = data.get("ranks")
        report.sent_nonfinite = list(data.get("sent_nonfinite", ()))
        return report

    @classmethod
    def from_json(cls, text: str) -> "Report":
        """Reads a report back from ``to_json``'s text.

        Args:
            text: what ``to_json`` returned.

        Returns:
            A Report with the same records.
        """
        return cls.from_dict(json.loads(text))

    def merge(self, data: Dict[str, Any]) -> None:
        """Merges another report's dict form into this one, every section
        (a worker process's records and origins; report_dict.merge_dict).

        Args:
            data: ``Report.to_dict()`` of another report, or part of it.
        """
        merge_dict(self, data)

    def clear(self) -> None:
        """Forgets every cast and origin (a forked worker starts from nothing)."""
        self.casts.clear()
        with self._lock:
            self._origins, self._propagated = [], 0

    # -- ranks ------------------------------------------------------------------
    def merge_ranks(self, dst: Optional[int] = 0, group: Optional[Any] = None
                    ) -> Optional["Report"]:
        """One report of every rank's: each section of each rank's dict form
        merged (report_dict.merge_ranks_dicts): casts by site; non-finite
        origins, each with its ``rank``, by step, then made on a rank before
        arrived through a collective; health, block headroom and update rows
        labelled "[rank N] module". One ``gather_object``
        (``all_gather_object`` with dst=None); every rank of ``group`` calls
        it once, after the track.

        Args:
            dst: the rank that receives the merged report (None: every rank).
            group: the torch.distributed process group (None: the world).

        Returns:
            A new Report on ``dst`` (on every rank with dst=None), None on
            the other ranks.
        """
        gathered = _gather(self, dst, group, "merge_ranks")
        if gathered is None:
            return None
        merged = Report(self.rtol, self.atol, str(self.kinds))
        merge_ranks_dicts(merged, gathered)
        return merged

    def all_reduce(self, group: Optional[Any] = None) -> "Report":
        """``merge_ranks(dst=None)`` in place: this report becomes the merged
        report of every rank, every section (each rank calls it once, like
        ``torch.distributed.all_reduce`` on a tensor).

        Args:
            group: the torch.distributed process group (None: the world).

        Returns:
            self.
        """
        gathered = _gather(self, None, group, "all_reduce")
        self.__init__(self.rtol, self.atol, str(self.kinds))
        merge_ranks_dicts(self, gathered)
        return self


def _gather(report: Report, dst: Optional[int], group: Any, method: str
            ) -> Optional[List[Dict[str, Any]]]:
    """Every rank's ``{"rank", "report": to_dict(), "sent"}`` on ``dst``
    (every rank with None), None on the others: one collective."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"torchcast.Report.{method}: torch.distributed is not initialized; "
                           "call torch.distributed.init_process_group first")
    payload = {"rank": dist.get_rank(), "report": report.to_dict(),
               "sent": list(report.sent_nonfinite)}
    world = dist.get_world_size(group)
    if dst is None:
        gathered = [None] * world
        dist.all_gather_object(gathered, payload, group=group)
        return gathered
    gathered = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(payload, gathered, dst=dst, group=group)
    return gathered if dist.get_rank() == dst else None


__all__ = ["Record", "Report", "SiteKey"]
