"""safe_to: x.to(dtype) that measures what the cast lost, and the policies
that decide what a loss does."""
import contextlib
import numbers
import threading
import warnings
from typing import Callable, Optional, Tuple

import torch

from . import _ops
from ._inputs import check_input
from .stats import CastStats, PendingStats, stats_tensor

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


def check_policy(name: str) -> str:
    """``name`` if it is one of POLICIES, else ValueError."""
    if name not in POLICIES:
        raise ValueError(f"torchcast: unknown policy {name!r}; expected one of {POLICIES}")
    return name


def set_policy(name):
    """Sets the process-wide default policy; returns the previous one."""
    global _default_policy
    check_policy(name)
    with _default_lock:
        previous, _default_policy = _default_policy, name
    return previous


def get_policy():
    stack = getattr(_local, "policies", None)
    return stack[-1] if stack else _default_policy


@contextlib.contextmanager
def policy(name):
    """Sets the policy for the block, in this thread only."""
    check_policy(name)
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


# Recorders: callables that every safe_to of this thread whose policy is not
# "ignore" reports to, as ``recorder(pending_stats, name)`` (torchcast.track's).

def recorders() -> Tuple[Callable[[PendingStats, Optional[str]], None], ...]:
    """The recorders active in this thread, outermost first."""
    return getattr(_local, "recorders", ())


def add_recorder(recorder: Callable[[PendingStats, Optional[str]], None]) -> None:
    """Makes every later safe_to of this thread (policy not "ignore") call
    ``recorder(pending_stats, name)`` until ``remove_recorder(recorder)``."""
    _local.recorders = recorders() + (recorder,)


def remove_recorder(recorder: Callable[[PendingStats, Optional[str]], None]) -> None:
    """Undoes ``add_recorder(recorder)`` (``recorder`` or an equal callable,
    such as the same bound method got again)."""
    _local.recorders = tuple(r for r in recorders() if r != recorder)


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


def check_tolerance(value, arg, fn):
    """value (None or a real number >= 0, inf allowed) as a float, else
    ValueError/TypeError naming fn, the argument and the value."""
    if value is None:
        return None
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{fn}: {arg} must be a real number (a float or an int) or None, got "
                            f"{type(value).__name__} ({value!r})")
        value = float(value)
    if not value >= 0:  # also NaN, which would silently disable the check
        raise ValueError(f"{fn}: {arg} must be a non-negative number, got {value:g}")
    return value


def _describe(name):
    return f"safe_to({name})" if name else "safe_to"


def violation_message(x: torch.Tensor, y: torch.Tensor, s: CastStats, rtol: Optional[float],
                      atol: Optional[float], name: Optional[str], head: Optional[str] = None,
                      advice: Optional[str] = None) -> str:
    """Builds the report of a violating cast. Only runs when a violation was
    found, so the elements breaking rtol/atol are counted here with composite
    ops rather than in the fused kernel.

    Args:
        x, y: the cast's input and result.
        s: the cast's stats.
        rtol, atol: the tolerances checked (None: not checked).
        name: safe_to's ``name`` of x (None: unnamed).
        head, advice: replace the head and the closing advice
            (torchcast.track names the cast's site).

    Returns:
        The message.
    """
    integer = is_integer_dtype(s.dtype)
    parts = []
    if integer:
        fields = (("nan", "NaN"), ("overflow", "out of range or infinite"))
    else:
        fields = (("overflow", "overflowed to inf"), ("underflow", "underflowed to zero"),
                  ("subnormal", "became subnormal"))
    for field, what in fields:
        if getattr(s, field):
            parts.append(f"{getattr(s, field)} {what}")
    if rtol is not None or atol is not None:
        xd = x.detach()
        if integer:
            xd = xd.to(torch.float64)
            ok, back = _integer_measured(xd, y.dtype)
        else:
            back = y.detach().to(x.dtype)
            ok = torch.isfinite(xd) & torch.isfinite(back)
        err = torch.where(ok, (xd - back).abs(), torch.zeros((), dtype=xd.dtype, device=x.device))
        if rtol is not None and s.max_rel_err > rtol:
            broke = int(((err > rtol * xd.abs()) & ok & (xd != 0)).sum())
            parts.append(f"{broke} broke rtol={rtol:g}")
        if atol is not None and s.max_abs_err > atol:
            broke = int((err > atol).sum())
            parts.append(f"{broke} broke atol={atol:g}")
    if advice is None and integer and (s.nan or s.overflow):
        if s.dtype == torch.bool:
            fix = "Replace NaN first (x.nan_to_num())"
        else:
            info = torch.iinfo(s.dtype)
            fix = (f"Replace NaN and clamp to the range of {s.dtype} first "
                   f"(x.nan_to_num().clamp({info.min}, {info.max}))")
        advice = f"{fix}, or pass policy='ignore' if the loss is acceptable."
    if advice is None:
        advice = (f"Keep {s.src_dtype}, rescale the data, or pass policy='ignore' if the loss "
                  "is acceptable.")
    return (
        f"{head or _describe(name)}: casting {s.numel} elements from {s.src_dtype} to {s.dtype} "
        f"lost precision: {', '.join(parts)}{_error_summary(s, integer)}. {advice}")


