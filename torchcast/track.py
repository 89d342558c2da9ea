"""track(): the casts of a block, measured with the fused op, attributed to the
module and source line that did them, and merged by site.

``with track() as report`` collects every safe_to (policies record/warn/raise).
``track(all_casts=True)`` also intercepts, at the dispatcher, every cast that
PyTorch itself performs in the block: one TorchDispatchMode per thread sees
``aten._to_copy`` (``Tensor.to``, ``.float()``, ``.half()``, ``.type()``,
``torch.as_tensor``/``torch.tensor`` with a dtype, autocast's casts) and
``aten.copy_``/``aten.copy``; every other op takes the fast path (an id() lookup,
then the op).

A tracked cast returns exactly what PyTorch returns: the program's behaviour
does not change under track. Its stats describe that result too. The fused op
rounds correctly, and so does PyTorch for every pair but float64 ->
float16/bfloat16, which PyTorch rounds twice (through float32): for those the
op measures every element where the two roundings agree, and the few elements
where PyTorch's double rounding lands on the other neighbour are measured
against PyTorch's value (``_double_rounded_stats``); ``Record.double_rounded``
counts them.

The stats stay tensors on the cast's device (merged per site by
``merge_stats_tensors``) until the report is read, unless the policy is "warn"
or "raise", which must read each cast's stats: one synchronization per cast.
"""
import bisect
import dataclasses
import json
import math
import os
import sys
import threading
import warnings
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _ops
from . import cast as _cast
from .stats import STAT_FIELDS, CastStats, PendingStats, _short, merge_stats_tensors

aten = torch.ops.aten
_TO_COPY = aten._to_copy.default
_COPY_ = aten.copy_.default
_COPY = aten.copy.default
# The mode's fast path tests every op against these by id(): OpOverload's
# __hash__ is Python code, too slow to run for every op.
_CAST_IDS = frozenset(map(id, (_TO_COPY, _COPY_, _COPY)))
_OpOverload = torch._ops.OpOverload

# Real dtypes the fused op measures, by precision rank.
_RANK = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 1}
_HALVES = (torch.float16, torch.bfloat16)
_REAL_OF = {torch.complex128: torch.float64, torch.complex64: torch.float32,
            torch.complex32: torch.float16}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # subclasses (FakeTensor, DTensor) pass through


# ---------------------------------------------------------------------------
# Where a cast comes from: the user's file:line (innermost frame outside torch
# and torchcast), and whether torchcast's own code did it (then it is not the
# user's cast: safe_to records itself).

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_OWN_FILES = frozenset(_PKG_DIR + f for f in ("cast.py", "_ops.py", "_reference.py", "stats.py",
                                              "nn.py"))
_USER, _SKIP, _OWN = 0, 1, 2
_frame_kinds = {}


def _frame_kind(code):
    kind = _frame_kinds.get(code)
    if kind is None:
        path = os.path.abspath(code.co_filename)
        if path in _OWN_FILES:
            kind = _OWN
        elif path.startswith(_TORCH_DIR) or path.startswith(_PKG_DIR) \
                or code.co_filename.startswith("<frozen"):
            kind = _SKIP
        else:
            kind = _USER
        _frame_kinds[code] = kind
    return kind


def _user_site(frame, skip_own):
    """(file, line) of the innermost user frame. None if torchcast's own code
    did the cast, unless ``skip_own`` (safe_to's records: look past it)."""
    while frame is not None:
        kind = _frame_kind(frame.f_code)
        if kind == _USER:
            return frame.f_code.co_filename, frame.f_lineno
        if kind == _OWN and not skip_own:
            return None
        frame = frame.f_back
    return "<no python frame>", 0  # e.g. the autograd engine's device threads


# ---------------------------------------------------------------------------
# Which module is running: global forward hooks (installed only while some
# track() is active) keep a per-thread stack of module calls. Each call also
# records the autograd sequence numbers its nodes got, so that a cast the
# autograd engine performs in backward is attributed to the module whose
# forward created the node.

