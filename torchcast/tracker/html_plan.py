"""The precision plan's section of ``Report.to_html``'s page: per recipe,
the nn.Linear layers to keep in bf16 with their reasons, then every layer's
SQNR and flushed/saturated fractions per role, failing cells marked. Drawn
from ``PrecisionPlan.to_dict()``."""
from typing import Any, Dict, List

from .html_parts import as_float, esc, html_table

_ROLES = ("input", "weight", "grad_output")


def _percent(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.3g}%"


def plan_section(plan: Dict[str, Any]) -> str:
    """The section for a plan.

    Args:
        plan: ``PrecisionPlan.to_dict()``.

    Returns:
        The HTML of the section.
    """
    measures = {(m["layer"], m["recipe"], m["role"]): m for m in plan["measures"]}
    parts = ['<section id="plan"><h2>Precision plan: which nn.Linear survive each '
             "low-precision recipe (real casts of a training step's tensors)</h2>"]
    limits = ", ".join(f"{esc(r)}: SQNR &ge; {plan['min_sqnr_db'][r]:g} dB, flushed to zero "
                       f"&le; {_percent(plan['max_underflow'][r])}" for r in plan["recipes"])
    parts.append(f'<p class="note">A layer passes a recipe when its input, weight and output '
                 f"gradient all keep within the thresholds ({limits}; saturated or not finite "
                 f"&le; {_percent(plan['max_overflow'])}).</p>")
    items: List[str] = []
    for recipe in plan["recipes"]:
        kept = {layer: why for layer, why in plan["verdicts"][recipe].items() if why}
        converted = len(plan["layers"]) - len(kept)
        line = (f"<b>{esc(recipe)}</b>: {converted} of {len(plan['layers'])} layers in low "
                "precision; keep in bf16: ")
        line += ("none" if not kept else "; ".join(
            f'<code>{esc(layer)}</code> <span class="bad">({esc(", ".join(why))})</span>'
            for layer, why in kept.items()))
        items.append(f"<li>{line}</li>")
    parts.append(f"<ul>{''.join(items)}</ul>")
    header = ["layer", "recipe"] + [f"{role} {what}" for role in _ROLES
                                    for what in ("SQNR", "flushed", "saturated")]
    rows, classes = [], []
    for layer in plan["layers"]:
        for recipe in plan["recipes"]:
            why = plan["verdicts"][recipe][layer]
            row = [esc(layer), esc(recipe)]
            for role in _ROLES:
                m = measures[(layer, recipe, role)]
                n = max(int(m["numel"]), 1)
                failed = [w for w in why if w.startswith(role + ":")]
                cells = [f"{as_float(m['sqnr_db']):.1f} dB",
                         _percent(int(m["underflow"]) / n),
                         _percent((int(m["saturated"]) + int(m["nonfinite"])) / n)]
                row += [f'<span class="bad">{c}</span>' if failed else c for c in cells]
            rows.append(row)
            classes.append("violation" if why else "")
    parts.append(html_table(header, rows, left=2, row_classes=classes))
    return "".join(parts) + "</section>"

