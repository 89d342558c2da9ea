"""Pure-PyTorch cast_with_stats: the fallback for devices without torchcast
kernels, and an independent restatement of the kernels' arithmetic.

It reproduces the kernels bit for bit: the same correctly rounded y (round to
odd in float32, then to nearest even) and the same statistics, including the
sums (plain float64 on the CPU; on CUDA compensated float32, or plain float64
for float64 sources), which it reduces in the canonical order described in
csrc/numerics.h (order.py)."""
import math

import torch

from ..formats import FLOAT8, FLOAT_RANK, format_of
from ..stats import STAT_FIELDS
from . import order
from .compensated import Compensated, PlainDouble
from .rounding import correctly_rounded

# How wide each floating dtype is (the formats table's rank): a cast to a
# higher rank is exact; to a lower one, or between the two 16-bit formats,
# lossy; between the two float8 formats, not supported (csrc/cast_common.cpp's
# float_rank).
_RANK = FLOAT_RANK
SUPPORTED = (
    "supported lossy pairs: float64->float32; float64, float32->float16, bfloat16; "
    "float16<->bfloat16; float64, float32, float16, bfloat16->float8_e4m3fn, float8_e5m2. "
    "Widening and same-dtype casts between these dtypes are exact")


def _lossy(src, dst):
    rs, rd = _RANK[src], _RANK[dst]
    return rs > rd and rd > 0 or (rs == rd == 2 and src != dst)


LOSSY_PAIRS = tuple((s, d) for s in _RANK for d in _RANK if _RANK[s] > 1 and _lossy(s, d))


def dtype_name(dtype):
    return str(dtype)


def classify_cast(src, dst):
    """'lossy' or 'exact'; TypeError (as the C++ op raises) for anything else."""
    rs, rd = _RANK.get(src, 0), _RANK.get(dst, 0)
    if rs == 0 or rd == 0 or (rs == rd == 1 and src != dst):
        raise TypeError(
            f"torchcast.cast_with_stats: cannot measure a cast of x from {dtype_name(src)} "
            f"to {dtype_name(dst)}; {SUPPORTED}. For other casts use x.to(dtype).")
    return "lossy" if _lossy(src, dst) else "exact"


def resolve_saturate(saturate, dtype):
    """saturate, or (None) what x.to(dtype) does: torch saturates casts to
    float8_e4m3fn (+-inf included) and no others."""
    return saturate if saturate is not None else dtype == torch.float8_e4m3fn


_MIN_NORMAL = {dtype: format_of(dtype).min_normal for dtype in _RANK}


def canonical_sum(terms, element_size):
    """The sum of a 1-D tensor of terms in the cast kernels' order for an
    input of element_size bytes, as a 0-dim float64 tensor: compensated
    float32 for float32 terms, plain float64 for float64 terms (numerics.h's
    PlainSums)."""
    pol = PlainDouble if terms.dtype == torch.float64 else Compensated
    rows = terms.reshape(1, -1)
    partials = order.block_partials(rows, order.thread_lanes(element_size), pol)
    return order.total(partials, pol)[0]


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
    """The stats of an exact cast of x: numel, the NaN and +-inf it carries,
    and amax."""
    xw = x.float() if x.dtype in FLOAT8 else x
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    values = dict.fromkeys(STAT_FIELDS, zero)
    values.update(numel=torch.full_like(zero, x.numel()), nan=torch.isnan(xw).sum(),
                  inf=torch.isinf(xw).sum())
    if x.numel():
        values["amax"] = torch.where(torch.isfinite(xw), xw.abs(), 0).amax()
    return torch.stack([values[name].to(device=x.device, dtype=torch.float64)
                        for name in STAT_FIELDS])


def cast_grad(grad_y, src_dtype, scale):
    """The gradient of x from y's: the cast's derivative is the identity,
    times scale for a scaled cast, in x's dtype (csrc/autograd.cpp)."""
    grad = grad_y.to(src_dtype)
    return grad if scale is None else grad * scale.reshape(()).to(src_dtype)


def check_scale(x, dtype, kind, scale):
    """cast_with_stats' checks of scale, as csrc/cast_common.cpp makes them."""
    if scale is None:
        return
    if kind != "lossy":
        raise RuntimeError(
            f"torchcast.cast_with_stats: a scale applies to lossy casts; the cast of x from "
            f"{x.dtype} to {dtype} is exact. Drop scale (and multiply x yourself if you meant to)")
    if not (scale.dtype == torch.float32 or scale.dtype == x.dtype == torch.float64) \
            or scale.numel() != 1:
        raise RuntimeError(
            f"torchcast.cast_with_stats: scale must be a one-element float32 tensor (float64 "
            f"also for a float64 x), got {scale.dtype} of shape {list(scale.shape)} for x of "
            f"{x.dtype}; pass torch.tensor(value, dtype=torch.float32, device=x.device)")
    if scale.device != x.device:
        raise RuntimeError(
            f"torchcast.cast_with_stats: scale is on {scale.device} but x is on {x.device}; "
            "move scale to x's device (it is read there, never on the host)")


