"""The pieces of the tracker's text tables (headroom, module health)."""
from typing import Any, Dict, List


class RowTable:
    """A table of rows that each have ``to_dict()``: iterable, sized, and
    its dict form a list of the rows'."""

    rows: List[Any]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_dict(self) -> List[Dict[str, Any]]:
        return [r.to_dict() for r in self.rows]


def percent(x: float) -> str:
    """A fraction as a table shows it: "0", "12.5%", "3.1e-06%"."""
    if x == 0:
        return "0"
    return f"{100 * x:.3g}%" if x >= 1e-5 else f"{100 * x:.1e}%"


def format_table(head: str, rows: List[tuple], left: int) -> str:
    """``head``, then ``rows`` of strings in columns: the first ``left``
    left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)
