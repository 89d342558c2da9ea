"""The torchcast ops defined from Python, for an install built without the
compiled extension (TORCHCAST_NO_EXTENSION=1).

The schemas (_schemas.py) are those of csrc/ops.cpp. Every kernel is the
pure-PyTorch reference, which the compiled kernels are tested against bit for
bit, so results do not change; only speed does, and the first call says so
once."""
import os
import sys
import warnings

import torch

from ._reference import adam as adam_reference
from ._reference import block_cast as block_reference
from ._reference import cast as cast_reference
from ._reference import health as health_reference
from ._reference import reduce as reduce_reference
from ._schemas import SCHEMAS

# The devices the compiled extension has kernels for; elsewhere the Python
# wrappers in _ops.py call the references directly, as with the extension.
_DEVICES = ("CPU", "CUDA")

_warned = False


def _user_stacklevel():
    """The stacklevel of the first caller outside torch and torchcast, so that
    the warning points at the user's line, past the dispatcher's frames."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _warn_once():
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "torchcast was installed without its compiled extension (TORCHCAST_NO_EXTENSION=1): "
            "every torchcast op runs its pure-PyTorch implementation (same results, several "
            "times slower). Reinstall with `pip install --no-build-isolation .` for the "
            "compiled kernels.", RuntimeWarning, stacklevel=_user_stacklevel())


def _cast_with_stats(x, dtype, scale=None, *, saturate=None):
    _warn_once()
    return cast_reference.cast_with_stats(x, dtype, saturate=saturate, scale=scale)


def _cast_with_stats_out(x, dtype, scale=None, *, saturate=None, out):
    _warn_once()
    return cast_reference.cast_with_stats(x, dtype, out, saturate, scale)[1]


def _adam_step_(*lists, **kwargs):
    _warn_once()
    adam_reference.adam_step_(*lists, **kwargs)


def _kahan(mean):
    def kernel(x, dim=None, keepdim=False, *, dtype=None):
        _warn_once()
        return reduce_reference.kahan_reduce(x, dim, keepdim, dtype, mean)
    return kernel


def _tensor_health(x):
    _warn_once()
    return health_reference.tensor_health(x)


def _block_cast(x, format, block_size, scale_mode, tensor_scale=None):
    _warn_once()
    return block_reference.block_cast(x, format, block_size, scale_mode, tensor_scale)


_KERNELS = {
    "cast_with_stats": _cast_with_stats,
    "cast_with_stats.out": _cast_with_stats_out,
    "adam_step_": _adam_step_,
    "adam_step_.tensor_lr": _adam_step_,
    "kahan_sum": _kahan(False),
    "kahan_mean": _kahan(True),
    "tensor_health": _tensor_health,
    "block_cast": _block_cast,
}

_lib = torch.library.Library("torchcast", "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    for _device in _DEVICES:
        _lib.impl(_name, _KERNELS[_name], _device)


def _cast_setup_context(ctx, inputs, keyword_only_inputs, output):
    # inputs: (x, dtype, scale); saturate is keyword-only and needs nothing.
    ctx.src_dtype = inputs[0].dtype
    ctx.save_for_backward(inputs[2])
    ctx.mark_non_differentiable(output[1])


def _cast_backward(ctx, grad_y, grad_stats):
    # The cast's derivative is the identity (times scale for a scaled cast);
    # the gradient comes back in x's dtype (as the C++ autograd kernel of the
    # compiled build).
    scale, = ctx.saved_tensors
    return cast_reference.cast_grad(grad_y, ctx.src_dtype, scale), None, None


torch.library.register_autograd("torchcast::cast_with_stats", _cast_backward,
                                setup_context=_cast_setup_context)

# tensor_health's outputs are statistics, never differentiable (as the C++
# Autograd kernel of the compiled build: csrc/autograd.cpp).
def _tensor_health_autograd(x):
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.torchcast.tensor_health(x)


_lib.impl("tensor_health", _tensor_health_autograd, "Autograd")



# block_cast's outputs carry no graph either (csrc/autograd.cpp).
def _block_cast_autograd(x, format, block_size, scale_mode, tensor_scale=None):
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.torchcast.block_cast(x, format, block_size, scale_mode, tensor_scale)


_lib.impl("block_cast", _block_cast_autograd, "Autograd")
