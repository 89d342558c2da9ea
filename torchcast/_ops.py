"""The one module that touches torch.ops.torchcast: loads the compiled
kernels (or, in a build without them, the ops defined from Python) and
registers fake kernels, autograd and the fallback. (The tracker's C++
switches in the same extension: tracker/native.py.)"""
import warnings
from typing import Optional

import torch

from . import _loader

_C = _loader.load_extension()
extension = _C  # torchcast._C, None in a build without it
if _C is None:
    from . import _python_ops  # noqa: F401  (defines the ops, with reference kernels)

from ._reference import adam as adam_reference
from ._reference import cast as cast_reference
from .stats import STAT_FIELDS

_ops = torch.ops.torchcast
WITH_EXTENSION = _C is not None
WITH_CUDA = WITH_EXTENSION and bool(_C.with_cuda)
# plain_tensor(x): whether x is a dense strided torch.Tensor or nn.Parameter
# outside every torch.func transform, read in C++ (csrc/ops.cpp): the common
# case of _inputs.check_input. None without the extension.
plain_tensor = _C.plain_tensor if WITH_EXTENSION else None


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a float8 dtype ``t`` widened to float32 (exactly): torch's
    isposinf, isneginf and max have no CPU kernels for the float8 dtypes, nor
    isfinite and isinf for all but float8_e5m2 (tests/test_track_nonfinite.py)."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def torch_all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` (any device, any dtype) is finite, by
    torch.isfinite: one sync."""
    return bool(torch.isfinite(readable(t)).all())


# all_finite(t): whether every element of a CPU tensor is finite, read in C++
# (csrc/cpu/all_finite.cpp): track(nonfinite=...) checks every op's output.
all_finite = _C.all_finite if WITH_EXTENSION else torch_all_finite


def finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: all_finite on the CPU,
    torch_all_finite (one sync) on other devices."""
    return all_finite(t) if t.device.type == "cpu" else torch_all_finite(t)


def _torch_all_finite_amax(t: torch.Tensor) -> Optional[float]:
    r = readable(t)
    if not bool(torch.isfinite(r).all()):
        return None
    return float(r.abs().amax()) if r.numel() else 0.0


# all_finite_amax(t): a CPU tensor's largest |x| (0.0 when empty), or None when
# an element is NaN/inf; one read in C++ (csrc/cpu/all_finite.cpp).
all_finite_amax = _C.all_finite_amax if WITH_EXTENSION else _torch_all_finite_amax


def exact_cast_stats(x: torch.Tensor) -> torch.Tensor:
    """The stats tensor ``cast_with_stats`` gives an exact cast of ``x`` (a
    float64/32/16 or bfloat16 tensor): numel and its NaN count, without
    casting it; on x's device, without a sync."""
    # Under torch.compile, the traceable reference: _C's is no torch op; and
    # for a wrapper subclass, whose data only its own dispatch can read.
    if WITH_EXTENSION and not torch.compiler.is_compiling() and plain_tensor(x):
        return _C.exact_cast_stats(x)
    return cast_reference.exact_cast_stats(x)


# ---------------------------------------------------------------------------
# cast_with_stats

@torch.library.register_fake("torchcast::cast_with_stats")
def _cast_with_stats_fake(x, dtype, scale=None, *, saturate=None):
    cast_reference.check_scale(x, dtype, cast_reference.classify_cast(x.dtype, dtype), scale)
    return torch.empty_like(x, dtype=dtype), x.new_empty(len(STAT_FIELDS), dtype=torch.float64)


@torch.library.register_fake("torchcast::cast_with_stats.out")
def _cast_with_stats_out_fake(x, dtype, scale=None, *, saturate=None, out):
    cast_reference.check_scale(x, dtype, cast_reference.classify_cast(x.dtype, dtype), scale)
    cast_reference.check_out_devices(x, out)
    return x.new_empty(len(STAT_FIELDS), dtype=torch.float64)


# Autograd for torchcast::cast_with_stats is registered in C++ (csrc/autograd.cpp):
# a Python autograd kernel would cost microseconds on every call.


_CAST = _ops.cast_with_stats.default
_warned_fallback = set()


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}


def has_kernel(op, device):
    """Whether torchcast::op has a compiled (or, for meta, fake) kernel for this
    device (a torch.device, or its type as device_type gives it). A set
    lookup, so torch.compile traces it without a graph break."""
    return (op, device if isinstance(device, str) else device.type) in _KERNELS


def device_type(x):
    """x's device type: x.is_cpu first, as reading x.device.type costs about
    0.2 µs, a tenth of a small cast."""
    return "cpu" if x.is_cpu else x.device.type


