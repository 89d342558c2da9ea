"""Optimizers that keep low-precision parameters accurate: Adam and AdamW with
Kahan-compensated (or float32-remainder) updates in one fused step."""
from .adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]
