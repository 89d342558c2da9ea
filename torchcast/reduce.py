"""Compensated float32 reductions: float64-class accuracy at float32 traffic.

kahan_sum and kahan_mean take the arguments of torch.sum and torch.mean and
accumulate in float32 with Neumaier compensation (float64 inputs in plain
float64), in a fixed order that makes the result bit-identical whatever the
thread count (csrc/reduce_common.h)."""
from . import _ops


def _dim_list(dim):
    if dim is None:
        return None
    if isinstance(dim, (list, tuple)):
        return list(dim)
    return [dim]


def kahan_sum(x, dim=None, keepdim=False, *, dtype=None):
    """Sum of x over dim (an int, a tuple of ints, or None for all dims), like
    torch.sum.

    x may be float32, float16 or bfloat16 (accumulated in float32 with
    Neumaier compensation) or float64 (accumulated in float64). The result has
    x's dtype unless dtype (a floating dtype) says otherwise; it is the
    compensated sum rounded once to that dtype, so dtype=torch.float64 keeps
    the extra digits the compensation carries. Differentiable: the gradient
    is grad broadcast back to x's shape, exactly."""
    return _ops.kahan_reduce(x, _dim_list(dim), keepdim, dtype, mean=False)


def kahan_mean(x, dim=None, keepdim=False, *, dtype=None):
    """Mean of x over dim, like torch.mean: kahan_sum's compensated sum
    divided by the count in float64, then rounded once to the result dtype."""
    return _ops.kahan_reduce(x, _dim_list(dim), keepdim, dtype, mean=True)
