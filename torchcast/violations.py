"""Which losses of a cast are violations: a selection of kinds, each with
the fraction of a cast's elements above which it counts.

A specification is a string such as ``"overflow,nan,underflow>1%"``, a dict
``{"overflow": 0.0, "underflow": 0.01}``, an iterable of kinds, or a
Violations. A kind without a threshold counts from the first element.

Kinds (the stats of CastStats they read):

- ``overflow``: finite values that became ±inf (NaN for float8_e4m3fn, which
  has no inf); for integer or bool targets,
  NaN, infinite and out-of-range values (``nan + overflow``), whose results
  are arbitrary.
- ``saturated``: values beyond the target's range clamped to its largest
  finite value (±inf included: torch casts inf to 448 in float8_e4m3fn).
- ``nan``: NaN in a floating cast (NaN passes through unchanged; the cast
  did not make it, but a NaN gradient or activation is often the news).
- ``underflow``: nonzero values that became zero.
- ``subnormal``: results in the subnormal range (precision reduced).
- ``graph_cut``: a tensor that requires grad cast to an integer or bool dtype.
- ``imag_dropped``: a complex -> real cast that dropped nonzero imaginary parts.
"""
import math
import re
from typing import Dict, Iterable, List, Mapping, Optional, Union

from .stats import LOSS_COUNTS, CastStats

KINDS = ("overflow", "saturated", "nan", "underflow", "subnormal", "graph_cut", "imag_dropped")
# What breaks training: values lost to inf or clamped, arbitrary integers,
# cut graphs, dropped imaginary parts, and a sizeable share of a tensor
# flushed to zero. Subnormal results and NaN passing through are notes.
DEFAULT = "overflow,saturated,underflow>1%,graph_cut,imag_dropped"
# Every loss of value, from the first element: safe_to's rule (an explicit
# safe_to asks about every loss) and audit's. NaN passing through is none.
STRICT = "overflow,saturated,underflow,subnormal,graph_cut,imag_dropped"
ALL = ",".join(KINDS)

_TERM = re.compile(r"^\s*([a-z_]+)\s*(?:>\s*([0-9.eE+-]+)\s*(%?)\s*)?$")

ViolationsSpec = Union[str, Mapping[str, float], Iterable[str], "Violations", None]


def _integer_target(dtype) -> bool:
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


