"""track(nonfinite=...)'s steps and reach: which step of the block each
non-finite origin belongs to, and whether its NaN/inf reached the block's
outputs, the loss or the gradients, or were absorbed.

nonfinite.py finds the origins, op by op; this module follows the block's
steps around them (its top-level module calls, backward, optimizer steps:
modules.py's output listener and events.py) and reads the values a step's
results leave by. It runs at another grain than the per-op
check, and costs nothing per op. A ``NonFiniteWatch`` owns one
``StepTracker``: it tells it of each call of an origin (``occurred``), asks
it for a backward origin's forward method (``forward``), and starts and
ends it with the track (``start``; ``end_block`` and ``stop``).

The rule. An origin's NaN/inf *reached* if, after it and before its step
ended, NaN/inf showed in one of the places a step's values leave by:
  1. the output of a top-level module call (checked as the call returns);
  2. a tensor backward() or autograd.grad() ran from: the loss (checked
     before the engine runs); under "raise", also the gradients it wrote
     into the parameters of the step's top-level modules, where an op
     (an update written by hand, ``p.data.add_(p.grad, alpha=-lr)``, no
     optimizer's step) is about to write them into a parameter
     (param_writes.py);
  3. the gradients an optimizer's step() read (checked before it runs)
     and, for the origins in the step itself, the parameters it wrote
     or the state it keeps (after: the gradients it read were finite,
     so NaN/inf there are its own ops');
  4. where a step ends without an optimizer step, the parameters, and
     their gradients, of the step's top-level modules.
Gradients in which a GradScaler found NaN/inf (events.py's GRADS_UNSCALED)
are not read in 2 (at a step's end) and 4, nor in 3 by an optimizer that
takes GradScaler's ``found_inf`` and skips itself (``_step_supports_amp_scaling``):
the scaler skips the step that would use them, and lowers its scale, which
is how float16 training is meant to go; until the next backward writes
new ones. An optimizer that steps on them all the same (its step()
called after ``scaler.unscale_`` found inf) still reads them in 3.
Otherwise, at the end of its step, it was *absorbed*. A step ends at an
optimizer's step() once the block has run one; before that, a top-level
call's step ends when the next one begins (noticed as it returns: an
origin in backward or inside the call cannot reach the next call's
output but through the modules' parameters, which 4 reads; one in
forward outside any module, which may make the next call's input,
is also checked against that call's output), and the last one at the
block's exit. A top-level module without parameters (a transform such as
nn.Identity or torchvision's Normalize, called on the data before the
model) ends no step: it counts the steps only until a top-level module
with parameters is called, which counts them from then on. Every check
is of values that stay in the program (a NaN/inf seen there is not
absorbed), so "absorbed" is sound for these places; what a step leaves
elsewhere (a tensor kept in a module's
plain attribute, a buffer, a Python variable read in a later step) is
not followed. When a check sees NaN/inf, every origin of the step not
yet decided is marked reached: which one's values they were is not
traced (that would take a look at every op that passes NaN/inf on, in
the C++ watch too), so with several in one step the reports put first
those never absorbed in another step (a harmless overflow that recurs
every step is the usual bystander), then time decides.

Cost: nothing per op. Per module call, a dict lookup (the forward of
each module path, for backward origins); per top-level call and
optimizer step, a few counters. The checks read values only while an
origin is undecided; on a GPU, with ops still awaiting their flags,
those are read first: one sync per top-level call, backward and
optimizer step.
"""
import functools
import inspect
import threading
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from .. import _ops
from .events import (BACKWARD, BACKWARD_DONE, GRADS_UNSCALED, OPTIMIZER_STEP, subscribe,
                     unsubscribe)
from .modules import add_output_listener, remove_output_listener, running_calls
from .nonfinite_origin import NonFiniteError, floating_data
from .origin import NonFiniteOrigin, reach_rank
from .param_writes import ParamWriteGuard


