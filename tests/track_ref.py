"""Independent reference for torchcast.track's tests: the statistics of a cast
that produced a GIVEN result y (PyTorch's, which for float64 ->
float16/bfloat16 is rounded twice), computed in numpy float64 with math.fsum."""
import math

import numpy as np
import torch

from numpy_ref import stats_of_values

EXACT_FIELDS = ("numel", "nan", "inexact", "overflow", "underflow", "subnormal",
                "max_abs_err", "max_rel_err")
SUM_FIELDS = ("sum_abs_err", "sum_sq_err", "sum_sq")


def as64(t):
    return t.detach().cpu().to(torch.float64).numpy().ravel()


def stats_of_cast(x, y):
    """Stats of "x became y", per CastStats' definitions (numpy_ref)."""
    return stats_of_values(as64(x), as64(y), x.dtype, torch.finfo(y.dtype).tiny)


def assert_stats_match(s, ref, what=""):
    for f in EXACT_FIELDS:
        assert getattr(s, f) == ref[f], (what, f, getattr(s, f), ref[f])
    for f in SUM_FIELDS:
        if not math.isfinite(getattr(s, f)):  # float32 accumulators end past 3.4e38
            assert ref[f] > 3.0e38, (what, f, getattr(s, f), ref[f])
            continue
        # float32 compensated sums: 1e-6 relative plus each term's rounding to
        # float32 (below its subnormal range).
        tol = 1e-6 * abs(ref[f]) + s.numel * 2.0 ** -150
        assert abs(getattr(s, f) - ref[f]) <= tol, (what, f, getattr(s, f), ref[f])


def merge_refs(refs):
    out = {}
    for f in EXACT_FIELDS + SUM_FIELDS:
        values = [r[f] for r in refs]
        out[f] = max(values) if f.startswith("max_") else (
            math.fsum(values) if f in SUM_FIELDS else sum(values))
    return out


def double_rounding_values(dtype, n, seed=0):
    """float64 values near the midpoints between neighbours of dtype (float16
    or bfloat16), displaced by less than half a float32 ulp: float32 rounds
    them onto the midpoint, and the tie then goes to the even neighbour,
    which for about half of them is the wrong one."""
    g = np.random.default_rng(seed)
    lo = torch.tensor(g.uniform(-8, 8, n), dtype=torch.float64).exp2().to(dtype)
    hi = (lo.view(torch.int16) + 1).view(dtype)  # next value up (positive, finite)
    mid = (lo.double() + hi.double()) / 2
    delta = torch.tensor(g.uniform(-0.4, 0.4, n), dtype=torch.float64) * mid * 2.0 ** -24
    sign = torch.tensor(g.choice([-1.0, 1.0], n), dtype=torch.float64)
    return (mid + delta) * sign
