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
  by the first track and never removed).

An unmarked cast while autocast is on is autocast's.
"""
import bisect
import threading
import warnings
import weakref
from typing import List, Optional, Tuple

import torch

from . import native

_local = threading.local()


# ---------------------------------------------------------------------------
# The module-call stack.

class ModuleCall:
    """One module call on a thread's stack, as output listeners receive it.

    Attributes:
        path: what ``current_module`` says during the call: the outermost
            module's class name, its children's paths without it
            ("layers.0.linear1"), "parent/Class" for a module its root
            does not register (one made inside a forward); None for
            compiled code called first.
        rel: the path below the outermost module: "" for it, "/Class" for
            a module it does not register that it calls directly.
        owner: the module the call stands for (a compiled wrapper and the
            module it wraps, and a graph module running for its caller,
            stand for one module); None for compiled code called first,
            and once the call has returned.
        parent: the call this one is inside, None for the outermost.
        args: the positional arguments of the call while it runs (where
            NaN/inf that entered came from: entries.py), then None.
    """
    __slots__ = ("path", "rel", "owner", "names", "start", "end", "parent", "module_id",
                 "epoch", "args")

    def __init__(self, path, rel, owner, names, start, parent, module_id, epoch, args):
        self.path, self.rel, self.owner = path, rel, owner
        self.names, self.start, self.end, self.parent = names, start, None, parent
        self.module_id, self.epoch, self.args = module_id, epoch, args


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


_WRAPPER = "_orig_mod"  # torch.compile(module) wraps module as OptimizedModule._orig_mod


def _unwrapped(module):
    """The module a torch.compile wrapper (OptimizedModule) holds, else module.
    Read from the registered children: getattr of a missing name goes through
    Module.__getattr__, which raises and catches an AttributeError, several
    times the cost of the rest of a hook."""
    inner = module.__dict__.get("_modules", {}).get(_WRAPPER)
    return inner if isinstance(inner, torch.nn.Module) else module


def _names_of(root):
    """module -> (its path in ``root``, the module it stands for), for every
    module ``root`` registers, the first path where one is registered twice."""
    names = _names_cache.get(root)
    if names is None:
        names = {}
        for path, module in root.named_modules(remove_duplicate=False):
            # A compiled submodule is the module it wraps: its path has no
            # "_orig_mod" component, and the wrapper and the wrapped share it
            # (and its owner: unwrapping here, once, keeps it off every call).
            if module not in names:
                names[module] = (".".join(p for p in path.split(".") if p != _WRAPPER),
                                 _unwrapped(module))
        del names[root]  # a value referring to its weak key would keep it alive
        _names_cache[root] = names
    return names


def _pre_hook(module, args):
    # Dynamo traces these hooks into every compiled module call; what they do
    # (thread-local stacks, a lock, the autograd sequence number) would break
    # the graph. Compiled casts get their module from the graph (compiled.py).
    if torch.compiler.is_compiling():
        return
    stack = _stack()
    parent = stack[-1] if stack else None
    if parent is None:
        names = _names_of(module)
        rel = ""
        # A graph module called first is compiled code (the "eager" and
        # "aot_eager" backends' graph of a compiled function): no module.
        if isinstance(module, torch.fx.GraphModule):
            path = owner = None
        else:
            owner = _unwrapped(module)
            path = type(owner).__name__
    else:
        names = parent.names
        registered = names.get(module)
        if registered is not None and registered[0]:
            path, owner = registered
            rel = path
        elif registered is not None or isinstance(module, torch.fx.GraphModule):
            # The module a compiled root wraps is the root itself; a graph
            # module that is not a child is compiled code (the "eager" and
            # "aot_eager" backends run one) standing for its caller.
            path, rel, owner = parent.path, parent.rel, parent.owner
        else:
            kind = type(module).__name__
            path, rel, owner = f"{parent.path}/{kind}", f"{parent.rel}/{kind}", module
    if module.__dict__.get("_forward_hooks"):
        _keep_tail_hook(module)
    call = ModuleCall(path, rel, owner, names, _sequence_nr(), parent, id(module), _epoch, args)
    stack.append(call)
    with _calls_lock:
        if len(_calls) >= _MAX_CALLS:
            del _calls[:_MAX_CALLS // 2], _call_starts[:_MAX_CALLS // 2]
        _calls.append(call)
        _call_starts.append(call.start)


# Output listeners belong to the thread that added them (a track's health
# watch, to the thread that entered the track): a module call goes to its
# thread's listeners, or, in a thread with none, to every thread's, as
# other threads' casts go to every all_casts track (threads.py). Tuples,
# replaced whole under the lock, so that the hook iterates them unlocked.
class _ThreadListeners:
    __slots__ = ("listeners",)

    def __init__(self):
        self.listeners = ()


_listeners_lock = threading.Lock()
_all_listeners = ()
_listener_threads = {}  # listener -> the _ThreadListeners of the thread that added it


def add_output_listener(listener) -> None:
    """Calls ``listener(call, output)`` after each forward of a module that
    the calling thread runs, with the ``ModuleCall`` and the module's output,
    until ``remove_output_listener(listener)`` (from any thread). A thread
    that has no listener of its own calls every thread's listeners."""
    global _all_listeners
    with _listeners_lock:
        own = getattr(_local, "listeners", None)
        if own is None:
            own = _local.listeners = _ThreadListeners()
        own.listeners += (listener,)
        _listener_threads[listener] = own
        _all_listeners += (listener,)