class _Call:
    __slots__ = ("path", "names", "start", "end", "parent")

    def __init__(self, path, names, start, parent):
        self.path, self.names, self.start, self.end, self.parent = path, names, start, None, parent


_local = threading.local()
_names_cache = weakref.WeakKeyDictionary()
_calls, _call_starts = [], []  # module calls in call order, for backward attribution
_MAX_CALLS = 1 << 16
_calls_lock = threading.Lock()
_sequence_nr = torch._C._autograd._get_sequence_nr


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _names_of(root):
    names = _names_cache.get(root)
    if names is None:
        names = {}
        for path, module in root.named_modules(remove_duplicate=False):
            names.setdefault(module, path)
        del names[root]  # a value referring to its weak key would keep it alive
        _names_cache[root] = names
    return names


def _pre_hook(module, args):
    stack = _stack()
    parent = stack[-1] if stack else None
    if parent is None:
        names, path = _names_of(module), type(module).__name__
    else:
        names = parent.names
        path = names.get(module) or f"{parent.path}/{type(module).__name__}"
    call = _Call(path, names, _sequence_nr(), parent)
    stack.append(call)
    with _calls_lock:
        if len(_calls) >= _MAX_CALLS:
            del _calls[:_MAX_CALLS // 2], _call_starts[:_MAX_CALLS // 2]
        _calls.append(call)
        _call_starts.append(call.start)


def _post_hook(module, args, output):
    stack = _stack()
    if stack:
        stack.pop().end = _sequence_nr()


def _current_module():
    stack = getattr(_local, "stack", None)
    return stack[-1].path if stack else None


def _module_of_node(node):
    """The module whose forward created autograd node ``node`` (None if none)."""
    seq = node._sequence_nr()
    with _calls_lock:
        i = bisect.bisect_right(_call_starts, seq) - 1
        call = _calls[i] if i >= 0 else None
    while call is not None and not (call.start <= seq and (call.end is None or seq < call.end)):
        call = call.parent
    return call.path if call is not None else None


# Autocast inserts its casts from inside its own kernels, with the autocast
# dispatch key excluded, and a TorchDispatchMode handler runs with every key
# above Python excluded: inside the handler torch.is_autocast_enabled() is
# always False. So two facts are gathered outside it while tracking:
# - whether autocast is on, per thread and device type: the state at track()
#   entry, then every torch.set_autocast_enabled (torch.autocast enters and
#   exits through it) is followed by a look at the new state;
# - which casts the program asked for: a kernel for aten::_to_copy at the
#   autocast keys, which only the program's casts pass through (autocast's
#   own casts bypass its key), counts them.
# An unmarked cast while autocast is on is autocast's.
_AUTOCAST_KEYS = [getattr(torch._C.DispatchKey, name) for name in
                  ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS")
                  if hasattr(torch._C.DispatchKey, name)]
_AUTOCAST_DEVICES = [d for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d)]


def _program_to_copy(keyset, *args, **kwargs):
    _local.program_casts = getattr(_local, "program_casts", 0) + 1
    try:
        for key in _AUTOCAST_KEYS:
            keyset = keyset.remove(key)
        return _TO_COPY.redispatch(keyset, *args, **kwargs)
    finally:
        _local.program_casts -= 1


def _autocast_state():
    state = getattr(_local, "autocast", None)
    if state is None:
        state = _local.autocast = {d: torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES}
    return state


def _watching_set_autocast_enabled(original):
    def set_autocast_enabled(*args, **kwargs):
        original(*args, **kwargs)
        _local.autocast = None  # looked up again, outside any handler, on next use
        _autocast_state()
    set_autocast_enabled.__wrapped__ = original
    set_autocast_enabled.__doc__ = original.__doc__
    return set_autocast_enabled


def _autocast_on(device_type):
    """Whether autocast is on for device_type (usable inside the handler)."""
    state = getattr(_local, "autocast", None)
    return bool(state and state.get(device_type))


