"""track(health=True): per module, the numeric health of its forward outputs
and of the gradients flowing into it in backward, merged over calls, written
into the report's health section as rows (health_rows.py: what they say of
headroom).

Forward: a listener on the tracker's module hooks (modules.py) measures each
floating output with ``torchcast.tensor_health``; backward: a hook on each
output that requires grad measures the gradient that reaches it (the
gradient flowing into the module from what used its output). The measures
stay tensors on the device, merged per (module, phase, dtype), until read.

Whose rows: a watch hears the module calls of the thread that started it
(of every thread without a watch of its own: modules.add_output_listener),
and a row is one module object, not a name: two models of one class, or
two threads' models, never share a row. Names are given when rows are
read, from the path each module had at its first call (see ``_names``).
"""
import collections
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from .._inputs import PLAIN_TENSOR_TYPES, dense_strided
from ..health import TensorHealth, tensor_health
from ..stats import CastStats
from .block_headroom import BlockEntries, BlockHeadroomRow, block_stats, element_dtype
from .health_rows import ModuleHealth, severity
from .modules import ModuleCall, add_output_listener, remove_output_listener
from .own import unwatched

PHASES = ("forward", "backward")
# The histograms an entry keeps unmerged at most (float32's is 28 KiB).
_PENDING_BYTES = 256 << 10