def _error_summary(s, integer):
    """The maxima, said so that elements they exclude (overflowed, and for an
    integer target NaN) do not read as "no error"."""
    maxima = f"max abs err {s.max_abs_err:.6g}, max rel err {s.max_rel_err:.6g}"
    lost = s.overflow + (s.nan if integer else 0)
    if not lost:
        return f" ({maxima})"
    what = "overflowed"
    if integer:
        verb = "was" if lost == 1 else "were"
        what = f"{verb} NaN, infinite or out of range" if s.nan else f"{verb} infinite or out of range"
        if s.dtype == torch.bool:
            what = f"{verb} NaN"
    head = f"; max error inf ({lost} element{'s' if lost > 1 else ''} {what}"
    if lost >= s.numel - (0 if integer else s.nan):
        return head + ")"
    return head + f"; the other elements: {maxima})"


def graph_cut_message(what: str, src_dtype: torch.dtype, dtype: torch.dtype) -> str:
    """The message for a tensor that requires grad cast to an integer or bool
    dtype; ``what`` names the cast."""
    return (f"{what}: casting a {src_dtype} tensor that requires grad to {dtype} cuts the "
            "autograd graph: the result has no gradient. Keep a floating copy for the loss, "
            "or detach() explicitly.")


def is_violation(s: CastStats, rtol: Optional[float], atol: Optional[float]) -> bool:
    """Whether stats ``s`` break the policy: any overflow, underflow or
    subnormal result, NaN cast to an integer or bool, or an error beyond
    ``rtol``/``atol`` (None: not checked)."""
    return bool(
        s.overflow or s.underflow or s.subnormal
        or (s.nan and is_integer_dtype(s.dtype))
        or (rtol is not None and s.max_rel_err > rtol)
        or (atol is not None and s.max_abs_err > atol))


def is_integer_dtype(dtype):
    """Integer or bool (None: unknown, for merged stats)."""
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


# ---------------------------------------------------------------------------
# float -> integer/bool casts: measured with composite ops (not the hot path),
# in float64, which holds every float16/bfloat16/float32/float64 value exactly.

def _integer_measured(xd, dtype):
    """(measured, back) for float64 xd cast to an integer or bool dtype: back
    is what the cast keeps of each element as a number (trunc(x), or x != 0
    for bool), measured the elements where that is what the cast gives: finite
    x, and for integers trunc(x) within the dtype's range (elsewhere C++ and
    torch leave the result undefined: it wraps or saturates by platform)."""
    finite = torch.isfinite(xd)
    if dtype == torch.bool:
        return finite, (xd != 0).to(torch.float64)
    info = torch.iinfo(dtype)
    back = torch.trunc(xd)
    # iinfo.max + 1 is a power of two, exact in float64 (iinfo.max of int64 is not).
    measured = finite & (back >= info.min) & (back < float(info.max + 1))
    return measured, back


def _integer_cast_stats(x, dtype):
    """The float64 stats tensor (layout of STAT_FIELDS) of casting floating x
    to an integer or bool dtype, without a host synchronization. NaN counts in
    ``nan``; +-inf and out-of-range values in ``overflow`` (never for bool,
    which only tests x != 0); every element whose number is not kept (those,
    and dropped fractions) in ``inexact``; the errors |x - trunc(x)| (bool:
    |x - (x != 0)|) over the measured elements."""
    xd = x.detach().to(torch.float64)
    measured, back = _integer_measured(xd, dtype)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    err = torch.where(measured, (xd - back).abs(), zero)
    rel = err / torch.where(measured & (xd != 0), xd.abs(), torch.ones_like(xd))
    nan = torch.isnan(xd)
    n = x.numel()
    values = {
        "numel": torch.full((), n, dtype=torch.float64, device=x.device),
        "nan": nan.sum(),
        "inexact": (~measured | (xd != back)).sum(),
        "overflow": (~measured & ~nan).sum() if dtype != torch.bool else zero,
        "underflow": zero,
        "subnormal": zero,
        "max_abs_err": err.max() if n else zero,
        "max_rel_err": rel.max() if n else zero,
        "sum_abs_err": err.sum(),
        "sum_sq_err": (err * err).sum(),
        "sum_sq": torch.where(measured, xd * xd, zero).sum(),
    }
    return stats_tensor(values)


