"""How track(all_casts=True) sees a thread's casts, and the global state
that tracking installs.

Two routes, chosen per thread, for the all_casts tracks active in it (its
recorders):

- direct (the compiled extension; no watch needs the mode): no dispatch
  mode. The casts (``aten._to_copy``: ``Tensor.to``, ``.float()``,
  ``.half()``, ``.type()``, ``torch.as_tensor`` with a dtype, autocast's
  casts; and ``aten.copy_`` into another dtype) reach the recorders through
  csrc/thread_casts.cpp's kernels (threads.py's callback), and a
  RecordFunction callback (csrc/dtype_watch.cpp, ``_dtype_event``) finds
  what the mode found in other ops: float64 promotions, the operands of an
  op that fails on mixed dtypes (its note is added when the error leaves the
  track), and casts under torch.inference_mode, which skips the kernels'
  dispatch key (measured after the fact: "raise" raises when the track
  exits). Other ops cost nothing in Python.
- the mode: one TorchDispatchMode per thread, shared by nested tracks, sees
  every op; casts are reported to the recorders, every other op takes the
  fast path (an id() lookup, then the op) unless a track watches for
  non-finite results in Python (its watches, nonfinite.py: "raise", or CUDA
  programs), which check every op.

Either way a tracked cast returns exactly what PyTorch returns.
"""
import sys
import threading
from types import FrameType
from typing import Callable, List, NamedTuple, Optional, Protocol, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import native
from .._inputs import PLAIN_TENSOR_TYPES, dense_strided
from ..stats import PendingStats
from .diagnose import mismatch_note, note_dtype_mismatch, op_name, promoted_operands
from .measure import MeasuredCast, measure_cast
from .nonfinite import NonFiniteWatch
from .op_args import inputs_nonfinite, writes_stats, written_before
from .own import unwatched
from .modules import (current_module, install_module_hooks, module_of_node,
                      refresh_autocast_state, remove_module_hooks, watch_autocast)
from .origins import made_by_autocast, origin_of
from .records import SiteKey
from .sites import Site, outside_torchcast, user_site

aten = torch.ops.aten
_TO_COPY = aten._to_copy.default
_COPY_ = aten.copy_.default
_COPY = aten.copy.default
# The mode's fast path tests every op against these by id(): OpOverload's
# __hash__ is Python code, too slow to run for every op.
_CAST_IDS = frozenset(map(id, (_TO_COPY, _COPY_, _COPY)))
_OpOverload = torch._ops.OpOverload
_Tensor, _FLOAT64 = torch.Tensor, torch.float64

_local = threading.local()


class CastRecorder(Protocol):
    """What the mode reports each tracked cast to (an active track())."""

    def add_cast(self, key: SiteKey, cast: MeasuredCast) -> None:
        """Records the cast at site ``key``."""

    def apply_policy(self, key: SiteKey, cast: MeasuredCast,
                     pending: Optional[PendingStats]) -> None:
        """Warns or raises if the cast violates the policy."""


try:  # Dynamo's per-code-object frame strategy (torch >= 2.4)
    from torch._C._dynamo import eval_frame as _eval_frame
    _SKIP_RECURSIVELY = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP,
                                                       _eval_frame._FrameAction.SKIP)
except (ImportError, AttributeError):  # pragma: no cover - older or Dynamo-less builds
    _eval_frame = None


class _CastMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls):
        # Dynamo must not trace the handler. TorchDispatchMode ensures it by
        # wrapping __torch_dispatch__ in torch._disable_dynamo, a per-call
        # Python wrapper that costs about a third of the mode's per-op
        # overhead; marking the handler's code object skipped, recursively,
        # once (below) does the same at no per-call cost.
        return _eval_frame is None

    @classmethod
    def ignore_compile_internals(cls):
        # With the default (False), Dynamo refuses to compile any frame while
        # the mode is on, and marks each such code object "skip" for good,
        # so a function first called under track is never compiled, even
        # after it. True: Dynamo compiles with the mode off and runs the
        # compiled code with it on. The casts inside an Inductor graph never
        # reach the dispatcher: compiled.py measures them in the graph.
        return True

    def __init__(self):
        super().__init__()
        self.recorders = []
        self.watches = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.watches:
            return _watched_op(self, func, args, kwargs or {})
        return _run_op(self.recorders, func, args, kwargs)


if _eval_frame is not None:
    _eval_frame.set_code_exec_strategy(_CastMode.__torch_dispatch__.__code__, _SKIP_RECURSIVELY)


