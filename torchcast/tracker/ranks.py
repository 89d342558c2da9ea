"""track(nonfinite=...) across torch.distributed ranks (DDP, FSDP2, torchrun).

Three parts, all on torch.distributed itself (no transport of our own):

1. **The rank.** Every NonFiniteOrigin records ``rank`` (the process's rank
   in the default group, None outside one): origin.py's ``current_rank``.

2. **Arrived through a collective.** A NaN/inf made on one rank reaches the
   others through the collectives (DDP's gradient all-reduce, FSDP2's
   reduce-scatter and all-gather). Those run through the dispatcher as c10d
   ops, whichever the backend (gloo and NCCL alike): DDP's reducer calls
   ``c10d::allreduce_`` (and ``c10d::broadcast_`` for buffers), FSDP2
   ``c10d::_reduce_scatter_base_`` and ``c10d::_allgather_base_`` (torch
   2.13, seen with a dispatch mode in a 2-rank gloo run). The first
   track(nonfinite=...) of a process registers a Python kernel for these
   ops on the AutogradCPU and AutogradCUDA keys (c10d registers none there),
   which runs the op below autograd as before and, while a track watches,
   notes for each call whether this rank's input held NaN/inf (a read of
   the input, as the watch reads every op's output), and keeps the call's
   output and Work. The op itself is run ``unwatched``: its output is
   written asynchronously by the backend, so the watch's own check of it
   would read a half-written buffer.

   The outputs are read once the Work completed: at the end of the
   backward that issued them (a callback queued on the autograd engine,
   after DDP's and FSDP2's own, which wait for their Works), and at the
   track's exit. An output holding NaN/inf while this rank's input was
   finite is recorded as an origin with ``arrived_through`` set (e.g.
   "all_reduce"): a propagation, which the reports put after the origins
   made on a rank. Where the ranks whose input was non-finite are known,
   ``from_ranks`` lists them.

   Which ranks: every rank numbers the collectives of each process group
   in the order it issues them (c10d requires the same order on every
   rank), and keeps the numbers of those whose local input was non-finite.
   ``merge_ranks`` gathers these lists with the reports at the end and
   fills ``from_ranks`` of each arrival from them. No extra collective
   is made while the program runs (an all-reduce of a flag after each
   non-finite output would be safe only where every rank's output is the
   same, which is not so for a reduce-scatter's shards), so nothing here
   can desynchronize or hang the program's collectives.

   Not covered: the functional collectives (``_c10d_functional::*``, whose
   results are read at ``wait_tensor``: DTensor redistribution, tensor
   parallelism), point-to-point ops, ``gather``/``scatter``/``reduce``, and
   collectives run under inference mode (no autograd key: the kernel is not
   reached). An all-gather output freed before the check (FSDP2 reshards
   after forward) is not read.

3. **One report.** ``Report.merge_ranks`` gathers every rank's report's
   dict form with one ``gather_object`` (or ``all_gather_object``), with
   the ids of the collectives it sent NaN/inf into (``finish`` leaves them
   on the report), and merges the dicts section by section
   (report_dict.merge_ranks_dicts): every rank's casts (merged by site),
   origins (with their rank; ordered by step, then made on a rank before
   arrived through a collective, then by rank and time) and rows (the
   module labelled "[rank N] path").

Overhead: nothing per op; per collective, a Python call and a read of its
input and, once, of its output; one gather at the end.
"""
import os
import sys
import threading
import warnings
from typing import Any, Dict, List, Optional

import torch

from .. import _ops
from .modules import current_module, module_of_node
from .nonfinite_origin import NonFiniteError, NonFiniteWarning, floating_data
from .origin import InputInfo, NonFiniteOrigin, current_rank
from .own import unwatched
from .sites import user_site

# c10d op -> (the collective's name, output argument, input argument (None:
# the op works in place: its input is its output), process group argument).
COLLECTIVES = {
    "allreduce_": ("all_reduce", 0, None, 1),
    "allreduce_coalesced_": ("all_reduce_coalesced", 0, None, 1),
    "broadcast_": ("broadcast", 0, None, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 0, 1, 2),
    "reduce_scatter_": ("reduce_scatter", 0, 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 0, 1, 2),
    "_allgather_base_": ("all_gather", 0, 1, 2),
    "allgather_": ("all_gather", 0, 1, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 1, 2),
}
_KEYS = ("AutogradCPU", "AutogradCUDA")
_MAX_PENDING = 4096  # collectives kept unread at most (a program that never ends a backward)
_MAX_BAD = 100_000  # numbers of collectives with a non-finite local input kept at most

