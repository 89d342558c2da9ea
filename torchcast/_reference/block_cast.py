"""block_cast in pure PyTorch: the fallback where no kernel exists and the
tests' restatement of csrc/block_cast.h, written independently of it (the
elements are rounded by searching the format's table of values, the "rceil"
scale by frexp), from the facts of torchcast/formats.py."""
import functools

import torch

from ..formats import FORMATS, Format, block_format
from ..stats import STAT_FIELDS
from .cast import check_scale_value
from .rounding import widen_exact

SOURCE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
SCALE_BINS = 256
BLOCK_COUNTS = ("blocks", "saturated_blocks", "underflow_blocks", "nan_blocks")
_E8M0_NAN = 0xFF
_MAX_BLOCK = 2**31 - 1  # a block's length is an int in the kernels
BAD_TENSOR_SCALE = ("torchcast.block_cast: tensor_scale must be positive and finite (each "
                    "element is x / (tensor_scale * its block's scale)); leave it out for "
                    "amax(|x|) / (448 * 6), as torchcast.block.nvfp4_tensor_scale(x) gives it")


def check_args(x, format, block_size, scale_mode, tensor_scale):
    """The checks of csrc/block_cast_common.cpp, with its messages' substance
    (ValueError/TypeError as the C++ op raises them)."""
    fmt = block_format(format)
    if fmt.tensor_scale and scale_mode not in fmt.scale_modes:
        raise ValueError("torchcast.block_cast: nvfp4 has one scale rule, 'amax' (amax / 6 over "
                         f"the tensor scale, rounded to e4m3); got scale_mode '{scale_mode}'")
    if scale_mode not in fmt.scale_modes:
        raise ValueError(f"torchcast.block_cast: unknown scale_mode '{scale_mode}' for an MX "
                         "format; expected one of 'floor' (OCP MX v1.0), 'ceil', 'even', 'rceil'")
    if x.dtype not in SOURCE_DTYPES:
        raise TypeError(f"torchcast.block_cast: x is {x.dtype}; expected torch.float64, float32, "
                        "float16 or bfloat16 (x.float() first)")
    if x.dim() == 0:
        raise ValueError("torchcast.block_cast: x is 0-d; blocks run along a dimension "
                         "(x.reshape(1) for a single value)")
    if not 1 <= block_size <= _MAX_BLOCK or (fmt.packed and block_size % 2):
        raise ValueError(f"torchcast.block_cast: block_size is {block_size}; expected a positive "
                         + ("even number (two 4-bit elements share a byte)" if fmt.packed
                            else "number") + " up to 2^31 - 1")
    if (tensor_scale is not None) != fmt.tensor_scale:
        raise ValueError("torchcast.block_cast: tensor_scale is "
                         + ("required for nvfp4" if fmt.tensor_scale
                            else "only for nvfp4, not for an MX format"))
    if tensor_scale is not None and (tensor_scale.dtype != torch.float32
                                     or tensor_scale.numel() != 1
                                     or tensor_scale.device != x.device):
        raise ValueError("torchcast.block_cast: tensor_scale must be a one-element "
                         f"torch.float32 tensor on x's device ({x.device}); got "
                         f"{tensor_scale.dtype} with {tensor_scale.numel()} elements on "
                         f"{tensor_scale.device}")
    return fmt


