"""Floats in a report's dict form. Strict JSON has no inf or NaN, yet they
are what a report exists for (a cast whose every element overflowed, an
op's infinite input): a float field of ``Report.to_dict()`` holds a number
or one of NONFINITE_STRINGS, which any JSON parser reads and ``float()``
turns back into the float."""
import math
from typing import Any

NONFINITE_STRINGS = ("inf", "-inf", "nan")


def json_float(value: Any) -> Any:
    """``value`` with every non-finite float in it (inside dicts and lists
    too) as "inf", "-inf" or "nan"; anything else unchanged.

    Args:
        value: a JSON-ready value (dicts, lists, numbers, strings, None).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # Python never writes "-nan"
    if isinstance(value, dict):
        return {k: json_float(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_float(v) for v in value]
    return value


def float_from_json(value: Any, field: str) -> Any:
    """The float a to_dict() float field holds: a number (or None) as it
    is, "inf"/"-inf"/"nan" as the float.

    Args:
        value: the field's value.
        field: its name, for the error.

    Raises:
        ValueError: a string other than those three.
    """
    if isinstance(value, str):
        if value not in NONFINITE_STRINGS:
            raise ValueError(f"torchcast.Report.from_dict: {field} must be a number or one of "
                             f"{', '.join(map(repr, NONFINITE_STRINGS))}, got {value!r}")
        return float(value)
    return value