def _act(pol, message, stats):
    if pol == "raise":
        raise PrecisionLossError(message, stats)
    warnings.warn(message, PrecisionWarning, stacklevel=3)


def safe_to(x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
            policy: Optional[str] = None, rtol: Optional[float] = None,
            atol: Optional[float] = None, name: Optional[str] = None) -> torch.Tensor:
    """``x.to(dtype)`` that measures the loss in the same pass and applies a policy.

    The cast is correctly rounded (one rounding from x's dtype; torch's own
    float64 -> float16/bfloat16 cast rounds twice, through float32), and the
    gradient flows back to x in x's dtype.

    A floating x cast to an integer or bool dtype returns exactly
    ``x.to(dtype)`` and is measured with composite ops: NaN (``nan``), +-inf
    and values whose integer part is outside the dtype's range (``overflow``;
    torch's result there is undefined) are violations; dropped fractions are
    ``inexact``, with errors |x - trunc(x)| over the other elements, and only
    violate rtol/atol. A bool cast tests x != 0: NaN (which becomes True) is
    its only violation.

    ``torchcast.last_stats()`` describes the latest call in this thread,
    whatever its policy (a same-dtype call returns x itself, with stats of
    ``numel`` only), except inside torch.compile.

    Args:
        x: a dense strided floating tensor, or a traceable wrapper subclass
            (``__tensor_flatten__``) whose own dispatch casts its inner
            tensors (their stats are merged); sparse, quantized and nested
            tensors, other __torch_dispatch__ subclasses and tensors inside
            torch.vmap raise a TypeError.
        dtype: the target dtype; None means the active autocast dtype for x's
            device.
        policy: "ignore" (nothing but ``last_stats``), "record" (stats also go
            to any active ``torchcast.track()``), "warn" (PrecisionWarning) or
            "raise" (PrecisionLossError); default from
            ``set_policy``/``policy(...)``, "warn" initially. A violation is
            any overflow, underflow or subnormal result, a NaN cast to an
            integer or bool, ``max_rel_err > rtol`` or ``max_abs_err > atol``
            when given, and a floating tensor that requires grad cast to an
            integer or bool dtype (where the gradient is lost). "ignore" and
            "record" never synchronize with the device: the stats stay a
            tensor until read. "warn" and "raise" must read them: one host
            synchronization per call.
        rtol, atol: None or a real number >= 0 (ValueError for negative or
            NaN, TypeError for anything else).
        name: None or a str naming x in messages and track reports.

    Inside torch.compile the cast and its stats are traced into the graph, but
    no policy is applied (that would need the stats on the host); use
    ``torchcast.cast_with_stats`` to get the stats tensor out of a compiled
    region.
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
    compiling = torch.compiler.is_compiling()

    if x.dtype == dtype:
        if not compiling:
            _local.last = PendingStats.known(CastStats(dtype, dtype, numel=x.numel()))
        return x
    if not (dtype.is_floating_point or dtype.is_complex) and x.is_floating_point():
        if x.requires_grad and pol in ("warn", "raise") and not compiling:
            _act(pol, graph_cut_message(_describe(name), x.dtype, dtype), None)
        y = x.to(dtype)
        if compiling:
            return y
        stats = _integer_cast_stats(x, dtype)
    else:
        y, stats = _ops.cast_with_stats(x, dtype)
        if compiling:
            return y
    pending = PendingStats(stats, x.dtype, dtype)
    _local.last = pending
    if pol == "ignore":
        return y
    for record in recorders():
        record(pending, name)
    if pol in ("warn", "raise"):
        s = pending.value
        if is_violation(s, rtol, atol):
            _act(pol, violation_message(x, y, s, rtol, atol, name), s)
    return y


def cast_with_stats(x: torch.Tensor, dtype: torch.dtype, *,
                    out: Optional[torch.Tensor] = None):
    """(y, CastStats-to-be): the fused op; stats is the raw float64 tensor,
    read it with ``CastStats.from_tensor(stats, x.dtype, dtype)``.

    Args:
        x: a dense strided float16/bfloat16/float32/float64 tensor (under
            torch.vmap, stats are per example).
        dtype: the target floating dtype.
        out: optional tensor of x's shape and dtype ``dtype`` to write y into.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"torchcast.cast_with_stats: x must be a torch.Tensor, got {type(x).__name__}")
    check_input(x, "torchcast.cast_with_stats")
    return _ops.cast_with_stats(x, dtype, out=out)


__all__ = [
    "CastStats", "PrecisionLossError", "PrecisionWarning", "cast_with_stats", "check_tolerance",
    "get_policy", "last_stats", "policy", "safe_to", "set_policy",
]
