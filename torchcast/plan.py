"""precision_plan: for each nn.Linear of a model, whether its input, weight
and output gradient survive the casts of torchao's low-precision training
recipes (tensorwise and rowwise float8, MXFP8, NVFP4), measured with real
casts of the tensors of a few training steps, and what to hand torchao: a
``module_filter_fn`` and the layers to keep in bf16, each with its reason.

Health tracking (track(health=True)) sees module outputs and their
gradients, not a Linear's input nor its weight, so the plan hooks every
nn.Linear itself while the caller's steps run: a forward pre-hook casts the
input and the weight, a hook on the output's gradient casts the gradient.
Only the statistics are kept; the casts run as the tracker's own work, so an
enclosing ``track()`` records none of them. docs/precision_plan.md states
each recipe's casts and the thresholds."""
import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .block import block_cast
from .formats import format_of
from .stats import sqnr_db_of
from .tracker.own import unwatched
from .tracker.text_table import format_table, percent

__all__ = ["DEFAULT_MAX_OVERFLOW", "DEFAULT_MAX_UNDERFLOW", "DEFAULT_MIN_SQNR_DB", "Measure",
           "PrecisionPlan", "RECIPES", "ROLES", "precision_plan"]

RECIPES = ("tensorwise", "rowwise", "mxfp8", "nvfp4")
ROLES = ("input", "weight", "grad_output")
# The thresholds, per recipe, from what each recipe loses of a standard
# normal tensor (1024 x 512; docs/precision_plan.md): SQNR tensorwise 31.6 dB
# (e4m3) and 25.6 dB (e5m2 gradients), rowwise and MXFP8 31.5 dB, NVFP4
# 20.4 dB. The SQNR floor is about 8 dB under the recipe's worst role there
# (an RMS error 2.5 times an ordinary tensor's fails). Underflow: a normal
# tensor flushes under 1e-5 of its elements in the float8 recipes, 6.8% in
# NVFP4 (e2m1 flushes what lies under 1/24 of its block's amax).
DEFAULT_MIN_SQNR_DB = {"tensorwise": 18.0, "rowwise": 23.0, "mxfp8": 23.0, "nvfp4": 12.0}
DEFAULT_MAX_UNDERFLOW = {"tensorwise": 0.01, "rowwise": 0.01, "mxfp8": 0.01, "nvfp4": 0.10}
# Elements saturated or not finite: amax scaling saturates none of a finite
# tensor, so any sizable fraction means a scale that did not fit.
DEFAULT_MAX_OVERFLOW = 0.001

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# torchao 0.18's Float8LinearConfig.from_recipe_name: the float8 dtype per
# role and whether scales are rounded down to powers of two.
_FLOAT8 = {"tensorwise": ({"input": _E4M3, "weight": _E4M3, "grad_output": _E5M2}, False),
           "rowwise": ({"input": _E4M3, "weight": _E4M3, "grad_output": _E4M3}, True)}
# torchao's MXFP8 training recipes derive the e8m0 scale by "rceil".
_BLOCK = {"mxfp8": ("mxfp8_e4m3", "rceil"), "nvfp4": ("nvfp4", None)}


@dataclasses.dataclass
class Measure:
    """What the casts of one tensor role lost, summed over the casts made
    (every step, and for rowwise, MXFP8 and NVFP4 both scaling directions).

    ``underflow`` counts nonzero elements flushed to zero, ``saturated``
    elements clamped to the format's largest value, ``nonfinite`` elements
    that were or became NaN/inf; ``sum_sq`` and ``sum_sq_err`` are sums of
    x^2 and (x - y)^2 over the finite ones, y the value the cast stands for.
    """

    numel: int = 0
    underflow: int = 0
    saturated: int = 0
    nonfinite: int = 0
    sum_sq: float = 0.0
    sum_sq_err: float = 0.0

    def __add__(self, other: "Measure") -> "Measure":
        return Measure(*(a + b for a, b in zip(dataclasses.astuple(self),
                                               dataclasses.astuple(other))))

    @property
    def sqnr_db(self) -> float:
        """10 log10(sum x^2 / sum (x - y)^2); inf for a lossless cast."""
        return sqnr_db_of(self.sum_sq, self.sum_sq_err)

    @property
    def underflow_fraction(self) -> float:
        """Nonzero elements flushed to zero, over the elements cast."""
        return self.underflow / max(self.numel, 1)

    @property
    def overflow_fraction(self) -> float:
        """Elements saturated or not finite, over the elements cast."""
        return (self.saturated + self.nonfinite) / max(self.numel, 1)