def _warn_fallback(device, stacklevel=3):
    """Says once per device type that the fallback runs. The default
    stacklevel points at the caller of the op wrapper that calls this."""
    if device.type not in _warned_fallback:
        _warned_fallback.add(device.type)
        warnings.warn(
            f"torchcast has no compiled kernels for device '{device.type}'; using the "
            "pure-PyTorch implementation (same results, several times slower).",
            RuntimeWarning, stacklevel=stacklevel)


# cast_with_stats(x, dtype, scale, saturate, out) -> (y, stats), or None where
# it declines (csrc/ops.cpp); None without the extension.
_cast_entry = _C.cast_with_stats if WITH_EXTENSION else None


def cast_with_stats(x, dtype, out=None, saturate=None, scale=None):
    """(y, stats): the fused op, or the pure-PyTorch fallback where no kernel exists."""
    if not torch.compiler.is_compiling():
        # torch.func refuses the op's C++ autograd Function (csrc/autograd.cpp)
        # and the fallback's old-style one: under its transforms, a Python one.
        if out is None and _functorch_active():
            return _DifferentiableCast.apply(x, dtype, scale, saturate)
        # First the C++ entry (out= too): it calls the op through the
        # dispatcher as torch.ops does, without torch.ops' boxing of the
        # arguments (about 2 µs, as much as a small cast). It declines (None)
        # wherever __torch_function__ applies or x is on a device without
        # compiled kernels; Dynamo cannot trace it.
        if _cast_entry is not None:
            result = _cast_entry(x, dtype, scale, saturate, out)
            if result is not None:
                return result
    return _cast(x, dtype, out, saturate, scale)


def _cast(x, dtype, out, saturate, scale):
    """cast_with_stats through torch.ops, or the fallback where no kernel exists."""
    if not has_kernel("cast_with_stats", device_type(x)):
        # 4: past this function and cast_with_stats, at the caller of the op wrapper.
        _warn_fallback(x.device, stacklevel=4)
        if x.requires_grad and torch.is_grad_enabled() and out is None:
            return _DifferentiableCast.apply(x, dtype, scale, saturate)
        return cast_reference.cast_with_stats(x, dtype, out, saturate, scale)
    if out is not None:
        return out, _ops.cast_with_stats.out(x, dtype, scale, saturate=saturate, out=out)
    # Only the arguments given: each keyword costs the dispatcher's parser
    # about 0.25 µs, a tenth of a small cast.
    if saturate is None:
        return _CAST(x, dtype) if scale is None else _CAST(x, dtype, scale)
    return _CAST(x, dtype, scale, saturate=saturate)


# Whether a torch.func transform (grad, vmap, jvp, ...) is active: a C++ query,
# about 10 ns.
_functorch_active = torch._C._are_functorch_transforms_active


