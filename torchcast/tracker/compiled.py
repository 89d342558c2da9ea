"""The casts inside torch.compile'd code, while a track(all_casts=True) is
active.

The dispatch mode (mode.py) lets Dynamo compile and runs the compiled code
with the mode on (its ``ignore_compile_internals``). What the compiled code
dispatches, it sees: with the "eager" and "aot_eager" backends that is every
aten op, casts included. Inductor's generated kernels cast in C++ and never
dispatch; for them, while a track is active in the compiling thread, an
Inductor post-grad pass puts after every cast node of the forward and
backward graphs a call to ``torchcast_track::compiled_cast(x, y, dtype,
module, frames, origin)``: an op that, when it runs, measures the cast as
the mode would (``report_cast``: the same statistics, policy and records)
from the cast's input and Inductor's result. The graph supplies what the
dispatcher cannot know at run time: the module path inside the compiled
module, the source lines (the node's recorded stack) and the origin.

The call must not change what Inductor computes. Inductor does not round at
a cast it fuses into the code around it (its emulate_precision_casts is
off): a call that made it keep a cast's bfloat16 result, or a 16-bit input,
in a buffer would round where the compiled program does not (issue 47). A
cast is measured only where what the call reads is in a buffer anyway or is
of a dtype a buffer holds exactly (``_measurable``); any other is recorded,
counted and not measured, by ``compiled_cast_fused``, whose call reads no
value of the graph (its only tensor is a graph input).

The casts instrumented are the program's: nodes whose aten op was a cast
(``_to_copy``, ``copy``/``copy_``, autocast's ``_to_copy``), not the
up-casts Inductor's decompositions add inside an op (softmax on bfloat16
computes in float32). A forward cast that the partitioner recomputes in the
backward graph is skipped there: eager runs it once.

A graph compiled inside a track keeps its calls after the track (each finds
no recorder and returns); a graph compiled outside any track has none, and
its casts inside a later track are not seen (``warn_uninstrumented``).
"""
import operator
import os
import sys
import threading
import warnings
import weakref
from itertools import chain
from typing import Iterator, Optional, Tuple

import torch

from ..formats import FLOAT_RANK
from .measure import MeasuredCast
from .mode import CastPlace, active_recorders, report_cast
from .modules import module_within
from .sites import frames_from, site_of

aten, prims = torch.ops.aten, torch.ops.prims
# How a cast Inductor fuses into the code around it reads in a record's
# origin: the program computes there without that rounding, so there is no
# rounding to measure (and measuring it would need a buffer the plain code
# does not have, which would round where the program does not).
FUSED = "fused by inductor, not measured"

_LIB = torch.library.Library("torchcast_track", "DEF")
_LIB.define("compiled_cast(Tensor x, Tensor? y, ScalarType dtype, str module, str frames, "
            "str origin) -> ()")
_LIB.define("compiled_cast_fused(Tensor anchor, ScalarType src_dtype, ScalarType dtype, "
            "int numel, str module, str frames, str origin) -> ()")

# The aten ops whose nodes are the program's casts (``original_aten`` of a
# post-grad node names the op it came from; compared by name, as the object
# there need not be the one torch.ops holds).
_CAST_ATEN = frozenset(op.name() for op in (aten._to_copy.default, aten.copy.default,
                                            aten.copy_.default))
# What a node's source_fn_stack names for a cast the program wrote; any
# other source (Linear, matmul, ...) of a _to_copy is autocast's.
_CAST_SOURCES = frozenset(("to", "float", "half", "bfloat16", "double", "type", "type_as",
                           "_to_copy", "copy_", "setitem", "tensor", "as_tensor", "cfloat",
                           "cdouble", "cpu", "cuda"))


def _frames_text(stack_trace: Optional[str]) -> str:
    """A node's recorded stack ("  File "f.py", line 7, in forward ...",
    outermost first) as "line:file" lines, innermost first."""
    found = []
    for line in (stack_trace or "").splitlines():
        line = line.strip()
        if line.startswith('File "'):
            file, _, rest = line[6:].partition('", line ')
            number = rest.split(",", 1)[0]
            if number.isdigit():
                found.append(f"{number}:{file}")
    return "\n".join(reversed(found))


def _parse_frames(text: str) -> Iterator[Tuple[str, int]]:
    for entry in text.splitlines():
        number, _, file = entry.partition(":")
        yield file, int(number)


