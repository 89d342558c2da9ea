"""tensor_health: one pass over a tensor that counts NaN, ±inf, zeros and
subnormals, keeps amax and the smallest nonzero magnitude, and histograms
the elements by binade and by the leading bits of their fraction (exact
enough to predict any cast to float16, bfloat16 or float8 at a power-of-two
scale: torchcast/headroom.py)."""
from typing import Any, Dict, List, NamedTuple, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _ops
from ._inputs import check_input
from ._reference.health import COLUMNS, binade_range
from .stats import dtype_from_name


class HealthValues(NamedTuple):
    """A TensorHealth's counts and extrema, read (``TensorHealth.read()``)."""

    nan: int
    posinf: int
    neginf: int
    zero: int
    subnormal: int
    numel: int
    amax: float
    min_nonzero: float  # inf when there is no nonzero finite element


_AMAX_LANES: Dict[torch.device, torch.Tensor] = {}


def _amax_lane(device: torch.device) -> torch.Tensor:
    """[True, False] on device: which entry of extrema is amax."""
    lane = _AMAX_LANES.get(device)
    if lane is None:
        lane = _AMAX_LANES[device] = torch.tensor([True, False], device=device)
    return lane


class TensorHealth:
    """The health of one tensor, or of several merged (``add_``): tensors on
    the measured tensor's device, read only when a property is.

    Attributes:
        dtype: the measured tensors' dtype.
        counts: int64 [5]: NaN, +inf, -inf, zeros, subnormals (of ``dtype``).
        hist: int64 [rows, 14]: the finite nonzero elements; row r holds the
            binade 2^e <= |x| < 2^(e+1), e = r + e_sub (``binades``); the
            column classifies the fraction f = |x|/2^e - 1 by its leading one
            bits L: 0 for f == 0, 1 + min(L, 11) otherwise, and 13 for
            f above 0.1101b in binary (L = 2). Rounding to q fraction bits
            carries an element into the next binade iff L >= q + 1.
        extrema: float64 [2]: amax over finite elements (0 if none), the
            smallest nonzero finite |x| (inf if none).
    """

    __slots__ = ("dtype", "counts", "hist", "extrema")

    def __init__(self, dtype: torch.dtype, counts: torch.Tensor, hist: torch.Tensor,
                 extrema: torch.Tensor):
        self.dtype, self.counts, self.hist, self.extrema = dtype, counts, hist, extrema

    @classmethod
    def empty(cls, dtype: torch.dtype, device: torch.device = torch.device("cpu")) \
            -> "TensorHealth":
        """The health of no elements: what merging starts from."""
        e_sub, e_max = binade_range(dtype)
        return cls(dtype, torch.zeros(5, dtype=torch.int64, device=device),
                   torch.zeros(e_max - e_sub + 1, COLUMNS, dtype=torch.int64, device=device),
                   torch.tensor([0.0, float("inf")], dtype=torch.float64, device=device))

    def add_(self, other: "TensorHealth") -> "TensorHealth":
        """Merges ``other`` into this one, on the device, without a sync."""
        if other.dtype != self.dtype:
            raise ValueError(f"torchcast.TensorHealth.add_: cannot merge the health of a "
                             f"{other.dtype} tensor into that of {self.dtype} tensors")
        self.counts.add_(other.counts)
        self.hist.add_(other.hist)
        # amax takes the larger, min_nonzero the smaller: two whole-tensor
        # ops and a select (slicing each half cost 10 µs a merge; track(
        # health=True) merges at every module call).
        e, o = self.extrema, other.extrema
        torch.where(_amax_lane(e.device), torch.maximum(e, o), torch.minimum(e, o), out=e)
        return self

    @classmethod
    def merged(cls, healths: Sequence["TensorHealth"]) -> "TensorHealth":
        """A new TensorHealth of all of ``healths`` (one dtype, one device; none
        of them changes), on the device, in eight ops whatever their number.

        Args:
            healths: at least one TensorHealth.
        """
        dtype = healths[0].dtype
        for h in healths:
            if h.dtype != dtype:
                raise ValueError(f"torchcast.TensorHealth.merged: cannot merge the health of a "
                                 f"{h.dtype} tensor with that of {dtype} tensors")
        extrema = torch.stack([h.extrema for h in healths])
        return cls(dtype, torch.stack([h.counts for h in healths]).sum(0),
                   torch.stack([h.hist for h in healths]).sum(0),
                   torch.stack((extrema[:, 0].amax(), extrema[:, 1].amin())))

    def merge(self, other: "TensorHealth") -> "TensorHealth":
        """A new TensorHealth of both (neither changes)."""
        return TensorHealth.merged((self, other))

    def cpu(self) -> "TensorHealth":
        """This health on the host (itself when it is there already): one
        transfer, for reading it several times (``headroom`` in every
        format)."""
        if self.hist.device.type == "cpu":
            return self
        counts, hist, extrema = (t.cpu() for t in (self.counts, self.hist, self.extrema))
        return TensorHealth(self.dtype, counts, hist, extrema)

    # -- reading (each a sync) ----------------------------------------------------
    def read(self) -> "HealthValues":
        """Every count and extremum, read in one transfer."""
        counts = self.counts.tolist()
        amax, low = self.extrema.tolist()
        numel = sum(counts[:4]) + int(self.hist.sum())
        return HealthValues(*counts, numel, amax, low)

    @property
    def nan(self) -> int:
        return self.read().nan

    @property
    def posinf(self) -> int:
        return self.read().posinf

    @property
    def neginf(self) -> int:
        return self.read().neginf

    @property
    def zero(self) -> int:
        return self.read().zero

    @property
    def subnormal(self) -> int:
        return self.read().subnormal

    @property
    def numel(self) -> int:
        """Every element measured: NaN, inf, zeros and the histogram's."""
        return self.read().numel

    @property
    def amax(self) -> float:
        return float(self.extrema[0])

    @property
    def min_nonzero(self) -> float:
        return float(self.extrema[1])

    @property
    def binades(self) -> List[int]:
        """The exponent e of each histogram row."""
        e_sub, e_max = binade_range(self.dtype)
        return list(range(e_sub, e_max + 1))

    @property
    def binade_counts(self) -> List[int]:
        """The elements per binade (the histogram summed over its columns)."""
        return self.hist.sum(dim=1).tolist()

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready values: counts, extrema (min_nonzero None when there is
        no nonzero element), the binades that hold elements, their counts,
        and their columns ("columns": binade -> 14 counts) for from_dict."""
        counts = self.counts.tolist()
        hist = self.hist.cpu()
        amax, low = self.extrema.tolist()
        per_binade = hist.sum(dim=1)
        rows = torch.nonzero(per_binade).flatten().tolist()
        binades = self.binades
        return {"dtype": str(self.dtype), "numel": sum(counts[:4]) + int(per_binade.sum()),
                "nan": counts[0], "posinf": counts[1], "neginf": counts[2], "zero": counts[3],
                "subnormal": counts[4], "amax": amax,
                "min_nonzero": low if low != float("inf") else None,
                "binades": [binades[r] for r in rows],
                "hist": [int(per_binade[r]) for r in rows],
                "columns": {str(binades[r]): hist[r].tolist() for r in rows}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TensorHealth":
        """Reads ``to_dict()``'s values back (on the CPU)."""
        dtype = dtype_from_name(d["dtype"])
        health = cls.empty(dtype)
        health.counts.copy_(torch.tensor([d["nan"], d["posinf"], d["neginf"], d["zero"],
                                          d["subnormal"]]))
        e_sub, _ = binade_range(dtype)
        for binade, columns in d["columns"].items():
            health.hist[int(binade) - e_sub] = torch.tensor(columns)
        low = d["min_nonzero"]
        health.extrema.copy_(torch.tensor([d["amax"], float("inf") if low is None else low]))
        return health

    def __repr__(self) -> str:
        return f"<torchcast.TensorHealth of {self.dtype} on {self.counts.device}>"