class _DifferentiableCast(torch.autograd.Function):
    """cast_with_stats with the derivative of csrc/autograd.cpp (the identity,
    times scale for a scaled cast, in x's dtype; none for the stats and the
    scale: cast_reference.cast_grad), where that autograd kernel is not the
    one that runs: under torch.func transforms, which refuse it, and for the
    pure-PyTorch fallback. vmap: torch's generated rule, which runs the op
    once per example, as vmap does for the op itself (the stats are per
    example)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, dtype, scale, saturate):
        # Autograd is off here: the op's C++ autograd kernel passes straight
        # to the kernels, and the fallback computes y without a graph.
        return _cast(x, dtype, None, saturate, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dtype, scale, _ = inputs
        ctx.src_dtype, ctx.dtype = x.dtype, dtype
        ctx.save_for_backward(scale)
        ctx.save_for_forward(scale)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad_y, grad_stats):
        scale, = ctx.saved_tensors
        return cast_reference.cast_grad(grad_y, ctx.src_dtype, scale), None, None, None

    @staticmethod
    def jvp(ctx, x_t, _dtype, _scale_t, _saturate):
        # scale's tangent is dropped, as backward gives scale no gradient.
        scale, = ctx.saved_tensors
        y_t = x_t if scale is None else x_t * scale.reshape(()).to(ctx.src_dtype)
        return y_t.to(ctx.dtype), None


# ---------------------------------------------------------------------------
# adam_step_ (torchcast.optim.Adam/AdamW): one fused step over the tensors of
# one dtype group. It mutates its inputs and returns nothing, so the fake
# kernels only check devices (the dispatcher picks them when any argument is
# on meta, so a meta tensor among CPU ones lands here); the schema's (a!)
# annotations tell torch.compile what changes.

def _check_adam_devices(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                        state_steps, lr, grad_scale, found_inf, update_stats=None,
                        moment_scales=None):
    """The device rules of csrc/adam_common.cpp: one device for the params and
    their grads and states, the step counts on the CPU, and lr, grad_scale
    and found_inf on the CPU or the params' device. Under fake tracing every
    tensor reports its real device; an all-meta call has meta step counts."""
    if not params:
        return
    device = params[0].device
    cpu = torch.device("cpu")
    for i, p in enumerate(params):
        if p.device != device:
            raise RuntimeError(f"torchcast.adam_step_: param {i} is on {p.device} but param 0 "
                               f"is on {device}; one call steps one device")
        for what, tensors in (("grad", grads), ("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs),
                              ("max_exp_avg_sq", max_exp_avg_sqs),
                              ("compensation", compensations),
                              ("update_stats", update_stats or []),
                              ("moment_scales", moment_scales or [])):
            if i < len(tensors) and tensors[i].device != p.device:
                raise RuntimeError(f"torchcast.adam_step_: {what} {i} is on {tensors[i].device} "
                                   f"but its param is on {p.device}")
    step_ok = (cpu, device) if device.type == "meta" else (cpu,)
    for i, s in enumerate(state_steps):
        if s.device not in step_ok:
            raise RuntimeError(f"torchcast.adam_step_: state_step {i} is on {s.device} but "
                               "state steps must be on the CPU")
    for what, t in (("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)):
        if isinstance(t, torch.Tensor) and t.device not in (cpu, device):
            raise RuntimeError(f"torchcast.adam_step_: {what} is on {t.device} but the params "
                               f"are on {device}; put it on the CPU or the params' device")


@torch.library.register_fake("torchcast::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                    state_steps, *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
                    decoupled_weight_decay, compensation, grad_scale=None, found_inf=None,
                    seed=0, update_stats=None, moment_scales=None):
    _check_adam_devices(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                        state_steps, lr, grad_scale, found_inf, update_stats, moment_scales)
    return None


@torch.library.register_fake("torchcast::adam_step_.tensor_lr")
def _adam_step_tensor_lr_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                              compensations, state_steps, *, lr, beta1, beta2, weight_decay,
                              eps, amsgrad, maximize, decoupled_weight_decay, compensation,
                              grad_scale=None, found_inf=None, seed=0, update_stats=None,
                              moment_scales=None):
    _check_adam_devices(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                        state_steps, lr, grad_scale, found_inf, update_stats, moment_scales)
    return None


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
               state_steps, *, fused, lr, **kwargs):
    """The op on one device's non-empty params, or the pure-PyTorch fallback
    where no kernel exists or ``fused`` is False (the optimizer's option; the
    fallback warns only under fused=None). A tensor lr takes the tensor_lr
    overload, on the CPU or the params' device."""
    device = params[0].device
    if has_kernel("adam_step_", device) and fused is not False:
        if isinstance(lr, torch.Tensor):
            lr = lr.to("cpu") if device.type == "cpu" else lr.to(device)
        op = _ops.adam_step_.tensor_lr if isinstance(lr, torch.Tensor) else _ops.adam_step_.default
        op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations, state_steps,
           lr=lr, **kwargs)
        return
    if fused is None:
        # 4: past this function and Adam._launch, at the Adam._step line that launched it.
        _warn_fallback(device, stacklevel=4)
    adam_reference.adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                              compensations, state_steps, lr=lr, **kwargs)

# kahan_sum / kahan_mean: compensated float32 reductions. Kernel order in
# csrc/reduce_common.h; the fallback in _reference/reduce.py reproduces it.

import math  # noqa: E402

from ._reference import reduce as reduce_reference  # noqa: E402


def _kahan_fake(op):
    def fake(x, dim=None, keepdim=False, *, dtype=None):
        reduce_reference.check_dtypes(op, x, dtype)
        dims = reduce_reference.reduce_dims(x, dim)
        return x.new_empty(reduce_reference.out_shape(x, dims, keepdim), dtype=dtype or x.dtype)
    return fake


def _kahan_setup_context(ctx, inputs, keyword_only_inputs, output):
    x, dim, keepdim = inputs
    ctx.shape, ctx.dtype, ctx.keepdim = x.shape, x.dtype, keepdim
    ctx.dims = reduce_reference.reduce_dims(x, dim)
    ctx.count = math.prod(x.shape[d] for d in ctx.dims)


def _reduce_grad(grad, shape, dtype, dims, keepdim, count, mean):
    """The exact gradient of a sum (grad broadcast back to x), over count for a mean."""
    if mean:
        grad = grad / count
    if not keepdim:
        for d in dims:
            grad = grad.unsqueeze(d)
    return grad.expand(shape).to(dtype)


def _kahan_backward(mean):
    def backward(ctx, grad):
        # One gradient per positional input (x, dim, keepdim).
        return (_reduce_grad(grad, ctx.shape, ctx.dtype, ctx.dims, ctx.keepdim, ctx.count, mean),
                None, None)
    return backward