_lock = threading.Lock()
_active: List["RankWatch"] = []
_library = None
_counters: Dict[str, int] = {}  # process group name -> collectives issued


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _readable(t: torch.Tensor) -> bool:
    """Whether ``t`` is floating and its storage still holds its elements
    (FSDP2 frees an all-gather's buffer by resizing its storage to 0)."""
    if not floating_data(t) or t.layout != torch.strided:
        return False
    try:
        needed = (t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) \
            * t.element_size()
        return t.untyped_storage().nbytes() >= needed
    except Exception:
        return False


def _read_inputs(tensors: List[torch.Tensor]):
    """Whether any of a collective's local inputs holds NaN/inf (a bool for
    CPU tensors, else a bool tensor on the device: no sync), and (dtype,
    shape, amax) of the first four, which an arrival's description shows:
    a CPU tensor read once, in C++."""
    bad, flags, described = False, [], []
    for t in tensors:
        if not _readable(t):
            continue
        if t.device.type == "cpu":
            amax = _ops.all_finite_amax(t)
            bad = bad or amax is None
        else:
            flags.append(~torch.isfinite(_ops.readable(t.detach())).all())
            amax = t.detach().abs().amax() if t.numel() else None
        if len(described) < 4:
            described.append((t.dtype, tuple(t.shape), amax))
    if flags and not bad:
        bad = torch.stack([f.to(flags[0].device) for f in flags]).any()
    return bad, described



def _group_name(pg: Any) -> str:
    try:
        pg = torch._C._distributed_c10d.ProcessGroup.unbox(pg)
        return pg.group_name
    except Exception:
        return "?"


def _kernel(op, name: str):
    label, out_at, in_at, pg_at = COLLECTIVES[name]

    def kernel(*args, **kwargs):
        watches = _active
        if not watches:
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args, **kwargs)
        outs = _tensors(args[out_at])
        ins = outs if in_at is None else _tensors(args[in_at])
        # What arrives in the outputs is this module's to judge (arrivals),
        # not NaN/inf entering the ops that read them, the collective's own
        # copies into them included.
        for watch in watches:
            watch.watch.account_for(outs)
        with unwatched():
            bad, amax = _read_inputs(ins)
            with torch._C._AutoDispatchBelowAutograd():
                result = op(*args, **kwargs)
        work = result[-1] if isinstance(result, tuple) else result
        group = _group_name(args[pg_at])
        with _lock:
            seq = _counters[group] = _counters.get(group, 0) + 1
        call = _Call(label, f"c10d::{name}", outs, bad, amax, work, f"{group}#{seq}",
                     sys._getframe(1))
        for watch in list(watches):
            watch.issued(call)
        return result

    return kernel


def install() -> None:
    """Registers the kernels of the c10d collectives (once per process;
    never removed: another thread may be dispatching through them)."""
    global _library
    with _lock:
        if _library is not None or not torch.distributed.is_available():
            return
        try:
            library = torch.library.Library("c10d", "IMPL")
        except Exception:  # no c10d in this build
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in COLLECTIVES:
                op = getattr(getattr(torch.ops.c10d, name, None), "default", None)
                if op is None:
                    continue
                for key in _KEYS:
                    library.impl(name, _kernel(op, name), key)
        _library = library


class _Call:
    """A collective issued while a track watched."""

    __slots__ = ("label", "op", "outs", "bad", "amax", "work", "id", "where", "raw")

    def __init__(self, label, op, outs, bad, amax, work, id_, frame):
        self.label, self.op, self.outs, self.bad, self.amax = label, op, outs, bad, amax
        self.work, self.id = work, id_
        node = torch._C._current_autograd_node()
        site = user_site(frame, skip_own=True)
        if node is not None:
            self.where = (module_of_node(node), "backward", node.name(), site)
        else:
            self.where = (current_module(), "forward", None, site)
        self.raw = None

    def completed(self, wait: bool) -> bool:
        try:
            work = torch._C._distributed_c10d.Work.unbox(self.work)
            if wait:
                work.wait()
                return True
            return work.is_completed()
        except Exception:  # a failed collective: its output says nothing
            return False


