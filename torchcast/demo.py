"""`python -m torchcast demo`: a float64 N-body simulation in SI units, its
data cast to float32/bfloat16/float16 with the stats of every cast, and a
policy catching the overflow a careless cast would hide."""
import math

import torch

from .cast import PrecisionLossError, last_stats, safe_to
from .stats import CastStats

G = 6.674e-11  # m^3 kg^-1 s^-2
SOLAR_MASS = 1.989e30  # kg
PARSEC = 3.0857e16  # m


def simulate(n=384, steps=100, seed=0):
    """A Plummer-like star cluster integrated with leapfrog in float64.

    Returns the physical quantities one would store or feed to a model."""
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


def stats_table(rows):
    """rows: (name, CastStats) -> an aligned text table."""
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


def run(out=print, n=384, steps=100):
    data = simulate(n, steps)
    out(f"torchcast demo: a {n}-star cluster, {steps} leapfrog steps in float64 (SI units)\n")
    rows = []
    for name, x in data.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y, stats = torch.ops.torchcast.cast_with_stats(x, dtype)
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
