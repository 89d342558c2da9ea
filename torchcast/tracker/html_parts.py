"""The small pieces every section of ``Report.to_html``'s page is made of
(html.py, html_health.py): escaping, numbers as the page shows them, tables,
and long names cut to fit, whole in their title.
"""
import html
from typing import Any, List, Optional


def counted(n: int, noun: str, plural: Optional[str] = None) -> str:
    """"1 op", "3 ops" ("2 entries" with plural="entries")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def esc(value: Any) -> str:
    """``str(value)`` escaped for HTML text and attribute values."""
    return html.escape(str(value), quote=True)


def short_dtype(dtype: Optional[str]) -> str:
    """A dtype's name without "torch." ("-" for None)."""
    return (dtype or "-").replace("torch.", "")


def as_float(x: Any) -> float:
    """A float field of to_dict(): a number, or "inf"/"-inf"/"nan" (strict
    JSON has no inf/NaN), which float() reads."""
    return float(x)


def number(x: Any) -> str:
    """A number as the page shows it: inf as "inf", None as "-"."""
    if x is None:
        return "-"
    if isinstance(x, str):
        x = as_float(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    return f"{x:.3g}"


def html_table(header: List[str], rows: List[List[str]], left: int = 1,
               row_classes: Optional[List[str]] = None) -> str:
    """rows of already escaped cells; the first ``left`` columns left-aligned.
    The first column (a site or module) wraps anywhere, the others only
    within a violations list: the table fits its window by its names alone."""
    def cls(i):
        return ' class="l w"' if i == 0 < left else ' class="l"' if i < left else ""

    head = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(header))
    body = []
    for k, row in enumerate(rows):
        tr = f' class="{row_classes[k]}"' if row_classes and row_classes[k] else ""
        cells = "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr{tr}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def ellipsize(text: str, limit: int) -> str:
    """``text`` cut in the middle to ``limit`` characters (the ends say the most)."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (limit - 1 - head):]


def module_tail(name: str, limit: int) -> str:
    """A dotted module path cut to its last components (the module itself
    and its parents up to ``limit`` characters)."""
    if len(name) <= limit:
        return name
    parts = name.split(".")
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(kept) + 1 > limit:
            break
        kept = f"{part}.{kept}"
    return ellipsize("\u2026" + kept, limit)


def titled(text: Any, short: str) -> str:
    """Escaped ``short``, with the full ``text`` in its title when they differ."""
    text = str(text)
    if short == text:
        return esc(text)
    return f'<span class="cut" title="{esc(text)}">{esc(short)}</span>'


def module_label(name: Optional[str], limit: int = 40) -> str:
    """A module path cut to ``limit`` (``module_tail``), whole in its title."""
    return titled(name or "-", module_tail(name or "-", limit))