class _Installed:
    """Reference-counted global state: module hooks (any track) and the
    autocast marker kernels (all_casts); nothing is left behind when the last
    track exits."""

    def __init__(self):
        self.lock = threading.Lock()
        self.hooks = 0
        self.hook_handles = ()
        self.marks = 0
        self.library = None

    def acquire(self, all_casts):
        with self.lock:
            if self.hooks == 0:
                mod = torch.nn.modules.module
                self.hook_handles = (mod.register_module_forward_pre_hook(_pre_hook),
                                     mod.register_module_forward_hook(_post_hook, always_call=True))
            self.hooks += 1
            if all_casts:
                if self.marks == 0:
                    self.library = torch.library.Library("aten", "IMPL")
                    for key in _AUTOCAST_KEYS:
                        self.library.impl("_to_copy", _program_to_copy, key.name,
                                          with_keyset=True)
                    self.set_autocast_enabled = torch.set_autocast_enabled
                    torch.set_autocast_enabled = _watching_set_autocast_enabled(
                        self.set_autocast_enabled)
                self.marks += 1
                _local.autocast = None
                _autocast_state()

    def release(self, all_casts):
        with self.lock:
            if all_casts:
                self.marks -= 1
                if self.marks == 0:
                    self.library._destroy()
                    self.library = None
                    if getattr(torch.set_autocast_enabled, "__wrapped__", None) \
                            is self.set_autocast_enabled:
                        torch.set_autocast_enabled = self.set_autocast_enabled
            self.hooks -= 1
            if self.hooks == 0:
                for handle in self.hook_handles:
                    handle.remove()
                self.hook_handles = ()
                with _calls_lock:
                    _calls.clear()
                    _call_starts.clear()


_installed = _Installed()


# ---------------------------------------------------------------------------
# Measuring one cast as PyTorch performs it.

_DOUBLE_ROUNDED = frozenset((torch.float64, h) for h in _HALVES)


def _double_rounded_stats(x, dtype, t):
    """Stats of float64 x cast to float16/bfloat16 as PyTorch did it (t).

    The op measures the elements where t is the correctly rounded value; the
    elements where PyTorch's double rounding chose the other neighbour (x not
    representable, so inexact; t finite or inf, never NaN) are zeroed in the
    op's input and measured against t here. Returns (stats, count of those
    elements)."""
    y, _ = _ops.cast_with_stats(x, dtype)
    differ = (t != y) & ~torch.isnan(t)
    _, rest = _ops.cast_with_stats(torch.where(differ, 0.0, x), dtype)
    td = t.to(torch.float64)
    finite = differ & torch.isfinite(td)
    err = torch.where(finite, (x - td).abs(), 0.0)
    rel = err / torch.where(finite, x.abs(), 1.0)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    tiny = torch.finfo(dtype).tiny
    own = torch.stack([v.to(torch.float64) for v in (
        zero, zero, differ.sum(), (differ & torch.isinf(td)).sum(), (differ & (td == 0)).sum(),
        (differ & (td != 0) & (td.abs() < tiny)).sum(), err.max(), rel.max(), err.sum(),
        (err * err).sum(), torch.where(finite, x * x, 0.0).sum())])
    return merge_stats_tensors(torch.stack([rest, own])), differ.sum()


def _measure(x, dtype, t):
    """(stats tensor, double-rounded count or None, y as PyTorch casts it) for
    real floating x cast to the narrower-or-equal-rank real ``dtype``; t is
    PyTorch's result when already computed."""
    if (x.dtype, dtype) in _DOUBLE_ROUNDED:
        if t is None or t.device != x.device:
            t = _TO_COPY(x, dtype=dtype)
        if x.numel() == 0:
            return _ops.cast_with_stats(x, dtype)[1], None, t
        stats, differ = _double_rounded_stats(x, dtype, t)
        return stats, differ, t
    if x.dtype in _HALVES:
        # float16 <-> bfloat16: the op has no such pair, but widening to
        # float32 is exact and PyTorch converts through float32 too.
        x = x.float()
    y, stats = _ops.cast_with_stats(x, dtype)
    return stats, None, y


