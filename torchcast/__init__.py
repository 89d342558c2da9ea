"""torchcast: accountable dtype casts and compensated low-precision arithmetic."""
from . import _ops  # loads the compiled kernels and registers the ops
from .reduce import kahan_sum, kahan_mean