def _without(listeners, listener):
    i = listeners.index(listener)
    return listeners[:i] + listeners[i + 1:]


def remove_output_listener(listener) -> None:
    """Undoes ``add_output_listener(listener)``."""
    global _all_listeners
    with _listeners_lock:
        own = _listener_threads.pop(listener)
        own.listeners = _without(own.listeners, listener)
        _all_listeners = _without(_all_listeners, listener)


# torch runs the global forward hooks before a module's own: a module with
# hooks of its own gets one more, kept last among them, that ends its call
# instead (the ops its hooks run are its own, and its output is what they
# leave). Removed with the global hooks.
_tail_hooks = weakref.WeakKeyDictionary()  # module -> the handle of its tail hook


def _keep_tail_hook(module) -> None:
    hooks = module._forward_hooks
    handle = _tail_hooks.get(module)
    if handle is None or handle.id not in hooks:
        _tail_hooks[module] = module.register_forward_hook(_tail_hook, always_call=True)
    elif next(reversed(hooks)) != handle.id:
        hooks.move_to_end(handle.id)


def _post_hook(module, args, output):
    if torch.compiler.is_compiling():
        return
    hooks = module.__dict__.get("_forward_hooks")
    if hooks and module in _tail_hooks:
        return  # its tail hook ends the call, after its own hooks
    _end_call(module, output)


def _tail_hook(module, args, output):
    if not torch.compiler.is_compiling():
        _end_call(module, output)


def _end_call(module, output):
    stack = _stack()
    if stack and stack[-1].module_id == id(module):
        call = stack.pop()
        call.end = _sequence_nr()
        own = getattr(_local, "listeners", None)
        for listener in own.listeners if own is not None and own.listeners else _all_listeners:
            listener(call, output)
        # The call stays in _calls for backward attribution; its modules must
        # not (the owner, and the root's children through names): a module
        # made for one call (a loss built at each step) would live on until
        # the last track exits.
        call.owner = call.names = call.args = None


# torch.compile(module) warns at every call, while global module hooks
# exist, that they fire for its wrapper too; these hooks give the wrapper and
# the module it wraps one path, so the warning is silenced while they are on.
_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def install_module_hooks() -> Tuple[object, object, object]:
    """Installs the global forward hooks that keep the module-call stack.

    Returns:
        Their handles, for ``remove_module_hooks``.
    """
    global _epoch
    _epoch += 1
    mod = torch.nn.modules.module
    warnings.filterwarnings("ignore", _HOOKS_WARNING)
    return (mod.register_module_forward_pre_hook(_pre_hook),
            mod.register_module_forward_hook(_post_hook, always_call=True),
            warnings.filters[0])


def remove_module_hooks(handles: Tuple[object, object, object]) -> None:
    """Removes the hooks ``install_module_hooks`` installed and forgets the
    module calls recorded for backward attribution.

    Args:
        handles: what ``install_module_hooks`` returned.
    """
    *hooks, warning_filter = handles
    for handle in hooks:
        handle.remove()
    for handle in list(_tail_hooks.values()):
        handle.remove()
    _tail_hooks.clear()
    try:
        warnings.filters.remove(warning_filter)
    except ValueError:  # warnings.resetwarnings() or a catch_warnings() exit removed it
        pass
    else:
        getattr(warnings, "_filters_mutated", lambda: None)()  # what catch_warnings calls
    with _calls_lock:
        _calls.clear()
        _call_starts.clear()


def running_calls() -> List[ModuleCall]:
    """The module calls this thread is running, outermost first."""
    return list(_stack())


def current_module() -> Optional[str]:
    """The path of the module whose forward this thread is running (e.g.
    "layers.0.linear1"), or None outside any forward or outside track()."""
    stack = _stack()
    return stack[-1].path if stack else None


def _call_of_node(node):
    seq = node._sequence_nr()
    with _calls_lock:
        i = bisect.bisect_right(_call_starts, seq) - 1
        call = _calls[i] if i >= 0 else None
    while call is not None and not (call.start <= seq and (call.end is None or seq < call.end)):
        call = call.parent
    return call


def module_of_node(node: torch.autograd.graph.Node) -> Optional[str]:
    """The path of the module whose forward created autograd node ``node``.

    Args:
        node: the autograd node running (``torch._C._current_autograd_node()``).

    Returns:
        The module path, or None if no tracked forward created it.
    """
    call = _call_of_node(node)
    return call.path if call is not None else None


def module_within(path: str, node: Optional[torch.autograd.graph.Node] = None) -> Optional[str]:
    """The path, as ``current_module`` and ``module_of_node`` write it, of
    the module at ``path`` below a running module: where a compiled graph's
    cast happened, the graph knowing only the path inside the compiled module.

    Args:
        path: the path below the running module ("" for the module itself).
        node: in backward, the autograd node running (the compiled graph's):
            the running module is the one whose forward created it; None:
            the module this thread is running.

    Returns:
        The module path; ``path`` (None if empty) outside any tracked forward.
    """
    if node is not None:
        call = _call_of_node(node)
    else:
        stack = getattr(_local, "stack", None)
        call = stack[-1] if stack else None
    if call is None:
        return path or None
    if not path:
        return call.path
    # The outermost module's children are named without it, as current_module does.
    return path if call.parent is None else f"{call.path}.{path}"


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
    return native.in_program_cast()
