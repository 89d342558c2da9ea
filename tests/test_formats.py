"""The formats table (torchcast/formats.py) against torch.finfo, ml_dtypes'
finfo and rounding, and csrc/formats.h's traits (torchcast._C.format_traits)."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from torchcast import _ops
from torchcast.formats import BLOCK_FORMATS, FLOAT_RANK, FORMATS, block_format, format_of
from torchcast._reference.block_cast import _round

_NARROW = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu")


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.dtype is not None])
def test_table_matches_torch_finfo(name):
    f = FORMATS[name]
    info = torch.finfo(f.dtype)
    assert (f.bits, f.max, f.min_normal) == (info.bits, info.max, info.smallest_normal)
    assert format_of(f.dtype) is f


@pytest.mark.parametrize("name", _NARROW)
def test_table_matches_ml_dtypes(name):
    f = FORMATS[name]
    dtype = getattr(ml_dtypes, name)
    info = ml_dtypes.finfo(dtype)
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (info.bits, info.nexp, info.nmant)
    assert (f.max, f.min_normal) == (float(info.max), float(info.tiny))
    assert f.min_subnormal == float(info.smallest_subnormal)
    assert f.emax == info.maxexp - 1
    # A normal exponent's field E means 2^(E - bias); e8m0 has no subnormals,
    # so its field 0 is already 2^-bias.
    assert info.minexp == (-f.bias if not f.signed else 1 - f.bias)
    assert f.has_nan == bool(np.isnan(np.array(np.nan).astype(dtype).astype(np.float64)))
    if f.signed:
        past = float(np.array(f.max * 4).astype(dtype).astype(np.float64))
        assert f.has_inf == math.isinf(past)
        expected = {"inf": "inf", "nan": "nan"}.get(f.overflow)
        if expected == "inf":
            assert math.isinf(past)
        elif expected == "nan":
            assert math.isnan(past)
        else:  # no special values: ml_dtypes saturates too
            assert past == f.max


@pytest.mark.parametrize("name", ("float8_e4m3fn", "float8_e5m2"))
def test_first_overflow_is_where_ml_dtypes_rounds_past_max(name):
    f = FORMATS[name]
    dtype = getattr(ml_dtypes, name)

    def past_max(v):
        return not abs(float(np.array(v).astype(dtype).astype(np.float64))) <= f.max

    assert past_max(f.first_overflow) == f.overflow_at_tie
    assert past_max(np.nextafter(f.first_overflow, np.inf))
    assert not past_max(np.nextafter(f.first_overflow, 0))


@pytest.mark.parametrize("name", ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"))
def test_reference_rounding_matches_ml_dtypes(name):
    """The block references' table-search rounding (ties to even codes) is
    ml_dtypes' round-to-nearest-even, over every float32 near the format's
    values: ties, midpoints' neighbours, subnormals, signed zeros."""
    f = FORMATS[name]
    dtype = getattr(ml_dtypes, name)
    grid = np.array(sorted({v * s for v in np.linspace(0, f.max, 4001) for s in (1, -1)}),
                    dtype=np.float32)
    mids = np.unique(np.abs(grid.astype(dtype).astype(np.float32)))
    ties = (mids[1:] + mids[:-1]) / 2
    near = np.concatenate([ties, np.nextafter(ties, np.float32(0)),
                           np.nextafter(ties, np.float32(np.inf)), [0.0, -0.0]]).astype(np.float32)
    values = np.concatenate([grid, near, -near])
    codes, saturated = _round(torch.from_numpy(values.astype(np.float64)), name)
    expected = values.astype(dtype).view(np.uint8)
    if f.bits == 4:  # ml_dtypes keeps a 4-bit value in the low bits of a byte
        expected = expected & 0xF
    assert not saturated.any()
    np.testing.assert_array_equal(codes.numpy(), expected)


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason="the C++ table is in the compiled extension")
def test_cpp_traits_equal_the_python_table():
    traits = _ops._C.format_traits
    assert set(traits) == set(FORMATS)
    for name, (bits, nexp, nmant, bias, emax, fmax, tiny, sub, inf, nan, rank) in traits.items():
        f = FORMATS[name]
        assert (bits, nexp, nmant, bias, emax, rank) == (f.bits, f.exponent_bits, f.mantissa_bits,
                                                         f.bias, f.emax, f.rank), name
        assert (fmax, tiny, sub, inf, nan) == (f.max, f.min_normal, f.min_subnormal, f.has_inf,
                                               f.has_nan), name


def test_rank_orders_the_measured_dtypes():
    assert FLOAT_RANK == {torch.float64: 4, torch.float32: 3, torch.float16: 2,
                          torch.bfloat16: 2, torch.float8_e4m3fn: 1, torch.float8_e5m2: 1}


def test_block_formats():
    assert {n: (b.element.name, b.block_size, b.scale.name, b.tensor_scale)
            for n, b in BLOCK_FORMATS.items()} == {
        "mxfp8_e4m3": ("float8_e4m3fn", 32, "float8_e8m0fnu", False),
        "mxfp8_e5m2": ("float8_e5m2", 32, "float8_e8m0fnu", False),
        "mxfp4": ("float4_e2m1fn", 32, "float8_e8m0fnu", False),
        "nvfp4": ("float4_e2m1fn", 16, "float8_e4m3fn", True),
    }
    with pytest.raises(ValueError, match="unknown format 'mxfp6'.*'mxfp8_e4m3'"):
        block_format("mxfp6")
