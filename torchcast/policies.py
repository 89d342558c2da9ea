"""The policies of ``safe_to`` and what a violating cast says: the four
policies (the process-wide default, and per thread the ``policy`` blocks),
PrecisionWarning and PrecisionLossError, the tolerance checks, which stats
are a violation, and the messages. ``torchcast.cast`` applies them (and
re-exports these names, the ones the rest of torchcast imports)."""
import contextlib
import numbers
import threading
import warnings
from typing import Iterator, Optional, Tuple

import torch

from .formats import format_of
from .stats import CastStats
from .violations import STRICT, Violations

_STRICT = Violations(STRICT)

POLICIES = ("ignore", "record", "warn", "raise")


class PrecisionWarning(UserWarning):
    """Warned by ``safe_to`` under policy "warn" when a cast loses more than
    its target dtype's rounding (see ``safe_to`` for what counts). Filter it
    with the ``warnings`` module as any other warning."""


class PrecisionLossError(RuntimeError):
    """Raised by ``safe_to`` under policy "raise" when a cast loses more than
    its target dtype's rounding (see ``safe_to`` for what counts).

    Args:
        message (str): what was lost, and how to avoid it.
        stats (CastStats, optional): the stats of the cast; None when the
            cast was refused before it ran (a tensor that requires grad cast
            to an integer or bool dtype).

    Attributes:
        stats (CastStats or None): as passed.
    """

    def __init__(self, message: str, stats: Optional[CastStats] = None):
        super().__init__(message)
        self.stats = stats


# The global default is shared by all threads; `with policy(...)` blocks are
# per thread.
_default_policy = "warn"
_default_lock = threading.Lock()


class _ThreadPolicies(threading.local):
    """Each thread's ``policy`` blocks; the class attribute is the default
    (a getattr with a default that misses costs 0.4 µs, a tenth of a call)."""
    policies: Tuple[str, ...] = ()  # a list once a policy() block entered


_local = _ThreadPolicies()


def check_policy(name: str) -> str:
    """``name`` if it is one of POLICIES, else ValueError."""
    if name not in POLICIES:
        raise ValueError(f"torchcast: unknown policy {name!r}; expected one of {POLICIES}")
    return name


def set_policy(name: str) -> str:
    """Sets the process-wide default policy of ``safe_to``, for every thread.
    A ``with torchcast.policy(...)`` block still overrides it in its thread.

    Args:
        name (str): "ignore", "record", "warn" or "raise" (see ``safe_to``).

    Returns:
        str: the previous default, to restore it later.

    Raises:
        ValueError: ``name`` is not one of the four policies.
    """
    global _default_policy
    check_policy(name)
    with _default_lock:
        previous, _default_policy = _default_policy, name
    return previous


def get_policy() -> str:
    """The policy ``safe_to`` applies in this thread when its ``policy``
    argument is None: the innermost ``with torchcast.policy(...)``, else the
    process-wide default (``set_policy``; "warn" initially).

    Returns:
        str: "ignore", "record", "warn" or "raise".
    """
    stack = _local.policies
    return stack[-1] if stack else _default_policy


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    """Context manager that sets the policy of ``safe_to`` for the block, in
    this thread only (as ``torch.no_grad`` sets grad mode); blocks nest.

    Args:
        name (str): "ignore", "record", "warn" or "raise" (see ``safe_to``).

    Raises:
        ValueError: ``name`` is not one of the four policies (on entering).

    Example::

        >>> with torchcast.policy("raise"):
        ...     y = torchcast.safe_to(x, torch.float16)
    """
    check_policy(name)
    stack = _local.__dict__.setdefault("policies", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def check_tolerance(value: object, arg: str, fn: str) -> Optional[float]:
    """Validates an rtol/atol-like argument.

    Args:
        value: the argument as passed.
        arg (str): its name, for the message (e.g. "rtol").
        fn (str): the function that takes it, for the message
            (e.g. "torchcast.safe_to").

    Returns:
        float or None: ``value`` as a float (inf allowed), None for None.

    Raises:
        TypeError: ``value`` is not None or a real number (a bool is not).
        ValueError: ``value`` is negative or NaN.
    """
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


def safe_to_head(name: Optional[str]) -> str:
    """How messages name a safe_to call: ``safe_to(name)``, or ``safe_to``."""
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
        # float8_e4m3fn has no inf: its overflow is NaN (the formats table says).
        to = "NaN" if s.dtype is not None and format_of(s.dtype).overflow == "nan" else "inf"
        largest = f"{torch.finfo(s.dtype).max:g}" if s.dtype is not None else "largest"
        infs = f" ({min(s.inf, s.saturated)} of them ±inf)" if s.inf else ""
        fields = (("nan", "were NaN (passed through)"), ("overflow", f"overflowed to {to}"),
                  ("saturated", f"saturated to ±{largest}{infs}"),
                  ("underflow", "underflowed to zero"), ("subnormal", "became subnormal"))
    for field, what in fields:
        if getattr(s, field):
            parts.append(f"{getattr(s, field)} {what}")
    if rtol is not None or atol is not None:
        xd = x.detach()
        if integer:
            xd = xd.to(torch.float64)
            ok, back = integer_measured(xd, y.dtype)
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
        f"{head or safe_to_head(name)}: casting {s.numel} elements from {s.src_dtype} to {s.dtype} "
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


def is_violation(s: CastStats, rtol: Optional[float], atol: Optional[float],
                 kinds: Optional[Violations] = None) -> bool:
    """Whether stats ``s`` break the policy.

    Args:
        s: the cast's stats.
        rtol, atol: the largest relative and absolute error that is not a
            violation (None: not checked).
        kinds: which losses count (default: safe_to's, ``violations.STRICT``:
            any overflow, underflow or subnormal result, and NaN, infinite or
            out-of-range values cast to an integer or bool).
    """
    return bool((kinds or _STRICT).found(s, rtol=rtol, atol=atol))


def is_integer_dtype(dtype: Optional[torch.dtype]) -> bool:
    """Whether ``dtype`` is an integer or bool dtype: neither
    ``dtype.is_floating_point`` nor ``dtype.is_complex``.

    Args:
        dtype (torch.dtype, optional): None stands for an unknown dtype (the
            target of stats merged over several dtypes) and gives False.

    Returns:
        bool
    """
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


# ---------------------------------------------------------------------------
# float -> integer/bool casts: measured with composite ops (not the hot path),
# in float64, which holds every float16/bfloat16/float32/float64 value exactly
# (by violation_message here, and by safe_to's stats in cast.py).

def integer_measured(xd, dtype):
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


def act(pol: str, message: str, stats: Optional[CastStats]) -> None:
    """What a violation does under policy "warn" or "raise": warns
    PrecisionWarning (at safe_to's caller) or raises PrecisionLossError."""
    if pol == "raise":
        raise PrecisionLossError(message, stats)
    warnings.warn(message, PrecisionWarning, stacklevel=3)


__all__ = [
    "POLICIES", "PrecisionLossError", "PrecisionWarning", "act", "check_policy",
    "check_tolerance", "get_policy", "graph_cut_message", "integer_measured", "is_integer_dtype",
    "is_violation", "policy", "safe_to_head", "set_policy", "violation_message",
]