class HealthWatch:
    """The module health of one track(health=True).

    Each measure is kept as it is, appended to its entry's list, and the list
    merged (``TensorHealth.merged``: a few ops for any number) when it is read
    or when it holds _PENDING_BYTES of histograms: merging at every module
    call cost five ops per call. A measure can be in several lists (a
    container returning its last child's output shares the child's); none
    is changed, merging makes new tensors."""

    def __init__(self, block_formats: Tuple[str, ...] = ()):
        # (module, phase, dtype) -> measures; the module is a _Module while
        # recording, a name (str or None) in a watch read back or fed by name.
        self.entries: Dict[Tuple[Any, str, torch.dtype], List[TensorHealth]] = {}
        self._merged = set()  # the keys whose list is one TensorHealth of this watch's own
        self.lock = threading.RLock()
        self.active = False
        # (weakref to the tensor, its version, its measure, its gradient hook):
        # the output measured last.
        self._last = None
        self._modules: Dict[int, _Module] = {}  # id(module) -> its row key, while it lives
        # (root key, path below it) -> the keys made for it: where a module
        # made anew (a loss module built at each step) finds the key of the
        # one before it, gone by then.
        self._places: Dict[Tuple[Any, str], List[_Module]] = {}
        self._made = 0  # keys made: their order, which numbers roots sharing a class
        # The block formats each measured tensor is also cast to (block_headroom.py).
        self.block_formats = block_formats
        self.blocks = BlockEntries(block_formats) if block_formats else None
        self.report = None

    # -- a track's feature -------------------------------------------------------
    def start(self, report: Any) -> None:
        """Measures the module calls of this thread into ``report``'s health
        section until ``stop``."""
        self.report = report
        report.set_health([])
        report.add_block_rows(self.block_formats, [])
        report.attach(self.refresh)
        self.active = True
        add_output_listener(self.on_output)

    def refresh(self) -> None:
        """Writes the rows measured so far into the report."""
        self.report.set_health(self.rows())
        self.report.block_rows = self.block_rows()

    def stop(self, failed: bool = False) -> None:
        """Stops measuring; the report keeps the rows."""
        self.active = False
        remove_output_listener(self.on_output)
        self.report.detach(self.refresh)
        self.refresh()

    def _add(self, module, phase, dtype, measured):
        """Appends ``measured`` to the entry (module, phase, dtype)."""
        key = (module, phase, dtype)
        with self.lock:
            pending = self.entries.get(key)
            if pending is None:
                self.entries[key] = [measured]
                return
            pending.append(measured)
            if len(pending) * measured.hist.numel() * 8 >= _PENDING_BYTES:
                self._merge(key)

    def _merge(self, key):
        """Replaces the list of ``key`` by one TensorHealth (lock held)."""
        with unwatched():
            self.entries[key] = [TensorHealth.merged(self.entries[key])]
        self._merged.add(key)

    def _add_blocks(self, module, phase, dtype, blocks):
        if blocks is not None:
            with self.lock:
                self.blocks.add(module, phase, dtype, blocks)

    def _block_stats(self, t):
        return block_stats(t, self.blocks.formats) if self.blocks is not None else None

    def measure(self, modules: List[Any], phase: str, t: torch.Tensor) -> None:
        """Measures ``t`` once, for each of ``modules`` (row keys, or names:
        a str or None)."""
        with unwatched():
            measured = tensor_health(t.detach())
        blocks = self._block_stats(t)
        for module in modules:
            self._add(module, phase, t.dtype, measured)
            self._add_blocks(module, phase, t.dtype, blocks)

    def _key(self, call: ModuleCall) -> Optional["_Module"]:
        """The row key of the module ``call`` stands for (None: no module)."""
        owner = call.owner
        if owner is None:
            return None
        key = self._modules.get(id(owner))
        if key is not None and key.ref() is owner:
            return key
        return self._new_key(call)

    def _new_key(self, call):
        """A module's first call: its key, made from the place it was called."""
        owner = call.owner
        root_call = call
        while root_call.parent is not None:
            root_call = root_call.parent
        root = self._key(root_call) if root_call is not call else None
        place = (root, call.rel) if root is not None else (None, call.path)
        with self.lock:
            key = self._modules.get(id(owner))
            if key is not None and key.ref() is owner:
                return key  # another thread made it meanwhile
            same = self._places.setdefault(place, [])
            key = next((k for k in same if k.ref() is None), None)
            if key is None:
                # A module is its own root at its first call: root None.
                key = _Module(call.path, root, call.rel, self._made)
                self._made += 1
                same.append(key)
            else:
                # The module before it here is gone: this one continues its rows.
                if self._modules.get(key.id) is key:
                    del self._modules[key.id]
            key.ref, key.id = weakref.ref(owner), id(owner)
            self._modules[key.id] = key
            return key

    def on_output(self, call: ModuleCall, output: Any) -> None:
        """The module hooks' listener: measures each floating output, and
        hooks its gradient. A tensor that is also the output of the module
        just measured (a container returning its last child's output) is not
        measured again: its measure and its gradient hook are shared."""
        if not self.active:
            return
        module = self._key(call)
        for t in tree_flatten(output)[0]:
            if type(t) not in PLAIN_TENSOR_TYPES or not t.is_floating_point() or t.numel() == 0:
                continue
            if not dense_strided(t):
                _warn_not_measured(module, t)
                continue
            last = self._last
            if last is not None and last[0]() is t and last[1] == t._version:
                _, _, measured, blocks, hook = last
                self._add(module, "forward", t.dtype, measured)
                self._add_blocks(module, "forward", t.dtype, blocks)
                if hook is not None:
                    hook.modules.append(module)
                continue
            with unwatched():
                measured = tensor_health(t.detach())
            blocks = self._block_stats(t)
            self._add(module, "forward", t.dtype, measured)
            self._add_blocks(module, "forward", t.dtype, blocks)
            hook = None
            if t.requires_grad and torch.is_grad_enabled():
                hook = _GradHook(self, module)
                t.register_hook(hook)
            self._last = (weakref.ref(t), t._version, measured, blocks, hook)

    def block_rows(self) -> List[BlockHeadroomRow]:
        """Every (module, phase, dtype, block format) entry, its stats read
        (one synchronization per device)."""
        if self.blocks is None:
            return []
        with self.lock:
            merged = self.blocks.merged()
            names = _names(m for m, _, _ in self.entries)
        keys = list(merged)
        values = torch.stack([merged[k].to("cpu", torch.float64) for k in keys]).tolist() \
            if keys else []
        return [BlockHeadroomRow(names.get(m), phase, dtype, fmt,
                                 CastStats.from_values(v, dtype, element_dtype(fmt)))
                for (m, phase, dtype, fmt), v in zip(keys, values)]

    def rows(self) -> List[ModuleHealth]:
        """Every entry, worst first: non-finite values, then the fewest
        binades to overflow (forward) and the largest share of zero and
        subnormal gradients (backward)."""
        with self.lock:
            for key in [k for k, pending in self.entries.items() if len(pending) > 1]:
                self._merge(key)
            # A measure one entry holds alone becomes that entry's own; one that
            # several hold (a container and its last child) is copied for all
            # but one of them, so that no two rows share tensors.
            holders = collections.Counter(id(h) for (h,) in self.entries.values())
            for key, (h,) in list(self.entries.items()):
                if key not in self._merged and holders[id(h)] > 1:
                    holders[id(h)] -= 1
                    self._merge(key)
                self._merged.add(key)
            names = _names(m for m, _, _ in self.entries)
            rows = [ModuleHealth(names[m], phase, h)
                    for (m, phase, _), (h,) in self.entries.items()]
        return sorted(rows, key=severity)