def _run_op(recorders, func, args, kwargs):
    """One op as PyTorch runs it: a cast reported to the all_casts
    recorders, a failing op's dtype-mismatch note, a float64 promotion."""
    if id(func) in _CAST_IDS and recorders and not unwatched.active():
        return _tracked_cast(recorders, func, args, kwargs or {})
    try:  # free unless the op raises
        if type(func) is _OpOverload:  # OpOverload.__call__ is just this, one frame more
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        else:
            out = func(*args, **(kwargs or {}))
    except RuntimeError as error:
        if not getattr(error, "_torchcast_noted", False):
            note_dtype_mismatch(error, mismatch_note(
                getattr(func, "name", lambda: str(func))(),
                list(args) + list((kwargs or {}).values()), sys._getframe(1)))
        raise
    if recorders and type(out) is _Tensor and out.dtype is _FLOAT64 and not unwatched.active():
        _record_promotion(recorders, op_name(func), args, out, sys._getframe(2))
    return out


_mutates = {}


def _watched_op(mode, func, args, kwargs):
    """Runs one op for a mode with non-finite watches: _run_op, then each
    watch's check of its result (an in-place op's inputs are read before it
    overwrites them)."""
    if torch.compiler.is_compiling() or unwatched.active():
        return func(*args, **kwargs)
    mutates = _mutates.get(id(func))
    if mutates is None:
        mutates = _mutates[id(func)] = bool(getattr(func, "_schema", None)
                                            and func._schema.is_mutable) or writes_stats(func)
    before = written_before(func, args, kwargs) if mutates else None
    inputs_bad = inputs_nonfinite(func, args, kwargs, before) if mutates else None
    out = _run_op(mode.recorders, func, args, kwargs)
    frame = sys._getframe(1)
    for watch in mode.watches:
        watch.after_op(func, args, kwargs, out, inputs_bad, frame, before)
    return out


def _record_promotion(recorders, name, args, out, frame):
    """Records an op whose float64 result came from float64 and narrower
    floating operands (diagnose.py), at origin "promotion (name)"."""
    narrow = promoted_operands(args)
    if narrow is None or torch.compiler.is_compiling():
        return
    where = locate_cast(frame, out, copy=False)
    if where is None:
        return
    key = (where.module, where.site.file, where.site.line, f"promotion ({name})", None,
           narrow, torch.float64, where.site.via)
    promotion = MeasuredCast(narrow, torch.float64, out.numel(), measured=False)
    for recorder in recorders:
        recorder.add_cast(key, promotion)


def _tracked_cast(recorders, func, args, kwargs):
    """Runs one cast op as PyTorch would, reporting it to every recorder."""
    if func is _TO_COPY:
        src, dtype, dst = args[0], kwargs.get("dtype"), None
    else:
        dst, src = args[0], args[1]
        dtype = dst.dtype
    if (dtype is None or dtype == src.dtype or type(src) not in PLAIN_TENSOR_TYPES
            or src.device.type == "meta" or torch.compiler.is_compiling()):
        return func(*args, **kwargs)
    where = locate_cast(sys._getframe(1), src, copy=dst is not None)
    if where is None:
        return func(*args, **kwargs)
    if dst is not None:
        # Measured before it writes, so that policy "raise" leaves dst untouched.
        report_cast(recorders, where, src, dtype, None)
        return func(*args, **kwargs)
    if _same_result(src, kwargs):
        # The measuring op's result stands in for PyTorch's where it has
        # its bits: one cast instead of two.
        return report_cast(recorders, where, src, dtype, None,
                           torch_cast=lambda: func(*args, **kwargs))
    out = func(*args, **kwargs)
    report_cast(recorders, where, src, dtype, out)
    return out


def _same_result(src, kwargs):
    """Whether ``aten._to_copy(src, **kwargs)`` lays out its result as the
    measuring op does: a dtype-only cast on src's device of a real,
    contiguous src (both results contiguous)."""
    for name, value in kwargs.items():
        if name != "dtype" and not (name == "device" and value == src.device):
            return False
    return src.is_floating_point() and dense_strided(src) and src.is_contiguous()


class CastPlace(NamedTuple):
    """Where a cast was made and by whom."""

    module: Optional[str]
    site: Site
    origin: str
    caller: Optional[FrameType]  # the innermost frame outside torchcast (forward casts)


