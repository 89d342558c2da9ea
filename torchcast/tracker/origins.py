"""Who made a cast: the program ("cast", "copy_"), autocast ("autocast"), the
autograd engine ("backward"), or an op's own implementation
("internal (scaled_dot_product_attention)").

An op's implementation can cast inside the dispatcher (the math path of
scaled_dot_product_attention upcasts to float32 and back): such casts reach
the tracker from the same Python line as the op's call, so the line alone
would label them the program's. What tells them apart is the call the
innermost Python frame is executing: a cast method (``x.float()``,
``t.to(...)``, ``torch.as_tensor``) or anything else (an op), read from the
frame's current instruction and its source columns, once per instruction.
Under autocast, an unmarked cast is autocast's (modules.py), except a cast of
a tensor that an autocast cast of the same call just produced: autocast never
casts its own result again, the op's implementation does.
"""
import dis
import linecache
import os
import re
import threading
import weakref
from types import CodeType, FrameType
from typing import Dict, Optional, Tuple

import torch

from .modules import autocast_on, in_program_cast

# The calls that cast as the program asks (their casts are the program's).
CAST_CALLS = frozenset(("to", "float", "half", "bfloat16", "double", "type", "type_as",
                        "copy_", "as_tensor", "tensor", "asarray"))
_CALL_OPS = frozenset(dis.opmap[n] for n in ("CALL", "CALL_FUNCTION_EX", "CALL_KW")
                      if n in dis.opmap)
_CACHE = dis.opmap.get("CACHE", -1)
_NAME_AT_END = re.compile(r"([A-Za-z_]\w*)\s*$")
_call_names: Dict[Tuple[CodeType, int], Optional[str]] = {}
_MAX_CACHED = 1 << 16
_local = threading.local()


def _source_segment(code: CodeType, index: int) -> Optional[str]:
    positions = list(code.co_positions())
    if index >= len(positions):
        return None
    line, end_line, col, end_col = positions[index]
    if None in (line, end_line, col, end_col):
        return None
    lines = [linecache.getline(code.co_filename, n).encode() for n in range(line, end_line + 1)]
    if not all(lines):
        return None
    if len(lines) == 1:
        return lines[0][col:end_col].decode(errors="replace")
    lines[0], lines[-1] = lines[0][col:], lines[-1][:end_col]
    return b"".join(lines).decode(errors="replace")


def _callee(segment: str) -> Optional[str]:
    """The name called by a call expression: "F.linear(x, w)" -> "linear",
    "x.float().half()" -> "half"; None when it is not a plain name."""
    text = segment.rstrip()
    if not text.endswith(")"):
        return None
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            m = _NAME_AT_END.search(text[:i])
            return m.group(1) if m else None
    return None


# Code that runs compiled graphs (torch.compile's eager and aot_eager
# backends, FX graph modules): the call it makes is the graph's, which may be
# the program's cast, so its name says nothing about who cast.
_GRAPH_RUNNERS = tuple(os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), p, "")
                       for p in ("_functorch", "_dynamo", "_inductor", "fx"))


def call_name(frame: FrameType) -> Optional[str]:
    """The name of the function ``frame`` is calling now (None: not a call,
    its source is not available, or the frame runs a compiled graph)."""
    code, offset = frame.f_code, frame.f_lasti
    key = (code, offset)
    if key not in _call_names:
        if len(_call_names) >= _MAX_CACHED:  # code made at run time (exec) would pile up
            _call_names.clear()
        name = None
        if code.co_filename.startswith("<eval_with_key>") or \
                os.path.abspath(code.co_filename).startswith(_GRAPH_RUNNERS):
            _call_names[key] = None
            return None
        # During a call into Python code f_lasti is past the CALL, on its
        # inline cache entries; during a call into C it is the CALL itself.
        while offset > 0 and code.co_code[offset] == _CACHE:
            offset -= 2
        if 0 <= offset < len(code.co_code) and code.co_code[offset] in _CALL_OPS:
            segment = _source_segment(code, offset // 2)
            name = _callee(segment) if segment else None
        _call_names[key] = name
    return _call_names[key]


def origin_of(frame: Optional[FrameType], src: torch.Tensor, copy: bool) -> str:
    """The origin of a forward cast of ``src`` (the autograd engine's casts
    are "backward", decided by the caller).

    Args:
        frame: the innermost Python frame outside torchcast (None: none).
        src: the tensor being cast.
        copy: whether the cast is a ``copy_`` into an existing tensor.
    """
    name = call_name(frame) if frame is not None else None
    op = name is not None and name not in CAST_CALLS
    if not copy and not in_program_cast() and autocast_on(src.device.type):
        made = getattr(_local, "autocast_made", None)
        if op and made is not None and made[0] == _call_key(frame):
            ref = made[1].get(id(src))
            if ref is not None and ref() is src:
                return f"internal ({name})"
        return "autocast"
    if op:
        return f"internal ({name})"
    return "copy_" if copy else "cast"


def _call_key(frame):
    return frame.f_code, frame.f_lasti, id(frame)


def made_by_autocast(frame: Optional[FrameType], out: torch.Tensor) -> None:
    """Notes that an autocast cast made ``out`` at ``frame``'s current call,
    so that a cast of it by the op's implementation reads as internal."""
    if frame is None:
        return
    key = _call_key(frame)
    made = getattr(_local, "autocast_made", None)
    if made is None or made[0] != key:
        made = _local.autocast_made = (key, {})
    made[1][id(out)] = weakref.ref(out)