class Violations:
    """A parsed violations specification (see the module docstring).

    Args:
        spec: a string (``"overflow,underflow>1%"``; ``"all"``; ``"none"`` or
            ``""`` for none), a dict kind -> fraction in [0, 1), an iterable of
            kinds, a Violations, or None for ``DEFAULT``.

    Raises:
        ValueError: an unknown kind, or a threshold that is not a fraction
            in [0, 1) (or a percentage below 100%), named with the spec.
        TypeError: ``spec`` is none of the above.
    """

    def __init__(self, spec: ViolationsSpec = None):
        if isinstance(spec, Violations):
            self.thresholds: Dict[str, float] = dict(spec.thresholds)
            return
        if spec is None:
            spec = DEFAULT
        if isinstance(spec, str):
            thresholds = self._parse(spec)
        elif isinstance(spec, Mapping):
            thresholds = {}
            for kind, fraction in spec.items():
                thresholds[self._kind(kind, spec)] = self._fraction(fraction, spec)
        elif isinstance(spec, Iterable):
            thresholds = {self._kind(kind, spec): 0.0 for kind in spec}
        else:
            raise TypeError("torchcast: violations must be a str, a dict of kind -> fraction, "
                            f"an iterable of kinds or None, got {type(spec).__name__}")
        self.thresholds = {k: thresholds[k] for k in KINDS if k in thresholds}

    @classmethod
    def _parse(cls, spec):
        if spec.strip().lower() == "all":
            return {k: 0.0 for k in KINDS}
        if spec.strip().lower() in ("", "none"):
            return {}
        thresholds = {}
        for term in spec.split(","):
            m = _TERM.match(term)
            if not m:
                raise ValueError(f"torchcast: cannot read {term.strip()!r} in violations={spec!r}: "
                                 "write KIND or KIND>FRACTION (e.g. 'underflow>0.01' or "
                                 f"'underflow>1%'), KIND one of {', '.join(KINDS)}")
            kind, number, percent = m.groups()
            fraction = 0.0
            if number is not None:
                try:
                    fraction = float(number) / (100.0 if percent else 1.0)
                except ValueError:
                    fraction = math.nan
            thresholds[cls._kind(kind, spec)] = cls._fraction(fraction, spec)
        return thresholds

    @staticmethod
    def _kind(kind, spec):
        if kind not in KINDS:
            raise ValueError(f"torchcast: unknown kind {kind!r} in violations={spec!r}; the kinds "
                             f"are {', '.join(KINDS)}")
        return kind

    @staticmethod
    def _fraction(value, spec):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0.0 <= value < 1.0:
            raise ValueError(f"torchcast: a threshold in violations={spec!r} must be a fraction "
                             f"of the elements in [0, 1) (e.g. 0.01, or '1%'), got {value!r}")
        return float(value)

    def __contains__(self, kind: str) -> bool:
        return kind in self.thresholds

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Violations) and other.thresholds == self.thresholds

    def __repr__(self) -> str:
        return f"Violations({str(self)!r})"

    def __str__(self) -> str:
        """The specification, in the string form that parses back to it."""
        # repr: the shortest decimal that reads back to the same float. "%g"
        # wrote 0.9999999 as "underflow>1", which does not parse back.
        terms = [k if t == 0 else f"{k}>{t!r}" for k, t in self.thresholds.items()]
        return ",".join(terms) or "none"

    def _counts(self, kind, count, numel):
        threshold = self.thresholds.get(kind)
        return threshold is not None and count > 0 and count > threshold * numel

    def found(self, s: Optional[CastStats], graph_cuts: int = 0, imag_dropped: int = 0,
              rtol: Optional[float] = None, atol: Optional[float] = None) -> List[str]:
        """The violations in one cast's (or one site's merged) stats.

        Args:
            s: the stats (None: the loss was not measured, only graph cuts
                and imaginary parts are checked).
            graph_cuts, imag_dropped: counts of those events.
            rtol, atol: the largest relative and absolute error that is not a
                violation (None: not checked).

        Returns:
            One phrase per violation, e.g. "12 overflow" (empty: none).
        """
        found = []
        if "graph_cut" in self and graph_cuts:
            found.append(f"{graph_cuts} graph cut{'s' if graph_cuts > 1 else ''}")
        if "imag_dropped" in self and imag_dropped:
            found.append(f"{imag_dropped} imaginary parts dropped")
        if s is None:
            return found
        integer = _integer_target(s.dtype)
        if integer:
            if self._counts("overflow", s.nan + s.overflow, s.numel):
                found += [f"{getattr(s, f)} {f}" for f in ("nan", "overflow") if getattr(s, f)]
        else:
            for kind in _FLOAT_KINDS:
                if self._counts(kind, getattr(s, kind), s.numel):
                    found.append(_phrase(s, kind))
        if rtol is not None and s.max_rel_err > rtol:
            found.append(f"max rel err > rtol={rtol:g}")
        if atol is not None and s.max_abs_err > atol:
            found.append(f"max abs err > atol={atol:g}")
        return found

    def notes(self, s: Optional[CastStats]) -> List[str]:
        """The losses in ``s`` that this selection does not count as
        violations (e.g. "3 subnormal" under the default), for the record."""
        if s is None:
            return []
        found = set(self.found(s))
        kinds = ("nan", "overflow") if _integer_target(s.dtype) else _FLOAT_KINDS
        return [p for p in (_phrase(s, k) for k in kinds if getattr(s, k)) if p not in found]


# The kinds a floating cast's stats count.
_FLOAT_KINDS = LOSS_COUNTS


def _phrase(s: CastStats, kind: str) -> str:
    """"12 overflow"; saturations say how many were infinities, which
    x.to(torch.float8_e4m3fn) turns into 448 without a word."""
    phrase = f"{getattr(s, kind)} {kind}"
    if kind == "saturated" and s.inf:
        phrase += f" ({min(s.inf, s.saturated)} of them ±inf)"
    return phrase