class StepTracker:
    """The steps of one track(nonfinite=...) block and the reach of its
    origins, from ``start()`` to ``stop()``, in the thread that entered the
    track.

    Of its watch (a ``NonFiniteWatch``) it reads ``lock`` (which guards the
    watch's origins and this tracker's undecided calls alike; a forked
    process replaces it), ``origins``, ``action`` ("raise" raises
    from here), and ``pending`` and ``flush()``: the ops still awaiting
    their flags are read before a step's boundary, so that each gets the
    step it ran in.

    Args:
        watch: the NonFiniteWatch that owns it.
        unwatched: a context manager class whose block the per-op check does
            not see (``nonfinite.unwatched``; handed in, as nonfinite.py
            imports this module): the tracker's own reads.
    """

    def __init__(self, watch: Any, unwatched: Callable[[], ContextManager]):
        self.watch = watch
        self.unwatched = unwatched
        self.started = False
        self.in_worker = False  # in a process forked inside the track (forked())
        self.thread: Optional[int] = None
        self.opt_seen = False  # an optimizer step began in the block
        self.opt_depth = 0  # optimizer steps running (one optimizer's step may call another's)
        self.opt_done = 0  # optimizer steps completed
        # Without an optimizer, a step is a call of the first top-level
        # module the block ran (the model; a loss module called beside it
        # belongs to the step): calls_done counts them, by its id.
        self.calls_done = 0
        self.stepping_root: Optional[int] = None
        self.stepping_name = ""
        # The stepping module holds no parameters (a transform such as
        # nn.Identity or torchvision's Normalize, called on the data before
        # the model): it counts steps only until a top-level module with
        # parameters is called, which takes its place, and ends none.
        self.stepping_free = False
        # The undecided calls of origins, by (origin key, raw step), in time order.
        self.open: Dict[tuple, "_Occurrence"] = {}
        # Origin key -> [raw step of its first call, raw step where it reached]; a
        # raw step is (optimizer steps completed, top-level calls begun), read as
        # one or the other once the block shows whether it steps an optimizer.
        self.raw: Dict[tuple, list] = {}
        self.roots: Dict[int, Any] = {}  # weakrefs to the top-level modules of the open steps
        self.forwards: Dict[str, tuple] = {}  # module path -> its forward (name, file, line)
        # Under "raise": the error for an origin found outside any check (an
        # optimizer step's deferred write), raised at the next one.
        self.pending_error: Optional[NonFiniteError] = None
        # Under "raise", after a backward that left NaN/inf in the gradients
        # while an origin was undecided, until the step's next boundary.
        self.guard: Optional[ParamWriteGuard] = None
        # The gradients a GradScaler checked since the last backward began:
        # id -> (weakref, its found_inf).
        self.unscaled: Dict[int, tuple] = {}

    # -- what the watch calls -------------------------------------------------------
    def start(self) -> None:
        """Starts counting steps and deciding reach, in the calling thread
        (the track's entry); ``end_block`` and ``stop`` end it."""
        self.thread = threading.get_ident()
        self.started = True
        add_output_listener(self._module_returned)
        subscribe(OPTIMIZER_STEP, self._optimizer_step)
        subscribe(BACKWARD, self._backward_from)
        subscribe(BACKWARD_DONE, self._backward_done)
        subscribe(GRADS_UNSCALED, self._grads_unscaled)

    def end_block(self, failed: bool) -> Optional[NonFiniteError]:
        """At the block's exit, once the watch's pending flags are read:
        ends the last step, unless the block ``failed`` (left by an
        exception, its step did not end, and its origins stay undecided).

        Returns:
            Under "raise", the error for an origin found to reach at
            the exit, else None.
        """
        if self.started and not failed and not self.in_worker:
            try:
                self._raise_pending()
                self._close(lambda occurrence: True, check=True)
            except NonFiniteError as raised:
                return raised
        return None

    def stop(self) -> None:
        """Stops following the thread's steps (whatever ``end_block`` did),
        and gives each of the watch's origins its step as the whole block
        counts it."""
        self.leave_guard()
        if self.started:
            self.started = False
            remove_output_listener(self._module_returned)
            unsubscribe(OPTIMIZER_STEP, self._optimizer_step)
            unsubscribe(BACKWARD, self._backward_from)
            unsubscribe(BACKWARD_DONE, self._backward_done)
            unsubscribe(GRADS_UNSCALED, self._grads_unscaled)
            self.unscaled = {}
            with self.watch.lock:
                for origin in self.watch.origins.values():
                    self._resolve(origin)

    def forked(self) -> None:
        """In a process forked inside the track: forgets the undecided calls.
        A worker's data leaves it as data: whether its NaN/inf reach the
        outputs shows in the track's process, where they are inputs."""
        self.open, self.raw, self.roots, self.unscaled = {}, {}, {}, {}
        self.in_worker = True

    def roots_now(self) -> List[torch.nn.Module]:
        """The top-level modules of the steps not yet ended (where an
        entry's parameter is looked for)."""
        return [root for root in (ref() for ref in list(self.roots.values())) if root is not None]

    def forward(self, module: Optional[str]) -> Optional[tuple]:
        """(name, file, line) of the forward method of the module at path
        ``module``, as seen when a call of it returned (a backward origin's
        forward), or None."""
        return self.forwards.get(module)

    def occurred(self, origin: NonFiniteOrigin, module: Optional[str], phase: str) -> None:
        """A call of ``origin`` happened now (with the watch's lock held): it
        is undecided until its step ends or its NaN/inf are seen to reach.

        Args:
            origin: the origin (new, or the one its key already names).
            module: the module path of the call, None outside any module.
            phase: "forward" or "backward".
        """
        if not self.started or self.in_worker:
            return
        # Only forward ops inside a call of the stepping module belong to
        # the call running now.
        in_call = phase == "forward" and module is not None and self._in_stepping_call()
        raw = (self.opt_done, self.calls_done + in_call)
        self.raw.setdefault(origin.key, [raw, None])
        self._resolve(origin)
        if origin.reached or (origin.key, raw) in self.open:
            return  # decided for good, or undecided in this step already
        in_step = self.opt_depth > 0
        outside = phase == "forward" and module is None and not in_step
        self.open[(origin.key, raw)] = _Occurrence(origin, raw, outside, in_step)

    def _in_stepping_call(self) -> bool:
        """Whether this thread runs a call of the stepping module now."""
        calls = running_calls()
        return bool(calls) and (self.stepping_root is None
                                or calls[0].module_id == self.stepping_root)

    def reached_in_step(self, origin: NonFiniteOrigin, raw: tuple, at: str) -> None:
        """An origin of an optimizer's step, found after it (one of its
        deferred writes, nonfinite.py): its NaN/inf reached ``at`` (what the
        step wrote) in that step, raw step ``raw``. Under "raise", raised at
        the next check (a top-level module's output, backward, the next
        optimizer step, the block's end)."""
        with self.watch.lock:
            if raw is None:  # a step too long before to be numbered
                origin.reached, origin.reached_at = True, at
            else:
                self.raw.setdefault(origin.key, [raw, None])
                self._mark(origin, at, raw)
        if self.watch.action == "raise" and self.pending_error is None:
            self.pending_error = _reached_error([origin], at)

    def _raise_pending(self) -> None:
        error, self.pending_error = self.pending_error, None
        if error is not None:
            raise error

    # -- deciding -------------------------------------------------------------------
    def _resolve(self, origin: NonFiniteOrigin) -> None:
        """Writes the origin's steps as the block counts them so far."""
        raw = self.raw.get(origin.key)
        if raw is None:
            return
        first, reach = raw
        if self.opt_seen:
            origin.step_kind, origin.step = "optimizer step", first[0] + 1
            origin.reached_step = reach[0] + 1 if reach else None
        elif self.stepping_root is not None:
            origin.step_kind, origin.step = f"call of {self.stepping_name}", first[1]
            origin.reached_step = reach[1] if reach else None
        else:  # no optimizer step, no module call: no steps to count
            origin.step_kind = origin.step = origin.reached_step = None

    def _reached(self, at: str, now: tuple,
                 which: Callable[["_Occurrence"], bool] = lambda occurrence: True) -> None:
        """NaN/inf showed at ``at`` (in raw step ``now``): every undecided
        origin (that ``which`` selects) reached; under "raise",
        raises for the first."""
        with self.watch.lock:
            keys = [key for key, occurrence in self.open.items() if which(occurrence)]
            occurrences = [self.open.pop(key) for key in keys]
            for occurrence in occurrences:
                self._mark(occurrence.origin, at, now)
        if self.watch.action == "raise" and occurrences:
            raise _reached_error([o.origin for o in occurrences], at)

    def _mark(self, origin: NonFiniteOrigin, at: str, now: tuple) -> None:
        if not origin.reached:
            origin.reached, origin.reached_at = True, at
            self.raw[origin.key][1] = now
        self._resolve(origin)

    def _close(self, ending: Callable[["_Occurrence"], bool], check: bool) -> None:
        """Ends the step of the undecided calls ``ending`` selects: reached
        if (with ``check``) the parameters or gradients of the open steps'
        top-level modules hold NaN/inf, else absorbed."""
        with self.watch.lock:
            closing = [key for key, occurrence in self.open.items() if ending(occurrence)]
            occurrences = [self.open.pop(key) for key in closing]
        if not occurrences:
            return
        at = self._state_nonfinite() if check else None
        with self.watch.lock:
            for occurrence in occurrences:
                origin = occurrence.origin
                if at is not None:
                    self._mark(origin, at, occurrence.raw)
                else:
                    origin.absorbed_steps += 1
                    if origin.reached is None:
                        origin.reached = False
                self._resolve(origin)
        if at is not None and self.watch.action == "raise":
            raise _reached_error([o.origin for o in occurrences], at)

    def _state_nonfinite(self, parameters: bool = True) -> Optional[str]:
        """What the open steps' top-level modules hold NaN/inf in (their
        parameters' gradients, or with ``parameters`` their parameters), or
        None."""
        for ref in list(self.roots.values()):
            root = ref()
            if root is None:
                continue
            params = list(root.parameters())
            if self._any_nonfinite(self._unskipped(p.grad for p in params)):
                return f"the gradients of {type(root).__name__}'s parameters"
            if parameters and self._any_nonfinite(params):
                return f"{type(root).__name__}'s parameters"
        return None

    def _unskipped(self, grads: Iterable[Any]) -> Iterable[Any]:
        """``grads`` but those a GradScaler found NaN/inf in (it skips the
        step that would use them)."""
        if not self.unscaled:
            return grads
        found = {}  # id(found_inf) -> whether it was set: each read once
        kept = []
        for grad in grads:
            entry = self.unscaled.get(id(grad))
            if entry is not None and entry[0]() is grad:
                found_inf = entry[1]
                if id(found_inf) not in found:
                    with self.unwatched():
                        found[id(found_inf)] = bool(found_inf.detach().ne(0).any())
                if found[id(found_inf)]:
                    continue
            kept.append(grad)
        return kept

    def _any_nonfinite(self, values: Iterable[Any]) -> bool:
        """Whether a floating tensor among ``values`` holds NaN/inf: CPU tensors
        read in C++, one sync per other device. The tracker's own reads: no
        watch checks them."""
        flags = {}
        with self.unwatched():
            for t in _plain_parts(values):
                if not (isinstance(t, torch.Tensor) and floating_data(t)
                        and t.layout == torch.strided):
                    continue
                if t.device.type == "cpu":
                    if not _ops.all_finite(t):
                        return True
                else:
                    flags.setdefault(t.device, []).append(
                        torch.isfinite(_ops.readable(t.detach())).all())
            return any(not bool(torch.stack(f).all()) for f in flags.values())

    # -- the events, in the thread that entered the track -----------------------------
    def _module_returned(self, call, output) -> None:
        """modules.py's output listener: every module call's forward
        method, kept for backward origins; a top-level call's output."""
        if self.thread != threading.get_ident() or self.in_worker:
            return  # another thread's module (a thread without listeners calls all)
        path = call.path
        if path is not None and path not in self.forwards and call.owner is not None:
            self.forwards[path] = _forward_of(call.owner)
        if call.parent is not None:
            return
        self.leave_guard()
        self._raise_pending()
        if self.watch.pending:
            self.watch.flush()
        if self.stepping_root is None or (
                self.stepping_free and call.module_id != self.stepping_root
                and not _parameter_free(call.owner)):
            self.stepping_root, self.calls_done = call.module_id, 0
            self.stepping_free = _parameter_free(call.owner)
            if call.owner is not None:
                self.stepping_name = type(call.owner).__name__
        if call.module_id != self.stepping_root:
            # Another top-level module (a loss module): its output is the
            # step's, its call no step of its own.
            if self.open and self._any_nonfinite(tree_flatten(output)[0]):
                self._reached(f"the output of {path or 'a compiled graph'}",
                              (self.opt_done, self.calls_done))
            self._keep_root(call)
            return
        number = self.calls_done + 1
        # (a parameter-free one ends no step: what it would read to decide,
        # the parameters of the steps' modules, it does not hold)
        ends = not self.opt_seen and not self.stepping_free
        try:
            if self.open and ends:
                # The steps before this call ended when it began.
                self._close(lambda o: o.raw[1] < number and not o.outside, check=True)
            if self.open and self._any_nonfinite(tree_flatten(output)[0]):
                self._reached(f"the output of {path or 'a compiled graph'}",
                              (self.opt_done, number))
            if self.open and ends:
                self._close(lambda o: o.raw[1] < number, check=True)
        finally:  # "raise" may raise above: the call still counts
            self.calls_done = number
            if ends:
                self.roots = {}
            self._keep_root(call)

    def _keep_root(self, call) -> None:
        """Keeps a top-level call's module among the open steps' roots."""
        owner = call.owner
        if owner is not None and id(owner) not in self.roots:
            self.roots[id(owner)] = weakref.ref(owner)

    def _backward_from(self, outputs: Iterable[Any]) -> None:
        """backward() or autograd.grad() is about to run from ``outputs``."""
        if self.in_worker:
            return
        self.unscaled = {}  # (it writes new gradients, for the scaler to check again)
        self.leave_guard()
        self._raise_pending()
        if self.watch.pending:
            self.watch.flush()
        if self.open and self._any_nonfinite(outputs):
            self._reached("the loss (a tensor backward() ran from)",
                          (self.opt_done, self.calls_done))

    def _backward_done(self, outputs: Iterable[Any]) -> None:
        """backward() or autograd.grad() returned. Under "raise", while an
        origin is undecided, the gradients it wrote into the open steps'
        parameters are read: with NaN/inf there, the ops that follow are
        watched until the step's next boundary, and the first that writes
        into one of those parameters raises before it does
        (param_writes.py): an update written by hand
        (``p.data.add_(p.grad, alpha=-lr)``) is no optimizer's step. One
        that writes none (a GradScaler skipping its step) runs on."""
        if self.in_worker or self.watch.action != "raise" or self.guard is not None:
            return
        if self.watch.pending:
            self.watch.flush()
        if not self.open:
            return
        at = self._state_nonfinite(parameters=False)  # (backward writes none)
        if at is None:
            return
        now = (self.opt_done, self.calls_done)
        params = [p for ref in list(self.roots.values()) if ref() is not None
                  for p in ref().parameters()]

        def error(op: str) -> Optional[BaseException]:
            try:
                self._reached(f"{at}, which {op} was about to write into them", now)
            except NonFiniteError as raised:
                return raised
            return None

        self.guard = ParamWriteGuard(params, error)
        self.guard.enter()

    def _grads_unscaled(self, grads: List[torch.Tensor], found_inf: torch.Tensor) -> None:
        """A GradScaler checked (and unscaled) ``grads``, setting
        ``found_inf`` if one held NaN/inf: kept, whether or not an origin is
        undecided yet (off the CPU, the backward's origins may still await
        their flags); found_inf is read only where the grads would be judged."""
        if self.in_worker:
            return
        for grad in grads:
            self.unscaled[id(grad)] = (weakref.ref(grad), found_inf)

    def leave_guard(self) -> None:
        """Leaves the guard _backward_done entered, at a boundary of the step
        and when the track stops (before the modes entered before it)."""
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.leave()

    def _optimizer_step(self, optimizer, before: bool) -> None:
        """Before and after an optimizer's step()."""
        if self.in_worker:
            return
        self.leave_guard()
        if self.watch.pending:
            self.watch.flush()  # the ops before this point get the step they ran in
        self.opt_depth += 1 if before else -1
        if self.opt_depth != (1 if before else 0):
            return  # an optimizer's step inside another's: one step
        name = type(optimizer).__name__
        params = [p for group in optimizer.param_groups for p in group["params"]]
        now = (self.opt_done, self.calls_done)
        if before:
            self.opt_seen = True
            try:
                self._raise_pending()
                grads = [p.grad for p in params]
                if self.open and getattr(optimizer, "_step_supports_amp_scaling", False):
                    grads = self._unskipped(grads)  # (it skips itself on GradScaler's found_inf)
                if self.open and self._any_nonfinite(grads):
                    self._reached(f"the gradients {name}.step() read", now)
            except NonFiniteError:
                self.opt_depth -= 1  # raised before the step: no post-hook comes
                raise
            self.watch.optimizer_step(optimizer, True, now)
            return
        self.watch.optimizer_step(optimizer, False, now)
        # A step on DTensors (FSDP2) writes their shards, and their states',
        # by ops no watch sees.
        wrapped = [p for p in params if is_traceable_wrapper_subclass(p)]
        if wrapped:
            self.watch.account_for(_plain_parts(wrapped + [
                t for p in wrapped for t in optimizer.state.get(p, {}).values()
                if isinstance(t, torch.Tensor)]))
        try:
            # The gradients it read were finite, or the origins before it
            # are decided already: NaN/inf in what it wrote are its own ops'.
            if any(o.in_step for o in self.open.values()):
                states = [t for state in optimizer.state.values() for t in state.values()
                          if isinstance(t, torch.Tensor)]
                if self._any_nonfinite(params):
                    self._reached(f"the parameters {name}.step() wrote", now,
                                  lambda o: o.in_step)
                elif self._any_nonfinite(states):
                    self._reached(f"the state {name}.step() keeps", now,
                                  lambda o: o.in_step)
            self._close(lambda o: True, check=False)
        finally:
            self.opt_done += 1
            self.roots = {}


