"""Measuring one cast as PyTorch performs it.

A tracked cast returns exactly what PyTorch returns, and its stats describe
that result. The fused op rounds correctly, and so does PyTorch for every
pair but float64 -> float16/bfloat16/float8, which PyTorch rounds twice
(through float32): for those the op measures every element where the two
roundings agree, and the few elements where PyTorch's double rounding lands
on the other neighbour are measured against PyTorch's value
(``Record.double_rounded`` counts them). Casts to float8_e4m3fn are measured
as torch makes them, saturating (inf becomes 448: a ``saturated`` violation).
"""
import dataclasses
from typing import Optional

import torch

from .. import _ops
from .._inputs import dense_strided
from ..formats import FLOAT_RANK, NARROW_TARGETS
from ..stats import STAT_FIELDS, PendingStats, merge_stats_tensors, stats_tensor

_TO_COPY = torch.ops.aten._to_copy.default
_NAN = STAT_FIELDS.index("nan")

# Real dtypes the fused op measures, by precision rank (the formats table's;
# the two float8 formats cannot be cast into each other).
_RANK = FLOAT_RANK
_REAL_OF = {torch.complex128: torch.float64, torch.complex64: torch.float32,
            torch.complex32: torch.float16}
_DOUBLE_ROUNDED = frozenset((torch.float64, d) for d in NARROW_TARGETS)


def _double_rounded_stats(x, dtype, t):
    """Stats of float64 x cast to float16/bfloat16 as PyTorch did it (t).

    The op measures the elements where t is the correctly rounded value; the
    elements where PyTorch's double rounding chose the other neighbour (x not
    representable, so inexact; t finite or inf, never NaN) are zeroed in the
    op's input and measured against t here. Returns (stats, count of those
    elements)."""
    y, _ = _ops.cast_with_stats(x, dtype)
    differ = (t != y) & ~torch.isnan(t)
    _, rest = _ops.cast_with_stats(torch.where(differ, 0.0, x), dtype)
    td = t.to(torch.float64)
    finite = differ & torch.isfinite(td)
    err = torch.where(finite, (x - td).abs(), 0.0)
    rel = err / torch.where(finite, x.abs(), 1.0)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    tiny = torch.finfo(dtype).tiny
    own = stats_tensor({
        "numel": zero, "nan": zero, "inf": zero, "inexact": differ.sum(),
        "overflow": (differ & ~torch.isfinite(td)).sum(), "saturated": zero,
        "underflow": (differ & (td == 0)).sum(),
        "subnormal": (differ & (td != 0) & (td.abs() < tiny)).sum(),
        "max_abs_err": err.max(), "max_rel_err": rel.max(),
        "amax": torch.where(differ, x.abs(), 0.0).max(), "sum_abs_err": err.sum(),
        "sum_sq_err": (err * err).sum(), "sum_sq": torch.where(finite, x * x, 0.0).sum()})
    return merge_stats_tensors(torch.stack([rest, own])), differ.sum()


def _measure(x, dtype, t):
    """(stats tensor, double-rounded count or None, y) for real floating x
    cast to the narrower-or-equal-rank real ``dtype``; t is PyTorch's result
    when already computed. y is PyTorch's for the pairs it rounds twice, else
    the fused op's."""
    if (x.dtype, dtype) in _DOUBLE_ROUNDED:
        if t is None or t.device != x.device:
            t = _TO_COPY(x, dtype=dtype)
        if x.numel() == 0:
            return _ops.cast_with_stats(x, dtype)[1], None, t
        stats, differ = _double_rounded_stats(x, dtype, t)
        return stats, differ, t
    y, stats = _ops.cast_with_stats(x, dtype)
    return stats, None, y


