"""What the reduction tests share (tests/test_reduce.py, tests/test_cuda.py):
bit-for-bit comparison of results (on any device against the CPU's) and
spread-out inputs."""
import torch


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