@dataclasses.dataclass
class _Cast:
    """What the dispatch mode learnt about one cast."""
    src_dtype: torch.dtype
    dtype: torch.dtype
    numel: int
    stats: Optional[torch.Tensor] = None     # None: nothing to measure (exact, or unmeasurable)
    measured: bool = True
    graph_cut: bool = False
    imag: Optional[torch.Tensor] = None      # complex -> real: elements with nonzero imaginary part
    double_rounded: Optional[torch.Tensor] = None
    x: Optional[torch.Tensor] = None         # for the violation message (rtol/atol counts)
    y: Optional[torch.Tensor] = None


def _analyse(src, dtype, t, grad_enabled):
    """Measures casting ``src`` to ``dtype`` (t: PyTorch's result, if known).
    None when the cast is not one track records."""
    s_dt = src.dtype
    if s_dt.is_complex or dtype.is_complex:
        return _analyse_complex(src, dtype, t, grad_enabled)
    if s_dt.is_floating_point and not dtype.is_floating_point:
        if src.requires_grad and grad_enabled:
            return _Cast(s_dt, dtype, src.numel(), measured=False, graph_cut=True)
        return None
    if not (s_dt.is_floating_point and dtype.is_floating_point):
        return None  # integer and bool sources: not a precision question track answers
    if s_dt not in _RANK or dtype not in _RANK:
        return _Cast(s_dt, dtype, src.numel(), measured=False)  # float8 and other formats
    if _RANK[dtype] > _RANK[s_dt] or dtype == s_dt:
        return _Cast(s_dt, dtype, src.numel())  # widening (or the real part kept): exact
    stats, differ, y = _measure(src, dtype, t)
    return _Cast(s_dt, dtype, src.numel(), stats, double_rounded=differ, x=src, y=y)


def _analyse_complex(src, dtype, t, grad_enabled):
    s_dt, d_dt = src.dtype, dtype
    imag = None
    if s_dt.is_complex and not dtype.is_complex:
        imag = (src.imag != 0).sum()
        x, t_real = src.real, t
    elif s_dt.is_complex:
        x = torch.view_as_real(src.resolve_conj())
        t_real = torch.view_as_real(t) if t is not None else None
        dtype = _REAL_OF.get(dtype)
    else:
        x = src
        t_real = torch.view_as_real(t)[..., 0] if t is not None else None
        dtype = _REAL_OF.get(dtype)
    if not dtype or x.dtype not in _RANK or dtype not in _RANK:
        if imag is None:
            return None
        graph_cut = src.requires_grad and grad_enabled and not dtype.is_floating_point
        return _Cast(s_dt, d_dt, src.numel(), measured=False, graph_cut=graph_cut, imag=imag)
    result = _analyse(x, dtype, t_real, grad_enabled)
    result.src_dtype, result.dtype, result.imag = s_dt, d_dt, imag
    return result


# ---------------------------------------------------------------------------
# The dispatch mode: one per thread, shared by nested all_casts trackers.

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

    def __init__(self):
        super().__init__()
        self.trackers = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if id(func) in _CAST_IDS:
            return _tracked_cast(self.trackers, func, args, kwargs or {})
        if type(func) is _OpOverload:  # OpOverload.__call__ is just this, one frame more
            return func._op(*args, **kwargs) if kwargs else func._op(*args)
        return func(*args, **(kwargs or {}))


if _eval_frame is not None:
    _eval_frame.set_code_exec_strategy(_CastMode.__torch_dispatch__.__code__, _SKIP_RECURSIVELY)


