"""The one module that touches torch.ops.torchcast: loads the compiled
kernels and registers fake kernels, autograd and the fallback."""
import warnings

import torch

try:
    from . import _C
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchcast's compiled extension torchcast._C could not be loaded "
        f"({e}). Build it from the source tree with "
        "`pip install --no-build-isolation -e .` (needs torch and ninja; set "
        "TORCHCAST_CUDA=1 for the CUDA kernels).") from e

from . import _reference

_ops = torch.ops.torchcast
WITH_CUDA = bool(_C.with_cuda)
STAT_FIELDS = _reference.STAT_FIELDS


# ---------------------------------------------------------------------------
# cast_with_stats

@torch.library.register_fake("torchcast::cast_with_stats")
def _cast_with_stats_fake(x, dtype):
    _reference.classify_cast(x.dtype, dtype)
    return torch.empty_like(x, dtype=dtype), x.new_empty(len(STAT_FIELDS), dtype=torch.float64)


@torch.library.register_fake("torchcast::cast_with_stats.out")
def _cast_with_stats_out_fake(x, dtype, *, out):
    _reference.classify_cast(x.dtype, dtype)
    return x.new_empty(len(STAT_FIELDS), dtype=torch.float64)


# Autograd for torchcast::cast_with_stats is registered in C++ (csrc/ops.cpp):
# a Python autograd kernel would cost microseconds on every call.


_warned_fallback = set()


def has_kernels(device):
    """Whether compiled torchcast kernels exist for this device type."""
    return device.type == "cpu" or device.type == "meta" or (device.type == "cuda" and WITH_CUDA)


def _warn_fallback(device):
    if device.type not in _warned_fallback:
        _warned_fallback.add(device.type)
        warnings.warn(
            f"torchcast has no compiled kernels for device '{device.type}'; using the "
            "pure-PyTorch implementation (same results, several times slower).",
            RuntimeWarning, stacklevel=3)


def cast_with_stats(x, dtype, out=None):
    """(y, stats): the fused op, or the pure-PyTorch fallback where no kernel exists."""
    if not has_kernels(x.device):
        _warn_fallback(x.device)
        if x.requires_grad and torch.is_grad_enabled():
            y, stats = _reference.cast_with_stats(x.detach(), dtype, out)
            return _FallbackCast.apply(x, y), stats
        return _reference.cast_with_stats(x, dtype, out)
    if out is not None:
        return out, _ops.cast_with_stats.out(x, dtype, out=out)
    return _ops.cast_with_stats(x, dtype)


class _FallbackCast(torch.autograd.Function):
    """Attaches the cast's identity derivative to a y computed without autograd."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.src_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y.to(ctx.src_dtype), None
