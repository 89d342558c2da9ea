"""Record and Report: the casts of a track() block merged by site, read
back (one transfer per device), printed, serialized, and merged across
ranks. Until read, a site's stats stay tensors on the cast's device."""
import dataclasses
import json
import math
import os
import secrets
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..stats import (STAT_FIELDS, CastStats, dtype_from_name, merge_stats_tensors,
                     short_dtype_name)
from ..violations import Violations, ViolationsSpec
from .health import (FORMATS, HeadroomRow, HeadroomTable, HealthWatch, ModuleHealth,
                     headroom_lines, headroom_table, health_lines)
from .html import render_html
from .nonfinite import NonFiniteWatch
from .nonfinite_origin import NonFiniteOrigin, reach_rank
from .regions import CompiledRegion
from .sites import short_path
from .tensorboard import write_tensorboard

# (module, file, line, origin, name, src_dtype, dtype, via): casts with the
# same key merge into one Record.
SiteKey = Tuple[Optional[str], str, int, str, Optional[str], torch.dtype, torch.dtype,
                Optional[str]]

_LOSS_COLUMNS = ("inexact", "nan", "overflow", "saturated", "underflow", "subnormal")

# Strict JSON has no inf or NaN, yet they are what a report exists for (a
# cast whose every element overflowed, an op's infinite input): a float field
# of to_dict() holds a number or one of these strings, which any JSON parser
# reads and float() turns back into the float.
NONFINITE_STRINGS = ("inf", "-inf", "nan")


