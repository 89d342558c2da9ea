"""track(nonfinite=...): the ops that first make NaN or ±inf.

The dispatch mode (mode.py) hands every aten op a watched track runs, forward
and backward, casts included, to ``NonFiniteWatch.after_op``. An op whose
floating output holds NaN or ±inf while every floating input (and every
Python float argument) was finite is an *origin*; one whose inputs already
held NaN/inf only propagates them, and is counted, not reported.

On the CPU each op is checked as it returns (``_ops.all_finite``: a read of
the output; the inputs are read only when the output is non-finite, or
before an in-place op). On other devices the check must not synchronize per
op: each op leaves two flags on its device, with what is needed to describe
it, and the flags are read once per ``PENDING_LIMIT`` ops and at the block's
exit (under "raise_at_op", once per op: raising at the op needs its answer).

NaN/inf that no watched op made (the data, a worker's batch, a checkpoint,
a literal) are found where they enter (entries.py): the first watched op
whose non-finite output came from a non-finite tensor no watched op wrote
(a non-finite Python number is the program's own, passed on purpose: a
propagation). An entry is recorded as an origin is, with ``entered``
saying which argument brought them in.

An origin names the op, the module (for backward, the module whose forward
made the autograd node), the phase, the user's line and the library frame,
the output's NaN/+inf/-inf counts, each floating input's dtype, shape and
amax, and what the op gives when run again in a wider dtype: whether the
narrow dtype's range was the problem.

On CPU programs under "record" and "warn" the C++ watch
(csrc/cpu/nonfinite_watch.cpp) checks each op instead of the dispatch mode;
its glue is at the end of this module, with ``unwatched``, the switch that
keeps the tracker's own reads unchecked in both.

Each origin also gets its step, and whether its NaN/inf reached the
block's outputs, the loss or the gradients, or were absorbed: reach.py
decides that, at the grain of the block's steps, through the
``StepTracker`` each watch owns (``NonFiniteWatch.steps``).
"""
import sys
import threading
import time
import warnings
import weakref
from types import FrameType
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten

from .. import _ops
from .._inputs import PLAIN_TENSOR_TYPES
from . import native
from .diagnose import op_name
from .entries import (KnownNonfinite, describe_entry, nonfinite_number,
                      nonfinite_scalar_tensor)
from .modules import current_module, module_of_node
from .own import unwatched
from .nonfinite_origin import NonFiniteError, NonFiniteWarning, floating_data, wider_note
from .op_args import any_nonfinite, bound, device_flag, input_infos, written
from .origin import NonFiniteOrigin
from .reach import StepTracker
from .sites import Site, user_site

ACTIONS = ("raise", "raise_at_op", "record", "warn")
PENDING_LIMIT = 256
_CAST_WITH_STATS = torch.ops.torchcast.cast_with_stats.default
# Ops not checked: those whose outputs are uninitialized memory (any bits,
# NaN among them) or relabel their input's memory, and those that only move,
# select or zero values (or fill in a Python number, which is an input): their
# outputs hold NaN/inf only if an input did, so they are never an origin.
_UNCHECKED = frozenset((
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
    "detach", "detach_", "alias", "lift_fresh", "_unsafe_view",
    "clone", "contiguous", "cat", "stack", "gather", "index_select", "select_backward",
    "slice_backward", "relu", "relu_", "threshold_backward", "bernoulli_", "zero_", "fill_",
    "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "masked_fill",
    "masked_fill_"))


_Tensor = torch.Tensor
_SKIP, _UNCHECKED_OP, _CHECK, _FIRST_OUTPUT = "skip", "unchecked", "check", "first output"
_op_kinds = {}  # id(op) -> one of the above: OpOverload's __hash__ is Python code


def _op_kind(func) -> str:
    """Which of an op's outputs after_op checks (_UNCHECKED_OP: none, unless
    the op was given a non-finite Python number: masked_fill(m, -inf))."""
    namespace = getattr(func, "namespace", None)
    if namespace in ("torchcast", "torchcast_track"):
        # torchcast's ops: only safe_to's cast result, not its stats nor the
        # tracker's own measures.
        return _FIRST_OUTPUT if func is _CAST_WITH_STATS else _SKIP
    if getattr(func, "is_view", False):
        return _SKIP
    return _UNCHECKED_OP if op_name(func) in _UNCHECKED else _CHECK