def output_shapes(x, fmt, block_size):
    """(data shape, scales shape) of block_cast(x) along the last dimension."""
    n = x.shape[-1]
    data = (*x.shape[:-1], (n + 1) // 2 if fmt.packed else n)
    scales = (*x.shape[:-1], -(-n // block_size))
    return data, scales


@functools.lru_cache(maxsize=None)
def _values(name):
    """The non-negative finite values of an element format, by code, in float64."""
    f: Format = FORMATS[name]
    values, code = [], 0
    while True:
        e, m = code >> f.mantissa_bits, code & ((1 << f.mantissa_bits) - 1)
        if e == 0:
            v = m * 2.0 ** (1 - f.bias - f.mantissa_bits)
        else:
            v = (1 + m / 2 ** f.mantissa_bits) * 2.0 ** (e - f.bias)
        values.append(v)
        if v == f.max:
            return values
        code += 1


def _round(v, name):
    """(codes, saturated): float64 v rounded to nearest (ties to the even code)
    in the element format, clamped to +-max; NaN to the all-ones magnitude
    (the largest for a format without NaN); the sign in the top bit."""
    f = FORMATS[name]
    table = torch.tensor(_values(name), dtype=torch.float64)
    mids = (table[1:] + table[:-1]) / 2  # exact: halves of neighbouring values
    a = v.abs().contiguous()
    lo = torch.searchsorted(mids, a.nan_to_num(posinf=f.max), right=False)
    tie = a == mids[lo.clamp(max=len(mids) - 1)]
    code = lo + (tie & (lo % 2 == 1)).long()
    saturated = f.rounds_past_max(a)
    code = torch.where(saturated, len(table) - 1, code)
    magnitude_bits = f.bits - 1
    nan_code = (1 << magnitude_bits) - 1 if f.has_nan else len(table) - 1
    code = torch.where(torch.isnan(v), nan_code, code)
    sign = torch.signbit(v).long() << magnitude_bits
    return code | sign, saturated & ~torch.isnan(v)


def _decode(codes, name):
    """float64 values of non-NaN codes (NaN codes give NaN)."""
    f = FORMATS[name]
    table = torch.tensor(_values(name), dtype=torch.float64)
    magnitude_bits = f.bits - 1
    mag = codes & ((1 << magnitude_bits) - 1)
    value = table[mag.clamp(max=len(table) - 1)]
    value = torch.where(mag >= len(table), float("nan"), value)
    return torch.where((codes >> magnitude_bits) & 1 == 1, -value, value)


def _pow2(e):
    """2.0 ** e (int64 tensor, -1022 <= e <= 1023) exactly, in float64."""
    return ((e + 1023) << 52).view(torch.float64)


def _mx_scale_bits(amax, elem: Format, mode, wide):
    """The e8m0 bits of each block (csrc/block_cast.h's mx_scale_bits)."""
    nan = torch.isnan(amax)
    inf = torch.isinf(amax)
    if mode == "rceil":
        d = (amax / elem.max).to(wide)
        mantissa, exponent = torch.frexp(d.to(torch.float64))
        e = exponent.long() - (mantissa == 0.5).long()
        e = torch.where(d == 0, -127, e)
        e = e.clamp(-127, 127)
        e = torch.where(inf, 127, e)
    else:
        mant_bits, bias = (23, 127) if wide == torch.float32 else (52, 1023)
        int_dtype = torch.int32 if wide == torch.float32 else torch.int64
        u = amax.to(wide).view(int_dtype).long()  # amax >= 0: the sign bit is clear
        if mode == "even":
            u = (u + (1 << (mant_bits - elem.mantissa_bits - 1))) & ~((1 << mant_bits) - 1)
        e = (u >> mant_bits) - bias
        if mode == "ceil":
            e = e + ((u & ((1 << mant_bits) - 1)) != 0).long()
        e = torch.where(inf, 128, e) - elem.emax
        e = e.clamp(-127, 127)
    return torch.where(nan, _E8M0_NAN, e + 127)


def block_cast(x, format, block_size, scale_mode, tensor_scale=None):
    """(data, scales, stats, scale_hist, block_counts) as the op returns them."""
    fmt = check_args(x, format, block_size, scale_mode, tensor_scale)
    if tensor_scale is not None:
        check_scale_value(tensor_scale, BAD_TENSOR_SCALE)
    elem = fmt.element
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    data_shape, scale_shape = output_shapes(x, fmt, block_size)
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    nb = scale_shape[-1]
    xw = widen_exact(x) if x.dtype in (torch.float16, torch.bfloat16) else x
    xw = xw.reshape(rows, n).to(wide)
    # A block longer than the row is the row: pad to whole blocks only when
    # there are several, so a huge block_size allocates nothing.
    width = min(block_size, max(n, 1))
    pad = nb * width - n
    blocks = torch.nn.functional.pad(xw, (0, pad)).reshape(rows, nb, width)
    valid = (torch.arange(nb * width) < n).reshape(nb, width).expand(rows, nb, width)

    any_nan = torch.isnan(blocks).any(-1)
    amax = blocks.abs().amax(-1) if blocks.numel() else blocks.new_zeros(rows, nb)
    amax = torch.where(any_nan, float("nan"), amax)

    if fmt.scale.name == "float8_e8m0fnu":
        scale_bits = _mx_scale_bits(amax, elem, scale_mode, wide)
        divisor = torch.where(scale_bits == _E8M0_NAN, float("inf"),
                              _pow2((scale_bits - 127).clamp(max=127)))
        v = blocks / divisor.to(wide).unsqueeze(-1)
        scale_value = torch.where(scale_bits == _E8M0_NAN, float("nan"),
                                  _pow2((scale_bits - 127).clamp(max=127)))
        scales = scale_bits.to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        pts = tensor_scale.reshape(()).to(wide)
        scaled = (amax / 6) / pts
        e4m3 = FORMATS["float8_e4m3fn"]
        clamped = torch.where(torch.isnan(scaled), scaled, scaled.clamp(e4m3.min_normal, e4m3.max))
        scale_bits, _ = _round(clamped.to(torch.float64), "float8_e4m3fn")
        s = _decode(scale_bits, "float8_e4m3fn")
        factor = (1 / pts) / s.to(wide)
        # Where float32's (1 / t) / s overflows, float64's, and x times it in
        # float64 (csrc/block_cast.h's BlockScale::wide).
        wide_factor = (1 / tensor_scale.reshape(()).to(torch.float64)) / s
        v = torch.where(torch.isinf(factor).unsqueeze(-1),
                        blocks.to(torch.float64) * wide_factor.unsqueeze(-1),
                        (blocks * factor.unsqueeze(-1)).to(torch.float64))
        scale_value = s * tensor_scale.reshape(()).to(torch.float64)
        scales = scale_bits.to(torch.uint8).view(torch.float8_e4m3fn)

    codes, saturated = _round(v.to(torch.float64), elem.name)
    ev = _decode(codes, elem.name)
    y = ev * scale_value.unsqueeze(-1)
    xd = blocks.to(torch.float64)

    x_nan = torch.isnan(xd) & valid
    x_finite = torch.isfinite(xd) & valid
    y_finite = torch.isfinite(y)
    measured = x_finite & y_finite
    under = valid & (xd != 0) & ~torch.isnan(xd) & (y == 0)
    saturated = saturated & valid
    subnormal = valid & ~torch.isnan(y) & (ev != 0) & (ev.abs() < elem.min_normal)
    err = torch.where(measured, (xd - y).abs(), 0.0)
    rel = torch.where(measured & (xd != 0), err / xd.abs(), 0.0)
    counts = {
        "numel": float(x.numel()), "nan": x_nan.sum(), "inf": (valid & torch.isinf(xd)).sum(),
        "inexact": (x_finite & (y != xd)).sum(), "overflow": (x_finite & ~y_finite).sum(),
        "saturated": saturated.sum(), "underflow": under.sum(), "subnormal": subnormal.sum(),
    }
    values = [float(counts[name]) for name in STAT_FIELDS[:8]]
    measured_count = values[0] - values[1] - values[2]
    all_overflowed = values[4] > 0 and values[4] == measured_count
    maxima = [float(err.max()) if err.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0]
    if all_overflowed:
        maxima = [float("inf"), float("inf")]
    amax_x = float(torch.where(x_finite, xd.abs(), 0.0).max()) if xd.numel() else 0.0
    sums = [float(err.sum()), float((err * err).sum()),
            float(torch.where(measured, xd * xd, 0.0).sum())]
    stats = torch.tensor(values + maxima + [amax_x] + sums, dtype=torch.float64)

    flat_codes = codes.reshape(rows, nb * width)[:, :n]
    if fmt.packed:
        flat_codes = torch.nn.functional.pad(flat_codes, (0, n % 2))
        flat_codes = flat_codes[:, 0::2] | (flat_codes[:, 1::2] << 4)
    data = flat_codes.to(torch.uint8).reshape(data_shape)
    if fmt.element_dtype != torch.uint8:
        data = data.view(fmt.element_dtype)
    hist = torch.bincount(scale_bits.reshape(-1), minlength=SCALE_BINS)
    nan_scale = scale_bits == (_E8M0_NAN if fmt.scale.name == "float8_e8m0fnu" else 0x7F)
    lengths = valid.sum(-1)
    block_counts = torch.tensor([
        rows * nb, int(saturated.any(-1).sum()), int((2 * under.sum(-1) > lengths).sum()),
        int(nan_scale.sum())], dtype=torch.int64)
    return (data.to(x.device), scales.reshape(scale_shape).to(x.device), stats.to(x.device),
            hist.to(x.device), block_counts.to(x.device))

