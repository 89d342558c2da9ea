"""Pure-PyTorch cast_with_stats: the fallback for devices without torchcast
kernels, and an independent restatement of the kernels' arithmetic.

It reproduces the kernels bit for bit: the same correctly rounded y (round to
odd in float32, then to nearest even) and the same statistics, including the
compensated float32 sums, which it reduces in the canonical order described
in csrc/numerics.h (order.py)."""
import torch

from ..stats import STAT_FIELDS
from . import order
from .compensated import Compensated
from .rounding import correctly_rounded

_RANK = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 1}
LOSSY_PAIRS = (
    (torch.float64, torch.float32), (torch.float64, torch.float16),
    (torch.float64, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
)


def dtype_name(dtype):
    return str(dtype)


def classify_cast(src, dst):
    """'lossy' or 'exact'; TypeError (as the C++ op raises) for anything else."""
    rs, rd = _RANK.get(src, 0), _RANK.get(dst, 0)
    if rs == 0 or rd == 0 or (rs == rd == 1 and src != dst):
        pairs = ", ".join(f"{str(a)[6:]}->{str(b)[6:]}" for a, b in LOSSY_PAIRS)
        raise TypeError(
            f"torchcast.cast_with_stats: cannot measure a cast of x from {dtype_name(src)} "
            f"to {dtype_name(dst)}; supported lossy pairs: {pairs}; widening and same-dtype "
            "casts between float16/bfloat16/float32/float64 are exact. For other casts use "
            "x.to(dtype).")
    return "lossy" if rs > rd else "exact"


_MIN_NORMAL = {
    torch.float32: torch.finfo(torch.float32).tiny,
    torch.float16: torch.finfo(torch.float16).tiny,
    torch.bfloat16: torch.finfo(torch.bfloat16).tiny,
}


def canonical_sum(terms, element_size):
    """Compensated float32 sum of a 1-D float32 tensor in the cast kernels'
    order for an input of element_size bytes: a 0-dim float64 tensor."""
    rows = terms.reshape(1, -1)
    partials = order.block_partials(rows, order.thread_lanes(element_size), Compensated)
    return order.total(partials, Compensated)[0]


def iteration_order(t, layout):
    """Flattens t (shaped like layout) in TensorIterator's order for an output
    with layout's strides: outermost stride first."""
    dims = sorted(range(layout.dim()), key=lambda d: (layout.stride(d), layout.size(d)), reverse=True)
    return t.permute(dims).reshape(-1)


OUT_REQUIRES_GRAD = (
    "torchcast.cast_with_stats(): functions with out=... arguments don't support automatic "
    "differentiation, but one of the arguments requires grad. Call it without out= (y then "
    "carries the gradient) or under torch.no_grad()")


def check_out_devices(x, out):
    """out on x's device (the fake kernel's check too: a meta out with a CPU x
    would otherwise select it and write nothing)."""
    if out.device != x.device:
        raise RuntimeError(
            f"torchcast.cast_with_stats: out is on {out.device} but x is on {x.device}; "
            "out must be on x's device")


def _may_self_overlap(t):
    """False when t's strides prove no two elements share memory (each stride,
    in increasing order, exceeds the span of the smaller ones)."""
    span = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _byte_range(t):
    start = t.data_ptr()
    return start, start + (sum((sz - 1) * st for sz, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def check_out(x, dtype, out):
    """cast_with_stats.out's checks, as csrc/cast_common.cpp makes them, before
    anything is written."""
    if torch.is_grad_enabled() and (x.requires_grad or out.requires_grad):
        raise RuntimeError(OUT_REQUIRES_GRAD)
    if out.dtype != dtype:
        raise RuntimeError(
            f"torchcast.cast_with_stats: out has dtype {out.dtype} but the cast is to {dtype}; "
            f"allocate out with dtype={dtype}")
    if out.shape != x.shape:
        raise RuntimeError(
            f"torchcast.cast_with_stats: out has shape {list(out.shape)} but x has shape "
            f"{list(x.shape)}; out must have x's shape")
    check_out_devices(x, out)
    if out.numel() == 0 or x.device.type == "meta":
        return
    if _may_self_overlap(out):
        raise RuntimeError(
            "torchcast.cast_with_stats: out's strides let elements share memory (e.g. an "
            "expanded tensor), so the result would depend on the write order; allocate out "
            "with torch.empty_like(x, dtype=...)")
    (x0, x1), (o0, o1) = _byte_range(x), _byte_range(out)
    if o0 < x1 and x0 < o1:
        raise RuntimeError(
            "torchcast.cast_with_stats: out shares memory with x, so writing out would "
            "overwrite x while it is read; pass an out that does not overlap x (or x.clone())")


def exact_cast_stats(x):
    """The stats of an exact cast of x: numel and the NaN it carries."""
    stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=x.device)
    stats[0] = x.numel()
    stats[1] = torch.isnan(x).sum()
    return stats


def cast_with_stats(x, dtype, out=None):
    kind = classify_cast(x.dtype, dtype)
    if out is not None:
        check_out(x, dtype, out)
    y = torch.empty_like(x, dtype=dtype) if out is None else out
    stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=x.device)
    stats[0] = x.numel()
    if kind == "exact":
        y.copy_(x)
        return y, exact_cast_stats(x)
    y.copy_(correctly_rounded(x, dtype))
    xf = iteration_order(x, y)
    back = iteration_order(y, y).to(x.dtype)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x_finite, y_finite = torch.isfinite(xf), torch.isfinite(back)
    measured = x_finite & y_finite
    abs_err = torch.where(measured, (xf - back).abs(), zero)
    denom = torch.where(measured & (xf != 0), xf.abs(), torch.ones_like(xf))
    rel_err = abs_err / denom
    stats[1] = torch.isnan(xf).sum()
    stats[2] = (x_finite & (back != xf)).sum()
    stats[3] = (x_finite & ~y_finite).sum()
    stats[4] = ((xf != 0) & (back == 0)).sum()
    stats[5] = ((back != 0) & (back.abs() < _MIN_NORMAL[dtype])).sum()
    if xf.numel():
        stats[6] = abs_err.max()
        stats[7] = rel_err.max()
    size = x.element_size()
    stats[8] = canonical_sum(abs_err.float(), size)
    stats[9] = canonical_sum((abs_err * abs_err).float(), size)
    stats[10] = canonical_sum(torch.where(measured, xf * xf, zero).float(), size)
    return y, stats