BAD_SCALE = ("torchcast.cast_with_stats: scale must be positive and finite (x * scale is cast, "
             "y / scale is read back); a zero or inf scale comes from an inf or zero amax (e.g. "
             "in a delayed-scaling history): recompute it with "
             "torchcast.scaling.amax_scale(x, dtype), or skip this cast")


def check_scale_value(scale, message=BAD_SCALE):
    """csrc/cast_common.cpp's check_scale_value: scale positive and finite,
    read on the CPU, queued on the device elsewhere (no host
    synchronization)."""
    if scale.device.type == "cpu":
        v = scale.item()
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{message}; got {v:g}")
    else:
        torch._assert_async(torch.isfinite(scale).logical_and_(scale > 0).reshape(()), message)


def cast_with_stats(x, dtype, out=None, saturate=None, scale=None, *, cuda_sums=None):
    """cast_with_stats(x, dtype) as the kernels compute it. cuda_sums: the
    sums of the CUDA kernel (True) or of the CPU kernel (False); None: of x's
    device. (The tests run CUDA's on CPU tensors for the emulated kernels.)"""
    kind = classify_cast(x.dtype, dtype)
    check_scale(x, dtype, kind, scale)
    if scale is not None:
        check_scale_value(scale)
    if out is not None:
        check_out(x, dtype, out)
    y = torch.empty_like(x, dtype=dtype) if out is None else out
    if kind == "exact":
        y.copy_(x)
        return y, exact_cast_stats(x)
    saturate = resolve_saturate(saturate, dtype)
    y.copy_(correctly_rounded(x, dtype, saturate, scale))
    # The errors in the type that holds x exactly: float64 or float32; y
    # measured as yw (its float32 value) divided by scale in that type.
    xf = iteration_order(x, y)
    xf = xf if xf.dtype == torch.float64 else xf.float()
    yw = iteration_order(y, y).float()
    back = yw.to(xf.dtype) if scale is None else yw.to(xf.dtype) / scale.reshape(()).to(xf.dtype)
    zero = torch.zeros((), dtype=xf.dtype, device=x.device)
    x_finite, y_finite = torch.isfinite(xf), torch.isfinite(yw)
    measured = x_finite & y_finite
    err = (xf - back).abs()
    if scale is not None:
        # y / scale past x's type's range while y is finite: float32 reads it
        # back in float64, the error rounded once; float64 halves both terms
        # (csrc/numerics.h's ElementMeasure).
        s64 = scale.reshape(()).double()
        if xf.dtype != torch.float64:
            wide = (xf.double() - yw.double() / s64).abs().to(xf.dtype)
        else:
            wide = (xf * 0.5 - yw.double() / (s64 * 2)).abs() * 2
        err = torch.where(y_finite & ~torch.isfinite(back), wide, err)
    abs_err = torch.where(measured, err, zero)
    denom = torch.where(measured & (xf != 0), xf.abs(), torch.ones_like(xf))
    rel_err = abs_err / denom
    n = xf.numel()
    # numel, nan, inf and amax are an exact cast's; the rest is the rounding's.
    values = dict(zip(STAT_FIELDS, exact_cast_stats(x)))
    nan, inf = values["nan"], values["inf"]
    overflow = (x_finite & ~y_finite).sum()
    # Beyond the range: not NaN, and not finite once rounded without saturation.
    if saturate:
        unsaturated = iteration_order(correctly_rounded(x, dtype, scale=scale), y).float()
        saturated = (~torch.isnan(xf) & ~torch.isfinite(unsaturated)).sum()
    else:
        saturated = 0
    values.update({
        "inexact": (x_finite & (back != xf)).sum(),
        "overflow": overflow,
        "saturated": saturated,
        "underflow": ((xf != 0) & (yw == 0)).sum(),
        "subnormal": ((yw != 0) & (yw.abs() < _MIN_NORMAL[dtype])).sum(),
        "max_abs_err": abs_err.max() if n else 0.0,
        "max_rel_err": rel_err.max() if n else 0.0,
    })
    # Every finite x overflowed: no measured element is left, and the maxima
    # are inf rather than 0.
    all_overflowed = (overflow > 0) & (overflow == n - nan - inf)
    for name in ("max_abs_err", "max_rel_err"):
        values[name] = torch.where(all_overflowed, float("inf"), values[name])
    # The terms: plain float64 sums of float64 terms on the CPU (a float32
    # term and its square are exact in float64) and for float64 sources;
    # compensated float32 sums of float32 terms for the other sources on
    # CUDA (numerics.h's SumsOf).
    size = x.element_size()
    cpu_sums = x.device.type == "cpu" if cuda_sums is None else not cuda_sums
    if cpu_sums:
        abs_err, xf = abs_err.double(), xf.double()
        zero = zero.double()
    values["sum_abs_err"] = canonical_sum(abs_err, size)
    values["sum_sq_err"] = canonical_sum(abs_err * abs_err, size)
    values["sum_sq"] = canonical_sum(torch.where(measured, xf * xf, zero), size)
    stats = torch.stack([torch.as_tensor(values[name], dtype=torch.float64, device=x.device)
                         .reshape(()) for name in STAT_FIELDS])
    return y, stats
