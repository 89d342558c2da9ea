"""Pure-PyTorch kahan_sum / kahan_mean: the fallback for devices without
torchcast kernels, and an independent restatement of the order written down
in csrc/reduce_common.h, which the tests compare with the kernels bit for bit.

Also the argument checks shared with the fake kernels, raising what torch
raises for the same mistake (torch.sum's dim errors, torch.mean's dtype
error)."""
import math

import torch

from . import _reference
from ._reference import BLOCK_THREADS, CHUNK, WARP

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


# ---------------------------------------------------------------------------
# Accumulators: lane update, merge of two partials, and the partial's value.

def _settled(s, c):
    return torch.where(torch.isfinite(s), c, torch.zeros_like(c))


class _Compensated:
    acc = torch.float32
    add = staticmethod(_reference._neumaier_add)

    @staticmethod
    def from_lane(s, c):
        return s, _settled(s, c)

    @staticmethod
    def merge(a, b):
        s, c = _reference._merge(a, b)
        return s, _settled(s, c)

    @staticmethod
    def value(s, c):
        return s.double() + c.double()


class _PlainDouble:
    acc = torch.float64

    @staticmethod
    def add(s, c, v):
        return s + v, c

    @staticmethod
    def from_lane(s, c):
        return s, torch.zeros_like(c)

    @staticmethod
    def merge(a, b):
        return a[0] + b[0], a[1]

    @staticmethod
    def value(s, c):
        return s


def _halving_tree(s, c, merge):
    """Reduces the last dim (a power of two) by shuffle-down steps."""
    off = s.shape[-1] // 2
    while off:
        s, c = merge((s[..., :off], c[..., :off]), (s[..., off:2 * off], c[..., off:2 * off]))
        off //= 2
    return s[..., 0], c[..., 0]


def _block_tree(s, c, merge):
    """block_tree_reduce over the last dim (BLOCK_THREADS values)."""
    shape = (*s.shape[:-1], BLOCK_THREADS // WARP, WARP)
    s, c = _halving_tree(s.reshape(shape), c.reshape(shape), merge)
    return _halving_tree(s, c, merge)


def _reduce_partials(s, c, merge):
    """reduce_partials over the last dim, batched over the others."""
    n = s.shape[-1]
    rows = max(1, -(-n // BLOCK_THREADS))
    grid_s = s.new_zeros(*s.shape[:-1], rows * BLOCK_THREADS)
    grid_c = torch.zeros_like(grid_s)
    grid_s[..., :n], grid_c[..., :n] = s, c
    grid_s = grid_s.unflatten(-1, (rows, BLOCK_THREADS))
    grid_c = grid_c.unflatten(-1, (rows, BLOCK_THREADS))
    ts, tc = torch.zeros_like(grid_s[..., 0, :]), torch.zeros_like(grid_c[..., 0, :])
    for r in range(rows):
        ts, tc = merge((ts, tc), (grid_s[..., r, :], grid_c[..., r, :]))
    return _block_tree(ts, tc, merge)


def _lane_sums(rows, lanes, pol):
    """Cuts each row of rows [k, m] into segments of CHUNK elements and sums
    element e of a segment into lane e % lanes: (s, c) of shape [k, nseg, lanes]."""
    k, m = rows.shape
    nseg = -(-m // CHUNK)
    steps = -(-min(m, CHUNK) // lanes)
    # A single segment is padded to whole steps only; zeros are exact no-ops.
    seg_len = CHUNK if nseg > 1 else steps * lanes
    padded = rows.new_zeros(k, nseg * seg_len)
    padded[:, :m] = rows
    v = padded.view(k, nseg, seg_len // lanes, lanes)
    s = rows.new_zeros(k, nseg, lanes)
    c = torch.zeros_like(s)
    for step in range(steps):
        s, c = pol.add(s, c, v[:, :, step])
    return pol.from_lane(s, c)


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
    pol = _PlainDouble if x.dtype == torch.float64 else _Compensated
    rows = x.permute(kept + reduced + ones).reshape(k, m).to(pol.acc)
    if scheme == "full":
        vec = 16 // x.element_size()
        s, c = _lane_sums(rows, BLOCK_THREADS * vec, pol)
        s, c = s.unflatten(-1, (BLOCK_THREADS, vec)), c.unflatten(-1, (BLOCK_THREADS, vec))
        ts, tc = torch.zeros_like(s[..., 0]), torch.zeros_like(c[..., 0])
        for j in range(vec):
            ts, tc = pol.merge((ts, tc), (s[..., j], c[..., j]))
        s, c = _block_tree(ts, tc, pol.merge)
    elif scheme == "warp":
        s, c = _halving_tree(*_lane_sums(rows, WARP, pol), pol.merge)
    else:
        s, c = _lane_sums(rows, 1, pol)
        s, c = s[..., 0], c[..., 0]
    value = pol.value(*_reduce_partials(s, c, pol.merge))
    if mean:
        value = value / m
    if out_dtype == torch.float64:
        result = value
    elif out_dtype == torch.float32:
        result = value.float()
    else:
        result = _reference.correctly_rounded(value, out_dtype)
    return result.reshape(shape)