for _name, _mean in (("kahan_sum", False), ("kahan_mean", True)):
    torch.library.register_fake(f"torchcast::{_name}", _kahan_fake(_name))
    torch.library.register_autograd(f"torchcast::{_name}", _kahan_backward(_mean),
                                    setup_context=_kahan_setup_context)


def kahan_reduce(x, dim, keepdim, dtype, mean):
    """kahan_mean (mean=True) or kahan_sum: the op, or the pure-PyTorch
    fallback where no kernel exists. dim: None or a list of ints."""
    if not has_kernel("kahan_mean" if mean else "kahan_sum", x.device):
        _warn_fallback(x.device)
        y = reduce_reference.kahan_reduce(x.detach(), dim, keepdim, dtype, mean)
        if x.requires_grad and torch.is_grad_enabled():
            return _FallbackReduce.apply(x, y, dim, keepdim, mean)
        return y
    op = _ops.kahan_mean if mean else _ops.kahan_sum
    return op(x, dim, keepdim, dtype=dtype)


class _FallbackReduce(torch.autograd.Function):
    """Attaches the reduction's exact gradient to a y computed without autograd."""

    @staticmethod
    def forward(ctx, x, y, dim, keepdim, mean):
        _kahan_setup_context(ctx, (x, dim, keepdim), {}, y)
        ctx.mean = mean
        return y

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_grad(grad, ctx.shape, ctx.dtype, ctx.dims, ctx.keepdim, ctx.count,
                             ctx.mean), None, None, None, None)


# ---------------------------------------------------------------------------
# tensor_health (torchcast.health): counts, exponent histogram, extrema.
# Autograd: a C++ kernel that detaches (csrc/autograd.cpp).

from ._reference import health as health_reference  # noqa: E402


@torch.library.register_fake("torchcast::tensor_health")
def _tensor_health_fake(x):
    health_reference.check_dtype(x)
    counts, hist, extrema = health_reference.output_shapes(x.dtype)
    return (x.new_empty(counts, dtype=torch.int64), x.new_empty(hist, dtype=torch.int64),
            x.new_empty(extrema, dtype=torch.float64))


_health_entry = _C.tensor_health if WITH_EXTENSION else None


def tensor_health(x):
    """(counts, hist, extrema): the op, or the pure-PyTorch fallback where no
    kernel exists."""
    # The C++ entry first, as for cast_with_stats.
    if _health_entry is not None and not torch.compiler.is_compiling():
        result = _health_entry(x)
        if result is not None:
            return result
    if not has_kernel("tensor_health", x.device):
        _warn_fallback(x.device)
        return health_reference.tensor_health(x)
    return _ops.tensor_health(x)


# ---------------------------------------------------------------------------
# block_cast (torchcast.block): a block-scaled cast along the last dimension.
# The op's outputs are float8, uint8 and counts, never differentiable
# (csrc/autograd.cpp); the gradient is BlockCast.dequantize's, straight
# through to x (straight_through).

from ._reference import block_cast as block_reference  # noqa: E402


@torch.library.register_fake("torchcast::block_cast")
def _block_cast_fake(x, format, block_size, scale_mode, tensor_scale=None):
    fmt = block_reference.check_args(x, format, block_size, scale_mode, tensor_scale)
    data_shape, scale_shape = block_reference.output_shapes(x, fmt, block_size)
    return (x.new_empty(data_shape, dtype=fmt.element_dtype),
            x.new_empty(scale_shape, dtype=fmt.scale.dtype),
            x.new_empty(len(STAT_FIELDS), dtype=torch.float64),
            x.new_empty(block_reference.SCALE_BINS, dtype=torch.int64),
            x.new_empty(len(block_reference.BLOCK_COUNTS), dtype=torch.int64))


class _StraightThrough(torch.autograd.Function):
    """y (the dequantized block cast of x) with the identity as its
    derivative with respect to x, in x's dtype."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.x_dtype = x.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.x_dtype), None


def straight_through(x, y):
    """BlockCast.dequantize's gradient: y, whose derivative with respect to
    x is taken to be the identity."""
    return _StraightThrough.apply(x, y)


def block_cast(x, format, block_size, scale_mode, tensor_scale):
    """(data, scales, stats, scale_hist, block_counts): the op, or the
    pure-PyTorch fallback where no kernel exists."""
    if not has_kernel("block_cast", device_type(x)):
        _warn_fallback(x.device)
        return block_reference.block_cast(x, format, block_size, scale_mode, tensor_scale)
    return _ops.block_cast(x, format, block_size, scale_mode, tensor_scale)


# Filled once every op above is registered (the Meta kernels come from register_fake).
_KERNELS = frozenset(
    (name, device)
    for name in ("cast_with_stats", "kahan_sum", "kahan_mean", "adam_step_", "tensor_health",
                 "block_cast")
    for device, key in _DISPATCH_KEYS.items()
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"torchcast::{name}", key))
