"""safe_to: x.to(dtype) that measures what the cast lost, and applies the
policy (torchcast.policies) to it; cast_with_stats, the fused cast alone;
and the per-thread state: the latest stats and scale, and the recorders
(torchcast.track's) that every safe_to reports to.

The policy names are re-exported here, where the rest of torchcast and its
tests import them from."""
import threading
from typing import Callable, Optional, Tuple, Union

import torch

from . import _ops
from ._inputs import check_input
from .policies import (
    act, check_policy, check_tolerance, get_policy, graph_cut_message, integer_measured,
    is_violation, safe_to_head, violation_message,
)
# Re-exported: torchcast/__init__.py, the tracker and the tests import them from here.
from .policies import (  # noqa: F401
    POLICIES, PrecisionLossError, PrecisionWarning, is_integer_dtype, policy, set_policy,
)
from .scaling import resolve_scale
from .stats import CastStats, PendingStats, stats_tensor


class _ThreadState(threading.local):
    """What each thread holds; the class attributes are the defaults (a
    getattr with a default that misses costs 0.4 µs, a tenth of a call).
    Its ``policy`` blocks are torchcast.policies'."""
    last: Optional[PendingStats] = None
    recorders: Tuple[Callable[[PendingStats, Optional[str]], None], ...] = ()
    all_casts_tracks: int = 0  # track(all_casts=True) blocks active in this thread


_local = _ThreadState()


def last_scale() -> Optional[torch.Tensor]:
    """The scale of the latest ``safe_to`` call in this thread: the 0-d
    tensor y was computed with (float32; float64 from the amax recipes for
    a float64 x; ``y = round(x * scale)``, so
    ``y.float() / scale`` reads it back; ``torch._scaled_mm`` wants
    ``scale.reciprocal()``), still on the device.

    Returns:
        Tensor or None: None when that call was unscaled, and before the
        thread's first ``safe_to``. Calls traced by torch.compile do not
        count.
    """
    pending = _local.last
    return pending.scale if pending is not None else None


def last_stats() -> Optional[CastStats]:
    """The stats of the latest ``safe_to`` call in this thread, whatever its
    policy. After a call under "ignore" or "record" the first read waits for
    the device (one host synchronization, as ``Tensor.item()``); later reads
    are free.

    Returns:
        CastStats or None: None before the thread's first ``safe_to``, and
        when that call cast a meta tensor (which has no values to measure).
        Calls traced by torch.compile leave no stats and do not count.
    """
    pending = _local.last
    if pending is None or pending.tensor is not None and pending.tensor.is_meta:
        return None
    return pending.value


# Recorders: callables that every safe_to of this thread whose policy is not
# "ignore" reports to, as ``recorder(pending_stats, name)`` (torchcast.track's).
# The active track(all_casts=True) blocks record the safe_to calls of every
# thread that has no such block of its own (its "other-thread recorders"),
# as csrc/thread_casts.cpp hands them the x.to of those threads.
_other_thread_recorders: Tuple[Callable[[PendingStats, Optional[str]], None], ...] = ()
_other_thread_lock = threading.Lock()


def recorders() -> Tuple[Callable[[PendingStats, Optional[str]], None], ...]:
    """The recorders active in this thread, outermost first, then, in a
    thread without a track(all_casts=True) of its own, those of the ones
    active in other threads."""
    others = _other_thread_recorders
    if not others or _local.all_casts_tracks:
        return _local.recorders
    return _local.recorders + tuple(r for r in others if r not in _local.recorders)


def set_all_casts_track(entered: bool) -> None:
    """Counts a track(all_casts=True) this thread enters (True) or leaves
    (False): while one is active, the other threads' tracks do not record
    this thread's safe_to calls."""
    _local.all_casts_tracks += 1 if entered else -1


def add_other_thread_recorder(recorder: Callable[[PendingStats, Optional[str]], None]) -> None:
    """Makes every later safe_to of a thread without recorders of its own
    call ``recorder`` until ``remove_other_thread_recorder(recorder)``."""
    global _other_thread_recorders
    with _other_thread_lock:
        _other_thread_recorders = _other_thread_recorders + (recorder,)


def remove_other_thread_recorder(recorder: Callable[[PendingStats, Optional[str]], None]) -> None:
    """Undoes ``add_other_thread_recorder(recorder)``."""
    global _other_thread_recorders
    with _other_thread_lock:
        _other_thread_recorders = tuple(r for r in _other_thread_recorders if r != recorder)


