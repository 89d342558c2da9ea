"""The events of a training step that a track's features subscribe to,
beside the module calls (modules.py's output listeners): an optimizer's
step, before and after it, the start and the end of a backward pass, and a
GradScaler's check of the gradients.

Optimizer steps come from torch.optim's global step hooks (every Optimizer
subclass); the start of backward from torch.autograd's engine entry, which
backward() and autograd.grad() both call, wrapped as torch.compiler's own
patch of it does. A GradScaler's check from the op it runs on the
gradients (in ``unscale_``, and before the step of an optimizer that skips
itself on its ``found_inf``), ``torch._amp_foreach_non_finite_check_and_unscale_``,
wrapped in torch's namespace, where GradScaler (and FSDP's
ShardedGradScaler) looks it up. Installed by the first subscription and
kept: removing
them while another thread iterates torch's hook dict would break its step.
A subscriber hears the events of the thread that subscribed (the thread
that entered the track), or with ``any_thread`` those of every thread.
"""
import threading
from typing import Any, Callable, Dict, Iterable, List

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# An optimizer step: callback(optimizer, before: bool). The start of a
# backward pass: callback(outputs it runs from); its end, once the engine
# returned (the gradients written, nothing else run yet): callback(outputs).
# A GradScaler's check of gradients, once it returned: callback(grads,
# found_inf), found_inf the 0-d tensor it set nonzero if one held NaN/inf
# (GradScaler then skips the optimizer's step).
OPTIMIZER_STEP, BACKWARD, BACKWARD_DONE = "optimizer step", "backward", "backward done"
GRADS_UNSCALED = "grads unscaled"
_EVENTS = (OPTIMIZER_STEP, BACKWARD, BACKWARD_DONE, GRADS_UNSCALED)

_lock = threading.Lock()
_installed = False
_local = threading.local()  # .subscribers: this thread's {event: [callback]}
_everywhere: Dict[str, List[Callable[..., None]]] = {event: [] for event in _EVENTS}


def _thread_subscribers() -> Dict[str, List[Callable[..., None]]]:
    subscribers = getattr(_local, "subscribers", None)
    if subscribers is None:
        subscribers = _local.subscribers = {event: [] for event in _EVENTS}
    return subscribers


def subscribe(event: str, callback: Callable[..., None], any_thread: bool = False) -> None:
    """Calls ``callback`` at each ``event`` (OPTIMIZER_STEP, BACKWARD, BACKWARD_DONE or
    GRADS_UNSCALED) of the calling thread (of every thread with
    ``any_thread``) until ``unsubscribe`` with the same arguments."""
    _install()
    with _lock:
        (_everywhere if any_thread else _thread_subscribers())[event].append(callback)


def unsubscribe(event: str, callback: Callable[..., None], any_thread: bool = False) -> None:
    """Undoes ``subscribe(event, callback, any_thread)``."""
    with _lock:
        (_everywhere if any_thread else _thread_subscribers())[event].remove(callback)


def _listeners(event: str) -> List[Callable[..., None]]:
    own = getattr(_local, "subscribers", None)
    return list(own[event] if own is not None else ()) + list(_everywhere[event])


def _optimizer_pre_hook(optimizer, args, kwargs) -> None:
    for callback in _listeners(OPTIMIZER_STEP):
        callback(optimizer, True)


def _optimizer_post_hook(optimizer, args, kwargs) -> None:
    for callback in _listeners(OPTIMIZER_STEP):
        callback(optimizer, False)


def _backward_from(outputs: Iterable[Any], event: str = BACKWARD) -> None:
    for callback in _listeners(event):
        callback(outputs)


def _install() -> None:
    global _installed
    with _lock:
        if not _installed:
            register_optimizer_step_pre_hook(_optimizer_pre_hook)
            register_optimizer_step_post_hook(_optimizer_post_hook)
            _install_unscale()
            _installed = True
        # Looked at on every subscription: a patch of torch's own (make_fx's)
        # that began before the first and ended after it restores what it saved.
        run_backward = torch.autograd.graph._engine_run_backward
        if getattr(run_backward, "_torchcast_events", False):
            return

        def _engine_run_backward(t_outputs, *args, **kwargs):
            watched = (getattr(_local, "subscribers", None) or _everywhere[BACKWARD]
                       or _everywhere[BACKWARD_DONE]) and not torch.compiler.is_compiling()
            if not watched:
                return run_backward(t_outputs, *args, **kwargs)
            outputs = [t_outputs] if isinstance(t_outputs, torch.Tensor) else t_outputs
            _backward_from(outputs)
            result = run_backward(t_outputs, *args, **kwargs)
            _backward_from(outputs, BACKWARD_DONE)
            return result

        _engine_run_backward.__wrapped__ = run_backward
        _engine_run_backward.__doc__ = run_backward.__doc__
        _engine_run_backward._torchcast_events = True
        torch.autograd.graph._engine_run_backward = _engine_run_backward
        torch.autograd._engine_run_backward = _engine_run_backward


def _install_unscale() -> None:
    """Wraps GradScaler's check of the gradients (under _lock, once)."""
    check = torch._amp_foreach_non_finite_check_and_unscale_

    def _amp_foreach_non_finite_check_and_unscale_(*args, **kwargs):
        result = check(*args, **kwargs)
        if not torch.compiler.is_compiling():
            named = dict(zip(("self", "found_inf", "inv_scale"), args), **kwargs)
            for callback in _listeners(GRADS_UNSCALED):
                callback(named["self"], named["found_inf"])
        return result

    _amp_foreach_non_finite_check_and_unscale_.__wrapped__ = check
    _amp_foreach_non_finite_check_and_unscale_.__doc__ = check.__doc__
    torch._amp_foreach_non_finite_check_and_unscale_ = _amp_foreach_non_finite_check_and_unscale_
