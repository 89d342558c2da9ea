"""CastStats: what a cast lost, read from the stats tensor of cast_with_stats.

CastStats' fields are the table of statistics: their order is the layout of
every stats tensor (StatIndex in csrc/numerics.h), and each says how the
values of two casts merge. STAT_FIELDS, the count/max/sum groups, CastStats'
``+`` and the merging of stats tensors on the device are built from it."""
import dataclasses
import math
from typing import Dict, Optional, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _stat(merge, default):
    """A statistic of CastStats: ``merge`` says how the values of two casts
    combine ("add" or "max")."""
    assert merge in ("add", "max")
    return dataclasses.field(default=default, metadata={"merge": merge})


def short_dtype_name(dtype: Optional[torch.dtype]) -> str:
    """``dtype`` without the "torch." prefix ("?" for None, a merge of
    different dtypes)."""
    return str(dtype).replace("torch.", "") if dtype is not None else "?"


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a report names ("torch.float16" or "float16"); ValueError
    for a name that is not one."""
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torchcast: unknown dtype {name!r} in a report")
    return dtype


def sqnr_db_of(sum_sq: float, sum_sq_err: float) -> float:
    """10 log10(sum_sq / sum_sq_err): inf with no error, -inf with no signal.

    Args:
        sum_sq: the sum of x^2 over the elements measured.
        sum_sq_err: the sum of (x - y)^2 over the same elements.
    """
    if sum_sq_err == 0:
        return math.inf
    if sum_sq == 0:
        return -math.inf
    return 10.0 * math.log10(sum_sq / sum_sq_err)


@dataclasses.dataclass(frozen=True)
class CastStats:
    """Statistics of one cast (or of several merged with ``+``), read from a
    stats tensor with ``from_tensor``; ``torchcast.last_stats()`` and
    ``Record.stats`` are CastStats.

    Counts are over the elements of x: ``nan`` (NaN in x), ``inf`` (+-inf in
    x), ``inexact`` (finite x whose y, widened back, differs; overflows and
    saturations included), ``overflow`` (finite x whose y is not finite: +-inf,
    or NaN for float8_e4m3fn, which has no inf), ``saturated`` (x beyond the
    target's range, +-inf included, clamped to +-its largest finite value),
    ``underflow`` (nonzero x that became zero), ``subnormal`` (y subnormal in
    the target dtype). ``max_abs_err`` and ``max_rel_err`` are over finite x
    with finite y (relative: x != 0), exact except for saturated elements,
    whose |x - y| may need more bits than x's dtype has and is rounded once;
    when every finite x overflowed they are inf, not 0. ``amax`` is the
    largest |x| over finite x (what float8 recipes scale by). ``sum_abs_err``,
    ``sum_sq_err`` and ``sum_sq`` (of x) are over the measured elements,
    within about 1e-6 relative of the exact sum: plain float64 sums on the
    CPU, and on CUDA for float64 sources (they hold the square of every
    float32 value exactly); on CUDA, float32 sums with Neumaier compensation
    for the other sources, where float32 cannot hold terms below 2^-149
    (they round to zero) nor sums above 3.4e38 (reported as inf: from
    |x| ~ 1.8e19 on, for casts to bfloat16 or saturated ones).

    Casts that cannot lose anything (widening, same dtype) are not measured:
    only ``numel``, ``nan``, ``inf`` and ``amax`` are set.

    Casts to an integer or bool dtype (safe_to): ``nan`` counts NaN (which
    becomes a number), ``overflow`` +-inf and values whose integer part is
    outside the dtype's range, ``inexact`` every element whose value is not
    kept (those and dropped fractions); the errors are |x - trunc(x)| (bool:
    |x - (x != 0)|) over the other finite elements, and the sums are float64.
    """

    src_dtype: Optional[torch.dtype]
    dtype: Optional[torch.dtype]
    # The table of statistics (see the module docstring): StatIndex's order.
    numel: int = _stat("add", 0)
    nan: int = _stat("add", 0)
    inf: int = _stat("add", 0)
    inexact: int = _stat("add", 0)
    overflow: int = _stat("add", 0)
    saturated: int = _stat("add", 0)
    underflow: int = _stat("add", 0)
    subnormal: int = _stat("add", 0)
    max_abs_err: float = _stat("max", 0.0)
    max_rel_err: float = _stat("max", 0.0)
    amax: float = _stat("max", 0.0)
    sum_abs_err: float = _stat("add", 0.0)
    sum_sq_err: float = _stat("add", 0.0)
    sum_sq: float = _stat("add", 0.0)

    @classmethod
    def from_tensor(cls, stats: torch.Tensor, src_dtype: Optional[torch.dtype] = None,
                    dtype: Optional[torch.dtype] = None) -> "CastStats":
        """Reads a stats tensor (one host synchronization if it is on a GPU).

        Args:
            stats: the 1-D tensor of ``len(STAT_FIELDS)`` values that
                cast_with_stats returns (ValueError for any other shape).
            src_dtype, dtype: the cast's dtypes, recorded in the result.

        Returns:
            The CastStats those values describe.
        """
        return cls.from_values(_read_stats(stats), src_dtype, dtype)

    @classmethod
    def from_values(cls, values: Sequence[float], src_dtype: Optional[torch.dtype] = None,
                    dtype: Optional[torch.dtype] = None) -> "CastStats":
        """The CastStats of a stats tensor's values, already on the host.

        Args:
            values: ``len(STAT_FIELDS)`` numbers in the order of STAT_FIELDS
                (counts may be floats: they are made ints).
            src_dtype, dtype: the cast's dtypes, recorded in the result.

        Returns:
            The CastStats those values describe.
        """
        # A safe_to under policy "warn" reads stats on every call, and the
        # frozen dataclass's __init__ (16 object.__setattr__ calls) took 2 µs
        # of it: the fields are set as one dict (no __post_init__ to run).
        # The counts come first in STAT_FIELDS.
        if len(values) != len(STAT_FIELDS):
            raise ValueError(f"CastStats.from_values: expected {len(STAT_FIELDS)} values "
                             f"({', '.join(STAT_FIELDS)}), got {len(values)}")
        fields = dict(zip(_INIT_FIELDS, (src_dtype, dtype, *map(int, values[:_NUM_COUNTS]),
                                         *values[_NUM_COUNTS:])))
        stats = object.__new__(cls)
        object.__setattr__(stats, "__dict__", fields)
        return stats

    def __add__(self, other: "CastStats") -> "CastStats":
        """The stats of both casts together: counts and sums add, maxima take
        the larger; a dtype that differs between the two becomes None."""
        if not isinstance(other, CastStats):
            return NotImplemented
        merged = {name: getattr(self, name) + getattr(other, name) for name in _ADDED}
        for name in MAX_FIELDS:
            merged[name] = max(getattr(self, name), getattr(other, name))
        src = self.src_dtype if self.src_dtype == other.src_dtype else None
        dst = self.dtype if self.dtype == other.dtype else None
        return CastStats(src, dst, **merged)

    def __radd__(self, other):
        # sum([s1, s2, ...]) starts from 0.
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented

    @property
    def sqnr_db(self) -> float:
        """Signal-to-quantization-noise ratio, 10 log10(sum x^2 / sum (x-y)^2):
        -inf if any element overflowed (an infinite error), NaN when a sum
        overflowed (a float32 sum: |x| beyond about 1e19 in a float32 or
        16-bit source)."""
        if self.overflow:
            return -math.inf
        if math.isinf(self.sum_sq) or math.isinf(self.sum_sq_err):
            return math.nan
        return sqnr_db_of(self.sum_sq, self.sum_sq_err)

    @property
    def lossless(self) -> bool:
        """Nothing inexact, overflowed or underflowed: y holds x exactly."""
        return self.inexact == 0 and self.overflow == 0 and self.underflow == 0

    def to_dict(self) -> dict:
        """The fields as a dict, dtypes as strings, with ``sqnr_db`` added.

        Returns:
            {"src_dtype": ..., "dtype": ..., one entry per STAT_FIELDS name,
            "sqnr_db": ...}.
        """
        d = dataclasses.asdict(self)
        d["src_dtype"] = str(self.src_dtype) if self.src_dtype is not None else None
        d["dtype"] = str(self.dtype) if self.dtype is not None else None
        d["sqnr_db"] = self.sqnr_db
        return d

    @property
    def worst_rel_err(self) -> float:
        """The largest relative error over every finite x: ``max_rel_err``,
        or inf where an element overflowed (``max_rel_err`` leaves those
        out). What a report's column shows."""
        return math.inf if self.overflow else self.max_rel_err

    def __str__(self):
        maxima = f"max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g}"
        if self.overflow:
            # The maxima are over elements that did not overflow: alone they
            # would read as "no error" where every element overflowed.
            if self.overflow >= self.numel - self.nan - self.inf:
                maxima = "max abs err inf, max rel err inf (all overflowed)"
            else:
                maxima = (f"max abs err inf, max rel err inf ({self.overflow} overflowed; the "
                          f"others: {self.max_abs_err:.3g}, {self.max_rel_err:.3g})")
        saturated = f"{self.saturated} saturated, " if self.saturated else ""
        return (
            f"{short_dtype_name(self.src_dtype)}->{short_dtype_name(self.dtype)}: "
            f"{self.numel} elements, "
            f"{self.inexact} inexact, {self.overflow} overflow, {saturated}{self.underflow} "
            f"underflow, {self.subnormal} subnormal, {self.nan} nan, {self.inf} inf, {maxima}, "
            f"amax {self.amax:.3g}, SQNR {self.sqnr_db:.1f} dB")


_STATS = [f for f in dataclasses.fields(CastStats) if "merge" in f.metadata]
STAT_FIELDS = tuple(f.name for f in _STATS)  # the layout of a stats tensor
COUNT_FIELDS = tuple(f.name for f in _STATS if f.type is int)
_NUM_COUNTS = len(COUNT_FIELDS)
assert STAT_FIELDS[:_NUM_COUNTS] == COUNT_FIELDS, "from_values reads the counts first"
_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(CastStats))
MAX_FIELDS = tuple(f.name for f in _STATS if f.metadata["merge"] == "max")
SUM_FIELDS = tuple(f.name for f in _STATS if f.type is float and f.metadata["merge"] == "add")
_ADDED = tuple(f.name for f in _STATS if f.metadata["merge"] == "add")


