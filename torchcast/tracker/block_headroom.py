"""Headroom in the block-scaled formats (MXFP8, MXFP4, NVFP4), exact: what
a real block_cast of each module output and gradient that
track(health=True, block_formats=...) measured would flush to zero, leave
subnormal or saturate, and its SQNR.

A per-tensor histogram cannot tell it (each block's scale comes from that
block's amax), so the watch casts each measured tensor with block_cast, in
each format asked for, blocks along its last dimension (an activation's
reduction dimension in a Linear), and keeps the statistics (merged per
module, phase, dtype and format, on the device until read). The cast's data
is not kept: the cost is one block_cast pass per tensor and format."""
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..block import block_cast
from ..formats import block_format
from ..stats import STAT_FIELDS, CastStats, dtype_from_name, merge_stats_tensors, short_dtype_name
from .own import unwatched
from .text_table import RowTable, format_table, percent


def check_block_formats(formats: Sequence[str]) -> Tuple[str, ...]:
    """The formats as a tuple of names, each one block_cast knows
    (ValueError naming the choices otherwise)."""
    if isinstance(formats, str):
        formats = (formats,)
    names = tuple(formats)
    for name in names:
        block_format(name)
    return names


def block_stats(t: torch.Tensor, formats: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The stats tensor of block_cast(t, fmt) for each format, blocks along
    t's last dimension (a 0-d t as one element); the tracker's own ops."""
    x = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    with unwatched():
        return {name: block_cast(x, name).stats_tensor for name in formats}


class BlockEntries:
    """Stats tensors by (module key, phase, dtype, format), merged when read."""

    def __init__(self, formats: Tuple[str, ...]):
        self.formats = formats
        self.entries: Dict[Tuple[Any, str, torch.dtype, str], List[torch.Tensor]] = {}

    def add(self, module: Any, phase: str, dtype: torch.dtype,
            measured: Dict[str, torch.Tensor]) -> None:
        for name, stats in measured.items():
            pending = self.entries.setdefault((module, phase, dtype, name), [])
            pending.append(stats)
            if len(pending) >= 64:
                self.entries[(module, phase, dtype, name)] = [merge_stats_tensors(
                    torch.stack(pending))]

    def merged(self) -> Dict[Tuple[Any, str, torch.dtype, str], torch.Tensor]:
        out = {}
        for key, pending in self.entries.items():
            out[key] = pending[0] if len(pending) == 1 else merge_stats_tensors(
                torch.stack(pending))
            self.entries[key] = [out[key]]
        return out


@dataclasses.dataclass
class BlockHeadroomRow:
    """One module's outputs (phase "forward") or gradients ("backward") of
    one dtype, cast to a block format: ``stats`` as block_cast measures them
    (``underflow`` the nonzero elements flushed to zero, ``subnormal``,
    ``saturated``, ``sqnr_db``)."""

    module: Optional[str]
    phase: str
    src_dtype: torch.dtype
    format: str
    stats: CastStats

    def to_dict(self) -> Dict[str, Any]:
        return {"module": self.module, "phase": self.phase, "src_dtype": str(self.src_dtype),
                "format": self.format, "stats": self.stats.to_dict()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "BlockHeadroomRow":
        s = d["stats"]
        stats = CastStats.from_values([float(s[f]) for f in STAT_FIELDS],
                                      dtype_from_name(s["src_dtype"]),
                                      dtype_from_name(s["dtype"]))
        return cls(d["module"], d["phase"], stats.src_dtype, d["format"], stats)


class BlockHeadroomTable(RowTable):
    """``Report.headroom(format)`` for a block format: per module, phase and
    dtype, what a real block cast of what was measured lost; ``str()`` prints
    it worst first (saturated, then flushed to zero, then the lowest SQNR)."""

    def __init__(self, format: str, rows: List[BlockHeadroomRow]):
        self.format = format
        self.rows = sorted(rows, key=lambda r: (-r.stats.saturated / max(r.stats.numel, 1),
                                                -r.stats.underflow / max(r.stats.numel, 1),
                                                r.stats.sqnr_db))

    def __str__(self) -> str:
        fmt = block_format(self.format)
        head = (f"torchcast headroom in {self.format} ({fmt.element.name} elements, a "
                f"{fmt.scale.name} scale per {fmt.block_size} along the last dimension; "
                "real casts), worst first")
        table = [("module", "phase", "dtype", "elements", "flushed to 0", "subnormal",
                  "saturated", "SQNR")]
        for r in self.rows:
            s = r.stats
            n = max(s.numel, 1)
            table.append((r.module or "-", r.phase, short_dtype_name(r.src_dtype), str(s.numel),
                          percent(s.underflow / n), percent(s.subnormal / n),
                          percent(s.saturated / n), f"{s.sqnr_db:.1f} dB"))
        return format_table(head, table, left=3)


def element_dtype(name: str) -> torch.dtype:
    """The dtype a block format's statistics name as the target: its element
    format's (torch's packed pair for e2m1)."""
    fmt = block_format(name)
    return torch.float4_e2m1fn_x2 if fmt.packed else fmt.element.dtype