def add_recorder(recorder: Callable[[PendingStats, Optional[str]], None]) -> None:
    """Makes every later safe_to of this thread (policy not "ignore") call
    ``recorder(pending_stats, name)`` until ``remove_recorder(recorder)``."""
    _local.recorders = _local.recorders + (recorder,)


def remove_recorder(recorder: Callable[[PendingStats, Optional[str]], None]) -> None:
    """Undoes ``add_recorder(recorder)`` (``recorder`` or an equal callable,
    such as the same bound method got again)."""
    _local.recorders = tuple(r for r in _local.recorders if r != recorder)


def _resolve_dtype(x, dtype):
    if dtype is None:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            raise TypeError(
                "torchcast.safe_to: dtype=None means the active autocast dtype, but autocast "
                f"is not enabled for device '{device}'; pass a dtype")
        return torch.get_autocast_dtype(device)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"torchcast.safe_to: dtype must be a torch.dtype, got {type(dtype).__name__} "
            f"({dtype!r})")
    return dtype


def _check_saturate(saturate: object, fn: str) -> None:
    """TypeError unless saturate is None or a bool; fn names the caller."""
    if saturate is not None and not isinstance(saturate, bool):
        raise TypeError(f"{fn}: saturate must be a bool or None, got "
                        f"{type(saturate).__name__} ({saturate!r})")


# float -> integer/bool casts: measured with composite ops (not the hot path),
# in float64 (policies.integer_measured).

def _integer_cast_stats(x, dtype):
    """The float64 stats tensor (layout of STAT_FIELDS) of casting floating x
    to an integer or bool dtype, without a host synchronization. NaN counts in
    ``nan``; +-inf and out-of-range values in ``overflow`` (never for bool,
    which only tests x != 0); every element whose number is not kept (those,
    and dropped fractions) in ``inexact``; the errors |x - trunc(x)| (bool:
    |x - (x != 0)|) over the measured elements."""
    xd = x.detach().to(torch.float64)
    measured, back = integer_measured(xd, dtype)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    err = torch.where(measured, (xd - back).abs(), zero)
    rel = err / torch.where(measured & (xd != 0), xd.abs(), torch.ones_like(xd))
    nan = torch.isnan(xd)
    n = x.numel()
    finite = torch.isfinite(xd)
    values = {
        "numel": torch.full((), n, dtype=torch.float64, device=x.device),
        "nan": nan.sum(),
        "inf": torch.isinf(xd).sum(),
        "inexact": (~measured | (xd != back)).sum(),
        "overflow": (~measured & ~nan).sum() if dtype != torch.bool else zero,
        "saturated": zero,
        "underflow": zero,
        "subnormal": zero,
        "max_abs_err": err.max() if n else zero,
        "max_rel_err": rel.max() if n else zero,
        "amax": torch.where(finite, xd.abs(), zero).max() if n else zero,
        "sum_abs_err": err.sum(),
        "sum_sq_err": (err * err).sum(),
        "sum_sq": torch.where(measured, xd * xd, zero).sum(),
    }
    return stats_tensor(values)