@dataclasses.dataclass
class MeasuredCast:
    """What measuring one cast found.

    ``stats`` is None when the loss cannot be measured (then ``measured`` is
    false); ``imag`` counts the
    elements whose nonzero imaginary part a complex -> real cast dropped;
    ``x`` and ``y`` are kept for a violation message (its rtol/atol counts).
    """
    src_dtype: torch.dtype
    dtype: torch.dtype
    numel: int
    stats: Optional[torch.Tensor] = None
    measured: bool = True
    graph_cut: bool = False
    imag: Optional[torch.Tensor] = None
    double_rounded: Optional[torch.Tensor] = None
    x: Optional[torch.Tensor] = None
    y: Optional[torch.Tensor] = None

    def torch_result(self, pending: PendingStats) -> Optional[torch.Tensor]:
        """y where it holds the bits PyTorch's ``x.to(dtype)`` gives, so that
        the tracker can return it instead of casting again; None elsewhere.
        The fused op rounds correctly, and so does PyTorch for every pair it
        does not round twice (tests/test_track.py checks the two agree bit
        for bit), but NaN may be spelled with other bits: y stands in only
        where x holds none, which is read (from ``pending``, the stats of
        this cast, whose read the policy then shares) on the CPU only:
        elsewhere the read would synchronize."""
        if self.y is None or self.stats is None or self.y.dtype != self.dtype:
            return None  # (a complex cast measures its real part)
        if (self.src_dtype, self.dtype) in _DOUBLE_ROUNDED:
            return self.y  # PyTorch's own result (_measure)
        if self.x is None or not self.x.is_cpu or pending.read()[_NAN] != 0:
            return None
        return self.y


def measure_cast(src: torch.Tensor, dtype: torch.dtype, t: Optional[torch.Tensor],
                 grad_enabled: bool) -> Optional[MeasuredCast]:
    """Measures casting ``src`` to ``dtype`` as PyTorch does it.

    Args:
        src: the tensor cast (call under torch.no_grad()).
        dtype: the target dtype.
        t: PyTorch's result, when already computed (None: computed here if
            needed).
        grad_enabled: whether grad mode was on at the cast (a float tensor
            that requires grad, cast to an integer dtype, cuts the graph).

    Returns:
        The MeasuredCast, or None when the cast is not one track records
        (integer and bool sources, float -> integer casts that cut nothing).
    """
    s_dt = src.dtype
    if not dense_strided(src):
        # The kernels read dense strided tensors: a sparse or nested one is
        # PyTorch's to cast, and its site says it was not measured.
        if s_dt.is_floating_point and dtype.is_floating_point:
            return MeasuredCast(s_dt, dtype, src.numel(), measured=False)
        return None
    s_rank, d_rank = _RANK.get(s_dt), _RANK.get(dtype)
    if s_rank is None or d_rank is None:
        return _measure_other(src, dtype, t, grad_enabled)
    if d_rank > s_rank or dtype == s_dt:  # widening (or the real part kept): exact
        return MeasuredCast(s_dt, dtype, src.numel(), _ops.exact_cast_stats(src))
    if d_rank == s_rank == 1:  # float8 <-> float8
        return MeasuredCast(s_dt, dtype, src.numel(), measured=False)
    stats, differ, y = _measure(src, dtype, t)
    return MeasuredCast(s_dt, dtype, src.numel(), stats, double_rounded=differ, x=src, y=y)


def _measure_other(src, dtype, t, grad_enabled):
    """measure_cast where src's or dtype's is not a real floating dtype of _RANK."""
    s_dt = src.dtype
    if s_dt.is_complex or dtype.is_complex:
        return _measure_complex(src, dtype, t, grad_enabled)
    if s_dt.is_floating_point and not dtype.is_floating_point:
        if src.requires_grad and grad_enabled:
            return MeasuredCast(s_dt, dtype, src.numel(), measured=False, graph_cut=True)
        return None
    if not (s_dt.is_floating_point and dtype.is_floating_point):
        return None  # integer and bool sources: not a precision question track answers
    return MeasuredCast(s_dt, dtype, src.numel(), measured=False)  # other floating formats


def _measure_complex(src, dtype, t, grad_enabled):
    s_dt, d_dt = src.dtype, dtype
    imag = None
    if s_dt.is_complex and not dtype.is_complex:
        imag = (src.imag != 0).sum()
        x, t_real = src.real, t
    elif s_dt.is_complex:
        x = torch.view_as_real(src.resolve_conj())
        t_real = torch.view_as_real(t) if t is not None else None
        dtype = _REAL_OF.get(dtype)
    else:
        x = src
        t_real = torch.view_as_real(t)[..., 0] if t is not None else None
        dtype = _REAL_OF.get(dtype)
    if not dtype or x.dtype not in _RANK or dtype not in _RANK:
        if imag is None:
            return None
        graph_cut = src.requires_grad and grad_enabled and not dtype.is_floating_point
        return MeasuredCast(s_dt, d_dt, src.numel(), measured=False, graph_cut=graph_cut,
                            imag=imag)
    result = measure_cast(x, dtype, t_real, grad_enabled)
    result.src_dtype, result.dtype, result.imag = s_dt, d_dt, imag
    return result