def float8_measure(x: torch.Tensor, dtype: torch.dtype, dim: Optional[int],
                   power_of_two: bool) -> Measure:
    """The scaled float8 cast torchao's Float8Linear makes, measured exactly.

    As torchao.float8 does it: amax over the tensor (``dim`` None) or along
    ``dim`` (one scale per row or column), scale = finfo(dtype).max / amax
    in float64 rounded to float32 (down to a power of two if
    ``power_of_two``), ``x.float() * scale`` clamped to the format's range
    and cast; y is that divided by the scale, compared in float64. An
    element is saturated where its scaled value rounds past the format's
    largest (``Format.rounds_past_max``), as ``cast_with_stats`` counts it:
    the clamp changes nothing where the scaled value rounds to the largest
    anyway (a scale rounded up by an ulp puts amax just above it).

    Args:
        x: a 2-D floating tensor.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        dim: the dimension amax runs over, or None for one scale.
        power_of_two: round scales down to powers of two (the rowwise recipe).

    Returns:
        The Measure of the cast.
    """
    x32 = x.detach().to(torch.float32)
    finite = torch.isfinite(x32)
    mag = torch.where(finite, x32.abs(), torch.zeros_like(x32))
    amax = mag.amax() if dim is None else mag.amax(dim=dim, keepdim=True)
    top = torch.finfo(dtype).max
    scale = (top / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = x32 * scale
    y = scaled.clamp(-top, top).to(dtype).to(torch.float64) / scale.to(torch.float64)
    x64 = x.detach().to(torch.float64)
    ok = finite & torch.isfinite(y)
    err = torch.where(ok, x64 - y, torch.zeros_like(y))
    sq = torch.where(ok, x64 * x64, torch.zeros_like(y))
    return Measure(numel=x.numel(),
                   underflow=int(((x64 != 0) & (y == 0) & ok).sum()),
                   saturated=int((finite & format_of(dtype).rounds_past_max(scaled.abs())).sum()),
                   nonfinite=int((~ok).sum()),
                   sum_sq=float(sq.sum()), sum_sq_err=float((err * err).sum()))


def block_measure(x: torch.Tensor, fmt: str, scale_mode: Optional[str], axis: int) -> Measure:
    """block_cast(x, fmt) along ``axis``, its statistics as a Measure."""
    s = block_cast(x.detach(), fmt, axis=axis, scale_mode=scale_mode).stats
    return Measure(numel=s.numel, underflow=s.underflow, saturated=s.saturated,
                   nonfinite=s.nan + s.inf + s.overflow, sum_sq=s.sum_sq,
                   sum_sq_err=s.sum_sq_err)


def recipe_measure(x: torch.Tensor, recipe: str, role: str) -> Measure:
    """What ``recipe`` loses of x in ``role``: its 2-D view (rows are the
    tokens for inputs and gradients, the output features for a weight) cast
    as that recipe casts it. Tensorwise float8 makes one cast; rowwise,
    MXFP8 and NVFP4 scale along each of the two dimensions, one per GEMM
    the tensor enters, and both casts are summed."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if recipe in _FLOAT8:
        dtypes, pow2 = _FLOAT8[recipe]
        if recipe == "tensorwise":
            return float8_measure(x2, dtypes[role], None, pow2)
        return sum((float8_measure(x2, dtypes[role], d, pow2) for d in (-1, 0)), Measure())
    fmt, mode = _BLOCK[recipe]
    return sum((block_measure(x2, fmt, mode, a) for a in (-1, 0)), Measure())


@dataclasses.dataclass
class PrecisionPlan:
    """Per nn.Linear (by its name in the model), per recipe and tensor role,
    what the casts lost (``measures[(layer, recipe, role)]``) and the
    thresholds it is judged by. Plain data: ``to_dict``/``from_dict``."""

    layers: List[str]
    recipes: Tuple[str, ...]
    min_sqnr_db: Dict[str, float]
    max_underflow: Dict[str, float]
    max_overflow: float
    measures: Dict[Tuple[str, str, str], Measure]

    def reasons(self, layer: str, recipe: str) -> List[str]:
        """Why ``layer`` fails ``recipe``: one line per threshold a role
        broke (empty when it passes)."""
        self._check_recipe(recipe)
        out = []
        for role in ROLES:
            m = self.measures[(layer, recipe, role)]
            if not m.sqnr_db >= self.min_sqnr_db[recipe]:
                out.append(f"{role}: SQNR {m.sqnr_db:.1f} dB < {self.min_sqnr_db[recipe]:g} dB")
            if m.underflow_fraction > self.max_underflow[recipe]:
                out.append(f"{role}: {percent(m.underflow_fraction)} flushed to zero > "
                           f"{percent(self.max_underflow[recipe])}")
            if m.overflow_fraction > self.max_overflow:
                out.append(f"{role}: {percent(m.overflow_fraction)} saturated or not finite "
                           f"> {percent(self.max_overflow)}")
        return out

    def passes(self, layer: str, recipe: str) -> bool:
        """Whether every role of ``layer`` keeps within the thresholds."""
        return not self.reasons(layer, recipe)

    def keep_in_bf16(self, recipe: str) -> List[Tuple[str, str]]:
        """The layers to leave in high precision under ``recipe``, each with
        its reasons joined by "; "."""
        return [(layer, "; ".join(self.reasons(layer, recipe))) for layer in self.layers
                if not self.passes(layer, recipe)]

    def module_filter_fn(self, recipe: str) -> Callable[[torch.nn.Module, str], bool]:
        """``(module, fqn) -> bool``: True for the nn.Linear layers that pass
        ``recipe``. torchao.float8.convert_to_float8_training takes it as
        ``module_filter_fn``, torchao.quantize_ (the MXFP8 and NVFP4 training
        configs) as ``filter_fn``. fqn is the name in the model the plan
        measured: convert that model, not a submodule of it.

        Raises:
            ValueError: recipe is not one the plan measured.
        """
        self._check_recipe(recipe)
        convert = frozenset(layer for layer in self.layers if self.passes(layer, recipe))

        def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
            return isinstance(module, torch.nn.Linear) and fqn in convert
        return module_filter_fn

    def _check_recipe(self, recipe: str) -> None:
        if recipe not in self.recipes:
            raise ValueError(f"torchcast.PrecisionPlan: recipe {recipe!r} was not measured; "
                             f"this plan has {', '.join(map(repr, self.recipes))}")

    def __str__(self) -> str:
        limits = ", ".join(f"{r} {self.min_sqnr_db[r]:g} dB / {percent(self.max_underflow[r])}"
                           for r in self.recipes)
        head = (f"torchcast precision plan: {len(self.layers)} nn.Linear layers; a role fails "
                f"under its recipe's SQNR or over its flushed-to-zero fraction ({limits}), or "
                f"over {percent(self.max_overflow)} saturated")
        rows = [("layer", "recipe", "role", "SQNR", "flushed to 0", "saturated", "verdict")]
        for layer in self.layers:
            for recipe in self.recipes:
                verdict = "convert" if self.passes(layer, recipe) else "keep bf16"
                for role in ROLES:
                    m = self.measures[(layer, recipe, role)]
                    rows.append((layer, recipe, role, f"{m.sqnr_db:.1f} dB",
                                 percent(m.underflow_fraction), percent(m.overflow_fraction),
                                 verdict))
        return format_table(head, rows, left=3)

    def to_dict(self) -> Dict[str, Any]:
        """The plan as JSON-ready data: the measures with their SQNR (inf as
        the string "inf"), and per recipe each layer's reasons to stay in
        bf16 (empty: it passes)."""
        def number(x):
            return x if math.isfinite(x) else str(x)
        return {"layers": list(self.layers), "recipes": list(self.recipes),
                "min_sqnr_db": dict(self.min_sqnr_db), "max_underflow": dict(self.max_underflow),
                "max_overflow": self.max_overflow,
                "measures": [{"layer": k[0], "recipe": k[1], "role": k[2],
                              **{f: number(v) for f, v in dataclasses.asdict(m).items()},
                              "sqnr_db": number(m.sqnr_db)}
                             for k, m in self.measures.items()],
                "verdicts": {r: {layer: self.reasons(layer, r) for layer in self.layers}
                             for r in self.recipes}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PrecisionPlan":
        """Reads back ``to_dict``'s form (SQNR and verdicts are recomputed)."""
        measures = {}
        for e in d["measures"]:
            measures[(e["layer"], e["recipe"], e["role"])] = Measure(
                int(e["numel"]), int(e["underflow"]), int(e["saturated"]),
                int(e["nonfinite"]), float(e["sum_sq"]), float(e["sum_sq_err"]))
        return cls(list(d["layers"]), tuple(d["recipes"]), dict(d["min_sqnr_db"]),
                   dict(d["max_underflow"]), float(d["max_overflow"]), measures)


def _check_recipes(recipes: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    names = (recipes,) if isinstance(recipes, str) else tuple(recipes)
    bad = [r for r in names if r not in RECIPES]
    if bad or not names:
        raise ValueError(f"torchcast.precision_plan: unknown recipe(s) {bad or names!r}; "
                         f"expected some of {', '.join(map(repr, RECIPES))}")
    return names


def _per_recipe(value: Union[None, float, Dict[str, float]], default: Dict[str, float],
                names: Tuple[str, ...]) -> Dict[str, float]:
    """A threshold per recipe of ``names``: one value for all, a dict
    overriding the defaults, or the defaults."""
    if value is None:
        return {r: default[r] for r in names}
    if isinstance(value, dict):
        _check_recipes(list(value))
        return {r: float(value.get(r, default[r])) for r in names}
    return {r: float(value) for r in names}


def precision_plan(model: torch.nn.Module, run: Callable[[], Any], *,
                   recipes: Union[str, Sequence[str]] = RECIPES,
                   min_sqnr_db: Union[None, float, Dict[str, float]] = None,
                   max_underflow: Union[None, float, Dict[str, float]] = None,
                   max_overflow: float = DEFAULT_MAX_OVERFLOW) -> PrecisionPlan:
    """Measures each nn.Linear of ``model`` while ``run()`` trains it, and
    says which survive each low-precision recipe.

    While ``run`` runs (one or a few training steps: forward and backward),
    every nn.Linear's input and weight are cast at each call, and its
    output's gradient when backward reaches it, in each recipe's way (see
    :func:`recipe_measure`); the statistics add up over the calls. A role
    fails a recipe when its SQNR is below ``min_sqnr_db``, or more than
    ``max_underflow`` of its elements flushed to zero, or more than
    ``max_overflow`` saturated or were not finite; a layer passes when all
    three roles do. Works inside ``torchcast.track()`` (the plan's casts are
    not recorded).

    Args:
        model: the module whose nn.Linear layers are planned (named as
            ``model.named_modules()`` names them).
        run: called once with no arguments, with the hooks in place.
        recipes: some of "tensorwise", "rowwise" (torchao.float8's recipes
            of those names), "mxfp8" (MXFP8 e4m3, rceil scales, as torchao's
            MXFP8 training recipes), "nvfp4" (NVFP4 as block_cast casts it).
        min_sqnr_db: one SQNR floor in dB for all recipes, or a dict of
            floors per recipe (the others keep DEFAULT_MIN_SQNR_DB's).
        max_underflow: the largest fraction of elements flushed to zero,
            one for all recipes or a dict per recipe (the others keep
            DEFAULT_MAX_UNDERFLOW's).
        max_overflow: the largest fraction saturated or not finite.

    Returns:
        The PrecisionPlan.

    Raises:
        ValueError: an unknown recipe; a model without nn.Linear; a run in
            which no nn.Linear was called, or none received a gradient.
    """
    names = _check_recipes(recipes)
    floors = _per_recipe(min_sqnr_db, DEFAULT_MIN_SQNR_DB, names)
    flushes = _per_recipe(max_underflow, DEFAULT_MAX_UNDERFLOW, names)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise ValueError(f"torchcast.precision_plan: {type(model).__name__} has no nn.Linear "
                         "to plan; pass the model that holds them")
    measures: Dict[Tuple[str, str, str], Measure] = {}

    def add(layer: str, role: str, t: torch.Tensor) -> None:
        with unwatched(), torch.no_grad():
            for r in names:
                key = (layer, r, role)
                measures[key] = measures.get(key, Measure()) + recipe_measure(t, r, role)

    def pre_hook(layer):
        def hook(module, args):
            add(layer, "input", args[0])
            add(layer, "weight", module.weight)
        return hook

    def out_hook(layer):
        def hook(module, args, output):
            if output.requires_grad:
                output.register_hook(lambda g: add(layer, "grad_output", g))
        return hook

    handles = []
    try:
        for name, m in linears:
            handles.append(m.register_forward_pre_hook(pre_hook(name)))
            handles.append(m.register_forward_hook(out_hook(name)))
        run()
    finally:
        for h in handles:
            h.remove()
    seen = [n for n, _ in linears if (n, names[0], "input") in measures]
    if not seen:
        raise ValueError("torchcast.precision_plan: run() called none of the model's "
                         f"{len(linears)} nn.Linear layers; run a forward and backward of it")
    missing = [n for n in seen if (n, names[0], "grad_output") not in measures]
    if missing:
        raise ValueError(f"torchcast.precision_plan: no gradient reached {', '.join(missing)}; "
                         "run() must call backward (a training step, not inference)")
    return PrecisionPlan(seen, names, floors, flushes, float(max_overflow), measures)
