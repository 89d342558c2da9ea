"""Pure-PyTorch kahan_sum / kahan_mean: the fallback for devices without
torchcast kernels, and an independent restatement of the order written down
in csrc/reduce_common.h, which the tests compare with the kernels bit for bit.

Also the argument checks shared with the fake kernels, raising what torch
raises for the same mistake (torch.sum's dim errors, torch.mean's dtype
error)."""
import math

import torch

from . import order
from .compensated import Compensated, PlainDouble
from .order import WARP
from .rounding import correctly_rounded

# Mirrors csrc/reduce_common.h.
WARP_MIN_RUN = 2 * WARP

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_dtypes(op, x, dtype):
    """RuntimeError, as torch.mean / torch.nansum raise, for non-float x or dtype."""
    if x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(
            f"torchcast.{op}: x must be float32, float16, bfloat16 or float64, got "
            f"{x.dtype}; convert it first, e.g. x.float()")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise RuntimeError(
            f"torchcast.{op}: dtype must be torch.float32, torch.float16, torch.bfloat16 or "
            f"torch.float64, got {dtype} (x is {x.dtype})")


def reduce_dims(x, dim):
    """The sorted dims to reduce, with torch.sum's semantics: None or () for
    all, IndexError when out of range, RuntimeError when repeated."""
    nd = x.dim()
    if dim is None or len(dim) == 0:
        return list(range(nd))
    if nd > 64:  # torch.sum's limit for a dim list (a 64-bit mask), and the kernels'
        raise RuntimeError("only tensors with up to 64 dims are supported")
    lo, hi = (-1, 0) if nd == 0 else (-nd, nd - 1)
    seen = []
    for d in dim:
        if not lo <= d <= hi:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{lo}, {hi}], but got {d})")
        w = d + max(nd, 1) if d < 0 else d
        if w in seen:
            raise RuntimeError(f"dim {w} appears multiple times in the list of dims")
        seen.append(w)
    return sorted(d for d in seen if d < nd)


def out_shape(x, dims, keepdim):
    if keepdim:
        return [1 if d in dims else s for d, s in enumerate(x.shape)]
    return [s for d, s in enumerate(x.shape) if d not in dims]


def plan(x, dims):
    """(kept dims, reduced dims in sequence order, scheme) per reduce_common.h."""
    kept = [d for d in range(x.dim()) if d not in dims]
    reduced = sorted((d for d in dims if x.size(d) != 1), key=lambda d: -x.stride(d))
    k = math.prod(x.size(d) for d in kept)
    run_size, run_stride = 1, 1
    if reduced:
        run_size, run_stride = x.size(reduced[-1]), x.stride(reduced[-1])
        for d in reversed(reduced[:-1]):
            if x.stride(d) != run_stride * run_size:
                break
            run_size *= x.size(d)
    if k == 1:
        scheme = "full"
    elif run_stride == 1 and run_size >= WARP_MIN_RUN:
        scheme = "warp"
    else:
        scheme = "one"
    return kept, reduced, scheme


def kahan_reduce(x, dim, keepdim, dtype, mean):
    """kahan_sum (mean=False) or kahan_mean, bit for bit as the kernels."""
    op = "kahan_mean" if mean else "kahan_sum"
    check_dtypes(op, x, dtype)
    dims = reduce_dims(x, dim)
    if dtype == torch.float64:
        # plan_accumulation: a float64 result accumulates in float64, once
        # the arguments are known to be good.
        x = x.to(torch.float64)
    out_dtype = dtype or x.dtype
    shape = out_shape(x, dims, keepdim)
    kept, reduced, scheme = plan(x, dims)
    ones = [d for d in dims if d not in reduced]
    k = math.prod(x.size(d) for d in kept)
    m = math.prod(x.size(d) for d in reduced)
    if k == 0 or m == 0:
        fill = math.nan if mean else 0.0
        return torch.full(shape, fill, dtype=out_dtype, device=x.device)
    pol = PlainDouble if x.dtype == torch.float64 else Compensated
    rows = x.permute(kept + reduced + ones).reshape(k, m).to(pol.acc)
    if scheme == "full":
        partials = order.block_partials(rows, order.thread_lanes(x.element_size()), pol)
    elif scheme == "warp":
        partials = order.warp_partials(rows, pol)
    else:
        partials = order.thread_partials(rows, pol)
    value = order.total(partials, pol)
    if mean:
        value = value / m
    if out_dtype == torch.float64:
        result = value
    elif out_dtype == torch.float32:
        result = value.float()
    else:
        result = correctly_rounded(value, out_dtype)
    return result.reshape(shape)