def safe_to(x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
            policy: Optional[str] = None, rtol: Optional[float] = None,
            atol: Optional[float] = None, name: Optional[str] = None,
            scale: Union[None, str, torch.Tensor] = None,
            saturate: Optional[bool] = None) -> torch.Tensor:
    """``x.to(dtype)`` that measures what the cast loses, in the same pass,
    and applies a policy to it.

    The cast is correctly rounded (one rounding from x's dtype; torch's own
    float64 -> float16/bfloat16 cast rounds twice, through float32), and
    autograd sees it as ``x.to(dtype)``: the gradient flows back to x in x's
    dtype.

    The floating casts measured are float64 -> float32, float64/float32 ->
    float16/bfloat16, float16 <-> bfloat16, and float64/float32/float16/
    bfloat16 -> float8_e4m3fn/float8_e5m2 (lossy), and widening casts
    between these dtypes (exact). A floating x cast to an integer or bool dtype returns
    exactly ``x.to(dtype)`` and is measured with composite ops: NaN
    (``nan``), +-inf and values whose integer part is outside the dtype's
    range (``overflow``; torch's result there is undefined) are violations;
    dropped fractions are ``inexact``, with errors |x - trunc(x)| over the
    other elements, and only violate rtol/atol. A bool cast tests x != 0:
    NaN (which becomes True) is its only violation.

    A violation is any overflow, saturation, underflow or subnormal result,
    a NaN cast
    to an integer or bool, ``max_rel_err > rtol`` or ``max_abs_err > atol``
    when given, and a floating x that requires grad cast to an integer or
    bool dtype (where the gradient is lost).

    ``torchcast.last_stats()`` describes the latest call in this thread,
    whatever its policy (a same-dtype call returns x itself, with stats of
    ``numel`` only), except inside torch.compile: there the cast and its
    stats are traced into the graph, but no policy is applied (that would
    need the stats on the host); use ``torchcast.cast_with_stats`` to get
    the stats tensor out of a compiled region.

    A meta tensor (a model built under ``torch.device("meta")``) has no
    values: its cast returns the meta result under every policy, with no
    loss checked or recorded, and ``last_stats()`` None; only a graph cut,
    which needs no values, still warns or raises.

    Args:
        x (Tensor): a dense strided floating tensor, or a traceable wrapper
            subclass (``__tensor_flatten__``, such as DTensor) whose own
            dispatch casts its inner tensors (their stats are merged).
        dtype (torch.dtype, optional): the desired dtype. Default: the
            active autocast dtype for x's device (``torch.autocast``).
        policy (str, optional): what a violation does: "ignore" (nothing;
            the stats still go to ``last_stats``), "record" (the stats also
            go to any active ``torchcast.track()``), "warn"
            (``PrecisionWarning``) or "raise" (``PrecisionLossError``).
            "ignore" and "record" never synchronize with the device: the
            stats stay a tensor until read. "warn" and "raise" read them:
            one host synchronization per call. Default: the thread's policy
            (``torchcast.policy``, ``set_policy``; "warn" initially).
        rtol (float, optional): the largest relative error |x - y| / |x|
            allowed; None (default) checks none. inf allowed.
        atol (float, optional): the largest absolute error |x - y| allowed;
            None (default) checks none. inf allowed.
        name (str, optional): what x is, for messages and track reports:
            ``safe_to(name)`` heads the warning or error, and
            ``torchcast.track()`` reports the cast under this name beside
            its source line. Default: None (messages say ``safe_to``).
        scale (Tensor or str, optional): cast ``x * scale`` (rounded once)
            and measure ``y / scale`` against x: a one-element float32 tensor
            on x's device (float64 also for a float64 x), or "amax"
            (``torchcast.scaling.amax_scale``: x's largest finite magnitude
            onto dtype's largest value, a float64 scale for a float64 x, so
            that amax reaches the top at any magnitude) or "amax_pow2" (the
            same rounded down to a power of two, so that only y's rounding
            loses anything). The scale used is
            ``torchcast.last_scale()``. Lossy floating casts only. Default:
            None (unscaled).
        saturate (bool, optional): values beyond ``dtype``'s range (+-inf
            included) become its +-largest finite value (counted as
            ``saturated``) instead of the format's overflow (inf, or NaN for
            float8_e4m3fn). Default: None, what ``x.to(dtype)`` does: torch
            saturates float8_e4m3fn (so inf becomes 448) and nothing else.

    Returns:
        Tensor: x cast to ``dtype`` (scaled by ``scale``); x itself when it
        already has ``dtype``.

    Raises:
        TypeError: x is not a Tensor, or a sparse, quantized or nested tensor,
            a ``__torch_dispatch__`` subclass without ``__tensor_flatten__``,
            or a tensor inside torch.vmap; the cast is not one listed above
            (for example float8_e4m3fn -> float8_e5m2, or from an integer
            dtype);
            ``dtype`` is not a torch.dtype, or None outside autocast; rtol,
            atol or name is of the wrong type.
        ValueError: an unknown policy, rtol/atol negative or NaN, or an
            unknown scale recipe.
        PrecisionLossError: a violation under policy "raise".

    Warns:
        PrecisionWarning: a violation under policy "warn".

    Example::

        >>> x = torch.tensor([1.0, 1e-8, 1e6], dtype=torch.float64)
        >>> y = torchcast.safe_to(x, torch.float16, policy="ignore")
        >>> s = torchcast.last_stats()
        >>> s.overflow, s.underflow  # 1e6 > 65504; 1e-8 rounds to 0
        (1, 1)
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"torchcast.safe_to: x must be a torch.Tensor, got {type(x).__name__}")
    check_input(x, "torchcast.safe_to", vmap=False)
    dtype = _resolve_dtype(x, dtype)
    pol = check_policy(policy) if policy is not None else get_policy()
    if rtol is not None:
        rtol = check_tolerance(rtol, "rtol", "torchcast.safe_to")
    if atol is not None:
        atol = check_tolerance(atol, "atol", "torchcast.safe_to")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"torchcast.safe_to: name must be a str or None, got "
                        f"{type(name).__name__} ({name!r})")
    _check_saturate(saturate, "torchcast.safe_to")
    compiling = torch.compiler.is_compiling()

    if x.dtype == dtype and scale is None:
        if not compiling:
            _local.last = PendingStats.known(CastStats(dtype, dtype, numel=x.numel()))
        return x
    if not (dtype.is_floating_point or dtype.is_complex) and x.is_floating_point():
        for arg, value in (("saturate", saturate), ("scale", scale)):
            if value is not None:
                raise TypeError(f"torchcast.safe_to: {arg} applies to floating targets, not to "
                                f"the cast to {dtype}. Drop {arg} (or clamp and scale x first)")
        if x.requires_grad and pol in ("warn", "raise") and not compiling:
            act(pol, graph_cut_message(safe_to_head(name), x.dtype, dtype), None)
        y = x.to(dtype)
        if compiling:
            return y
        stats = _integer_cast_stats(x, dtype)
        scale = None
    else:
        scale = resolve_scale(x, dtype, scale, "torchcast.safe_to")
        y, stats = _ops.cast_with_stats(x, dtype, saturate=saturate, scale=scale)
        if compiling:
            return y
    pending = PendingStats(stats, x.dtype, dtype, scale)
    _local.last = pending
    if pol == "ignore":
        return y
    # A meta tensor (a model being built) has no values: no loss to record or
    # check, as track(all_casts=True) skips meta casts. Checked past "ignore",
    # the path that must stay quickest.
    if y.is_meta:
        return y
    for record in recorders():
        record(pending, name)
    if pol in ("warn", "raise") and (pending.has_loss() or rtol is not None or atol is not None):
        s = pending.value
        if is_violation(s, rtol, atol):
            act(pol, violation_message(x, y, s, rtol, atol, name), s)
    return y


def cast_with_stats(x: torch.Tensor, dtype: torch.dtype, *,
                    out: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
                    saturate: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused cast: ``x.to(dtype)``, correctly rounded, and the statistics
    of what it lost, both computed in one pass on x's device, with no host
    synchronization and no policy. Traceable by torch.compile (fullgraph);
    under torch.vmap the stats are per example. Without ``out``, autograd
    sees y as ``x.to(dtype)``, and so do the torch.func transforms (grad,
    vjp, jvp, jacrev, jacfwd, vmap).

    Args:
        x (Tensor): a dense strided float64, float32, float16, bfloat16,
            float8_e4m3fn or float8_e5m2 tensor.
        dtype (torch.dtype): the desired floating dtype: a lossy pair
            (float64 -> float32; float64/float32 -> float16/bfloat16;
            float16 <-> bfloat16; float64/float32/float16/bfloat16 ->
            float8_e4m3fn/float8_e5m2) or a widening or same-dtype cast
            between these dtypes (exact).
        out (Tensor, optional): the output tensor for y, of x's shape and
            dtype ``dtype``, on x's device.
        scale (Tensor, optional): a one-element float32 tensor on x's
            device (float64 also for a float64 x): y = round(x * scale),
            rounded once, and the stats measure
            ``y / scale`` against x (the gradient is scale times y's).
            ``torchcast.scaling.amax_scale`` computes the usual one. Lossy
            casts only. Default: None (unscaled).
        saturate (bool, optional): as for ``safe_to``: True clamps values
            beyond dtype's range (+-inf included) to its +-largest finite
            value; False gives the format's overflow (inf; NaN for
            float8_e4m3fn); None (default) does what ``x.to(dtype)`` does
            (saturate float8_e4m3fn only).

    Returns:
        (Tensor, Tensor): ``(y, stats)``: y is the cast (``out`` when given);
        stats is a float64 tensor of the fields of CastStats, still on the
        device. Read it with ``CastStats.from_tensor(stats, x.dtype, dtype)``
        (one host synchronization).

    Raises:
        TypeError: x is not a Tensor or not a dense strided tensor, or the
            pair of dtypes is not one listed above.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"torchcast.cast_with_stats: x must be a torch.Tensor, got {type(x).__name__}")
    check_input(x, "torchcast.cast_with_stats")
    _check_saturate(saturate, "torchcast.cast_with_stats")
    return _ops.cast_with_stats(x, dtype, out=out, saturate=saturate, scale=scale)

__all__ = [
    "CastStats", "PrecisionLossError", "PrecisionWarning", "cast_with_stats", "check_tolerance",
    "get_policy", "last_stats", "policy", "safe_to", "set_policy",
]