class NonFiniteWatch:
    """The non-finite origins and entries of one track (``nonfinite=``
    "raise", "raise_at_op", "record" or "warn"), in the order they happened, with
    their steps and whether their NaN/inf reached (start() to finish():
    ``steps``, a reach.StepTracker, decides those)."""

    def __init__(self, action: str):
        self.action = action
        self.origins: Dict[tuple, NonFiniteOrigin] = {}
        self.propagated = 0
        # The dispatch mode's route (the C++ watch keeps its own): the storages
        # watched ops wrote NaN/inf into, and those whose NaN/inf are
        # accounted for elsewhere (account_for).
        self.known, self.accounted = KnownNonfinite(), KnownNonfinite()
        self.lock = threading.Lock()
        self.pending: List[tuple] = []  # non-CPU ops awaiting their flags' reading
        self.warned = set()
        # Set in a process forked inside the track (forked()).
        self.worker_id: Optional[Callable[[], int]] = None
        self.on_origin: Optional[Callable[[], None]] = None
        self.report = None  # the report its origins are written into (start())
        # Steps and reach, from start() to finish() in the thread that
        # entered the track (reach.py).
        self.steps = StepTracker(self, unwatched)

    def forked(self, worker_id: Callable[[], int], on_origin: Callable[[], None]) -> None:
        """In a process forked inside the track (a DataLoader worker):
        forgets the origins and counts it inherited, which are the parent's
        to report; labels each origin it finds from now on with
        ``worker_id()``, and calls ``on_origin()`` after each new one is
        stored, before it is raised: the parent reads a worker's origins
        when its track exits, and under "raise_at_op" that is as soon as the
        worker's error reaches it, while the worker still runs.

        Args:
            worker_id: gives this process's worker id.
            on_origin: hands this process's origins to the parent.
        """
        self.lock = threading.Lock()  # another thread may have held it at the fork
        self.origins, self.propagated, self.pending = {}, 0, []
        self.steps.forked()
        native.take_propagated()  # the C++ watch's count not yet taken is the parent's
        self.worker_id, self.on_origin = worker_id, on_origin

    # -- per op -------------------------------------------------------------------
    def after_op(self, func, args: tuple, kwargs: dict, out: Any,
                 inputs_bad: Union[None, bool, torch.Tensor], frame: Optional[FrameType],
                 before: Optional[Dict[str, Any]] = None) -> None:
        """Checks one op's outputs; records (or raises for) an origin or an
        entry.

        Args:
            func: the op (an OpOverload).
            args, kwargs: its arguments.
            out: what it returned.
            inputs_bad: ``inputs_nonfinite`` before an in-place op ran, else None.
            frame: the frame the dispatch mode was called from.
            before: ``written_before`` before an in-place op ran, else None.
        """
        kind = _op_kinds.get(id(func))
        if kind is None:
            kind = _op_kinds[id(func)] = _op_kind(func)
        if kind is _UNCHECKED_OP:
            values = tree_flatten((args, kwargs))[0]
            read = [v for argument, v in bound(func, args, kwargs) if not written(argument)]
            if any(nonfinite_scalar_tensor(v) and not self.known.contains(v)
                   and not self.accounted.contains(v) for v in read):
                kind = _CHECK  # scores[0] = -inf: where they enter
            elif any(map(nonfinite_number, values)):
                self.known.mark(tree_flatten(out)[0])  # placed by the program, on purpose
                return
        if kind is _SKIP or kind is _UNCHECKED_OP:
            if self.known and self.known.any_of(tree_flatten((args, kwargs))[0]):
                # Not read; but what it made of NaN/inf a watched op wrote is known.
                self.known.mark(tree_flatten(out)[0])
            return
        if kind is _FIRST_OUTPUT:  # safe_to's cast: its result, not its stats (inf for an overflow)
            out = out[0]
        if type(out) is _Tensor:  # most ops: no pytree walk
            outs = [out] if floating_data(out) else []
        elif out is None:
            # An op that returns nothing (_foreach_mul_, an out= op such as
            # FSDP's split_with_sizes_copy): what it wrote to is its output.
            outs = [t for argument, value in bound(func, args, kwargs)
                    if argument.is_out or argument.name in (before or ())
                    for t in (value if isinstance(value, (list, tuple)) else [value])
                    if isinstance(t, torch.Tensor) and floating_data(t)]
        else:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and floating_data(t)]
        if not outs:
            return
        device = outs[0].device
        if checked_at_once(device):
            if not any(not _ops.all_finite(t) for t in outs):
                return
            if inputs_bad is None:
                inputs_bad = any_nonfinite(tree_flatten((args, kwargs))[0])
            self._nonfinite_output(func, args, kwargs, outs, bool(inputs_bad), frame,
                                   _where(frame), before)
            return
        out_bad = device_flag(outs, device)
        in_bad = (device_flag(tree_flatten((args, kwargs))[0], device) if inputs_bad is None
                  else torch.as_tensor(inputs_bad).to(device))
        entry = (func, args, kwargs, outs, _where(frame), torch.stack([out_bad, in_bad]), before)
        if self.action == "raise_at_op":
            self._settle([entry])
            return
        with self.lock:
            self.pending.append(entry)
            full = len(self.pending) >= PENDING_LIMIT
        if full:
            self.flush()

    def flush(self) -> None:
        """Reads the flags of the ops awaiting them (one sync per device),
        and the C++ watch's count of propagations."""
        if self in getattr(_cpp, "watches", ()):
            _take_propagated()
        with self.lock:
            pending, self.pending = self.pending, []
        if pending:
            self._settle(pending)

    def _settle(self, entries):
        flags = torch.stack([e[5].cpu() for e in entries]).tolist()
        for (func, args, kwargs, outs, where, _, before), (out_bad, in_bad) in zip(entries, flags):
            if out_bad:
                self._nonfinite_output(func, args, kwargs, outs, bool(in_bad), None, where,
                                       before)

    def _nonfinite_output(self, func, args, kwargs, outs, inputs_bad, frame, where, before):
        """An op whose output holds NaN/inf: an origin (finite inputs), an
        entry (an input held NaN/inf no watched op made), or a propagation."""
        entered = None
        if inputs_bad:
            entered, passed_on = self._entered(func, args, kwargs, before or {}, outs)
            if not (entered or passed_on):
                return  # only an input it returned as it is (a no-op .to()): as a view is
        self.known.mark(outs)
        if before:  # what it wrote into its inputs (a batch norm's running statistics) is its own
            given = dict((argument.name, value) for argument, value in bound(func, args, kwargs))
            self.known.mark(t for name in before for t in tree_flatten(given.get(name))[0]
                            if isinstance(t, torch.Tensor) and floating_data(t)
                            and not _ops.finite(t))
        if entered:  # found where they entered: their next readers only pass them on
            given = list(bound(func, args, kwargs))
            self.known.mark(tree_flatten([given[i][1] for i in entered])[0])
        if inputs_bad and not entered:
            with self.lock:
                self.propagated += 1
            return
        self._found(func, args, kwargs, outs, frame, where, before, entered)

    def _entered(self, func, args: tuple, kwargs: dict, before: Dict[str, Any],
                 outs: List[torch.Tensor]) -> Tuple[List[int], bool]:
        """Where the NaN/inf an op received came from: the indices, in its
        schema, of the inputs that held NaN/inf no watched op made, and
        whether others passed on NaN/inf a watched op made (or a Python
        number the program gave). An input the op writes to is of the
        latter: what it held may be stale or uninitialized memory the op
        overwrites (copy_'s self, a reused buffer; named in ``before``). One
        it returns (``outs``) is neither: it may return it as it is (a
        no-op .to()), or write to it undeclared (FSDP's all_gather_copy_in).
        """
        returned = {id(t.untyped_storage()) for t in outs}
        if any(self.accounted.contains(t) for t in outs):
            # Written into storage whose NaN/inf are accounted for: a
            # collective's own copy into its output, what arrives there.
            return [], True
        entered, passed_on = [], False
        for i, (argument, value) in enumerate(bound(func, args, kwargs)):
            if argument.is_out:
                continue
            tensors = value if isinstance(value, (list, tuple)) else [value]
            if argument.name in before or any(nonfinite_number(t) for t in tensors):
                passed_on = passed_on or any(
                    nonfinite_number(t) for t in tensors) or any(
                    amax is not None and not bool(torch.isfinite(torch.as_tensor(amax)).all())
                    for amax in before.get(argument.name, ()))
                continue
            bad = [t for t in tensors if isinstance(t, torch.Tensor) and floating_data(t)
                   and not _ops.finite(t)]
            unknown = [t for t in bad if not self.known.contains(t)
                       and not self.accounted.contains(t)]
            passed_on = passed_on or len(unknown) < len(bad)
            if any(id(t.untyped_storage()) not in returned for t in unknown):
                entered.append(i)
        return entered, passed_on

    def account_for(self, tensors: Iterable[Any]) -> None:
        """Takes NaN/inf in ``tensors`` as accounted for, not as entering
        where they are read next: what an optimizer's step wrote (from
        gradients the watch saw, or by ops it saw; a step on DTensors runs
        ops on their shards that no watch sees)."""
        plain = [t for t in tensors if isinstance(t, torch.Tensor) and floating_data(t)]
        self.accounted.mark(plain)
        for t in plain:
            native.account_for_nonfinite(t)

    # -- an origin ----------------------------------------------------------------
    def _found(self, func, args, kwargs, outs, frame, where, before=None, entered=None):
        when = time.monotonic()
        module, phase, node, site = where
        out = next(t for t in outs if not _ops.torch_all_finite(t))
        values = _ops.readable(out)
        inputs = input_infos(func, args, kwargs, before or {})
        with torch.no_grad():
            nan, posinf, neginf = (int(torch.isnan(values).sum()),
                                   int(torch.isposinf(values).sum()),
                                   int(torch.isneginf(values).sum()))
        forward = self.steps.forward(module) if phase == "backward" else None
        if entered:
            given = list(bound(func, args, kwargs))
            entered_text = describe_entry([given[i][0].name for i in entered],
                                          [given[i][1] for i in entered], self.steps.roots_now())
            note = ""
        else:
            entered_text = None
            note = wider_note(func, args, kwargs, out, any(i.overwritten for i in inputs))
        origin = NonFiniteOrigin(
            op=f"{func.namespace}::{op_name(func)}", module=module, phase=phase, node=node,
            file=site.file, line=site.line, via=site.via, dtype=out.dtype, nan=nan,
            posinf=posinf, neginf=neginf, inputs=inputs, note=note, entered=entered_text,
            worker=self.worker_id() if self.worker_id is not None else None, time=when,
            **dict(zip(("forward", "forward_file", "forward_line"), forward or ())))
        with self.lock:
            known = self.origins.get(origin.key)
            if known is not None:
                known.count += 1
                self.steps.occurred(known, module, phase)
                return
            self.origins[origin.key] = origin
            self.steps.occurred(origin, module, phase)
        if self.on_origin is not None:
            self.on_origin()
        if self.action == "raise_at_op":
            raise NonFiniteError(origin, _RAISED_AT_THE_OP)
        if self.action == "warn" and origin.key not in self.warned:
            self.warned.add(origin.key)
            warnings.warn_explicit(origin.describe(), NonFiniteWarning, site.file, site.line or 1)

    # -- an optimizer's step: its writes checked where next read ------------------------
    def optimizer_step(self, optimizer: Any, before: bool, raw: tuple) -> None:
        """Before and after an optimizer's step (the outermost, in the track's
        thread; ``raw``: the step's raw number, reach.py): on the C++ watch,
        while no NaN/inf has been seen in the block, the writes of the step's
        ops are not read as they write, but where an op next reads them and
        makes NaN/inf from them, or when the watch ends (``found_deferred``):
        a healthy step's parameters and states, most of its memory traffic,
        are not read at all. With NaN/inf about, each op is read as any
        other: the step may pass them on, and only its inputs tell."""
        if self not in getattr(_cpp, "watches", ()) or _cpp.watches[0] is not self:
            return
        if not before:
            native.defer_writes(False)
            return
        with self.lock:
            healthy = not self.origins
        if not healthy or native.nonfinite_seen():
            # NaN/inf about (arrived, entered, made): the step may pass them
            # on, and only reading its inputs tells its own from those.
            return
        batch = native.defer_writes(True)
        _batches[batch] = (raw, user_site(sys._getframe(1), skip_own=True),
                           type(optimizer).__name__, weakref.ref(optimizer))
        while len(_batches) > _BATCHES_KEPT:
            # A later step rewrote what this one wrote (the same parameters).
            del _batches[next(iter(_batches))]

    def found_deferred(self, func, out: torch.Tensor, batch: int) -> None:
        """An op of optimizer step ``batch`` wrote NaN/inf into ``out`` (seen
        where it was next read, or at the end): an origin of that step, its
        inputs not read; its NaN/inf reached what the step wrote."""
        # A step long before (not rewritten since) is known by its op alone.
        raw, site, name, optimizer = _batches.get(batch) or (
            None, Site("<an optimizer step more than 64 steps before>", 0, None), "an optimizer",
            lambda: None)
        optimizer = optimizer()
        params = () if optimizer is None else {
            id(p.untyped_storage()) for group in optimizer.param_groups for p in group["params"]
            if type(p) in PLAIN_TENSOR_TYPES}
        values = _ops.readable(out)
        origin = NonFiniteOrigin(
            op=f"{func.namespace}::{op_name(func)}", module=None, phase="forward", node=None,
            file=site.file, line=site.line, via=site.via, dtype=out.dtype,
            nan=int(torch.isnan(values).sum()), posinf=int(torch.isposinf(values).sum()),
            neginf=int(torch.isneginf(values).sum()), inputs=[], note=_DEFERRED_NOTE,
            worker=self.worker_id() if self.worker_id is not None else None,
            time=time.monotonic())
        # (out may be a view of what the step wrote: a Linear's weight, transposed)
        where = f"the parameters {name}.step() wrote" if id(out.untyped_storage()) in params \
            else f"the state {name}.step() keeps"
        with self.lock:
            known = self.origins.get(origin.key)
            if known is not None:
                known.count += 1
                return
            self.origins[origin.key] = origin
        self.steps.reached_in_step(origin, raw, where)
        if self.action == "warn" and origin.key not in self.warned:
            self.warned.add(origin.key)
            warnings.warn_explicit(origin.describe(), NonFiniteWarning, site.file, site.line or 1)

    # -- the track's entry and exit -----------------------------------------------------
    def start(self, report: Any) -> None:
        """Starts counting steps and deciding reach, in the calling thread
        (the track's entry), and writing the origins into ``report``'s
        non-finite section; ``finish`` ends it."""
        self.report = report
        report.set_origins([], 0)
        report.attach(self.refresh)
        self.steps.start()

    def refresh(self) -> None:
        """Writes the origins found so far (and the count of propagations)
        into the report, once the flags still pending are read."""
        self.flush()
        with self.lock:
            origins, propagated = list(self.origins.values()), self.propagated
        self.report.set_origins(origins, propagated)

    def finish(self, failed: bool = False) -> Optional[NonFiniteError]:
        """At the track's exit: reads the flags still pending, ends the last
        step (unless the block ``failed``: left by an exception, its step did
        not end, and its origins stay undecided), and gives each origin its
        step as the whole block counts it.

        Args:
            failed: whether the block is left by an exception.

        Returns:
            Under "raise", the error for an origin found to reach at
            the exit (the track raises it once it is cleaned up), else None.
        """
        try:
            if self in getattr(_cpp, "watches", ()):
                native.check_deferred()
            self.flush()
            return self.steps.end_block(failed)
        finally:
            self.steps.stop()
            self.report.detach(self.refresh)
            self.refresh()