def json_float(value: Any) -> Any:
    """``value`` with every non-finite float in it (inside dicts and lists
    too) as "inf", "-inf" or "nan"; anything else unchanged.

    Args:
        value: a JSON-ready value (dicts, lists, numbers, strings, None).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # Python never writes "-nan"
    if isinstance(value, dict):
        return {k: json_float(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_float(v) for v in value]
    return value


def float_from_json(value: Any, field: str) -> Any:
    """The float a to_dict() float field holds: a number (or None) as it
    is, "inf"/"-inf"/"nan" as the float.

    Args:
        value: the field's value.
        field: its name, for the error.

    Raises:
        ValueError: a string other than those three.
    """
    if isinstance(value, str):
        if value not in NONFINITE_STRINGS:
            raise ValueError(f"torchcast.Report.from_dict: {field} must be a number or one of "
                             f"{', '.join(map(repr, NONFINITE_STRINGS))}, got {value!r}")
        return float(value)
    return value


def _phrase_kind(phrase):
    """The kind a violation phrase names ("12 overflow" -> "overflow",
    "max rel err > rtol=1e-3" -> "rtol=1e-3")."""
    if phrase.startswith("max "):
        return phrase.split("> ")[-1]
    return phrase.split(" ", 1)[1].replace("graph cuts", "graph cut")


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


def undone_upcast_message(up: Record) -> str:
    """What to say of a program's upcast that autocast undoes at its line."""
    src, dst = short_dtype_name(up.src_dtype), short_dtype_name(up.dtype)
    return (f"this upcast {src}->{dst} has no effect under autocast, which casts the op's "
            f"inputs back to {src} at the same line; wrap the region in "
            "torch.autocast(..., enabled=False) to compute it in " + dst)


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

    def headroom(self, dtype: torch.dtype,
                 scale: Union[None, float, str] = None) -> HeadroomTable:
        """What casting each module's outputs and gradients to ``dtype``
        would do, exactly, from their histograms (``track(health=True)``).

        Args:
            dtype: torch.float16, torch.bfloat16, torch.float8_e4m3fn or
                torch.float8_e5m2.
            scale: None (no scaling), a power of two, or "amax": per entry,
                the scale ``safe_to(..., scale="amax_pow2")`` would use, the
                largest power of two s with ``amax * s <= finfo(dtype).max``
                (docs/scaling.md).

        Returns:
            A HeadroomTable (``str()`` prints it, worst first; ``.rows``).
        """
        if self.health_watch is None:
            raise RuntimeError("torchcast.Report.headroom: this report has no module health; "
                               "record it with torchcast.track(health=True)")
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
        records = self.records
        lines = _nonfinite_lines(self)
        shown = records if limit is None else records[:limit]
        bad = sum(1 for r in records if r.violations(self.rtol, self.atol, self.kinds))
        calls = sum(r.calls for r in records)
        head = (f"torchcast.track: {len(records)} cast sites, {calls} casts, "
                f"{bad} with violations (worst first)")
        if not records:  # a track that only watches says nothing of casts
            only_watching = lines or self.health_watch is not None
            return "\n".join((lines if only_watching else [head]) + self._health_lines()
                             + self._region_lines())
        rows = [("site", "origin", "calls", "dtypes", "elements", *_LOSS_COLUMNS, "max rel err",
                 "violations", "notes")]
        for r in shown:
            s = r.stats
            losses = ([str(getattr(s, c)) for c in _LOSS_COLUMNS] + [f"{s.max_rel_err:.3g}"]
                      if r.measured else ["-"] * (len(_LOSS_COLUMNS) + 1))
            found = r.violations(self.rtol, self.atol, self.kinds)
            flagged = ", ".join(_phrase_kind(p) for p in found)
            notes = [n for n in r.notes(self.kinds) if _phrase_kind(n).split()[0] not in _LOSS_COLUMNS]
            if r.double_rounded:
                notes.append(f"{r.double_rounded} double-rounded by torch")
            if r.origin.startswith("promotion"):
                notes.append(f"a float64 operand made the result float64: the "
                             f"{short_dtype_name(r.src_dtype)} operands were computed on in "
                             "float64")
            rows.append((r.site, r.origin, str(r.calls),
                         f"{short_dtype_name(r.src_dtype)}->{short_dtype_name(r.dtype)}",
                         str(s.numel), *losses, flagged, "; ".join(notes)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines.append(head)
        for row in rows:
            cells = [c.ljust(w) if i in (0, 1, 3, len(row) - 2, len(row) - 1) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
        if len(shown) < len(records):
            lines.append(f"... {len(records) - len(shown)} more sites")
        for up, back in self.undone_upcasts():
            lines.append(f"{up.site}: {undone_upcast_message(up)}")
        return "\n".join(lines + self._health_lines() + self._region_lines())

    def _health_lines(self):
        return health_lines(self.health_watch) if self.health_watch is not None else []

    def _region_lines(self):
        regions = self.compiled_regions
        if not regions:
            return []
        n = len(regions)
        return ([f"torchcast.track: {n} torch.compile'd region{'s' if n != 1 else ''} with "
                 "what this track could not watch inside:"]
                + [f"  {r.describe()}" for r in regions])

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
        records = []
        for r in self.records:
            record = r.to_dict()
            record["violations"] = r.violations(self.rtol, self.atol, self.kinds)
            records.append(record)
        data = {"format": "torchcast.track.Report", "version": 1, "rtol": self.rtol,
                "atol": self.atol, "violations": str(self.kinds), "records": records}
        if self.nonfinite_watch is not None:
            data["nonfinite"] = [o.to_dict() for o in self.nonfinite]
            data["propagated"] = self.propagated
        if self.compiled_regions:
            data["compiled_regions"] = [r.to_dict() for r in self.compiled_regions]
        if self.health_watch is not None:
            # On the host once: each row is read for 8 headroom entries.
            rows = [dataclasses.replace(r, health=r.health.cpu()) for r in self.health]
            data["health"] = [r.to_dict() for r in rows]
            data["headroom"] = [
                HeadroomRow(r.module, r.phase, r.dtype, r.headroom(fmt, scale)).to_dict()
                for r in rows for fmt in FORMATS for scale in (None, "amax")]
        # The records' stats are encoded already; this covers rtol/atol, the
        # origins' input amax, the health extrema and any float added later.
        return json_float(data)

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

    def to_html(self, path: str) -> None:
        """Writes the report as one self-contained HTML page (inline CSS and
        SVG; no script, nothing fetched): non-finite origins, the cast sites,
        each module's exponent histogram over the formats' windows, headroom.

        Args:
            path: the file to write (atomically: the page is rendered first,
                so a failure leaves no empty or partial file).
        """
        write_text(path, render_html(self.to_dict()))

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
        if data.get("format") != "torchcast.track.Report":
            raise ValueError("torchcast.Report.from_dict: not a torchcast.track report "
                             f"(format={data.get('format')!r})")
        report = cls(float_from_json(data.get("rtol"), "rtol"),
                     float_from_json(data.get("atol"), "atol"), data.get("violations"))
        report.merge_records(data["records"])
        if "nonfinite" in data:
            watch = report.nonfinite_watch = NonFiniteWatch("record")
            watch.propagated = data.get("propagated", 0)
            for d in data["nonfinite"]:
                origin = _origin_from_dict(d)
                watch.origins[origin.key] = origin
        report.compiled_regions = [CompiledRegion.from_dict(d)
                                   for d in data.get("compiled_regions", ())]
        if "health" in data:
            rows = [dict(d, **{k: float_from_json(d[k], f"a health row's {k}")
                               for k in ("amax", "min_nonzero")}) for d in data["health"]]
            report.health_watch = HealthWatch.from_dicts(rows)
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
                origin = _origin_from_dict(d)
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


def _origin_from_dict(d: Dict[str, Any]) -> NonFiniteOrigin:
    """A NonFiniteOrigin from its to_dict() form, an input's amax possibly
    one of the strings "inf", "-inf", "nan"."""
    d = dict(d, inputs=[dict(i, amax=float_from_json(i["amax"], "an input's amax"))
                        for i in d["inputs"]])
    return NonFiniteOrigin.from_dict(d)


def _nonfinite_lines(report: Report) -> List[str]:
    """The table's opening lines on non-finite origins (none without a watch)."""
    if report.nonfinite_watch is None:
        return []
    origins = report.nonfinite
    reached = sum(1 for o in origins if o.reached)
    absorbed = sum(1 for o in origins if o.reached is False)
    lines = [f"torchcast.track: {len(origins)} op{'' if len(origins) == 1 else 's'} made NaN/inf "
             f"from finite inputs ({reached} reached the outputs, loss or gradients, listed "
             f"first; {absorbed} absorbed; each in time order), {report.propagated} op calls "
             "passed NaN/inf on"]
    # A stable sort: time order within each rank.
    for o in sorted(origins, key=lambda o: reach_rank(o.reached, o.absorbed_steps)):
        calls = f" [{o.count} calls]" if o.count > 1 else ""
        lines.append(f"  {o.describe()}{calls}")
    return lines


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


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: into a new file beside it,
    then renamed over it, so that a reader (or a crash) never sees an empty
    or partial report. The new file gets the mode ``open()`` would give.

    Args:
        path: the file to write (a symlink is written through).
        text: the contents (UTF-8).
    """
    path = os.path.realpath(path)
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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
