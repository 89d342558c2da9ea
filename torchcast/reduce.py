"""Compensated float32 reductions at float32 traffic: results within 2 ulp
of the exact sum plus Neumaier's condition term (docs/reduce.md states the
bound; about half an ulp on well-conditioned data).

kahan_sum and kahan_mean take the arguments of torch.sum and torch.mean and
accumulate in float32 with Neumaier compensation (float64 inputs, and any
input with dtype=torch.float64, in plain float64), in a fixed order that
makes the result bit-identical whatever the thread count
(csrc/reduce_common.h)."""
import operator
from typing import List, Optional, Sequence, Union

import torch

from . import _ops
from ._inputs import check_input

_SIGNATURE = ("(Tensor x, tuple of ints dim = None, bool keepdim = False, *, "
              "torch.dtype dtype = None)")


def _invalid(fn, arg, value, why):
    # torch.sum's wording for the same mistake, then what would be accepted.
    return TypeError(
        f"{fn}() received an invalid combination of arguments - got (Tensor, "
        f"{arg}={type(value).__name__}), but expected one of:\n * {_SIGNATURE}\n"
        f"({arg} must be {why}, got {value!r})")


def _dim_index(fn, dim, d):
    if isinstance(d, (float, complex, str)) or d is None:
        raise _invalid(fn, "dim", dim, "an int, a tuple of ints, or None")
    try:
        return operator.index(d)  # ints (a bool inside a tuple too, as torch), numpy ints
    except TypeError:
        if isinstance(d, torch.Tensor) and d.numel() == 1 and not d.is_floating_point():
            return int(d)  # torch.sum takes a one-element integer tensor as a dim
        raise _invalid(fn, "dim", dim, "an int, a tuple of ints, or None") from None


def _check_args(fn, x, dim, keepdim, dtype) -> Optional[List[int]]:
    """Validates the arguments as torch.sum does; returns dim as a list."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"torchcast.{fn}: x must be a Tensor, got {type(x).__name__}")
    check_input(x, f"torchcast.{fn}")
    if not isinstance(keepdim, bool):
        raise _invalid(fn, "keepdim", keepdim, "a bool")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise _invalid(fn, "dtype", dtype, "a torch.dtype or None")
    if dim is None:
        return None
    if isinstance(dim, bool):  # torch.sum rejects a bare bool (but not a bool in a tuple)
        raise _invalid(fn, "dim", dim, "an int, a tuple of ints, or None")
    if isinstance(dim, (list, tuple)):
        return [_dim_index(fn, dim, d) for d in dim]
    return [_dim_index(fn, dim, dim)]


def kahan_sum(x: torch.Tensor, dim: Union[int, Sequence[int], None] = None,
              keepdim: bool = False, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Sum of x over ``dim``, like ``torch.sum``, within 2 ulp of the exact
    sum plus Neumaier's condition term (docs/reduce.md).

    float16, bfloat16 and float32 x are accumulated in float32 with Neumaier
    compensation, float64 x in float64, in a fixed order: the result is the
    same bits whatever the thread count, and on CPU and CUDA. Differentiable:
    the gradient is the incoming gradient broadcast back to x's shape, exactly.

    Args:
        x (Tensor): a dense strided floating tensor (or a traceable wrapper
            subclass, ``__tensor_flatten__``).
        dim (int or tuple of ints, optional): the dimension or dimensions to
            reduce. None or () reduces all of them.
        keepdim (bool): whether the output keeps the reduced dimensions, with
            size 1. Default: False.
        dtype (torch.dtype, optional): the desired dtype of the returned
            tensor. Default: x's dtype. With torch.float64 the sum is
            accumulated in float64: the result is
            ``kahan_sum(x.to(torch.float64))`` bit for bit, so it overflows
            only where a float64 sum does, as with
            ``torch.sum(x, dtype=torch.float64)``. Any other dtype only sets
            the result's dtype: unlike torch.sum, x is not cast to dtype
            first; x's own values are summed and the result is rounded once,
            so ``dtype=torch.bfloat16`` rounds the result, not every element.

    Returns:
        Tensor: the sum, of x's shape without the reduced dimensions (kept
        with size 1 under ``keepdim``).

    Raises:
        TypeError: x is not a dense strided floating tensor (sparse,
            quantized, nested, mkldnn, or a ``__torch_dispatch__`` subclass
            without ``__tensor_flatten__``), or an argument has the wrong
            type; torch.sum's message.
        IndexError: a dim out of range, as torch.sum raises it.
        RuntimeError: a dim repeated, as torch.sum raises it.
    """
    dims = _check_args("kahan_sum", x, dim, keepdim, dtype)
    return _ops.kahan_reduce(x, dims, keepdim, dtype, mean=False)


def kahan_mean(x: torch.Tensor, dim: Union[int, Sequence[int], None] = None,
               keepdim: bool = False, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Mean of x over ``dim``, like ``torch.mean``: ``kahan_sum``'s sum
    divided by the number of elements reduced, in float64, then rounded
    once to the result's dtype. Differentiable, exactly (the incoming
    gradient over that number).

    Args:
        x (Tensor): as ``kahan_sum``.
        dim (int or tuple of ints, optional): as ``kahan_sum``.
        keepdim (bool): as ``kahan_sum``. Default: False.
        dtype (torch.dtype, optional): as ``kahan_sum``; with torch.float64
            the result is ``kahan_mean(x.to(torch.float64))`` bit for bit, as
            ``torch.mean(x, dtype=torch.float64)`` sums in float64.

    Returns:
        Tensor: the mean, shaped as ``kahan_sum``'s result. The mean over
        no elements is NaN, as torch.mean's.

    Raises:
        TypeError, IndexError, RuntimeError: as ``kahan_sum``.
    """
    dims = _check_args("kahan_mean", x, dim, keepdim, dtype)
    return _ops.kahan_reduce(x, dims, keepdim, dtype, mean=True)