# The optimizer steps whose writes the C++ watch checks where they are next
# read: batch -> (raw step, the user's site of step(), the optimizer's class
# name, a weak reference to it).
_batches: Dict[int, tuple] = {}
_BATCHES_KEPT = 64

_DEFERRED_NOTE = (
    "Found where what it wrote was next read (or at the track's end): an optimizer step's "
    "writes are not read as it writes them, so its inputs were not read.")

_RAISED_AT_THE_OP = (
    "Raised at the op (nonfinite=\"raise_at_op\"), before the program used its result: whether "
    "its NaN/inf would reach the outputs, the loss or the gradients is not known yet "
    "(nonfinite=\"raise\" stops only where they do).")


# -- the C++ watch: CPU programs, "record" and "warn" -----------------------------
# csrc/cpu/nonfinite_watch.cpp checks every op the dispatcher runs, at a
# fraction of the dispatch mode's cost per op, and calls _on_origin at each
# origin. An exception cannot leave it, so "raise_at_op" takes the dispatch mode;
# so does a program that uses CUDA (the mode keeps the flags on the device).

_cpp = threading.local()  # .watches: this thread's NonFiniteWatches the C++ watch serves


def checked_in_cpp(action: str) -> bool:
    """Whether a track(nonfinite=action) entered now is served by the C++ watch
    ("raise" raises from the step's checks, outside any op: it is)."""
    return (native.start_nonfinite_watch is not None and action != "raise_at_op"
            and not torch.cuda.is_initialized())


