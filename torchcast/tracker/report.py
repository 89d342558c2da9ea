"""Record and Report: the casts of a track() block merged by site, read
back (one transfer per device), and merged across ranks and processes.
Until read, a site's stats stay tensors on the cast's device.

Report's methods are where its users call them; those that write it out
delegate: to report_table.py (the text table), report_dict.py (the dict
form, JSON, and atomic writes), html.py and tensorboard.py.
"""
import dataclasses
import json
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..stats import STAT_FIELDS, CastStats, dtype_from_name, merge_stats_tensors
from ..violations import Violations, ViolationsSpec
from .block_headroom import BlockHeadroomTable
from .health import HeadroomTable, HealthWatch, ModuleHealth, headroom_lines, headroom_table
from .html import render_html
from .nonfinite import NonFiniteWatch
from .nonfinite_origin import NonFiniteOrigin, reach_rank
from .regions import CompiledRegion
from .report_dict import (json_float, origin_from_dict, report_from_dict, report_to_dict,
                          write_text)
from .report_table import render_table
from .sites import short_path
from .tensorboard import write_tensorboard

# (module, file, line, origin, name, src_dtype, dtype, via): casts with the
# same key merge into one Record.
SiteKey = Tuple[Optional[str], str, int, str, Optional[str], torch.dtype, torch.dtype,
                Optional[str]]


@dataclasses.dataclass(frozen=True)
class Record:
    """The merged casts of one site: a module (None outside any forward), a
    source line, an origin ("cast", "copy_", "autocast", "backward" or
    "safe_to"), a safe_to name, and a dtype pair.

    ``stats`` merges every call's CastStats (elements of complex casts count
    real components when both sides are complex). ``measured`` is false where
    the loss is not measured (float -> integer casts, float8_e4m3fn <->
    float8_e5m2, formats torchcast does not know): then
    only ``stats.numel`` is set. ``graph_cuts`` counts casts of a tensor that
    required grad to an integer or bool dtype; ``imag_dropped`` the elements
    whose nonzero imaginary part a complex -> real cast dropped;
    ``double_rounded`` the elements where PyTorch's float64 ->
    float16/bfloat16/float8 cast (rounded twice, through float32) differs from the
    correctly rounded value: ``stats`` measure PyTorch's value. ``file`` and
    ``line`` are the user's (outside torch, torchcast and libraries); ``via``
    is the library frame the cast came through ("path:line"), if any."""

    module: Optional[str]
    file: str
    line: int
    origin: str
    name: Optional[str]
    src_dtype: torch.dtype
    dtype: torch.dtype
    calls: int
    stats: CastStats
    measured: bool = True
    graph_cuts: int = 0
    imag_dropped: int = 0
    double_rounded: int = 0
    via: Optional[str] = None

    @property
    def key(self) -> SiteKey:
        """(module, file, line, origin, name, src_dtype, dtype, via): what
        identifies the site."""
        return (self.module, self.file, self.line, self.origin, self.name, self.src_dtype,
                self.dtype, self.via)

    @property
    def site(self) -> str:
        """The site as printed: "module file:line safe_to(name) via lib.py:N"."""
        where = f"{short_path(self.file)}:{self.line}"
        what = (f" safe_to({self.name})" if self.name else "") + \
            (f" via {self.via}" if self.via else "")
        return f"{self.module} {where}{what}" if self.module else f"{where}{what}"

    def violations(self, rtol: Optional[float] = None, atol: Optional[float] = None,
                   kinds: ViolationsSpec = None) -> List[str]:
        """What makes this site a violation.

        Args:
            rtol, atol: the tolerances to check max_rel_err and max_abs_err
                against (None: not checked).
            kinds: which losses count, as track's ``violations`` (None:
                ``torchcast.violations.DEFAULT``); fractions are of the
                site's elements.

        Returns:
            One phrase per kind of violation, e.g. "12 overflow" (empty
            list: none).
        """
        return Violations(kinds).found(self.stats if self.measured else None, self.graph_cuts,
                                       self.imag_dropped, rtol, atol)

    def notes(self, kinds: ViolationsSpec = None) -> List[str]:
        """The losses of this site that ``kinds`` does not count as
        violations (e.g. "3 subnormal" under the default)."""
        return Violations(kinds).notes(self.stats if self.measured else None)

    def to_dict(self) -> Dict[str, Any]:
        """The record as JSON-ready values: dtypes as strings, non-finite
        stats (the maxima of a cast that all overflowed, an infinite or NaN
        ``sqnr_db``) as the strings "inf", "-inf" or "nan" (``json_float``),
        which ``float()`` reads back."""
        stats = self.stats.to_dict()
        for name in ("src_dtype", "dtype"):
            stats.pop(name)
        stats = json_float(stats)
        return {
            "site": self.site, "module": self.module, "file": self.file, "line": self.line,
            "via": self.via, "origin": self.origin, "name": self.name,
            "src_dtype": str(self.src_dtype),
            "dtype": str(self.dtype), "calls": self.calls, "measured": self.measured,
            "graph_cuts": self.graph_cuts, "imag_dropped": self.imag_dropped,
            "double_rounded": self.double_rounded, "stats": stats,
        }


