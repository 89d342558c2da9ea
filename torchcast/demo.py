"""`python -m torchcast demo`: a float64 N-body simulation in SI units, its
data cast to float32/bfloat16/float16 with the stats of every cast, and a
policy catching the overflow a careless cast would hide."""
import math
from typing import Callable, Dict, Iterable, List, Tuple

import torch

from .cast import PrecisionLossError, cast_with_stats, last_stats, safe_to
from .stats import CastStats

G = 6.674e-11  # m^3 kg^-1 s^-2
SOLAR_MASS = 1.989e30  # kg
PARSEC = 3.0857e16  # m


def simulate(n: int = 384, steps: int = 100, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A Plummer-like star cluster integrated with leapfrog in float64.

    Args:
        n: the number of stars.
        steps: the number of leapfrog steps (about a thousand years each).
        seed: seeds the ``torch.Generator`` that draws masses, positions
            and velocities, so a call is reproducible.

    Returns:
        The physical quantities one would store or feed to a model, by name
        with unit: float64 tensors of shape ``(n, 3)``, the pair potentials
        of shape ``(n * (n - 1) // 2,)``.
    """
    g = torch.Generator().manual_seed(seed)
    mass = SOLAR_MASS * torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
    pos = PARSEC * torch.randn(n, 3, generator=g, dtype=torch.float64)
    vel = 1e3 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    soft2 = (0.01 * PARSEC) ** 2
    dt = 3.15e10  # about a thousand years

    def accel(p):
        d = p[None, :, :] - p[:, None, :]
        inv3 = (d.pow(2).sum(-1) + soft2).pow(-1.5)
        return G * (d * (mass[None, :, None] * inv3[..., None])).sum(1)

    a = accel(pos)
    for _ in range(steps):
        vel += 0.5 * dt * a
        pos += dt * vel
        a = accel(pos)
        vel += 0.5 * dt * a
    d = (pos[None, :, :] - pos[:, None, :]).pow(2).sum(-1).add(soft2).sqrt()
    iu = torch.triu_indices(n, n, 1)
    potential = -G * mass[iu[0]] * mass[iu[1]] / d[iu[0], iu[1]]
    return {
        "position [m]": pos,
        "velocity [m/s]": vel,
        "acceleration [m/s^2]": a,
        "pair potential [J]": potential,
        "angular momentum [kg m^2/s]": mass[:, None] * torch.linalg.cross(pos, vel),
    }


def stats_table(rows: Iterable[Tuple[str, CastStats]]) -> str:
    """The stats of several casts as an aligned text table, one row a cast.

    Args:
        rows: ``(name of the data, CastStats of its cast)`` pairs.

    Returns:
        The table, a header line and a rule first, lines joined by newlines.
    """
    head = ("data", "cast", "elements", "inexact", "overflow", "underflow", "subnormal",
            "max rel err", "SQNR dB")
    body = [
        (name, f"{str(s.src_dtype)[6:]}->{str(s.dtype)[6:]}", str(s.numel), str(s.inexact),
         str(s.overflow), str(s.underflow), str(s.subnormal), f"{s.max_rel_err:.3g}",
         f"{s.sqnr_db:.1f}" if math.isfinite(s.sqnr_db) else str(s.sqnr_db))
        for name, s in rows
    ]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body])


def run(out: Callable[[str], object] = print, n: int = 384,
        steps: int = 100) -> List[Tuple[str, CastStats]]:
    """Runs the demo: simulates, casts every quantity to float32, bfloat16
    and float16 with ``torchcast.cast_with_stats``, prints the table of what
    each cast lost, then shows ``safe_to(..., policy="raise")`` catching the
    overflow that ``Tensor.to`` hides.

    Args:
        out: receives the text, one block per call (``print`` by default).
        n, steps: as ``simulate``.

    Returns:
        The table's rows: ``(name of the data, CastStats of its cast)``.
    """
    data = simulate(n, steps)
    out(f"torchcast demo: a {n}-star cluster, {steps} leapfrog steps in float64 (SI units)\n")
    rows = []
    for name, x in data.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            _, stats = cast_with_stats(x, dtype)
            rows.append((name, CastStats.from_tensor(stats, x.dtype, dtype)))
    out(stats_table(rows))

    momentum = data["angular momentum [kg m^2/s]"]
    out("\nStoring the angular momenta as float32 with policy='raise':")
    try:
        safe_to(momentum, torch.float32, policy="raise", name="angular momentum")
        out("  no loss")
    except PrecisionLossError as e:
        out(f"  PrecisionLossError: {e}")
    plain = momentum.to(torch.float32)
    out(f"  (momentum.to(torch.float32) says nothing: {int(torch.isinf(plain).sum())} of "
        f"{plain.numel()} values silently became inf)")
    unit = SOLAR_MASS * PARSEC * 1e3  # solar mass * parsec * km/s
    rescaled = safe_to(momentum / unit, torch.float32, policy="raise", name="angular momentum")
    out(f"  In units of solar mass * pc * km/s the cast passes: {last_stats()}; "
        f"y is {rescaled.dtype}")
    return rows