class _Module:
    """A module object's row key in one watch, hashed by identity; it holds
    the module weakly (a report must not keep a model alive).

    Attributes:
        path: ``current_module``'s path at its first call (for messages).
        root: the key of the outermost module of that call; None for that
            outermost module itself, or under compiled code called first.
        rel: its path below ``root`` ("" for a root, "/Class" for a module
            the root calls but does not register).
        order: the how-manieth key of the watch it is.
        ref, id: a weak reference to the module and its id().
    """

    __slots__ = ("path", "root", "rel", "order", "ref", "id")

    def __init__(self, path, root, rel, order):
        self.path, self.root, self.rel, self.order = path, root, rel, order
        self.ref, self.id = None, 0


def _names(keys) -> Dict[Any, Optional[str]]:
    """key -> the row's name, distinct for distinct keys.

    A root is named by its class, with "#2", "#3", ... for the second, third
    root object of a class (in the order first seen). A module its root
    registers is named by its path there, as casts are ("layers.0"), or,
    when modules of several roots have rows, by the root's name and the
    path ("Sequential#2.0"); one that the root calls without registering it
    by the root's name and "/Class". A module called from several places is
    one row, named at its first call. A name still taken (a registered child
    named like a root) gets "#2", ...; names given by hand (str) are kept."""
    keys = set(keys)
    modules = sorted((k for k in keys if isinstance(k, _Module)), key=lambda k: k.order)
    roots = sorted({k.root if k.root is not None else k for k in modules
                    if k.root is not None or not k.rel}, key=lambda k: k.order)
    label, per_class = {}, collections.Counter()
    for root in roots:
        per_class[root.path] += 1
        n = per_class[root.path]
        label[root] = root.path if n == 1 else f"{root.path}#{n}"
    qualify = len({k.root for k in modules if k.root is not None and k.rel[:1] != "/"}) > 1
    names = {k: k for k in keys if not isinstance(k, _Module)}
    taken = set(names.values())
    for k in modules:
        if k.root is None:
            name = label.get(k, k.path)  # a root, or a module under compiled code
        elif k.rel[:1] == "/":
            name = label[k.root] + k.rel
        else:
            name = f"{label[k.root]}.{k.rel}" if qualify else k.rel
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}#{n}"
        taken.add(unique)
        names[k] = unique
    return names


class _GradHook:
    """Measures the gradient reaching a module's output, for that module and
    the containers that returned the same tensor (returns None: the gradient
    passes unchanged)."""

    __slots__ = ("watch", "modules")

    def __init__(self, watch, module):
        self.watch, self.modules = watch, [module]

    def __call__(self, grad):
        if self.watch.active and grad is not None and grad.numel():
            if not dense_strided(grad):
                _warn_not_measured(self.modules[0], grad)
                return
            self.watch.measure(self.modules, "backward", grad)


_warned_layouts = set()


def _warn_not_measured(module: Any, t: torch.Tensor) -> None:
    """Says once per layout that such tensors are left out of health rows:
    tensor_health reads dense strided tensors."""
    if isinstance(module, _Module):
        module = module.path
    kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
    if kind not in _warned_layouts:
        _warned_layouts.add(kind)
        warnings.warn(f"torchcast.track(health=True): {module or 'the model'} passed a {kind} "
                      f"tensor, which tensor_health cannot read; {kind} tensors are left out "
                      "of the health rows (said once)", RuntimeWarning, stacklevel=2)


__all__ = ["HealthWatch"]
