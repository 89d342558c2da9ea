"""block_cast: a tensor cast to a block-scaled format (MXFP8, MXFP4, NVFP4),
with what the cast lost, element by element and block by block.

The formats and their scale rules are torchcast/formats.py's table and
docs/formats.md; the per-block math is csrc/block_cast.h, restated in
torchcast/_reference/block_cast.py."""
from typing import Dict, NamedTuple, Optional

import torch

from . import _ops
from .formats import FORMATS, block_format
from .stats import CastStats

__all__ = ["BlockCast", "block_cast"]

# e2m1's values by code (sign in bit 3), for dequantize.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# NVFP4's default tensor scale: amax / (largest e4m3 * largest e2m1), so
# that the block with the tensor's amax gets the largest block scale.
_NVFP4_SCALE_DIVISOR = FORMATS["float8_e4m3fn"].max * FORMATS["float4_e2m1fn"].max
_FLOAT32_TINY = FORMATS["float32"].min_subnormal


class BlockCast(NamedTuple):
    """The result of :func:`block_cast`.

    ``data`` holds the elements (float8_e4m3fn or float8_e5m2; for 4-bit
    elements uint8, two a byte along ``axis``, the first in the low nibble),
    ``scales`` one scale per block along ``axis`` (float8_e8m0fnu for MX,
    float8_e4m3fn for NVFP4), ``tensor_scale`` NVFP4's float32 scale of the
    whole tensor (None for MX). ``stats_tensor``, ``scale_hist`` and
    ``block_counts`` are the op's raw outputs, read by the properties below
    without a host synchronization until one is asked for. ``source`` is x
    itself (its shape and dtype, and the graph dequantize's gradient flows
    into); ``axis`` is non-negative.
    """

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: Optional[torch.Tensor]
    stats_tensor: torch.Tensor
    scale_hist: torch.Tensor
    block_counts: torch.Tensor
    format: str
    block_size: int
    axis: int
    scale_mode: str
    source: torch.Tensor

    @property
    def stats(self) -> CastStats:
        """What the cast lost, with cast_with_stats' fields, measured against
        x: y is the value each element stands for (element times its block's
        scale, times the tensor scale for NVFP4), exact in float64. A finite
        x in a block whose scale is NaN (the block holds a NaN) reads back
        NaN and counts as an overflow; ``saturated`` counts elements whose
        scaled value rounded past the element format's largest (inf
        included); ``subnormal`` elements subnormal in the element format."""
        fmt = block_format(self.format)
        # torch's dtype for e2m1 is the packed pair, float4_e2m1fn_x2.
        element = torch.float4_e2m1fn_x2 if fmt.packed else fmt.element.dtype
        return CastStats.from_tensor(self.stats_tensor, self.source.dtype, element)

    @property
    def blocks(self) -> int:
        """How many blocks (scales) there are."""
        return int(self.block_counts[0])

    @property
    def saturated_blocks(self) -> int:
        """Blocks in which at least one element saturated (its amax did)."""
        return int(self.block_counts[1])

    @property
    def underflow_blocks(self) -> int:
        """Blocks in which more than half of the elements underflowed to zero."""
        return int(self.block_counts[2])

    @property
    def nan_blocks(self) -> int:
        """Blocks whose scale is NaN (the block holds a NaN)."""
        return int(self.block_counts[3])

    def scale_distribution(self) -> Dict[int, int]:
        """How many blocks have each scale, keyed by the scale's byte: for MX
        the e8m0 bits b (the scale is 2^(b - 127); 255 is NaN), for NVFP4 the
        e4m3 bits. Only bytes that occur are listed."""
        hist = self.scale_hist.tolist()
        return {b: count for b, count in enumerate(hist) if count}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values the cast stands for, element times scale (times the
        tensor scale), formed exactly in float64 and rounded once to dtype,
        in x's shape.

        Gradient: straight-through. Where x requires grad, the result's
        gradient flows to x unchanged (cast to x's dtype): the derivative of
        dequantize(block_cast(x)) is taken to be the identity, the usual
        choice for training through a quantizer, whose true derivative is
        zero almost everywhere.

        Args:
            dtype: the floating dtype of the result.
        """
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"BlockCast.dequantize: dtype must be a floating dtype, got {dtype}")
        fmt = block_format(self.format)
        data = self.data.movedim(self.axis, -1)
        scales = self.scales.movedim(self.axis, -1)
        n = self.source.shape[self.axis]
        if fmt.packed:
            table = torch.tensor(_E2M1, dtype=torch.float64, device=data.device)
            codes = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)[..., :n]
            elements = table[codes.long()]
        else:
            elements = data.to(torch.float64)
        scale = scales.to(torch.float64)
        if self.tensor_scale is not None:
            scale = scale * self.tensor_scale.reshape(()).to(torch.float64)
        scale = scale.repeat_interleave(self.block_size, dim=-1)[..., :n]
        y = (elements * scale).to(dtype).movedim(-1, self.axis)
        if self.source.requires_grad and torch.is_grad_enabled():
            return _ops.straight_through(self.source, y)
        return y


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's default float32 tensor scale of x: amax(|x|) / (448 * 6), as
    torchao's per_tensor_amax_to_scale; the smallest positive float32,
    2^-149, where that quotient underflows to zero for a nonzero amax (below
    about 1.9e-42), and 1.0 where amax is zero or the quotient not finite
    (an all-zero x, or one holding inf or NaN): in both torchao's would make
    every block scale NaN."""
    amax = x.detach().abs().amax() if x.numel() else x.new_zeros(())
    scale = (amax.to(torch.float32) / _NVFP4_SCALE_DIVISOR).clamp(min=_FLOAT32_TINY)
    return torch.where(torch.isfinite(scale) & (amax > 0), scale, torch.ones_like(scale))


def block_cast(x: torch.Tensor, format: str, *, block_size: Optional[int] = None,
               axis: int = -1, scale_mode: Optional[str] = None,
               tensor_scale: Optional[torch.Tensor] = None) -> BlockCast:
    """Casts x to a block-scaled format and measures what that lost.

    One pass over x on the CPU (and a CUDA kernel beside it): each block's
    amax, its scale, its elements rounded to nearest even and clamped to the
    element format's range, and the statistics of cast_with_stats measured
    against x, plus per-block facts (the scales' distribution, blocks that
    saturate, blocks that mostly underflow). NVFP4's default tensor scale
    takes one more reduction over x first.

    Args:
        x: a float64, float32, float16 or bfloat16 tensor of at least one
            dimension, on any device (CPU and CUDA have kernels; others run
            the pure-PyTorch reference).
        format: "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4" (OCP MX v1.0: an e8m0
            power-of-two scale per 32 elements) or "nvfp4" (e2m1 elements, an
            e4m3 scale per 16 and a float32 scale per tensor).
        block_size: elements per block along ``axis`` (the format's own by
            default; even for 4-bit elements). A last block shorter than
            block_size is scaled by its own amax.
        axis: the dimension blocks run along.
        scale_mode: how an MX block's scale is derived from its amax, as
            torchao's ScaleCalculationMode: "floor" (the default, OCP MX
            v1.0), "ceil", "even" or "rceil"; NVFP4 has one rule, "amax"
            (its default). docs/formats.md states each.
        tensor_scale: NVFP4 only: the float32 tensor scale (a one-element
            tensor on x's device, positive and finite); by default
            amax(|x|) / (448 * 6) (``nvfp4_tensor_scale``).

    Returns:
        A :class:`BlockCast`: data, scales, stats, per-block facts and
        ``dequantize()`` (straight-through gradient to x).
    """
    fmt = block_format(format)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"torchcast.block_cast: x must be a tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("torchcast.block_cast: x is 0-d; blocks run along a dimension "
                         "(x.reshape(1) for a single value)")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"torchcast.block_cast: axis {axis} is out of range for x of shape "
                         f"{tuple(x.shape)}")
    axis = axis % x.dim()
    block_size = fmt.block_size if block_size is None else block_size
    scale_mode = fmt.scale_modes[0] if scale_mode is None else scale_mode
    if fmt.tensor_scale and tensor_scale is None:
        tensor_scale = nvfp4_tensor_scale(x)
    data, scales, stats, hist, counts = _ops.block_cast(
        x.detach().movedim(axis, -1), fmt.name, block_size, scale_mode, tensor_scale)
    return BlockCast(data.movedim(-1, axis), scales.movedim(-1, axis), tensor_scale, stats, hist,
                     counts, fmt.name, block_size, axis, scale_mode, x)