def _tracked_cast(trackers, func, args, kwargs):
    """Runs one cast op as PyTorch would, recording it into every tracker."""
    if func is _TO_COPY:
        src, dtype, dst = args[0], kwargs.get("dtype"), None
    else:
        dst, src = args[0], args[1]
        dtype = dst.dtype
    if (dtype is None or dtype == src.dtype or type(src) not in _PLAIN_TYPES
            or src.device.type == "meta" or torch.compiler.is_compiling()):
        return func(*args, **kwargs)
    site = _user_site(sys._getframe(1), skip_own=False)
    if site is None:
        return func(*args, **kwargs)
    node = torch._C._current_autograd_node()
    if node is not None:
        origin, module = "backward", _module_of_node(node)
    else:
        module = _current_module()
        if dst is not None:
            origin = "copy_"
        elif (getattr(_local, "program_casts", 0) == 0 and _autocast_on(src.device.type)):
            origin = "autocast"
        else:
            origin = "cast"
    # A fresh result can be computed first and measured as it is; copy_ is
    # measured before it writes, so that policy "raise" leaves dst untouched.
    out = func(*args, **kwargs) if dst is None else None
    grad_enabled = torch.is_grad_enabled()
    with torch.no_grad():
        cast = _analyse(src, dtype, out, grad_enabled)
    if cast is not None:
        key = (module, site[0], site[1], origin, None, cast.src_dtype, cast.dtype)
        pending = PendingStats(cast.stats, cast.src_dtype, cast.dtype) \
            if cast.stats is not None else None
        for tracker in trackers:
            tracker._report._add(key, cast.stats, 0 if cast.stats is not None else cast.numel,
                                 cast.measured, int(cast.graph_cut), cast.imag,
                                 cast.double_rounded)
        for tracker in trackers:
            tracker._apply_policy(key, cast, pending)
    return func(*args, **kwargs) if out is None else out


# ---------------------------------------------------------------------------
# The report.

_LOSS_COLUMNS = ("inexact", "overflow", "underflow", "subnormal")


@dataclasses.dataclass(frozen=True)
class Record:
    """The merged casts of one site: a module (None outside any forward), a
    source line, an origin ("cast", "copy_", "autocast", "backward" or
    "safe_to"), a safe_to name, and a dtype pair.

    ``stats`` merges every call's CastStats (elements of complex casts count
    real components when both sides are complex). ``measured`` is false where
    the loss is not measured (float -> integer casts, float8 formats): then
    only ``stats.numel`` is set. ``graph_cuts`` counts casts of a tensor that
    required grad to an integer or bool dtype; ``imag_dropped`` the elements
    whose nonzero imaginary part a complex -> real cast dropped;
    ``double_rounded`` the elements where PyTorch's float64 ->
    float16/bfloat16 cast (rounded twice, through float32) differs from the
    correctly rounded value: ``stats`` measure PyTorch's value."""

    module: Optional[str]
    file: str
    line: int
    origin: str
    name: Optional[str]
    src_dtype: torch.dtype
    dtype: torch.dtype
    calls: int
    stats: CastStats
    measured: bool = True
    graph_cuts: int = 0
    imag_dropped: int = 0
    double_rounded: int = 0

    @property
    def key(self):
        return (self.module, self.file, self.line, self.origin, self.name, self.src_dtype,
                self.dtype)

    @property
    def site(self):
        where = f"{_short_path(self.file)}:{self.line}"
        what = f" safe_to({self.name})" if self.name else ""
        return f"{self.module} {where}{what}" if self.module else f"{where}{what}"

    def violations(self, rtol=None, atol=None):
        """What makes this site a violation (empty list: none)."""
        found = []
        if self.graph_cuts:
            found.append(f"{self.graph_cuts} graph cut{'s' if self.graph_cuts > 1 else ''}")
        if self.imag_dropped:
            found.append(f"{self.imag_dropped} imaginary parts dropped")
        s = self.stats
        if self.measured:
            found += [f"{getattr(s, f)} {f}" for f in ("overflow", "underflow", "subnormal")
                      if getattr(s, f)]
            if s.nan and _cast.is_integer_dtype(self.dtype):  # safe_to to an integer/bool dtype
                found.append(f"{s.nan} nan")
            if rtol is not None and s.max_rel_err > rtol:
                found.append(f"max rel err > rtol={rtol:g}")
            if atol is not None and s.max_abs_err > atol:
                found.append(f"max abs err > atol={atol:g}")
        return found

    def to_dict(self):
        stats = self.stats.to_dict()
        for name in ("src_dtype", "dtype"):
            stats.pop(name)
        sqnr = stats.pop("sqnr_db")
        stats["sqnr_db"] = sqnr if math.isfinite(sqnr) else None  # strict JSON has no inf/NaN
        return {
            "site": self.site, "module": self.module, "file": self.file, "line": self.line,
            "origin": self.origin, "name": self.name, "src_dtype": str(self.src_dtype),
            "dtype": str(self.dtype), "calls": self.calls, "measured": self.measured,
            "graph_cuts": self.graph_cuts, "imag_dropped": self.imag_dropped,
            "double_rounded": self.double_rounded, "stats": stats,
        }


