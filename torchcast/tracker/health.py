"""track(health=True): per module, the numeric health of its forward outputs
and of the gradients flowing into it in backward, merged over calls, and
what a narrower format would make of them (headroom).

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
import dataclasses
import math
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten

from .._inputs import PLAIN_TENSOR_TYPES, dense_strided
from ..headroom import FORMATS, Headroom, headroom
from ..health import TensorHealth, tensor_health
from ..stats import CastStats, short_dtype_name
from .block_headroom import BlockEntries, BlockHeadroomRow, block_stats, element_dtype
from .modules import ModuleCall, add_output_listener, remove_output_listener
from .own import unwatched
from .text_table import RowTable, format_table, percent

PHASES = ("forward", "backward")
# The histograms an entry keeps unmerged at most (float32's is 28 KiB).
_PENDING_BYTES = 256 << 10


@dataclasses.dataclass
class ModuleHealth:
    """The merged health of a module's outputs (phase "forward") or of the
    gradients flowing into it (phase "backward"), for one dtype."""

    module: Optional[str]
    phase: str
    health: TensorHealth

    @property
    def dtype(self) -> torch.dtype:
        return self.health.dtype

    def headroom(self, dtype: torch.dtype, scale: Union[None, float, str] = None) -> Headroom:
        """``torchcast.headroom.headroom`` of this entry."""
        return headroom(self.health, dtype, scale)

    def binades_to_overflow(self) -> float:
        """log2(largest finite value of its dtype / amax): how many doublings
        the largest element can take (inf when all are zero)."""
        return _binades_to_overflow(self.dtype, self.health.amax)

    def to_dict(self) -> Dict[str, Any]:
        h = self.health
        return {"module": self.module, "phase": self.phase, **h.to_dict()}


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
        self.blocks = BlockEntries(block_formats) if block_formats else None
        self._block_rows: List[BlockHeadroomRow] = []  # of a watch read back

    def start(self) -> None:
        self.active = True
        add_output_listener(self.on_output)

    def stop(self) -> None:
        self.active = False
        remove_output_listener(self.on_output)

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

    @classmethod
    def from_dicts(cls, rows: List[Dict[str, Any]],
                   block_rows: Sequence[Dict[str, Any]] = ()) -> "HealthWatch":
        """A stopped watch holding ``ModuleHealth.to_dict()`` rows and
        ``BlockHeadroomRow.to_dict()`` rows (a report read back from JSON)."""
        watch = cls()
        watch._block_rows = [BlockHeadroomRow.from_dict(d) for d in block_rows]
        for d in rows:
            h = TensorHealth.from_dict(d)
            key = (d["module"], d["phase"], h.dtype)
            watch.entries[key] = [h]
            watch._merged.add(key)
        return watch

    def block_formats(self) -> Tuple[str, ...]:
        """The block formats this watch cast to (or, read back, holds rows of)."""
        if self.blocks is not None:
            return self.blocks.formats
        return tuple(dict.fromkeys(r.format for r in self._block_rows))

    def block_rows(self) -> List[BlockHeadroomRow]:
        """Every (module, phase, dtype, block format) entry, its stats read
        (one synchronization per device)."""
        if self.blocks is None:
            return list(self._block_rows)
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
        return sorted(rows, key=_severity)


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


def _binades_to_overflow(dtype: torch.dtype, amax: float) -> float:
    return math.log2(torch.finfo(dtype).max / amax) if amax > 0 else math.inf


def _severity(row: ModuleHealth):
    h = row.health.read()
    lost = (h.zero + h.subnormal) / max(h.numel, 1)
    return (-(h.nan + h.posinf + h.neginf), _binades_to_overflow(row.dtype, h.amax), -lost)


@dataclasses.dataclass
class HeadroomRow:
    module: Optional[str]
    phase: str
    src_dtype: torch.dtype
    result: Headroom

    @property
    def identity(self) -> bool:
        """Whether the entry is in the format already: a "cast" to it changes
        nothing at scale 1, and a scale within one format is no cast at all."""
        return self.result.dtype == self.src_dtype

    def to_dict(self) -> Dict[str, Any]:
        r = self.result
        return {"module": self.module, "phase": self.phase, "src_dtype": str(self.src_dtype),
                "format": str(r.dtype), "scale": r.scale, "numel": r.numel,
                "overflow": r.overflow_fraction, "underflow": r.underflow_fraction,
                "subnormal": r.subnormal_fraction}


class HeadroomTable(RowTable):
    """``Report.headroom``'s answer: per module and phase, what a cast to a
    format would do; ``str()`` prints it worst first (overflow, then
    underflow, then subnormal results). ``omitted`` counts the entries left
    out for being in ``dtype`` already (``HeadroomRow.identity``)."""

    def __init__(self, dtype: torch.dtype, scale: Union[None, float, str],
                 rows: List[HeadroomRow], omitted: int = 0):
        self.dtype, self.scale, self.omitted = dtype, scale, omitted
        self.rows = sorted(rows, key=lambda r: (-r.result.overflow_fraction,
                                                -r.result.underflow_fraction,
                                                -r.result.subnormal_fraction))

    def __str__(self) -> str:
        scale = "per-entry power-of-two amax scale" if self.scale == "amax" else \
            f"scale {1.0 if self.scale is None else self.scale:g}"
        head = f"torchcast headroom in {short_dtype_name(self.dtype)} ({scale}), worst first"
        table = [("module", "phase", "dtype", "elements", "scale", "overflow", "underflow",
                  "subnormal")]
        for r in self.rows:
            h = r.result
            table.append((r.module or "-", r.phase, short_dtype_name(r.src_dtype), str(h.numel),
                          f"2^{int(math.log2(h.scale))}", percent(h.overflow_fraction),
                          percent(h.underflow_fraction), percent(h.subnormal_fraction)))
        text = format_table(head, table, left=3)
        if self.omitted:
            text += (f"\n... {self.omitted} more already in {short_dtype_name(self.dtype)} "
                     "(no cast)")
        return text




def headroom_table(watch: HealthWatch, dtype: torch.dtype,
                   scale: Union[None, float, str] = None) -> HeadroomTable:
    """``Report.headroom``: every entry of ``watch`` cast to ``dtype``, but
    those in ``dtype`` already (counted as ``omitted``): of a model run in
    float16, the float16 table would otherwise be half "0" rows of no cast."""
    entries = watch.rows()
    rows = [HeadroomRow(r.module, r.phase, r.dtype, r.headroom(dtype, scale))
            for r in entries if r.dtype != dtype]
    return HeadroomTable(dtype, scale, rows, omitted=len(entries) - len(rows))


def _lost(h: Headroom) -> str:
    return f"{percent(h.overflow_fraction)}/{percent(h.underflow_fraction)}"


def headroom_lines(watch: HealthWatch) -> List[str]:
    """``Report.headroom_summary``: one row per entry of ``watch``, one
    column per format of FORMATS (``headroom_table`` gives one format's
    full table, subnormals included)."""
    rows = watch.rows()
    head = (f"torchcast headroom of {len(rows)} module outputs and gradients (worst first): the "
            "% of elements a cast to each format loses\nto overflow/underflow at scale 1, and "
            "where it loses any, at the entry's power-of-two amax scale (2^k: overflow/underflow;"
            "\n-: the entry is in that format already)")
    table = [("module", "phase", "dtype", "elements", *(short_dtype_name(f) for f in FORMATS))]
    lossless = 0
    for r in rows:
        health = r.health.cpu()  # one transfer for the 8 predictions
        cells = []
        for fmt in FORMATS:
            if fmt == r.dtype:
                cells.append("-")  # no cast: "0/0" would read as a cast that loses nothing
                continue
            plain = headroom(health, fmt)
            cell = _lost(plain)
            if plain.overflow or plain.underflow:
                scaled = headroom(health, fmt, "amax")
                if scaled.scale != 1:  # else the same figures again
                    cell += f", 2^{int(math.log2(scaled.scale))}: {_lost(scaled)}"
            cells.append(cell)
        if all(c in ("0/0", "-") for c in cells):
            lossless += 1  # a table of only "0/0" rows says less than their count
            continue
        table.append((r.module or "-", r.phase, short_dtype_name(r.dtype),
                      str(health.numel), *cells))
    lines = format_table(head, table, left=3).split("\n") if len(table) > 1 else [head]
    if lossless:
        lines.append(f"... {lossless} more lose nothing in any format at scale 1")
    return lines


def _lossy(row: Dict[str, Any]) -> bool:
    return any(float(row[k]) for k in ("overflow", "underflow", "subnormal"))


def headroom_view(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows of ``Report.to_dict()["headroom"]`` worth reading (the HTML
    page's headroom table and TensorBoard's headroom scalars), worst first.

    ``to_dict`` keeps every (entry, format, scale) as data; read as a table, most of
    them answer nothing. So, per entry (module, phase, source dtype) and format:

    - none where the format is the entry's dtype: no cast happens (a model run
      in float16 made a quarter of a GPT-2's rows float16 -> float16 at 2^0);
    - one row, holding the scale-1 figures and, beside them, the amax
      scale's: an amax scale of 1 repeats the scale-1 row (the duplicates);
    - the amax scale's figures only where scale 1 loses something: a scale
      is the remedy for a loss, and without one "bfloat16 at 2^120" only
      says that bfloat16 has float32's range.

    Args:
        rows: ``HeadroomRow.to_dict()`` rows (floats possibly "inf"/"nan").

    Returns:
        Dicts of "module", "phase", "src_dtype", "format", "numel", "plain"
        (the scale-1 row, None if the rows had none) and "scaled" (the amax
        row, or None), and "lossy" (whether scale 1 loses anything), the
        lossy first, by overflow, then underflow, then subnormal at scale 1.
        An entry whose rows repeat (the same module twice in ``rows``) is one.
    """
    view: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        if r["format"] == r["src_dtype"]:
            continue
        key = (r["module"], r["phase"], r["src_dtype"], r["format"])
        entry = view.setdefault(key, {"module": r["module"], "phase": r["phase"],
                                      "src_dtype": r["src_dtype"], "format": r["format"],
                                      "numel": r["numel"], "plain": None, "scaled": None})
        slot = "plain" if float(r["scale"]) == 1 else "scaled"
        if entry[slot] is None:
            entry[slot] = r
    out = []
    for entry in view.values():
        if entry["plain"] is None:  # rows of other scales only: shown as they are
            entry["plain"], entry["scaled"] = entry["scaled"], None
        entry["lossy"] = _lossy(entry["plain"])
        if not entry["lossy"]:
            entry["scaled"] = None
        out.append(entry)
    return sorted(out, key=lambda e: (not e["lossy"], -float(e["plain"]["overflow"]),
                                      -float(e["plain"]["underflow"]),
                                      -float(e["plain"]["subnormal"])))


def health_lines(watch: HealthWatch) -> List[str]:
    """The report table's section on module health, worst first."""
    rows = watch.rows()
    head = (f"torchcast.track: numeric health of {len(rows)} module outputs and gradients "
            "(worst first)")
    table = [("module", "phase", "dtype", "elements", "amax", "binades to max", "min nonzero",
              "nan/inf", "zero", "subnormal")]
    for r in rows:
        h = r.health.read()
        n = max(h.numel, 1)
        room = _binades_to_overflow(r.dtype, h.amax)
        table.append((r.module or "-", r.phase, short_dtype_name(r.dtype), str(h.numel),
                      f"{h.amax:.3g}", f"{room:.1f}" if math.isfinite(room) else "-",
                      f"{h.min_nonzero:.3g}" if math.isfinite(h.min_nonzero) else "-",
                      str(h.nan + h.posinf + h.neginf), percent(h.zero / n),
                      percent(h.subnormal / n)))
    return format_table(head, table, left=3).split("\n")


__all__ = ["FORMATS", "HealthWatch", "HeadroomRow", "HeadroomTable", "ModuleHealth",
           "headroom_lines", "headroom_table", "headroom_view", "health_lines"]