def tensor_health(x: torch.Tensor) -> TensorHealth:
    """Measures ``x`` in one pass, on its device, without a sync.

    Args:
        x: a dense strided float64, float32, float16, bfloat16,
            float8_e4m3fn or float8_e5m2 tensor (any shape and strides), or a
            traceable wrapper subclass (``__tensor_flatten__``: TwoTensor,
            DTensor) whose own dispatch runs the op on its inner tensors:
            their healths are merged, the health of everything it holds (for
            a DTensor, this rank's shard).

    Returns:
        A TensorHealth (read its properties, or merge it with ``add_``).

    Raises:
        TypeError: x is not a Tensor, or a sparse, mkldnn, quantized or nested
            tensor, or a ``__torch_dispatch__`` subclass without
            ``__tensor_flatten__`` (the message says how to convert it); x's
            dtype is not one listed above.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"torchcast.tensor_health: x must be a torch.Tensor, got {type(x).__name__}")
    check_input(x, "torchcast.tensor_health")
    counts, hist, extrema = _ops.tensor_health(x)
    if type(counts) is not torch.Tensor and is_traceable_wrapper_subclass(counts):
        return _merged_inner(x.dtype, counts, hist, extrema)
    return TensorHealth(x.dtype, counts, hist, extrema)


def _merged_inner(dtype, counts, hist, extrema):
    """The health of everything a traceable wrapper subclass holds: its op
    returns each output wrapped, one per inner tensor, and these merge (as
    stats.plain_stats merges a cast's stats)."""
    names, _ = counts.__tensor_flatten__()
    inner = [[getattr(t, name) for t in (counts, hist, extrema)] for name in names]
    return TensorHealth.merged([
        _merged_inner(dtype, *parts) if is_traceable_wrapper_subclass(parts[0])
        else TensorHealth(dtype, *parts) for parts in inner])


__all__ = ["HealthValues", "TensorHealth", "tensor_health"]