def _module_path(stack: Optional[dict]) -> str:
    """The innermost entry of an ``nn_module_stack`` ("L['self'].layers[0].fc",
    as Dynamo names it) as a path below the compiled module ("layers.0.fc")."""
    if not stack:
        return ""
    source = list(stack.values())[-1][0]
    parts = []
    i = source.find("]")  # past the root: L['self'] or G['model']
    rest = source[i + 1:] if source[:2] in ("L[", "G[") and i >= 0 else source
    for piece in rest.replace("[", ".[").split("."):
        if not piece or piece == "_modules":
            continue
        if piece.startswith("["):
            piece = piece.strip("[]").strip("'\"")
        if piece != "_orig_mod":
            parts.append(piece)
    return ".".join(parts)


def _source_name(node: torch.fx.Node) -> str:
    stack = node.meta.get("source_fn_stack")
    if not stack:
        return ""
    target = stack[-1][1]
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _cast_of(node: torch.fx.Node):
    """(x, y, dtype, origin) of a cast node the program made, else None."""
    original = node.meta.get("original_aten")
    if node.op != "call_function" or getattr(original, "name", lambda: None)() not in _CAST_ATEN:
        return None
    tag = node.meta.get("partitioner_tag")
    if node.meta.get("autograd_backward") and tag != "is_backward":
        return None  # a forward cast recomputed in the backward graph
    if node.target is prims.convert_element_type.default:
        x, y, dtype = node.args[0], node, node.args[1]
    elif node.target is aten._to_copy.default and "dtype" in node.kwargs:
        x, y, dtype = node.args[0], node, node.kwargs["dtype"]
    elif node.target in (aten.copy.default, aten.copy_.default):
        x, y, dtype = node.args[1], None, getattr(node.meta.get("val"), "dtype", None)
    else:
        return None
    x_val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(x_val, torch.Tensor) or dtype is None or x_val.dtype == dtype:
        return None
    if tag == "is_backward":
        origin = "backward"
    elif y is None:
        origin = "copy_"
    elif _source_name(node) in _CAST_SOURCES:
        origin = "cast"
    else:
        origin = "autocast"
    return x, y, dtype, origin


# Ops whose result passes on the storage of their input: a view of a
# buffer is read from that buffer, a view of a value Inductor computes inline
# is computed inline too.
_VIEWS = frozenset(op.name() for op in (
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.select.int,
    aten.slice.Tensor, aten.alias.default, aten.as_strided.default))
_EXACT = (torch.float32, torch.float64)  # what Inductor computes in: stored exactly


def _name(node: torch.fx.Node) -> str:
    """The name of the op a node calls ("aten::permute"), or ""."""
    name = getattr(node.target, "name", None)
    return name() if callable(name) else ""


def _own_kernel(node: torch.fx.Node) -> bool:
    """Whether Inductor runs ``node``'s op as a kernel of its own (a
    fallback to ATen, a matmul or convolution, attention) that reads its
    inputs from buffers and writes its result to one."""
    from torch._inductor import config
    from torch._inductor.lowering import fallbacks, needs_realized_inputs
    target = node.target
    if target in needs_realized_inputs or target in fallbacks:
        return True
    # addmm and baddbmm realize their inputs (mm_args) unless Inductor
    # writes the matmul itself (then the bias add is pointwise).
    return target in (aten.addmm.default, aten.baddbmm.default) and \
        not getattr(config.triton, "native_matmul", False)


def _makes_buffer(node: torch.fx.Node) -> bool:
    """Whether Inductor's code holds ``node``'s value in a buffer whatever
    the tracker adds: a graph input, the result (or a view of the result) of
    an op it runs as a kernel of its own (a matmul, attention, a fallback),
    or a value the graph returns."""
    if node.op == "placeholder":
        return True
    if node.op != "call_function":
        return False
    if any(user.op == "output" for user in node.users) or _own_kernel(node):
        return True
    if node.target is operator.getitem or _name(node) in _VIEWS:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and _makes_buffer(source)
    return False


def _read_as_buffer(node: torch.fx.Node) -> bool:
    """Whether every reader of ``node``'s value reads it from a buffer: each
    user (through views) is an op Inductor runs as a kernel of its own, which
    reads its inputs from memory, the graph's output, or a copy_ that
    stores it into a buffer of its dtype (an input the graph mutates). A
    pointwise user
    would compute it inline, in float32, without the rounding of its dtype
    (Inductor's emulate_precision_casts is off)."""
    for user in node.users:
        if user.op == "output" or _own_kernel(user):
            continue
        if user.target is aten.copy_.default and user.args[1] is node and \
                user.args[0].meta["val"].dtype == node.meta["val"].dtype:
            continue  # stored, in its dtype, into copy_'s destination
        if _name(user) in _VIEWS and user.args[0] is node and _read_as_buffer(user):
            continue
        return False
    return bool(node.users)


