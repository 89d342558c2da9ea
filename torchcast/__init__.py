"""torchcast: accountable dtype casts and compensated low-precision arithmetic."""
from . import _ops  # loads the compiled kernels and registers the ops
from . import nn
from . import optim
from . import scaling
from .reduce import kahan_mean, kahan_sum
from .cast import (
    PrecisionLossError, PrecisionWarning, cast_with_stats, get_policy, last_scale, last_stats,
    policy, safe_to, set_policy,
)
from .stats import CastStats
from .health import TensorHealth, tensor_health
from . import formats
from .block import BlockCast, block_cast

__all__ = [
    "BlockCast", "block_cast", "formats", "CastStats", "PrecisionLossError", "PrecisionWarning", "cast_with_stats", "get_policy",
    "kahan_mean", "kahan_sum", "last_scale", "last_stats", "nn", "optim", "policy", "safe_to",
    "scaling", "set_policy", "TensorHealth", "tensor_health",
]

# track() records the casts a program makes; audit() checks a model's casts with it.
from .tracker import NonFiniteError, NonFiniteWarning, Record, Report, track  # noqa: E402
from .audit import AuditReport, Finding, audit  # noqa: E402

__all__ += ["AuditReport", "Finding", "NonFiniteError", "NonFiniteWarning", "Record", "Report",
            "audit", "track"]

# precision_plan measures each nn.Linear under torchao's low-precision recipes.
from .plan import PrecisionPlan, precision_plan  # noqa: E402

__all__ += ["PrecisionPlan", "precision_plan"]
