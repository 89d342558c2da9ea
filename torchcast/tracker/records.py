"""The casts of a track as data: ``Record``, one site's merged casts, and
``CastSites``, where a track's casts accumulate (stats kept as tensors on
their device until read).
"""
import dataclasses
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..stats import STAT_FIELDS, CastStats, dtype_from_name, merge_stats_tensors
from ..violations import Violations, ViolationsSpec
from .json_floats import json_float
from .sites import short_path

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

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Record":
        """A Record from its ``to_dict()`` form (read back from JSON too)."""
        src_dtype, dtype = dtype_from_name(d["src_dtype"]), dtype_from_name(d["dtype"])
        stats = CastStats.from_values([float(d["stats"][f]) for f in STAT_FIELDS], src_dtype,
                                      dtype)
        return cls(d["module"], d["file"], d["line"], d["origin"], d["name"], src_dtype, dtype,
                   d["calls"], stats, d["measured"], d["graph_cuts"], d["imag_dropped"],
                   d["double_rounded"], d.get("via"))


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


class CastSites:
    """The casts of a track, merged by site (``SiteKey``): every cast's stats
    stay tensors on its device, stacked and merged every COLLAPSE casts,
    until they are read (``records``: one transfer per device)."""

    def __init__(self):
        self._sites: Dict[SiteKey, _Site] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sites)

    def add(self, key: SiteKey, stats: Optional[torch.Tensor], *, measured: bool,
            calls: int = 1, numel: int = 0, graph_cuts: int = 0,
            imag: Optional[Count] = None, double_rounded: Optional[Count] = None) -> None:
        """Merges casts into the site ``key``: one tracked cast, or a
        serialized record's many. Thread-safe; never synchronizes.

        Args:
            key: the site.
            stats: the casts' stats tensor (None: nothing measured).
            measured: whether the loss is measured at this site (a new site).
            calls: how many casts this is.
            numel: elements of casts without a stats tensor.
            graph_cuts: how many of the casts cut the autograd graph.
            imag: elements whose nonzero imaginary part was dropped.
            double_rounded: elements PyTorch rounded twice to another value.
        """
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = self._sites[key] = _Site(measured)
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

    def add_record(self, r: Dict[str, Any]) -> None:
        """Merges a record in ``Record.to_dict()``'s form (another rank's, a
        worker process's)."""
        key = (r["module"], r["file"], r["line"], r["origin"], r["name"],
               dtype_from_name(r["src_dtype"]), dtype_from_name(r["dtype"]), r.get("via"))
        # float() reads the strings "inf", "-inf" and "nan" of non-finite stats.
        stats = torch.tensor([float(r["stats"][f]) for f in STAT_FIELDS], dtype=torch.float64)
        self.add(key, stats, measured=r["measured"], calls=r["calls"],
                 graph_cuts=r["graph_cuts"], imag=r["imag_dropped"],
                 double_rounded=r["double_rounded"])

    def clear(self) -> None:
        """Forgets every site (a forked worker starts from nothing)."""
        with self._lock:
            self._sites = {}

    def records(self) -> List[Record]:
        """The sites as Records, in the order they were first met (one
        synchronization per device)."""
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
        return records


def undone_upcasts(records: List[Record]) -> List[Tuple[Record, Record]]:
    """``Report.undone_upcasts`` of these records."""
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