def locate_cast(frame: Optional[FrameType], src: torch.Tensor, copy: bool) -> Optional[CastPlace]:
    """The module, site and origin of a cast of ``src`` that reached the
    tracker from ``frame``; None when torchcast's own code made it.

    Args:
        frame: the frame the tracker was called from.
        src: the tensor cast.
        copy: whether it is a ``copy_`` into an existing tensor.
    """
    site = user_site(frame, skip_own=False)
    if site is None:
        return None
    node = torch._C._current_autograd_node()
    if node is not None:
        return CastPlace(module_of_node(node), site, "backward", None)
    caller = outside_torchcast(frame)
    return CastPlace(current_module(), site, origin_of(caller, src, copy), caller)


def report_cast(recorders: Sequence[CastRecorder], where: CastPlace, src: torch.Tensor,
                dtype: torch.dtype, out: Optional[torch.Tensor],
                torch_cast: Optional[Callable[[], torch.Tensor]] = None) \
        -> Optional[torch.Tensor]:
    """Measures a cast of ``src`` to ``dtype`` and reports it to every
    recorder (which may raise, under policy "raise").

    Args:
        recorders: the active tracks' recorders.
        where: the cast's place (locate_cast).
        src, dtype: the cast.
        out: PyTorch's result, when already computed (None: a copy_ that has
            not written yet, or a result still to make: ``torch_cast``).
        torch_cast: with ``out`` None, makes PyTorch's result where the
            measurement did not (MeasuredCast.torch_result).

    Returns:
        The cast's result: ``out``, or with ``torch_cast`` the measured y or
        what ``torch_cast()`` made; None for a copy_.
    """
    grad_enabled = torch.is_grad_enabled()
    # torch.no_grad(), without the 2-3 us its Python context manager costs
    # on every cast.
    torch._C._set_grad_enabled(False)
    try:
        cast = measure_cast(src, dtype, out, grad_enabled)
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    pending = PendingStats(cast.stats, cast.src_dtype, cast.dtype) \
        if cast is not None and cast.stats is not None else None
    if torch_cast is not None:
        out = cast.torch_result(pending) if pending is not None else None
        if out is None:
            out = torch_cast()
    if where.origin == "autocast" and out is not None:
        made_by_autocast(where.caller, out)
    if cast is None:
        return out
    key = (where.module, where.site.file, where.site.line, where.origin, None, cast.src_dtype,
           cast.dtype, where.site.via)
    for recorder in recorders:
        recorder.add_cast(key, cast)
    for recorder in recorders:
        recorder.apply_policy(key, cast, pending)
    return out


class _ThreadState:
    """This thread's all_casts recorders and Python non-finite watches, and
    the route that serves them."""

    def __init__(self):
        self.recorders: List[CastRecorder] = []
        self.watches: List[NonFiniteWatch] = []
        self.mode: Optional[_CastMode] = None
        self.direct = False  # the direct route's kernels and dtype watch serve the recorders
        self.failure_note: Optional[str] = None  # the dtype watch's note of a failing op
        self.deferred: Optional[BaseException] = None  # "raise" of an inference-mode cast


def _state() -> _ThreadState:
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _ThreadState()
    return state


def active_recorders() -> List[CastRecorder]:
    """The recorders of this thread's all_casts tracks (empty outside any)."""
    state = getattr(_local, "state", None)
    return list(state.recorders) if state is not None else []


def direct_recorders() -> Optional[List[CastRecorder]]:
    """This thread's recorders when the direct route serves them, else None."""
    state = getattr(_local, "state", None)
    return state.recorders if state is not None and state.direct else None


def push_mode(recorder: Optional[CastRecorder] = None,
              watch: Optional[NonFiniteWatch] = None) -> None:
    """Reports every cast PyTorch performs in this thread to ``recorder``
    and every op's result to ``watch``, until ``pop_mode`` with the same
    arguments."""
    state = _state()
    if recorder is not None:
        state.recorders.append(recorder)
    if watch is not None:
        state.watches.append(watch)
    _route(state)


def pop_mode(recorder: Optional[CastRecorder] = None,
             watch: Optional[NonFiniteWatch] = None) -> None:
    """Undoes ``push_mode(recorder, watch)``."""
    state = _state()
    if recorder is not None:
        state.recorders.remove(recorder)
    if watch is not None:
        state.watches.remove(watch)
    _route(state)


