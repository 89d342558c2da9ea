"""What the reduction tests share (tests/test_reduce.py, tests/test_cuda.py,
tests/test_doc_claims.py): bit-for-bit comparison of results (on any device
against the CPU's), spread-out inputs, and the terms of the accuracy bound
(ulp, chain_length)."""
import math

import numpy as np
import torch

from torchcast._reference import order


def ulp(v, dtype):
    """Spacing of dtype at |v| (v a float64 array or scalar)."""
    fi = torch.finfo(dtype)
    a = np.abs(np.asarray(v, dtype=np.float64))
    with np.errstate(divide="ignore"):
        exp = np.floor(np.log2(np.maximum(a, fi.tiny)))
    return np.exp2(exp) * fi.eps


def chain_length(n, elem_size=4):
    """Longest chain of compensated additions one element goes through in the
    full-reduction order of csrc/reduce_common.h (each merge is two)."""
    lanes = order.BLOCK_THREADS * (16 // elem_size)
    nchunks = max(1, -(-n // order.CHUNK))
    tree = 2 * int(math.log2(order.BLOCK_THREADS))
    return (order.CHUNK // lanes + 2 * (16 // elem_size) + 2 * tree
            + 2 * -(-nchunks // order.BLOCK_THREADS))


def bits(t):
    """The raw bytes of t, so that equality is bit equality (NaNs and -0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(bits(a), bits(b)), (a, b)


def assert_matches(got, want):
    """got, the op's result on any device, equals want (on the CPU) bit for
    bit. Off the CPU NaNs compare by position: x86 keeps an operand's payload,
    CUDA makes the canonical NaN."""
    if got.device.type == "cpu":
        assert_bitwise(got, want)
    else:
        assert_matches_but_nan_payloads(got.cpu(), want)


def assert_matches_but_nan_payloads(got, want):
    """got equals want bit for bit, except that a NaN matches any NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype)
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got)), (want, got)
    assert torch.equal(bits(want[~nan]), bits(got[~nan])), (want, got)


def spread_sample(shape, dtype, seed=0):
    """Normal values scaled by powers of two from 2^-20 to 2^19."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 20, shape, generator=g).double())
    return x.to(dtype)