def _short_path(path):
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _dtype_from_str(name):
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torchcast: unknown dtype {name!r} in a report")
    return dtype


class _Site:
    __slots__ = ("calls", "buf", "numel", "measured", "graph_cuts", "imag", "double_rounded")
    COLLAPSE = 64  # merge the pending stats tensors of a site every COLLAPSE casts

    def __init__(self, measured):
        self.calls, self.buf, self.numel, self.measured = 0, [], 0, measured
        self.graph_cuts, self.imag, self.double_rounded = 0, 0, 0

    def merged(self):
        if not self.buf:
            return None
        if len(self.buf) == 1:
            return self.buf[0]
        device = self.buf[0].device
        return merge_stats_tensors(torch.stack([b.to(device) for b in self.buf]))


class Report:
    """The casts recorded by ``torchcast.track``, merged by site.

    ``records`` lists them worst first (violations first, then by max rel
    err); ``str(report)`` is that list as a table; ``to_dict``/``to_json`` for
    loggers (``Report.from_json`` reads it back); ``all_reduce()`` merges the
    reports of all torch.distributed ranks. Reading the report synchronizes
    with the device once; recording never does under policy "record".
    """

    def __init__(self, rtol=None, atol=None):
        self.rtol, self.atol = rtol, atol
        self._sites = {}
        self._lock = threading.Lock()

    # -- recording (from the dispatch mode and safe_to) -----------------------
    def _add(self, key, stats, numel, measured, graph_cuts=0, imag=None, double_rounded=None):
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = self._sites[key] = _Site(measured)
            site.calls += 1
            site.numel += numel
            site.graph_cuts += graph_cuts
            if imag is not None:
                site.imag = site.imag + imag
            if double_rounded is not None:
                site.double_rounded = site.double_rounded + double_rounded
            if stats is not None:
                site.buf.append(stats)
                if len(site.buf) >= _Site.COLLAPSE:
                    site.buf = [site.merged()]

    # -- reading ----------------------------------------------------------------
    @property
    def records(self):
        """The sites as Records, worst first (one synchronization per device)."""
        with self._lock:
            items = [(key, site, site.merged()) for key, site in self._sites.items()]
        values = _to_host([merged for _, _, merged in items]
                          + [site.imag for _, site, _ in items]
                          + [site.double_rounded for _, site, _ in items])
        n = len(items)
        records = []
        for i, (key, site, merged) in enumerate(items):
            module, file, line, origin, name, src_dtype, dtype = key
            if merged is None:
                stats = CastStats(src_dtype, dtype, numel=site.numel)
            else:
                fields = dict(zip(STAT_FIELDS, values[i]))
                fields["numel"] += site.numel
                for field in ("numel", "nan", "inexact", "overflow", "underflow", "subnormal"):
                    fields[field] = int(fields[field])
                stats = CastStats(src_dtype, dtype, **fields)
            records.append(Record(module, file, line, origin, name, src_dtype, dtype, site.calls,
                                  stats, site.measured, site.graph_cuts,
                                  int(values[n + i]), int(values[2 * n + i])))
        records.sort(key=self._severity, reverse=True)
        return records

    def _severity(self, r):
        s = r.stats
        return (bool(r.violations(self.rtol, self.atol)), r.graph_cuts, r.imag_dropped,
                s.overflow, s.underflow, s.subnormal, s.max_rel_err, s.inexact, s.numel)

    @property
    def violations(self):
        return [r for r in self.records if r.violations(self.rtol, self.atol)]

    def __len__(self):
        return len(self._sites)

    def __iter__(self):
        return iter(self.records)

    def table(self, limit=None):
        records = self.records
        shown = records if limit is None else records[:limit]
        bad = sum(1 for r in records if r.violations(self.rtol, self.atol))
        calls = sum(r.calls for r in records)
        head = (f"torchcast.track: {len(records)} cast sites, {calls} casts, "
                f"{bad} with violations (worst first)")
        if not records:
            return head
        rows = [("site", "origin", "calls", "dtypes", "elements", *_LOSS_COLUMNS, "max rel err",
                 "notes")]
        for r in shown:
            s = r.stats
            losses = ([str(getattr(s, c)) for c in _LOSS_COLUMNS] + [f"{s.max_rel_err:.3g}"]
                      if r.measured else ["-"] * (len(_LOSS_COLUMNS) + 1))
            notes = r.violations(self.rtol, self.atol)
            notes = [n for n in notes if not n.endswith(("overflow", "underflow", "subnormal"))]
            if r.double_rounded:
                notes.append(f"{r.double_rounded} double-rounded by torch")
            rows.append((r.site, r.origin, str(r.calls),
                         f"{_short(r.src_dtype)}->{_short(r.dtype)}", str(s.numel), *losses,
                         "; ".join(notes)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [head]
        for row in rows:
            cells = [c.ljust(w) if i in (0, 1, 3, len(row) - 1) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
        if len(shown) < len(records):
            lines.append(f"... {len(records) - len(shown)} more sites")
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    def __repr__(self):
        return f"<torchcast.Report: {len(self)} sites>"

    def to_dict(self):
        return {"format": "torchcast.track.Report", "version": 1, "rtol": self.rtol,
                "atol": self.atol, "records": [r.to_dict() for r in self.records]}

    def to_json(self, **kwargs):
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    @classmethod
    def from_dict(cls, data):
        if data.get("format") != "torchcast.track.Report":
            raise ValueError("torchcast.Report.from_dict: not a torchcast.track report "
                             f"(format={data.get('format')!r})")
        report = cls(data.get("rtol"), data.get("atol"))
        report._merge_records(data["records"])
        return report

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))

    def _merge_records(self, records):
        for r in records:
            key = (r["module"], r["file"], r["line"], r["origin"], r["name"],
                   _dtype_from_str(r["src_dtype"]), _dtype_from_str(r["dtype"]))
            stats = torch.tensor([float(r["stats"][f]) for f in STAT_FIELDS], dtype=torch.float64)
            with self._lock:
                site = self._sites.get(key)
                if site is None:
                    site = self._sites[key] = _Site(r["measured"])
                site.calls += r["calls"]
                site.graph_cuts += r["graph_cuts"]
                site.imag = site.imag + r["imag_dropped"]
                site.double_rounded = site.double_rounded + r["double_rounded"]
                site.buf.append(stats)
                if len(site.buf) >= _Site.COLLAPSE:
                    site.buf = [site.merged()]

    def all_reduce(self, group=None):
        """Merges this report with the same report on every rank of
        ``group`` (default: the world), in place, on every rank; returns self.
        Each call adds the other ranks' records again, like
        ``torch.distributed.all_reduce`` on a tensor: call it once."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torchcast.Report.all_reduce: torch.distributed is not "
                               "initialized; call torch.distributed.init_process_group first")
        mine = self.to_dict()["records"]
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        with self._lock:
            self._sites = {}
        for records in gathered:
            self._merge_records(records)
        return self


def _to_host(values):
    """Lists of Python numbers for a list of tensors (or ints), one transfer
    per device."""
    by_device = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    out = list(values)
    for device, idx in by_device.items():
        flat = torch.cat([values[i].reshape(-1).to(torch.float64) for i in idx]).tolist()
        pos = 0
        for i in idx:
            n = values[i].numel()
            out[i] = flat[pos:pos + n] if values[i].dim() else flat[pos]
            pos += n
    return out


# ---------------------------------------------------------------------------
# track()

class track:
    """``with torchcast.track(all_casts=False) as report:`` records casts in
    the block into ``report`` (a Report).

    Always: every ``safe_to`` whose policy is "record", "warn" or "raise".
    With ``all_casts=True`` also every dtype-changing cast PyTorch performs,
    in code that never mentions torchcast (see the module docstring); the
    cast returns exactly what PyTorch returns.

    ``policy`` ("record", "warn", "raise"; default: ``torchcast.get_policy()``
    at each cast) decides what a violating tracked cast does: any overflow,
    underflow or subnormal result, ``max_rel_err > rtol`` or ``max_abs_err >
    atol`` when given, a float tensor that requires grad cast to an integer or
    bool dtype (the graph is cut), a complex -> real cast that drops a nonzero
    imaginary part. "warn" warns once per site (PrecisionWarning); "raise"
    raises PrecisionLossError at the first one, naming its site. Tracked casts
    are always recorded ("ignore" acts like "record" here). "warn" and
    "raise" read each cast's stats: one device synchronization per cast.
    """

    def __init__(self, all_casts=False, *, policy=None, rtol=None, atol=None):
        if policy is not None:
            _cast._check_policy(policy)
        rtol = _cast.check_tolerance(rtol, "rtol", "torchcast.track")
        atol = _cast.check_tolerance(atol, "atol", "torchcast.track")
        self.all_casts = bool(all_casts)
        self.policy, self.rtol, self.atol = policy, rtol, atol
        self._report = None
        self._active = False
        self._warned = set()
        self._mode = None

    def __enter__(self):
        # Reusable like torch.autocast: each entry records into a fresh Report.
        # Nesting the same object would make two entries share one state.
        if self._active:
            raise RuntimeError("torchcast.track: this track() is already active; nest a new "
                               "one instead: create a new torchcast.track()")
        self._report = Report(self.rtol, self.atol)
        self._warned = set()
        _installed.acquire(self.all_casts)
        _cast._push_tracker(self)
        if self.all_casts:
            mode = getattr(_local, "mode", None)
            if mode is None:
                mode = _local.mode = _CastMode()
                mode.__enter__()
            mode.trackers.append(self)
            self._mode = mode
        self._active = True
        return self._report

    def __exit__(self, *exc):
        try:
            if self._mode is not None:
                self._mode.trackers.remove(self)
                if not self._mode.trackers:
                    _local.mode = None
                    self._mode.__exit__(None, None, None)
                self._mode = None
        finally:
            self._active = False
            _cast._pop_tracker(self)
            _installed.release(self.all_casts)
        return False

    # -- called by safe_to --------------------------------------------------------
    def _on_safe_to(self, pending, name):
        file, line = _user_site(sys._getframe(1), skip_own=True)
        key = (_current_module(), file, line, "safe_to", name, pending.src_dtype, pending.dtype)
        self._report._add(key, pending.tensor, 0, True)

    # -- called by the dispatch mode ----------------------------------------------
    def _apply_policy(self, key, cast, pending):
        pol = self.policy or _cast.get_policy()
        if pol not in ("warn", "raise"):
            return
        module, file, line, origin = key[:4]
        where = f"{module} {_short_path(file)}:{line}" if module else f"{_short_path(file)}:{line}"
        head = f"torchcast.track: {origin} at {where}"
        message = None
        if cast.graph_cut:
            message = _cast._graph_cut_message(head, cast.src_dtype, cast.dtype)
        elif cast.imag is not None and int(cast.imag):
            message = (f"{head}: casting {cast.src_dtype} to {cast.dtype} dropped "
                       f"{int(cast.imag)} nonzero imaginary parts. Take .real or .abs() "
                       "explicitly, or keep a complex dtype.")
        if message is None and pending is not None:
            s = pending.value
            if _cast._is_violation(s, self.rtol, self.atol):
                message = _cast._violation_message(
                    cast.x, cast.y, s, self.rtol, self.atol, None, head=head,
                    advice=(f"Keep {s.src_dtype} here, rescale the data, or use "
                            "torchcast.safe_to with an explicit policy at this line."))
        if message is None:
            return
        if pol == "raise":
            error = _cast.PrecisionLossError(message, pending.value if pending else None)
            error.site = where
            raise error
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn_explicit(message, _cast.PrecisionWarning, file, line or 1)


__all__ = ["Record", "Report", "track"]