def _measurable(node: torch.fx.Node, x: torch.fx.Node, y: Optional[torch.fx.Node],
                dtype: torch.dtype) -> bool:
    """Whether a call can measure the cast ``node`` of ``x`` to ``dtype``
    (result ``y``; None for a copy) without changing what Inductor
    computes, and the program rounds there. What the call reads must be in a
    buffer already, or of a dtype a buffer holds exactly as Inductor
    computes it (float32, float64). A narrowing cast's result ``y``, which
    the call reads, must be read from a buffer by all its readers (else
    Inductor fuses the cast away). A copy's result is not read (the call
    measures from ``x``): it is measured where it is stored, into copy_'s
    destination, an own kernel's input or the graph's output."""
    x_dtype = x.meta["val"].dtype
    if not (x_dtype in _EXACT or _makes_buffer(x)):
        return False
    if _widening(x_dtype, dtype) or node.target is aten.copy_.default:
        return True
    if node.target is aten.copy.default:
        return any(user.op == "output" or _own_kernel(user) or (
            user.target is aten.copy_.default and user.args[1] is node) for user in node.users)
    return y is not None and _read_as_buffer(y)


def _widening(src: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether casting src to dtype is exact (a wider floating format): its
    measure needs the input only."""
    return src in FLOAT_RANK and FLOAT_RANK.get(dtype, 0) > FLOAT_RANK[src]


def _anchor(graph: torch.fx.Graph) -> Optional[torch.fx.Node]:
    """A graph input tensor: the argument of a call that must read none of
    the graph's values (an input is a buffer already; reading it changes
    no kernel)."""
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            return node
    return None


def instrument_casts(graph: torch.fx.Graph) -> int:
    """Puts after every cast node of the program in ``graph`` (a post-grad
    graph) a ``torchcast_track::compiled_cast`` call that measures it, where
    that leaves Inductor's code computing what it computed
    (``_measurable``), else a ``compiled_cast_fused`` call that records the
    site as fused by inductor, not measured. The generated kernels stay
    those of the plain program: a call never makes Inductor keep a value in
    a buffer whose dtype would round it where the plain code does not.

    Args:
        graph: the graph, changed in place.

    Returns:
        How many casts were measured.
    """
    count = 0
    anchor = _anchor(graph)
    for node in list(graph.nodes):
        cast = _cast_of(node)
        if cast is None:
            continue
        x, y, dtype, origin = cast
        stack = node.meta.get("fwd_nn_module_stack" if origin == "backward" else "nn_module_stack")
        where = (_module_path(stack), _frames_text(node.meta.get("stack_trace")), origin)
        x_val = x.meta["val"]
        if _measurable(node, x, y, dtype):
            call_args = (x, None if _widening(x_val.dtype, dtype) else y, dtype, *where)
            op = torch.ops.torchcast_track.compiled_cast.default
            count += 1
        elif anchor is not None:
            numel = x_val.numel()
            call_args = (anchor, x_val.dtype, dtype, numel if isinstance(numel, int) else -1,
                         *where)
            op = torch.ops.torchcast_track.compiled_cast_fused.default
        else:
            continue
        with graph.inserting_after(node):
            call = graph.call_function(op, call_args)
        call.meta["val"] = None
    return count


_output_dir = []


def _runtime_frames(frame):
    """The frames from ``frame`` outwards, less Inductor's generated code
    (its output files live in its cache directory, which is no one's source)."""
    if not _output_dir:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        _output_dir.append(os.path.join(cache_dir(), ""))
    for file, line in frames_from(frame):
        if not file.startswith(_output_dir[0]):
            yield file, line


def _place(module: str, frames: str, origin: str, caller) -> Optional[CastPlace]:
    """Where a compiled cast was made: its module, and its site from the
    graph's recorded stack (inside the compiled code), then the frames that
    called it (``caller`` outwards), for a user line when the compiled code
    is a library's; in backward, where backward was called, as in eager."""
    node = torch._C._current_autograd_node() if origin == "backward" else None
    static = () if origin == "backward" else _parse_frames(frames)
    site = site_of(chain(static, _runtime_frames(caller)), skip_own=False)
    return None if site is None else CastPlace(module_within(module, node), site, origin, None)


def _compiled_cast(x, y, dtype, module, frames, origin):
    recorders = active_recorders()
    place = _place(module, frames, origin, sys._getframe(1)) if recorders else None
    if place is not None:
        report_cast(recorders, place, x, dtype, y)


def _compiled_cast_fused(anchor, src_dtype, dtype, numel, module, frames, origin):
    recorders = active_recorders()
    place = _place(module, frames, origin, sys._getframe(1)) if recorders else None
    if place is None:
        return
    site = place.site
    key = (place.module, site.file, site.line, f"{origin} ({FUSED})", None, src_dtype, dtype,
           site.via)
    fused = MeasuredCast(src_dtype, dtype, max(numel, 0), measured=False)
    for recorder in recorders:
        recorder.add_cast(key, fused)


_LIB.impl("compiled_cast", _compiled_cast, "CompositeExplicitAutograd")
_LIB.impl("compiled_cast_fused", _compiled_cast_fused, "CompositeExplicitAutograd")


@torch.library.register_fake("torchcast_track::compiled_cast", lib=_LIB)
def _compiled_cast_fake(x, y, dtype, module, frames, origin):
    return None


@torch.library.register_fake("torchcast_track::compiled_cast_fused", lib=_LIB)
def _compiled_cast_fused_fake(anchor, src_dtype, dtype, numel, module, frames, origin):
    return None


# Ops that return nothing: without this, dead-code elimination (FX's and
# Inductor's scheduler) removes them.
torch.fx.node.has_side_effect(torch.ops.torchcast_track.compiled_cast.default)
torch.fx.node.has_side_effect(torch.ops.torchcast_track.compiled_cast_fused.default)


class _Installed:
    """Inductor's post_grad_custom_post_pass while some track(all_casts=True)
    is active (the user's own pass, if any, runs first), restored after the
    last one."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0
        self.previous = None
        self.ours = None

    def acquire(self) -> None:
        with self.lock:
            # Importing Inductor in a process that never compiles costs a
            # second and leaves threads that abort gloo ranks at exit; a
            # process that compiles has imported Dynamo (torch.compile does).
            if self.count == 0 and "torch._dynamo" in sys.modules:
                from torch._inductor import config
                self.previous = config.post_grad_custom_post_pass
                passes = self.previous if isinstance(self.previous, (list, tuple)) else \
                    [self.previous] if self.previous is not None else []
                self.ours = [*passes, _cast_pass()] if passes else _cast_pass()
                config.post_grad_custom_post_pass = self.ours
            self.count += 1

    def release(self) -> None:
        with self.lock:
            self.count -= 1
            _known_codes.update(_compiled_codes())  # compiled inside the track
            if self.count == 0 and self.ours is not None:
                from torch._inductor import config
                if config.post_grad_custom_post_pass is self.ours:  # else the user changed it since
                    config.post_grad_custom_post_pass = self.previous
                self.previous = self.ours = None


def _cast_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class InstrumentCasts(CustomGraphPass):
        """Instruments the casts of graphs compiled in a thread that is
        tracking; a no-op in other threads."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            if active_recorders():
                instrument_casts(graph)

        def uuid(self) -> Optional[str]:
            # Inductor's graph cache keys on this. An instrumented graph names
            # source lines the key does not hold: None bypasses the cache.
            return None if active_recorders() else "torchcast.tracker.compiled:inactive"

    return InstrumentCasts()


_installed = _Installed()
# Dynamo's compiled code objects already seen at a track's edge (weakly: an
# id could be reused by code compiled later).
_known_codes = weakref.WeakSet()


def _compiled_codes():
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if convert_frame is None:
        return set()
    return {code for code in (ref() for ref in convert_frame.output_codes.seen)
            if code is not None}


def warn_uninstrumented() -> None:
    """Warns, at the entry of a track(all_casts=True), if Dynamo compiled
    code outside any track since the last one was left: an Inductor graph
    compiled outside a track runs inside it as it was compiled, its casts
    unseen. (Each compiled code object is warned about once.) The warning
    points at the program's ``with track(...)`` line: stacklevel 5 passes
    this function, CastRecording.start, features.start_all and
    track.__enter__."""
    codes = _compiled_codes()
    outside = [code for code in codes if code not in _known_codes]
    _known_codes.update(codes)
    if outside:
        warnings.warn(
            f"torchcast.track: torch.compile compiled {len(outside)} frame(s) outside any "
            "track(all_casts=True). The casts inside an Inductor graph compiled outside a "
            "track are not recorded when it runs inside one (Dynamo reuses it as it is; "
            "graphs compiled inside a track, and those of the \"eager\" and \"aot_eager\" "
            "backends, are recorded). Call torch.compiler.reset() before the track to have "
            "them compiled again, measured.", RuntimeWarning, stacklevel=5)


def instrumenting() -> bool:
    """Whether Inductor's graph pass that measures compiled casts is
    installed now (an all_casts track is active in a process that had
    imported Dynamo when the first one entered)."""
    return _installed.ours is not None


def install() -> None:
    """Instruments the casts of every graph Inductor compiles in a thread
    with an active all_casts track, until ``uninstall()`` (reference-counted)."""
    _installed.acquire()


def uninstall() -> None:
    """Undoes one ``install()``; the last one restores Inductor's config."""
    _installed.release()
