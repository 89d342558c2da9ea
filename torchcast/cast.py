"""safe_to: x.to(dtype) that measures what the cast lost, and the policies
that decide what a loss does."""
import contextlib
import threading
import warnings

import torch

from . import _ops
from .stats import CastStats, PendingStats

POLICIES = ("ignore", "record", "warn", "raise")


class PrecisionWarning(UserWarning):
    """A cast lost more than its target's rounding (policy "warn")."""


class PrecisionLossError(RuntimeError):
    """A cast lost more than its target's rounding (policy "raise")."""

    def __init__(self, message, stats=None):
        super().__init__(message)
        self.stats = stats


# The global default is shared by all threads; `with policy(...)` blocks and
# the latest stats are per thread.
_default_policy = "warn"
_default_lock = threading.Lock()
_local = threading.local()


def _check_policy(name):
    if name not in POLICIES:
        raise ValueError(f"torchcast: unknown policy {name!r}; expected one of {POLICIES}")
    return name


def set_policy(name):
    """Sets the process-wide default policy; returns the previous one."""
    global _default_policy
    _check_policy(name)
    with _default_lock:
        previous, _default_policy = _default_policy, name
    return previous


def get_policy():
    stack = getattr(_local, "policies", None)
    return stack[-1] if stack else _default_policy


@contextlib.contextmanager
def policy(name):
    """Sets the policy for the block, in this thread only."""
    _check_policy(name)
    stack = _local.__dict__.setdefault("policies", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def last_stats():
    """The CastStats of the latest safe_to in this thread (None if none yet)."""
    pending = getattr(_local, "last", None)
    return pending.value if pending is not None else None


def _trackers():
    return getattr(_local, "trackers", ())


def _push_tracker(tracker):
    _local.trackers = _trackers() + (tracker,)


def _pop_tracker(tracker):
    _local.trackers = tuple(t for t in _trackers() if t is not tracker)


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


def _describe(name):
    return f"safe_to({name})" if name else "safe_to"


def _violation_message(x, y, s, rtol, atol, name, head=None, advice=None):
    """Builds the report of a violating cast. Only runs when a violation was
    found, so the elements breaking rtol/atol are counted here with composite
    ops rather than in the fused kernel. ``head`` and ``advice`` replace the
    head and the closing advice (torchcast.track names the cast's site)."""
    parts = []
    for field, what in (("overflow", "overflowed to inf"), ("underflow", "underflowed to zero"),
                        ("subnormal", "became subnormal")):
        if getattr(s, field):
            parts.append(f"{getattr(s, field)} {what}")
    if rtol is not None or atol is not None:
        xd = x.detach()
        back = y.detach().to(x.dtype)
        ok = torch.isfinite(xd) & torch.isfinite(back)
        err = torch.where(ok, (xd - back).abs(), torch.zeros((), dtype=x.dtype, device=x.device))
        if rtol is not None and s.max_rel_err > rtol:
            broke = int(((err > rtol * xd.abs()) & ok & (xd != 0)).sum())
            parts.append(f"{broke} broke rtol={rtol:g}")
        if atol is not None and s.max_abs_err > atol:
            broke = int((err > atol).sum())
            parts.append(f"{broke} broke atol={atol:g}")
    if advice is None:
        advice = (f"Keep {s.src_dtype}, rescale the data, or pass policy='ignore' if the loss "
                  "is acceptable.")
    return (
        f"{head or _describe(name)}: casting {s.numel} elements from {s.src_dtype} to {s.dtype} "
        f"lost precision: {', '.join(parts)} (max abs err {s.max_abs_err:.6g}, max rel err "
        f"{s.max_rel_err:.6g}). {advice}")


def _graph_cut_message(what, src_dtype, dtype):
    return (f"{what}: casting a {src_dtype} tensor that requires grad to {dtype} cuts the "
            "autograd graph: the result has no gradient. Keep a floating copy for the loss, "
            "or detach() explicitly.")


def _is_violation(s, rtol, atol):
    return bool(
        s.overflow or s.underflow or s.subnormal
        or (rtol is not None and s.max_rel_err > rtol)
        or (atol is not None and s.max_abs_err > atol))


def _act(pol, message, stats):
    if pol == "raise":
        raise PrecisionLossError(message, stats)
    warnings.warn(message, PrecisionWarning, stacklevel=3)


def safe_to(x, dtype=None, *, policy=None, rtol=None, atol=None, name=None):
    """``x.to(dtype)`` that measures the loss in the same pass and applies a policy.

    The cast is correctly rounded (one rounding from x's dtype; torch's own
    float64 -> float16/bfloat16 cast rounds twice, through float32), and the
    gradient flows back to x in x's dtype.

    policy: "ignore", "record" (stats go to ``torchcast.last_stats()`` and
    any active ``torchcast.track()``), "warn" (PrecisionWarning) or "raise"
    (PrecisionLossError); default from ``set_policy``/``policy(...)``, "warn"
    initially. A violation is any overflow, underflow or subnormal result,
    ``max_rel_err > rtol`` or ``max_abs_err > atol`` when given, and a
    floating tensor that requires grad cast to an integer or bool dtype (where
    the gradient is lost). "ignore" and "record" never synchronize with the
    device: the stats stay a tensor until read. "warn" and "raise" must read
    them: one host synchronization per call.

    dtype=None means the active autocast dtype for x's device. Inside
    torch.compile the cast and its stats are traced into the graph, but no
    policy is applied (that would need the stats on the host); use
    ``torchcast.cast_with_stats`` to get the stats tensor out of a compiled
    region.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"torchcast.safe_to: x must be a torch.Tensor, got {type(x).__name__}")
    dtype = _resolve_dtype(x, dtype)
    pol = _check_policy(policy) if policy is not None else get_policy()

    if not (dtype.is_floating_point or dtype.is_complex) and x.is_floating_point():
        if x.requires_grad and pol in ("warn", "raise") and not torch.compiler.is_compiling():
            _act(pol, _graph_cut_message(_describe(name), x.dtype, dtype), None)
        return x.to(dtype)
    if x.dtype == dtype:
        return x

    y, stats = _ops.cast_with_stats(x, dtype)
    if torch.compiler.is_compiling() or pol == "ignore":
        return y
    pending = PendingStats(stats, x.dtype, dtype)
    _local.last = pending
    for tracker in _trackers():
        tracker._on_safe_to(pending, name)
    if pol in ("warn", "raise"):
        s = pending.value
        if _is_violation(s, rtol, atol):
            _act(pol, _violation_message(x, y, s, rtol, atol, name), s)
    return y


def cast_with_stats(x, dtype, *, out=None):
    """(y, CastStats-to-be): the fused op; stats is the raw float64 tensor,
    read it with ``CastStats.from_tensor(stats, x.dtype, dtype)``."""
    return _ops.cast_with_stats(x, dtype, out=out)


__all__ = [
    "CastStats", "PrecisionLossError", "PrecisionWarning", "cast_with_stats", "get_policy",
    "last_stats", "policy", "safe_to", "set_policy",
]