def _read_stats(stats: torch.Tensor) -> list:
    """The values of a stats tensor, in STAT_FIELDS' order (one host
    synchronization if it is on a GPU); ValueError for any other shape."""
    stats = plain_stats(stats)
    if stats.dim() != 1 or stats.shape[0] != len(STAT_FIELDS):
        got = (f"got {stats.shape[0]}" if stats.dim() == 1
               else f"got shape {tuple(stats.shape)}")
        raise ValueError(
            f"CastStats.from_tensor: stats must be a 1-D tensor, as cast_with_stats returns "
            f"it: expected {len(STAT_FIELDS)} values ({', '.join(STAT_FIELDS)}), {got}")
    return stats.tolist()


# The counts a violation is made of: torchcast.violations' kinds, besides
# graph cuts and dropped imaginary parts, which are not stats (an integer
# target's are nan and overflow), in the order messages list them.
LOSS_COUNTS = ("overflow", "saturated", "nan", "underflow", "subnormal")
_LOSS_COLUMNS = tuple(STAT_FIELDS.index(name) for name in LOSS_COUNTS)


class PendingStats:
    """A stats tensor not yet read: reading it (``.value``) synchronizes once.

    Args:
        tensor: the stats tensor (None for ``known`` stats).
        src_dtype, dtype: the cast's dtypes.
        scale: a scaled cast's scale tensor (None: unscaled).
    """

    __slots__ = ("tensor", "src_dtype", "dtype", "scale", "_values", "_value")

    def __init__(self, tensor: Optional[torch.Tensor], src_dtype: Optional[torch.dtype],
                 dtype: Optional[torch.dtype], scale: Optional[torch.Tensor] = None):
        self.tensor = tensor
        self.src_dtype = src_dtype
        self.dtype = dtype
        self.scale = scale
        self._values = None
        self._value = None

    @classmethod
    def known(cls, value: CastStats) -> "PendingStats":
        """Stats already read (a cast that needs no pass, such as same-dtype)."""
        pending = cls(None, value.src_dtype, value.dtype)
        pending._value = value
        return pending

    @property
    def value(self) -> CastStats:
        """The CastStats, read from the tensor on first use."""
        if self._value is None:
            self._value = CastStats.from_values(self.read(), self.src_dtype, self.dtype)
        return self._value

    def has_loss(self) -> bool:
        """Whether any of LOSS_COUNTS is nonzero: when none is, no violation
        kind can be found in these stats (only rtol/atol remain to check).
        Reads the tensor as ``value`` does, without building the CastStats,
        which a safe_to under policy "warn" would otherwise build on every
        call."""
        if self._value is not None:
            return any(getattr(self._value, name) for name in LOSS_COUNTS)
        return any(map(self.read().__getitem__, _LOSS_COLUMNS))

    def read(self) -> list:
        """The tensor's values in STAT_FIELDS' order, read on first use (one
        host synchronization, shared with ``value`` and ``has_loss``)."""
        if self._values is None:
            self._values = _read_stats(self.tensor)
        return self._values