def _route(state: _ThreadState) -> None:
    """Serves the thread's recorders and watches by the route they need:
    the mode for Python watches (and without the extension), else direct."""
    use_mode = bool(state.watches) or (bool(state.recorders) and native.start_dtype_watch is None)
    direct = bool(state.recorders) and not use_mode
    if direct and not state.direct:
        native.start_dtype_watch(_dtype_event)
    elif state.direct and not direct:
        native.stop_dtype_watch()
    state.direct = direct
    native.set_thread_direct(direct)
    if use_mode and state.mode is None:
        state.mode = _CastMode()
        state.mode.recorders, state.mode.watches = state.recorders, state.watches
        state.mode.__enter__()
    elif not use_mode and state.mode is not None:
        mode, state.mode = state.mode, None
        mode.__exit__(None, None, None)
    native.set_thread_tracked(use_mode and bool(state.recorders))


def _dtype_event(kind: str, a, b, c) -> None:
    """csrc/dtype_watch.cpp's callback, in a thread of the direct route."""
    state = _state()
    recorders = state.recorders
    if not recorders or torch.compiler.is_compiling():
        return
    if kind == "promotion":  # a: op, b: its inputs, c: its float64 output
        if type(c) in PLAIN_TENSOR_TYPES:
            _record_promotion(recorders, a.rpartition("::")[2], b, c, sys._getframe(1))
    elif kind == "failure":  # a: op, b: its inputs
        frame = sys._getframe(1)
        state.failure_note = note = mismatch_note(a, b, frame)
        if note is not None:
            _note_on_arrival(frame, note)
    elif kind == "cast":  # a: src, b: the result (None: a copy_), c: its dtype
        if type(a) not in PLAIN_TENSOR_TYPES or a.device.type == "meta":
            return
        where = locate_cast(sys._getframe(1), a, copy=b is None)
        if where is None:
            return
        try:
            report_cast(recorders, where, a, c, b)
        except Exception as error:  # noqa: BLE001 - raised when the track exits
            if state.deferred is None:
                state.deferred = error


def _note_on_arrival(frame: FrameType, note: str) -> None:
    """Adds ``note`` to the exception now leaving a failing op as it
    reaches ``frame``, the Python frame that called the op (where the
    program may catch it): a trace function on that frame alone, removed at
    the exception or when the frame returns. With another tracer in the
    thread (a debugger, coverage) the note waits for the track's exit."""
    if sys.gettrace() is not None:
        return

    def on_frame(traced, event, arg):
        if event == "exception":
            note_dtype_mismatch(arg[1], note)
        if event in ("exception", "return"):
            sys.settrace(None)
            traced.f_trace = None
            return None
        return on_frame

    frame.f_trace_lines = False
    frame.f_trace = on_frame
    sys.settrace(lambda *_: None)  # tracing on, for that frame only


def take_pending(error: Optional[BaseException]) -> Optional[BaseException]:
    """At a track's exit in this thread: adds the dtype watch's note to
    ``error`` (the exception leaving the track, if it is a dtype mismatch),
    and returns what an inference-mode cast deferred (policy "raise"), if
    nothing else is leaving."""
    state = _state()
    note, state.failure_note = state.failure_note, None
    deferred, state.deferred = state.deferred, None
    if error is not None:
        if note is not None:
            note_dtype_mismatch(error, note)
        return None
    return deferred


class _Installed:
    """Global state: the module hooks, reference-counted (installed while any
    track is active); the watch on torch.set_autocast_enabled, installed at
    the first all_casts track and kept, so that every thread's autocast
    state stays known however tracks start and end around it. (The kernels
    that mark the program's casts under autocast and report other threads'
    casts are registered by the first install(), never at import, and kept:
    csrc/program_casts.cpp, csrc/thread_casts.cpp.)"""

    def __init__(self):
        self.lock = threading.Lock()
        self.hooks = 0
        self.hook_handles = ()

    def acquire(self, all_casts):
        with self.lock:
            if self.hooks == 0:
                self.hook_handles = install_module_hooks()
            self.hooks += 1
            if all_casts:
                watch_autocast()
                refresh_autocast_state()

    def release(self, all_casts):
        with self.lock:
            self.hooks -= 1
            if self.hooks == 0:
                remove_module_hooks(self.hook_handles)
                self.hook_handles = ()


_installed = _Installed()


def install(all_casts: bool) -> None:
    """Installs what a track() needs (module hooks; with ``all_casts`` the
    autocast watch), shared by all active tracks; the first one in the
    process also registers the tracker's kernels on aten::_to_copy."""
    native.install_tracker_kernels()
    _installed.acquire(all_casts)


def uninstall(all_casts: bool) -> None:
    """Undoes one ``install(all_casts)``; the last one removes the module hooks."""
    _installed.release(all_casts)