def _parameter_free(module: Optional[torch.nn.Module]) -> bool:
    """Whether ``module`` (a top-level call's; None: a compiled graph's)
    holds no parameters."""
    return module is not None and next(module.parameters(), None) is None


class _Occurrence:
    """An undecided call of an origin: its raw step (optimizer steps
    completed, top-level calls begun), whether it ran in forward outside
    any module (it may make the next top-level call's input) and whether
    inside an optimizer's step()."""

    __slots__ = ("origin", "raw", "outside", "in_step")

    def __init__(self, origin: NonFiniteOrigin, raw: tuple, outside: bool, in_step: bool):
        self.origin, self.raw, self.outside, self.in_step = origin, raw, outside, in_step


def _plain_parts(values: Iterable[Any]) -> Iterable[Any]:
    """``values``, with each traceable wrapper subclass (a DTensor: FSDP2's
    parameters and gradients) replaced by the tensors it holds (this rank's
    shard)."""
    for v in values:
        if isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v):
            names, _ = v.__tensor_flatten__()
            yield from _plain_parts(getattr(v, name) for name in names)
        else:
            yield v


def _reached_error(origins: List[NonFiniteOrigin], at: str) -> NonFiniteError:
    """track(nonfinite="raise")'s error for the step's undecided
    origins, which NaN/inf at ``at`` were seen to reach: it names the first
    never absorbed in another step (reach_rank), else the first."""
    origins = sorted(origins, key=lambda o: reach_rank(o.reached, o.absorbed_steps))
    detail = f"Raised where NaN/inf reached {at}."
    if len(origins) > 1:
        others = ", ".join(o.op for o in origins[1:4]) + (", ..." if len(origins) > 4 else "")
        detail += (f" {len(origins) - 1} other origins of the step ({others}) were undecided "
                   "too: which one's NaN/inf these are is not traced; this one, never absorbed "
                   "in another step or the first, is the likely cause.")
    return NonFiniteError(origins[0], detail)


def _forward_of(module: torch.nn.Module) -> tuple:
    """(name, file, line) of ``module``'s forward method, e.g.
    ("Linear.forward", ".../linear.py", 124)."""
    return _class_forward(type(module))


@functools.lru_cache(maxsize=4096)
def _class_forward(kind: type) -> tuple:
    """_forward_of by class: looked up once per class, not unwrapped again at
    every module call."""
    name = f"{kind.__name__}.forward"
    forward = getattr(kind, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return (name, code.co_filename, code.co_firstlineno) if code is not None else (name,)
