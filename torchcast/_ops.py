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


def _cast_setup_context(ctx, inputs, output):
    ctx.src_dtype = inputs[0].dtype


def _cast_backward(ctx, grad_y, grad_stats):
    # The cast's derivative is the identity; the gradient comes back in x's dtype.
    return grad_y.to(ctx.src_dtype), None


torch.library.register_autograd(
    "torchcast::cast_with_stats", _cast_backward, setup_context=_cast_setup_context)


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


# ---------------------------------------------------------------------------
# adam_step_ (torchcast.optim.Adam/AdamW): one fused step over the tensors of
# one dtype group. It mutates its inputs and returns nothing, so the fake
# kernels have nothing to compute; the schema's (a!) annotations tell
# torch.compile what changes.

@torch.library.register_fake("torchcast::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                    state_steps, *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
                    decoupled_weight_decay, compensation, grad_scale=None, found_inf=None):
    return None


@torch.library.register_fake("torchcast::adam_step_.tensor_lr")
def _adam_step_tensor_lr_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                              compensations, state_steps, *, lr, beta1, beta2, weight_decay,
                              eps, amsgrad, maximize, decoupled_weight_decay, compensation,
                              grad_scale=None, found_inf=None):
    return None


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def has_adam_kernel(device):
    """Whether a compiled adam_step_ kernel exists for this device type."""
    key = _DISPATCH_KEYS.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "torchcast::adam_step_", key)


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
               state_steps, *, lr, **kwargs):
    """The compiled step; a tensor lr takes the tensor_lr overload."""
    op = _ops.adam_step_.tensor_lr if isinstance(lr, torch.Tensor) else _ops.adam_step_.default
    op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations, state_steps,
       lr=lr, **kwargs)