# ---------------------------------------------------------------------------
# Stats tensors on the device (torchcast.track): built and merged by the
# table above, so that merged stats stay on the device until read.

_MAX_COLUMNS = [STAT_FIELDS.index(name) for name in MAX_FIELDS]
_MAX_LO, _MAX_HI = min(_MAX_COLUMNS), max(_MAX_COLUMNS) + 1
# One slice assignment merges them (an index list would be a slower index_put).
assert _MAX_HI - _MAX_LO == len(_MAX_COLUMNS), "the maxima must be adjacent in STAT_FIELDS"


def stats_tensor(values: Dict[str, torch.Tensor]) -> torch.Tensor:
    """A stats tensor from one 0-d tensor per statistic.

    Args:
        values: a 0-d tensor for every name in STAT_FIELDS, on one device.

    Returns:
        The float64 tensor of those values in the order of STAT_FIELDS.
    """
    return torch.stack([values[name].to(torch.float64) for name in STAT_FIELDS])


def plain_stats(stats: torch.Tensor) -> torch.Tensor:
    """A plain stats tensor. The stats of a cast of a traceable wrapper
    subclass (TwoTensor, DTensor, ...) come back wrapped, one stats tensor per
    inner tensor: they merge into the stats of everything the subclass holds
    (for a DTensor, this rank's shard)."""
    if type(stats) is torch.Tensor or not is_traceable_wrapper_subclass(stats):
        return stats
    names, _ = stats.__tensor_flatten__()
    inner = [plain_stats(getattr(stats, name)) for name in names]
    return merge_stats_tensors(torch.stack(inner))


def merge_stats_tensors(stacked: torch.Tensor) -> torch.Tensor:
    """Merges stats tensors into one, as CastStats' ``+`` merges their
    values: counts and sums add, maxima take the max. No host synchronization.

    Args:
        stacked: stats tensors stacked along dim 0, shape (k, len(STAT_FIELDS)),
            k >= 1.

    Returns:
        The merged stats tensor, shape (len(STAT_FIELDS),).
    """
    merged = stacked.sum(0)
    merged[_MAX_LO:_MAX_HI] = stacked[:, _MAX_LO:_MAX_HI].amax(0)
    return merged
