"""Which module is running, and whether a cast is autocast's.

Global forward hooks (installed only while some track() is active) keep a
per-thread stack of module calls. Each call also records the autograd
sequence numbers its nodes got, so that a cast the autograd engine performs
in backward is attributed to the module whose forward created the node.

Autocast inserts its casts from inside its own kernels, with the autocast
dispatch key excluded, and a TorchDispatchMode handler runs with every key
above Python excluded: inside the handler torch.is_autocast_enabled() is
always False. So two facts are gathered outside it while tracking:

- whether autocast is on, per thread and device type: the state at track()
  entry, then every torch.set_autocast_enabled (torch.autocast enters and
  exits through it) is followed by a look at the new state;
- which casts the program asked for: a kernel for aten::_to_copy at the
  autocast keys, which only the program's casts pass through (autocast's own
  casts bypass its key), counts them (csrc/program_casts.cpp, registered
  once at import and never removed).

An unmarked cast while autocast is on is autocast's.
"""
import bisect
import threading
import weakref
from typing import Optional, Tuple

import torch

from .. import _ops

_local = threading.local()


# ---------------------------------------------------------------------------
# The module-call stack.

class _Call:
    __slots__ = ("path", "names", "start", "end", "parent", "module_id", "epoch")

    def __init__(self, path, names, start, parent, module_id, epoch):
        self.path, self.names, self.start, self.end, self.parent = path, names, start, None, parent
        self.module_id, self.epoch = module_id, epoch


_names_cache = weakref.WeakKeyDictionary()
_calls, _call_starts = [], []  # module calls in call order, for backward attribution
_MAX_CALLS = 1 << 16
_calls_lock = threading.Lock()
_sequence_nr = torch._C._autograd._get_sequence_nr


# Hooks are installed and removed while other threads run forwards: a forward
# whose pre-hook ran but whose post-hook was removed leaves its call on that
# thread's stack. Each installation is an epoch; calls of an earlier epoch
# are dropped when the stack is next used, and a post-hook pops only its own
# module's call.
_epoch = 0


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    elif stack and stack[0].epoch != _epoch:
        stack[:] = [c for c in stack if c.epoch == _epoch]
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
    call = _Call(path, names, _sequence_nr(), parent, id(module), _epoch)
    stack.append(call)
    with _calls_lock:
        if len(_calls) >= _MAX_CALLS:
            del _calls[:_MAX_CALLS // 2], _call_starts[:_MAX_CALLS // 2]
        _calls.append(call)
        _call_starts.append(call.start)


def _post_hook(module, args, output):
    stack = _stack()
    if stack and stack[-1].module_id == id(module):
        stack.pop().end = _sequence_nr()


def install_module_hooks() -> Tuple[object, object]:
    """Installs the global forward hooks that keep the module-call stack.

    Returns:
        Their handles, for ``remove_module_hooks``.
    """
    global _epoch
    _epoch += 1
    mod = torch.nn.modules.module
    return (mod.register_module_forward_pre_hook(_pre_hook),
            mod.register_module_forward_hook(_post_hook, always_call=True))


def remove_module_hooks(handles: Tuple[object, object]) -> None:
    """Removes the hooks ``install_module_hooks`` installed and forgets the
    module calls recorded for backward attribution.

    Args:
        handles: what ``install_module_hooks`` returned.
    """
    for handle in handles:
        handle.remove()
    with _calls_lock:
        _calls.clear()
        _call_starts.clear()


def current_module() -> Optional[str]:
    """The path of the module whose forward this thread is running (e.g.
    "layers.0.linear1"), or None outside any forward or outside track()."""
    stack = _stack()
    return stack[-1].path if stack else None


def module_of_node(node: torch.autograd.graph.Node) -> Optional[str]:
    """The path of the module whose forward created autograd node ``node``.

    Args:
        node: the autograd node running (``torch._C._current_autograd_node()``).

    Returns:
        The module path, or None if no tracked forward created it.
    """
    seq = node._sequence_nr()
    with _calls_lock:
        i = bisect.bisect_right(_call_starts, seq) - 1
        call = _calls[i] if i >= 0 else None
    while call is not None and not (call.start <= seq and (call.end is None or seq < call.end)):
        call = call.parent
    return call.path if call is not None else None


# ---------------------------------------------------------------------------
# Autocast marking.

_AUTOCAST_DEVICES = [d for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d)]


def _autocast_state():
    state = getattr(_local, "autocast", None)
    if state is None:
        state = _local.autocast = {d: torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES}
    return state


def refresh_autocast_state() -> None:
    """Looks up this thread's autocast state again (outside any handler)."""
    _local.autocast = None
    _autocast_state()


def _watching_set_autocast_enabled(original):
    def set_autocast_enabled(*args, **kwargs):
        original(*args, **kwargs)
        refresh_autocast_state()
    set_autocast_enabled.__wrapped__ = original
    set_autocast_enabled.__doc__ = original.__doc__
    return set_autocast_enabled


_watching = False


def watch_autocast() -> None:
    """From now on, refreshes the calling thread's autocast state after every
    torch.set_autocast_enabled (torch.autocast enters and exits through it).
    Installed once and kept: with tracks starting and ending in some threads
    while others enter and leave autocast, a watch that comes and goes
    leaves those threads' states stale. Call with the tracker's lock held."""
    global _watching
    if not _watching:
        torch.set_autocast_enabled = _watching_set_autocast_enabled(torch.set_autocast_enabled)
        _watching = True


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` in this thread, usable
    inside a dispatch handler (valid while an all_casts track() is active).

    Args:
        device_type: "cpu", "cuda", ...
    """
    state = getattr(_local, "autocast", None)
    return bool(state and state.get(device_type))


def in_program_cast() -> bool:
    """Whether the cast being dispatched is one the program asked for (it
    passed the autocast keys), rather than one autocast inserted."""
    return _ops.in_program_cast()
