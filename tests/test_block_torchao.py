"""torchcast.block_cast bit for bit against torchao 0.18's reference casts
(torchao.prototype.mx_formats: to_mx for MX in each ScaleCalculationMode,
nvfp4_quantize for NVFP4), and the places where torchcast follows the OCP MX
v1.0 specification or the exact cuBLAS/PTX rule instead, or departs where
torchao's float32 arithmetic overflows (docs/formats.md's table).

torchao is a test-only dependency (requirements.txt); without it these
tests skip, saying why."""
import math
from fractions import Fraction

import pytest
import torch

import torchcast

try:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
except Exception as error:  # ImportError, or torchao failing against this torch
    pytestmark = pytest.mark.skip(reason=f"torchao is not importable here: {error!r}")

ELEMENT = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
           "mxfp4": torch.float4_e2m1fn_x2}
MX = [(f, m) for f in ELEMENT for m in ("floor", "ceil", "even", "rceil")]


def u8(t):
    return t.contiguous().view(torch.uint8)


def heavy_tailed(shape, seed):
    """float32 normal values times e^(4 N(0, 1)), with an all-zero block,
    a block of tiny values (scale 2^-110 or so) and one near float32's
    largest. (Blocks whose scale clamps at 2^-127 are where torchao departs
    from the specification: test_floor_smallest_scale_follows_the_spec.)"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(4 * torch.randn(shape, generator=g))
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1, 1, 32) * 2.0 ** -100
    x[2, :32] = torch.linspace(-1, 1, 32) * 3.0e38
    return x


def ours_and_torchao(x, fmt, mode, source=None):
    """(ours, torchao's) (scale bits, data bits) of x; ours from `source`
    (x in another dtype holding the same values) when given."""
    r = torchcast.block_cast(x if source is None else source, fmt, scale_mode=mode)
    scale, data = to_mx(x, ELEMENT[fmt], 32, ScaleCalculationMode(mode))
    return (u8(r.scales), u8(r.data)), (u8(scale), u8(data))


@pytest.mark.parametrize("fmt,mode", MX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_matches_torchao(fmt, mode, dtype):
    x = heavy_tailed((16, 512), seed=1).to(dtype)
    ours, theirs = ours_and_torchao(x, fmt, mode)
    assert torch.equal(ours[0], theirs[0]), "scales differ"
    assert torch.equal(ours[1], theirs[1]), "elements differ"


@pytest.mark.parametrize("fmt,mode", MX)
def test_mx_from_float16_and_float64_matches_torchao_on_the_same_values(fmt, mode):
    """torchao takes float32 and bfloat16; a float16 or float64 x holding
    float32 values casts as torchao casts those values."""
    x16 = heavy_tailed((8, 256), seed=2).to(torch.float16)
    ours, theirs = ours_and_torchao(x16.float(), fmt, mode, source=x16)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    x32 = heavy_tailed((8, 256), seed=3)
    ours, theirs = ours_and_torchao(x32, fmt, mode, source=x32.double())
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("fmt,mode", MX)
def test_nan_and_inf_inside_blocks(fmt, mode):
    """Scales equal torchao's everywhere (NaN: 0xff; inf: its exponent field
    as amax's, or 2^127 under rceil). Elements equal torchao's outside
    blocks whose scale is NaN; inside them the OCP MX block decodes NaN
    whatever its elements hold, and torchao writes x / inf (floor, ceil,
    even), x * NaN (rceil) or, for e2m1, which has no NaN, 1.5 for a NaN,
    while torchcast writes x / inf in every mode and e2m1's largest for NaN."""
    x = heavy_tailed((4, 128), seed=4)
    x[0, 3], x[1, 40], x[2, 70], x[3, 100], x[3, 101] = math.nan, math.inf, -math.inf, math.nan, \
        -math.inf
    ours, theirs = ours_and_torchao(x, fmt, mode)
    assert torch.equal(ours[0], theirs[0])
    nan_block = (ours[0] == 0xFF).repeat_interleave(32, dim=-1)
    if fmt == "mxfp4":
        nan_block = nan_block[:, ::2]
    assert torch.equal(ours[1][~nan_block], theirs[1][~nan_block])
    assert nan_block.any()
    r = torchcast.block_cast(x, fmt, scale_mode=mode)
    y = r.dequantize()
    assert torch.isnan(y[(ours[0] == 0xFF).repeat_interleave(32, dim=-1)]).all()


@pytest.mark.parametrize("fmt,mode", MX)
def test_ragged_last_block_is_torchao_on_the_zero_padded_tensor(fmt, mode):
    """torchao requires whole blocks; torchcast scales a short last block by
    its own amax, which is what zero padding to a whole block gives."""
    x = heavy_tailed((6, 70), seed=5)
    padded = torch.nn.functional.pad(x, (0, 26))
    r = torchcast.block_cast(x, fmt, scale_mode=mode)
    scale, data = to_mx(padded, ELEMENT[fmt], 32, ScaleCalculationMode(mode))
    assert torch.equal(u8(r.scales), u8(scale))
    assert torch.equal(u8(r.data), u8(data)[:, :u8(r.data).shape[1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("two_level", [True, False])
def test_nvfp4_matches_torchao(dtype, two_level):
    x = heavy_tailed((16, 256), seed=6)
    x[3, 17] = math.inf
    x = x.to(dtype)
    source = x.float() if dtype in (torch.float16, torch.float64) else x
    tensor_scale = per_tensor_amax_to_scale(source[torch.isfinite(source)].abs().amax()) \
        if two_level else torch.tensor(1.0)
    r = torchcast.block_cast(x, "nvfp4", tensor_scale=tensor_scale)
    scale, data = nvfp4_quantize(source, 16, tensor_scale if two_level else None)
    assert torch.equal(u8(r.scales), u8(scale))
    assert torch.equal(u8(r.data), u8(data))


def test_nvfp4_nan_blocks_and_default_tensor_scale():
    """A NaN makes its block's e4m3 scale NaN, as in torchao (whose e2m1
    elements there read 1.5 for NaN; torchcast's e2m1's largest). An
    all-zero x: torchao's per-tensor scale is 0 and every block scale NaN;
    torchcast's default tensor scale is then 1.0, and a given 0 is refused
    (every element would be lost while the errors read as a cast's)."""
    x = heavy_tailed((4, 64), seed=7)
    x[1, 20] = math.nan
    ts = torch.tensor(0.5)
    r = torchcast.block_cast(x, "nvfp4", tensor_scale=ts)
    scale, data = nvfp4_quantize(x, 16, ts)
    assert torch.equal(u8(r.scales), u8(scale)) and u8(r.scales)[1, 1] == 0x7F
    keep = torch.ones_like(u8(r.data), dtype=torch.bool)
    keep[1, 8:16] = False
    assert torch.equal(u8(r.data)[keep], u8(data)[keep])

    zeros = torch.zeros(2, 32)
    theirs, _ = nvfp4_quantize(zeros, 16, per_tensor_amax_to_scale(zeros.abs().amax()))
    assert torch.isnan(theirs.float()).all()
    r = torchcast.block_cast(zeros, "nvfp4")
    assert r.tensor_scale == 1.0 and not torch.isnan(r.scales.float()).any()
    assert torch.equal(r.dequantize(), zeros)
    with pytest.raises(ValueError, match="tensor_scale must be positive and finite"):
        torchcast.block_cast(zeros, "nvfp4", tensor_scale=torch.tensor(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_tiny_tensor_departs_from_torchao(dtype):
    """An exception to bit-exactness, where torchao is wrong (issue 40):
    a tensor whose amax is below about 7.9e-36 gets a default tensor scale
    t = amax / 2688 so small that torchao's (1 / t) / s is inf in float32.
    torchao multiplies every element by it: a zero becomes NaN (its e2m1
    code reads +-1.5, not 0) and every other element +-6. torchcast takes
    that multiplier, and x times it, in float64 (docs/formats.md): the
    same block scales as torchao, zeros stay zeros and every element is
    the nearest e2m1 value (tests/test_block_cast.py checks that exactly)."""
    x = (torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(1, 16) * 1e-36).to(dtype)
    x[0, 7] = 0
    t = per_tensor_amax_to_scale(x.float().abs().amax())
    scale, data = nvfp4_quantize(x, 16, t)
    r = torchcast.block_cast(x, "nvfp4")
    assert r.tensor_scale == t
    assert torch.equal(u8(r.scales), u8(scale))
    codes = lambda d: torch.stack((u8(d) & 0xF, u8(d) >> 4), -1).reshape(-1)  # noqa: E731
    theirs, ours = codes(data), codes(r.data)
    assert theirs[7] & 0x7 != 0, "torchao: the zero's code is NaN's, not 0"
    assert ((theirs & 0x7) == 0x7)[torch.arange(16) != 7].all(), "torchao: the rest +-6"
    assert ours[7] & 0x7 == 0 and r.stats.saturated == 0
    assert len(set((ours & 0x7).tolist())) > 4  # several magnitudes, not all 6


@pytest.mark.parametrize("fmt", ELEMENT)
def test_floor_smallest_scale_follows_the_spec(fmt):
    """A block whose scale clamps to e8m0's smallest, 2^-127 (bits 0): OCP MX
    v1.0 scales the elements by that X, P = V / 2^-127. torchao divides by
    2^-126 instead (it clamps the float32 scale to the smallest normal), so
    its elements are half of V / X and decode to half of x."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1.5 * 2.0 ** -127
    x[0, 1] = -(2.0 ** -128)
    ours, theirs = ours_and_torchao(x, fmt, "floor")
    assert ours[0].item() == theirs[0].item() == 0
    r = torchcast.block_cast(x, fmt)
    assert torch.equal(r.dequantize(), x), "V = X * P exactly, X = 2^-127"
    assert not torch.equal(ours[1], theirs[1])
    halved = torchcast.block_cast(x / 2, fmt)  # its elements are x * 2^126: torchao's
    assert u8(halved.scales).item() == 0 and torch.equal(u8(halved.data), theirs[1])


def test_rceil_scale_is_the_exact_ceiling():
    """rceil: the scale is 2^ceil(log2(amax / max)), amax / max rounded to
    float32 (cuBLAS's rule; PTX's cvt.rp.satfinite.ue8m0x2.f32, which torchao
    uses on Blackwell GPUs, rounds up exactly). torchao's CPU path takes
    ceil(log2(d)) in float32, which rounds log2 of d just above a power of
    two down to that power: its scale is then one binade too small and the
    block's largest element saturates."""
    amax = torch.nextafter(torch.tensor(448.0 * 2.0 ** -30), torch.tensor(math.inf))
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    d = Fraction((amax / 448.0).item())
    exact = next(k for k in range(-140, 140) if Fraction(2) ** k >= d)
    ours, theirs = ours_and_torchao(x, "mxfp8_e4m3", "rceil")
    assert ours[0].item() == exact + 127
    assert theirs[0].item() == exact + 126
    r = torchcast.block_cast(x, "mxfp8_e4m3", scale_mode="rceil")
    assert r.stats.saturated == 0


def test_rceil_smallest_scale_follows_the_spec():
    """rceil with a scale of 2^-127 (bits 0): torchao (after
    TransformerEngine) scales such a block's elements by 1, not 2^127, so
    they underflow; torchcast divides by the scale as for every other."""
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0 ** -125
    ours, theirs = ours_and_torchao(x, "mxfp8_e4m3", "rceil")
    assert ours[0].item() == theirs[0].item() == 0
    assert torch.equal(torchcast.block_cast(x, "mxfp8_e4m3", scale_mode="rceil").dequantize(), x)
    assert (theirs[1] == 0).all()


@pytest.mark.parametrize("fmt,mode", MX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_bit_patterns_match_torchao(fmt, mode, dtype):
    """x's bits drawn uniformly (NaN payloads, infs, subnormals, both
    signs): the scales everywhere, the elements outside NaN-scale blocks."""
    g = torch.Generator().manual_seed(16)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(ints)
    x = torch.randint(info.min, info.max, (64, 256), generator=g,
                      dtype=torch.int64).to(ints).view(dtype)
    ours, theirs = ours_and_torchao(x, fmt, mode)
    assert torch.equal(ours[0], theirs[0])
    per_byte = 16 if fmt == "mxfp4" else 32
    keep = (ours[0] != 0xFF).repeat_interleave(per_byte, dim=-1)
    assert keep.any() and not keep.all()
    assert torch.equal(ours[1][keep], theirs[1][keep])