class RankWatch:
    """The collectives of one track(nonfinite=...): which held NaN/inf
    only once they arrived (origins with ``arrived_through``), and which
    were sent non-finite from here (``bad_inputs``)."""

    def __init__(self, watch):
        self.watch = watch  # the track's NonFiniteWatch
        self.pending: List[_Call] = []
        self.bad_inputs: List[str] = []  # ids of collectives whose local input was non-finite
        self.lock = threading.Lock()
        self.queued_task = None

    def issued(self, call: _Call) -> None:
        steps = _steps(self.watch)
        call.raw = (getattr(steps, "opt_done", 0), getattr(steps, "calls_done", 0))
        with self.lock:
            self.pending.append(call)
            full = len(self.pending) > _MAX_PENDING
        if full:
            self.settle(wait=False, raising=False)
        if torch._C._current_autograd_node() is not None:
            task = torch._C._current_graph_task_id()
            if task != self.queued_task:
                self.queued_task = task
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                except RuntimeError:  # not inside the engine after all
                    pass

    def _backward_done(self) -> None:
        # DDP and FSDP2 have waited for their collectives' futures by now, but
        # gloo marks a Work completed only after its future: wait() closes
        # the gap. A collective issued here is issued on every rank in the
        # same order (c10d's rule), so waiting for it needs nothing more of
        # this rank: it cannot deadlock.
        self.queued_task = None
        self.settle(wait=True, raising=True)

    def settle(self, wait: bool, raising: bool = True) -> None:
        """Reads the outputs of the collectives whose Works completed (with
        ``wait``: waits for each first); records the arrivals."""
        with self.lock:
            calls, self.pending = self.pending, []
        keep, arrivals = [], []
        with unwatched():
            for call in calls:
                if not call.completed(wait):
                    if not wait:
                        keep.append(call)
                    continue
                bad = call.bad if isinstance(call.bad, bool) else bool(call.bad)
                if bad:
                    if len(self.bad_inputs) < _MAX_BAD:
                        self.bad_inputs.append(call.id)
                    continue
                outs = [t for t in call.outs if _readable(t)]
                out = next((t for t in outs if not _ops.finite(t)), None)
                if out is not None:
                    arrivals.append(self._arrival(call, out))
        if keep:
            with self.lock:
                self.pending[:0] = keep
        for origin, call in arrivals:
            self._record(origin, call, raising)

    def _arrival(self, call: _Call, out: torch.Tensor):
        module, phase, node, site = call.where
        values = _ops.readable(out.detach())
        inputs = [InputInfo(dtype, shape, float(amax) if amax is not None else 0.0)
                  for dtype, shape, amax in call.amax]
        origin = NonFiniteOrigin(
            op=call.op, module=module, phase=phase, node=node, file=site.file, line=site.line,
            via=site.via, dtype=out.dtype, nan=int(torch.isnan(values).sum()),
            posinf=int(torch.isposinf(values).sum()), neginf=int(torch.isneginf(values).sum()),
            inputs=inputs, note="", rank=current_rank(), arrived_through=call.label,
            collective=call.id, time=__import__("time").monotonic())
        return origin, call

    def _record(self, origin: NonFiniteOrigin, call: _Call, raising: bool) -> None:
        watch = self.watch
        module, phase = call.where[0], call.where[1]
        with watch.lock:
            known = watch.origins.get(origin.key)
            if known is not None:
                known.count += 1
                origin = known
            else:
                watch.origins[origin.key] = origin
            # The step it arrived in is the step the collective was issued in.
            steps = _steps(watch)
            raw = getattr(steps, "raw", None)
            if isinstance(raw, dict) and call.raw is not None and getattr(steps, "started", False):
                raw.setdefault(origin.key, [call.raw, None])
            occurred = getattr(steps, "occurred", None) or getattr(steps, "_occurred", None)
            if occurred is not None:
                try:
                    occurred(origin, module, phase)
                except Exception:  # the watch's bookkeeping changed shape: no step then
                    pass
        if known is not None:
            return
        action = watch.action
        if action == "raise" and raising:
            raise NonFiniteError(origin, "Raised at the end of the backward that received it.")
        if action == "warn":
            warnings.warn_explicit(origin.describe(), NonFiniteWarning, origin.file,
                                   origin.line or 1)


def _steps(watch):
    """What counts the watch's steps: its reach.StepTracker (``watch.steps``),
    or the watch itself where it does (before reach.py)."""
    return getattr(watch, "steps", watch)


def start(watch) -> Optional[RankWatch]:
    """At a track(nonfinite=...)'s entry: installs the collectives' kernels
    and watches them for ``watch`` (None where torch.distributed is absent)."""
    if not torch.distributed.is_available():
        return None
    install()
    ranks = RankWatch(watch)
    with _lock:
        _active.append(ranks)
    return ranks


def finish(ranks: Optional[RankWatch], report: Any, failed: bool) -> Optional[NonFiniteError]:
    """At the track's exit, before its watch finishes: reads the collectives
    still unread (waiting for them unless the block ``failed``), stops
    watching, and leaves on ``report`` the ids of the collectives this rank
    sent non-finite (``merge_ranks`` reads them).

    Returns:
        Under "raise", the error for an arrival found now (the track raises
        it once it is cleaned up), else None.
    """
    if ranks is None:
        return None
    with _lock:
        if ranks in _active:
            _active.remove(ranks)
    try:
        ranks.settle(wait=not failed, raising=not failed)
    except NonFiniteError as error:
        return error
    finally:
        report.sent_nonfinite = list(ranks.bad_inputs)
    return None


# -- the CLI under torchrun -------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Whether this process is one rank of several (RANK and WORLD_SIZE set)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def per_rank_path(path: str, rank: int) -> str:
    """"report.json" -> "report.rank1.json"."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"