def start_cpp(watch: "NonFiniteWatch") -> None:
    """Has the C++ watch of this thread report to ``watch`` until ``stop_cpp``."""
    watches = getattr(_cpp, "watches", None)
    if watches:
        _take_propagated()
        watches.append(watch)
        return
    _cpp.watches = [watch]
    native.take_propagated()
    native.start_nonfinite_watch(_on_origin, sorted(f"aten::{name}" for name in _UNCHECKED))


def stop_cpp(watch: "NonFiniteWatch") -> None:
    """Undoes ``start_cpp(watch)``; the last one stops the C++ watch."""
    _take_propagated()
    _cpp.watches.remove(watch)
    if not _cpp.watches:
        native.stop_nonfinite_watch()


def _take_propagated():
    n = native.take_propagated()
    for watch in _cpp.watches:
        with watch.lock:
            watch.propagated += n


def _on_origin(name: str, overload: str, outputs: list, inputs: list, before: list,
               entered: Optional[List[int]], batch: Optional[int]) -> None:
    """The C++ watch's callback at an origin or entry: the op, its outputs,
    its inputs in schema order, per input the amax (or list of them) of an
    input the op wrote to, read before it did (None for the others), for an
    entry the indices of the inputs that brought NaN/inf in, and for an op
    of an optimizer's step whose write was checked later, its batch."""
    namespace, op = name.split("::", 1)
    func = getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
    if batch is not None:
        for watch in list(_cpp.watches):
            watch.found_deferred(func, outputs[0], batch)
        return
    args, kwargs, written = [], {}, {}
    for argument, value, prior in zip(func._schema.arguments, inputs,
                                      before or [None] * len(inputs)):
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
        if prior is not None:
            written[argument.name] = prior if isinstance(prior, list) else [prior]
    if func is _CAST_WITH_STATS:
        outputs = outputs[:1]
    outs = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and floating_data(t)]
    where = _where(sys._getframe(1))
    for watch in list(_cpp.watches):
        watch._found(func, tuple(args), kwargs, outs, None, where, written, entered)


def checked_at_once(device: torch.device) -> bool:
    """Whether an op's result on ``device`` is read as the op returns (the
    CPU) rather than from flags read later."""
    return device.type == "cpu"


def _where(frame: Optional[FrameType]):
    """(module, phase, autograd node name, Site) of the op running now."""
    node = torch._C._current_autograd_node()
    site = user_site(frame, skip_own=True)
    if node is not None:
        return module_of_node(node), "backward", node.name(), site
    return current_module(), "forward", None, site


def check_action(nonfinite: Optional[str]) -> Optional[str]:
    """``nonfinite`` as track() takes it: None or one of ACTIONS."""
    if nonfinite is not None and nonfinite not in ACTIONS:
        raise ValueError(f"torchcast.track: nonfinite must be None or one of {ACTIONS}, "
                         f"got {nonfinite!r}")
    return nonfinite