class _Site:
    __slots__ = ("calls", "buf", "numel", "measured", "graph_cuts", "imag", "double_rounded")
    COLLAPSE = 64  # merge the pending stats tensors of a site every COLLAPSE casts

    def __init__(self, measured):
        self.calls, self.buf, self.numel, self.measured = 0, [], 0, measured
        self.graph_cuts, self.imag, self.double_rounded = 0, 0, 0

    def merged(self):
        if not self.buf:
            return None
        if len(self.buf) == 1:
            return self.buf[0]
        device = self.buf[0].device
        return merge_stats_tensors(torch.stack([b.to(device) for b in self.buf]))


Count = Union[int, torch.Tensor]


class Report:
    """The casts recorded by ``torchcast.track``, merged by site.

    ``records`` lists them worst first (violations first, then by max rel
    err); ``str(report)`` is that list as a table; ``to_dict``/``to_json`` for
    loggers (``Report.from_json`` reads it back); ``all_reduce()`` merges the
    reports of all torch.distributed ranks. Reading the report synchronizes
    with the device once; recording never does under policy "record".

    Args:
        rtol, atol: the tolerances that make a site a violation (None: not
            checked), as given to track().
        violations: which losses make a site a violation, as given to
            track() (None: ``torchcast.violations.DEFAULT``).

    Attributes:
        kinds (torchcast.violations.Violations): ``violations``, parsed.
    """

    def __init__(self, rtol: Optional[float] = None, atol: Optional[float] = None,
                 violations: ViolationsSpec = None):
        self.rtol, self.atol = rtol, atol
        self.kinds = Violations(violations)
        self.nonfinite_watch: Optional[NonFiniteWatch] = None
        self.health_watch: Optional[HealthWatch] = None
        # torch.compile'd regions that ran in the block with something this
        # track could not watch inside them (regions.py).
        self.compiled_regions: List[CompiledRegion] = []
        # What rounding did to the updates of the torchcast optimizers that
        # stepped in the block with track_updates=True (updates.py): rows.
        self.updates: List[Dict[str, Any]] = []
        # Set when the block was left by an exception (its name and message),
        # KeyboardInterrupt included: the report holds what was known then.
        self.ended_by: Optional[str] = None
        self._sites = {}
        self._lock = threading.Lock()

    # -- reading ----------------------------------------------------------------
    @property
    def records(self) -> List[Record]:
        """The sites as Records, worst first (one synchronization per device)."""
        with self._lock:
            items = [(key, site, site.merged()) for key, site in self._sites.items()]
        values = _to_host([merged for _, _, merged in items]
                          + [site.imag for _, site, _ in items]
                          + [site.double_rounded for _, site, _ in items])
        n = len(items)
        records = []
        for i, (key, site, merged) in enumerate(items):
            module, file, line, origin, name, src_dtype, dtype, via = key
            if merged is None:
                stats = CastStats(src_dtype, dtype, numel=site.numel)
            else:
                stats = CastStats.from_values(values[i], src_dtype, dtype)
                stats = dataclasses.replace(stats, numel=stats.numel + site.numel)
            records.append(Record(module, file, line, origin, name, src_dtype, dtype, site.calls,
                                  stats, site.measured, site.graph_cuts,
                                  int(values[n + i]), int(values[2 * n + i]), via))
        records.sort(key=self._severity, reverse=True)
        return records

    def _severity(self, r):
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
        records = self.records
        autocasts = {(r.module, r.file, r.line, r.src_dtype, r.dtype): r
                     for r in records if r.origin == "autocast"}
        pairs = []
        for r in records:
            if r.origin != "cast" or r.dtype is None or r.src_dtype is None:
                continue
            back = autocasts.get((r.module, r.file, r.line, r.dtype, r.src_dtype))
            if back is not None and r.dtype.itemsize > r.src_dtype.itemsize:
                pairs.append((r, back))
        return pairs

    @property
    def nonfinite(self) -> List[NonFiniteOrigin]:
        """The ops that made NaN/inf from finite inputs, in the order they
        happened (``track(nonfinite=...)``; empty without it)."""
        watch = self.nonfinite_watch
        if watch is None:
            return []
        watch.flush()
        with watch.lock:
            return list(watch.origins.values())

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
        watch = self.nonfinite_watch
        if watch is None:
            return 0
        watch.flush()
        return watch.propagated

    @property
    def health(self) -> List[ModuleHealth]:
        """Per module, phase ("forward": its outputs; "backward": the
        gradients flowing into it) and dtype, the merged
        ``torchcast.TensorHealth`` (``track(health=True)``; empty without
        it), worst first: non-finite values, then the fewest binades between
        amax and the dtype's largest value, then the most zero and subnormal
        elements."""
        return self.health_watch.rows() if self.health_watch is not None else []

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
        if self.health_watch is None:
            raise RuntimeError("torchcast.Report.headroom: this report has no module health; "
                               "record it with torchcast.track(health=True)")
        if isinstance(dtype, str):
            if scale is not None:
                raise ValueError(f"torchcast.Report.headroom: {dtype} scales each block by its "
                                 "own rule; leave scale=None")
            if dtype not in self.health_watch.block_formats():
                raise ValueError(f"torchcast.Report.headroom: {dtype!r} was not measured; "
                                 f"track(health=True, block_formats=({dtype!r},)) measures it")
            return BlockHeadroomTable(dtype, [r for r in self.health_watch.block_rows()
                                              if r.format == dtype])
        return headroom_table(self.health_watch, dtype, scale)

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
        if self.health_watch is None:
            raise RuntimeError("torchcast.Report.headroom_summary: this report has no module "
                               "health; record it with torchcast.track(health=True)")
        return "\n".join(headroom_lines(self.health_watch))

    def __len__(self) -> int:
        return len(self._sites)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def table(self, limit: Optional[int] = None) -> str:
        """The records as a table, worst first.

        Args:
            limit: show only the ``limit`` worst sites (None: all).

        Returns:
            A summary line, then one line per site.
        """
        return render_table(self, limit)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<torchcast.Report: {len(self)} sites>"

    # -- serializing and merging ------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-ready values, for ``from_dict``.

        Returns:
            {"format", "version", "rtol", "atol", "violations", "records":
            [Record.to_dict()]}; each record also lists its "violations".
            With non-finite tracking, "nonfinite" (the origins) and
            "propagated"; with health, "health" and "headroom" rows. Every
            non-finite float is the string "inf", "-inf" or "nan" (see
            ``to_json``).
        """
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
            A Report with the same records.
        """
        return report_from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "Report":
        """Reads a report back from ``to_json``'s text.

        Args:
            text: what ``to_json`` returned.

        Returns:
            A Report with the same records.
        """
        return cls.from_dict(json.loads(text))

    def clear(self) -> None:
        """Forgets every record (a forked worker starts from nothing)."""
        with self._lock:
            self._sites = {}

    def merge_records(self, records: List[Dict[str, Any]]) -> None:
        """Merges records in ``to_dict()["records"]``'s form into this report
        (another rank's, a worker process's).

        Args:
            records: the records, as ``Record.to_dict`` gives them.
        """
        for r in records:
            key = (r["module"], r["file"], r["line"], r["origin"], r["name"],
                   dtype_from_name(r["src_dtype"]), dtype_from_name(r["dtype"]), r.get("via"))
            # float() reads the strings "inf", "-inf" and "nan" of non-finite stats.
            stats = torch.tensor([float(r["stats"][f]) for f in STAT_FIELDS], dtype=torch.float64)
            merge_into(self, key, stats, measured=r["measured"], calls=r["calls"],
                       graph_cuts=r["graph_cuts"], imag=r["imag_dropped"],
                       double_rounded=r["double_rounded"])

    def merge_nonfinite(self, origins: List[Dict[str, Any]], propagated: int = 0) -> None:
        """Merges non-finite origins in ``to_dict()["nonfinite"]``'s form (a
        worker process's) into this report's, which stay in the order they
        happened: by their ``time``, the machine's clock (origins without one
        come last, in the order given). An origin already here adds its count.

        Args:
            origins: the origins, as ``NonFiniteOrigin.to_dict`` gives them.
            propagated: op calls that only passed NaN/inf on, to add.
        """
        if not origins and not propagated:
            return
        watch = self.nonfinite_watch
        if watch is None:
            watch = self.nonfinite_watch = NonFiniteWatch("record")
        with watch.lock:
            watch.propagated += propagated
            for d in origins:
                origin = origin_from_dict(d)
                known = watch.origins.get(origin.key)
                if known is None:
                    watch.origins[origin.key] = origin
                else:
                    known.count += origin.count
            ordered = sorted(watch.origins.items(),
                             key=lambda item: (item[1].time is None, item[1].time or 0.0))
            watch.origins.clear()
            watch.origins.update(ordered)

    def all_reduce(self, group: Optional[Any] = None) -> "Report":
        """Merges this report with the same report on every rank, in place,
        on every rank. Each call adds the other ranks' records again, like
        ``torch.distributed.all_reduce`` on a tensor: call it once.

        Args:
            group: the torch.distributed process group (None: the world).

        Returns:
            self.
        """
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torchcast.Report.all_reduce: torch.distributed is not "
                               "initialized; call torch.distributed.init_process_group first")
        mine = self.to_dict()["records"]
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        self.clear()
        for records in gathered:
            self.merge_records(records)
        return self

    def merge_ranks(self, dst: Optional[int] = 0, group: Optional[Any] = None
                    ) -> Optional["Report"]:
        """One report of every rank's casts, non-finite origins (each with
        its ``rank``; by step, then made on a rank before arrived through a
        collective) and health rows (labelled "[rank N] module"), gathered
        with one ``gather_object`` (``all_gather_object`` with dst=None).
        Every rank of ``group`` calls it once, after the track (ranks.py).

        Args:
            dst: the rank that receives the merged report (None: every rank).
            group: the torch.distributed process group (None: the world).

        Returns:
            A new Report on ``dst`` (on every rank with dst=None), None on
            the other ranks.
        """
        from .ranks import merge_ranks
        return merge_ranks(self, dst, group)


