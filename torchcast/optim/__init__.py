"""Optimizers that keep low-precision parameters accurate: Adam and AdamW with
Kahan-compensated (or float32-remainder, or stochastically rounded) updates in
one fused step, which can also count what rounding did to each update."""
from ._update_stats import UpdateRecord, UpdateStats
from .adam import Adam, AdamW

__all__ = ["Adam", "AdamW", "UpdateRecord", "UpdateStats"]
