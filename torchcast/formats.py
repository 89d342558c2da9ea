"""The one table of number formats: every fact about a floating-point element
format (its bits, range, subnormal spacing, what happens past its range) and
about the block-scaled formats built on them (block size, scale format). The
C++ side states the same facts once, as the traits of csrc/formats.h;
tests/test_formats.py checks the two against each other and against
torch.finfo and ml_dtypes.finfo.

Element formats are keyed by name ("float8_e4m3fn"); those torch stores as a
dtype of their own carry it (``Format.dtype``). float4_e2m1fn has no torch
dtype of one element (torch packs two: float4_e2m1fn_x2); block_cast stores it
packed in uint8, two elements a byte, the first in the low nibble.
"""
import dataclasses
import math
from typing import Dict, Optional, Tuple

import torch

__all__ = ["BLOCK_FORMATS", "BlockFormat", "FLOAT8", "FORMATS", "FLOAT_RANK", "Format",
           "NARROW_TARGETS", "block_format", "format_of"]


@dataclasses.dataclass(frozen=True)
class Format:
    """One binary floating-point element format.

    ``overflow`` says what a finite value that rounds past ``max`` becomes
    when the cast does not saturate: "inf" (IEEE-like formats), "nan"
    (float8_e4m3fn, whose only non-finite encoding is NaN) or "clamp"
    (float4_e2m1fn, which has neither: every cast to it saturates).
    ``signed`` is False for float8_e8m0fnu, the MX scale format: eight
    exponent bits, no sign, no mantissa, no zero, 0xff is NaN.
    ``rank`` orders the formats torchcast's casts measure by width (a cast to
    a higher rank is exact); 0 for formats those casts do not take.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_nan: bool
    overflow: str
    signed: bool = True
    rank: int = 0
    dtype: Optional[torch.dtype] = None

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two <= max (OCP MX's emax_elem)."""
        return math.frexp(self.max)[1] - 1

    @property
    def first_overflow(self) -> float:
        """The smallest magnitude that rounds (to nearest even) past ``max``:
        max plus half its ulp, a tie that rounds up where max's last mantissa
        bit is odd (then this value itself overflows) and down where it is even
        (then only values above it do); see ``overflow_at_tie``."""
        return self.max + 2.0 ** (self.emax - self.mantissa_bits - 1)

    @property
    def overflow_at_tie(self) -> bool:
        """Whether ``first_overflow`` itself rounds past max (max's last
        mantissa bit is odd: the tie goes to the even value above)."""
        mantissa = int(self.max / 2.0 ** (self.emax - self.mantissa_bits))
        return mantissa % 2 == 1

    def rounds_past_max(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Whether each magnitude (>= 0; inf included) rounds to nearest even
        past ``max``: what a saturating cast clamps and counts as saturated,
        and what a plain one makes inf (or NaN). A value above max but below
        ``first_overflow`` rounds to max: it is not saturated.

        Args:
            magnitude: a floating tensor of absolute values.
        """
        if self.overflow_at_tie:
            return magnitude >= self.first_overflow
        return magnitude > self.first_overflow


def _table(*formats: Format) -> Dict[str, Format]:
    return {f.name: f for f in formats}


FORMATS: Dict[str, Format] = _table(
    Format("float64", 64, 11, 52, 1023, 1.7976931348623157e308, 2.0 ** -1022, 2.0 ** -1074,
           True, True, "inf", rank=4, dtype=torch.float64),
    Format("float32", 32, 8, 23, 127, 3.4028234663852886e38, 2.0 ** -126, 2.0 ** -149,
           True, True, "inf", rank=3, dtype=torch.float32),
    Format("float16", 16, 5, 10, 15, 65504.0, 2.0 ** -14, 2.0 ** -24, True, True, "inf",
           rank=2, dtype=torch.float16),
    Format("bfloat16", 16, 8, 7, 127, 3.3895313892515355e38, 2.0 ** -126, 2.0 ** -133,
           True, True, "inf", rank=2, dtype=torch.bfloat16),
    Format("float8_e4m3fn", 8, 4, 3, 7, 448.0, 2.0 ** -6, 2.0 ** -9, False, True, "nan",
           rank=1, dtype=torch.float8_e4m3fn),
    Format("float8_e5m2", 8, 5, 2, 15, 57344.0, 2.0 ** -14, 2.0 ** -16, True, True, "inf",
           rank=1, dtype=torch.float8_e5m2),
    Format("float4_e2m1fn", 4, 2, 1, 1, 6.0, 1.0, 0.5, False, False, "clamp"),
    # Every value is a power of two 2^(bits - 127); 2^-127 (bits 0) is its
    # smallest, and no value is subnormal.
    Format("float8_e8m0fnu", 8, 8, 0, 127, 2.0 ** 127, 2.0 ** -127, 2.0 ** -127, False, True,
           "nan", signed=False, dtype=torch.float8_e8m0fnu),
)

FLOAT_RANK: Dict[torch.dtype, int] = {f.dtype: f.rank for f in FORMATS.values() if f.rank}
"""The floating dtypes cast_with_stats measures, by width: a cast to a higher
rank is exact (csrc/cast_common.cpp's float_rank states the same)."""

NARROW_TARGETS: Tuple[torch.dtype, ...] = tuple(
    dtype for dtype, rank in FLOAT_RANK.items() if rank < FLOAT_RANK[torch.float32])
"""The measured dtypes narrower than float32, widest first: float16,
bfloat16, float8_e4m3fn, float8_e5m2 (headroom's formats, the health
page's windows, the casts that double-round from float64)."""

FLOAT8: Tuple[torch.dtype, ...] = tuple(
    dtype for dtype, rank in FLOAT_RANK.items() if rank == FORMATS["float8_e4m3fn"].rank)
"""The float8 dtypes the casts measure (which cannot be cast into each other)."""


def format_of(dtype: torch.dtype) -> Format:
    """The Format of a torch dtype (KeyError for a dtype the table lacks)."""
    return _BY_DTYPE[dtype]


_BY_DTYPE = {f.dtype: f for f in FORMATS.values() if f.dtype is not None}


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``element`` values, one ``scale`` per
    ``block_size`` consecutive elements along one axis, and for NVFP4 a
    float32 scale for the whole tensor (``tensor_scale``).

    ``element_dtype`` is what block_cast's data tensor holds (uint8, two
    elements a byte, for float4_e2m1fn); ``scale_modes`` the rules it can
    derive a block's scale by (the first is the default).
    """

    name: str
    element: Format
    block_size: int
    scale: Format
    tensor_scale: bool
    element_dtype: torch.dtype
    scale_modes: tuple

    @property
    def packed(self) -> bool:
        """Whether two elements share a byte of the data tensor."""
        return self.element.bits == 4


# The MX scale modes of torchao's ScaleCalculationMode: "floor" is the OCP
# MX v1.0 rule (docs/formats.md has all four).
MX_SCALE_MODES = ("floor", "ceil", "even", "rceil")
# NVFP4's block scale is amax / 6 (over the tensor scale) rounded to e4m3:
# one rule, named for what it rounds.
NVFP4_SCALE_MODES = ("amax",)

BLOCK_FORMATS: Dict[str, BlockFormat] = {
    b.name: b for b in (
        BlockFormat("mxfp8_e4m3", FORMATS["float8_e4m3fn"], 32, FORMATS["float8_e8m0fnu"],
                    False, torch.float8_e4m3fn, MX_SCALE_MODES),
        BlockFormat("mxfp8_e5m2", FORMATS["float8_e5m2"], 32, FORMATS["float8_e8m0fnu"],
                    False, torch.float8_e5m2, MX_SCALE_MODES),
        BlockFormat("mxfp4", FORMATS["float4_e2m1fn"], 32, FORMATS["float8_e8m0fnu"],
                    False, torch.uint8, MX_SCALE_MODES),
        BlockFormat("nvfp4", FORMATS["float4_e2m1fn"], 16, FORMATS["float8_e4m3fn"],
                    True, torch.uint8, NVFP4_SCALE_MODES),
    )
}


def block_format(name: str) -> BlockFormat:
    """The BlockFormat called ``name``; ValueError naming the choices otherwise."""
    try:
        return BLOCK_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"torchcast.block_cast: unknown format {name!r}; expected one of "
                         f"{', '.join(map(repr, BLOCK_FORMATS))}") from None