def merge_into(report: Report, key: SiteKey, stats: Optional[torch.Tensor], *, measured: bool,
               calls: int = 1, numel: int = 0, graph_cuts: int = 0,
               imag: Optional[Count] = None, double_rounded: Optional[Count] = None) -> None:
    """Merges casts into the site ``key`` of ``report``: one tracked cast, or
    a serialized record's many. Thread-safe; never synchronizes.

    Args:
        report: the Report to record into.
        key: the site.
        stats: the casts' stats tensor (None: nothing measured).
        measured: whether the loss is measured at this site (a new site).
        calls: how many casts this is.
        numel: elements of casts without a stats tensor.
        graph_cuts: how many of the casts cut the autograd graph.
        imag: elements whose nonzero imaginary part was dropped.
        double_rounded: elements PyTorch rounded twice to another value.
    """
    with report._lock:
        site = report._sites.get(key)
        if site is None:
            site = report._sites[key] = _Site(measured)
        site.calls += calls
        site.numel += numel
        site.graph_cuts += graph_cuts
        if imag is not None:
            site.imag = site.imag + imag
        if double_rounded is not None:
            site.double_rounded = site.double_rounded + double_rounded
        if stats is not None:
            site.buf.append(stats)
            if len(site.buf) >= _Site.COLLAPSE:
                site.buf = [site.merged()]


def _to_host(values: List[Optional[Count]]) -> list:
    """Lists of Python numbers for a list of tensors (or ints), one transfer
    per device."""
    by_device = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    out = list(values)
    for device, idx in by_device.items():
        flat = torch.cat([values[i].reshape(-1).to(torch.float64) for i in idx]).tolist()
        pos = 0
        for i in idx:
            n = values[i].numel()
            out[i] = flat[pos:pos + n] if values[i].dim() else flat[pos]
            pos += n
    return out
