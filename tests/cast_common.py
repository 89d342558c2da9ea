"""What the cast tests share (tests/test_cast.py, tests/test_cuda.py): the
inputs they cast (sample: edge values, NaN payloads, every class of value),
raw-bit views, and the check of a device's (y, stats) against the CPU op's."""
import math

import torch
from torchcast.stats import STAT_FIELDS

from numpy_ref import edge_values

BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
        torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}
SUM_FIELDS = ("sum_abs_err", "sum_sq_err", "sum_sq")


def bits(t):
    """t's raw bits, as integers of its width (a 0-d t as one element)."""
    return t.contiguous().view(BITS[t.dtype]) if t.dim() else t.reshape(1).view(BITS[t.dtype])


def assert_same(cpu, other, src):
    """(y, stats) from the CPU op and from the op on another device: y the
    same bits and layout, counts and maxima the same bits. The sums are the
    same bits for float64 sources; for the others the CPU sums in float64 and
    CUDA in compensated float32 (numerics.h's SumsOf), each within 1e-6 of
    the exact sum, and CUDA's overflow past float32's range (the tests
    against the reference on the device check those sums bit for bit).
    src is x's dtype."""
    y_cpu, s_cpu = cpu
    y_dev, s_dev = other
    assert y_dev.device == s_dev.device and y_dev.device.type != "cpu"
    assert y_dev.dtype == y_cpu.dtype and y_dev.shape == y_cpu.shape
    assert y_dev.stride() == y_cpu.stride()
    assert torch.equal(bits(y_dev.cpu()), bits(y_cpu)), "y differs from the CPU op"
    s_dev = s_dev.cpu()
    bits_differ = (s_dev.view(torch.int64) != s_cpu.view(torch.int64)).tolist()
    differ = [f"  {f}: cpu {a!r} {y_dev.device.type} {b!r}"
              for f, a, b, d in zip(STAT_FIELDS, s_cpu.tolist(), s_dev.tolist(), bits_differ)
              if d and not (f in SUM_FIELDS and src != torch.float64 and plain_vs_float32_sum(a, b))]
    assert not differ, "stats differ from the CPU op:\n" + "\n".join(differ)


def plain_vs_float32_sum(plain, compensated):
    """Whether a compensated float32 sum agrees with the plain float64 one:
    within 2e-6 (each is within 1e-6 of the exact sum), or inf where the sum
    exceeds float32's range."""
    if plain > torch.finfo(torch.float32).max:
        return compensated == math.inf
    return abs(plain - compensated) <= 2e-6 * plain


def nan_patterns(dtype):
    """NaNs with payloads and both signs, as raw bits (a float conversion would
    canonicalize them)."""
    if dtype == torch.float64:
        raw = [0x7FF8000000000000, 0x7FF0000000000001, -0x0007FFFFFFFFFEDD,
               0x7FF4000000000123]
    else:
        raw = [0x7FC00000, 0x7F800001, -0x003FFEDD, 0x7FA00123]
    return torch.tensor(raw, dtype=BITS[dtype]).view(dtype)


def sample(n, src, seed=0):
    """n values of dtype src, on the CPU: the edge values of every target
    (midpoints, overflow and underflow thresholds, each with its neighbours)
    and NaN payloads cycled, random bit patterns (every class of value), and
    normal values spread over the targets' ranges."""
    g = torch.Generator().manual_seed(seed)
    ib = BITS[src]
    info = torch.iinfo(ib)
    raw = torch.randint(info.min, info.max, (n,), generator=g, dtype=ib).view(src)
    spread = (torch.randn(n, generator=g, dtype=torch.float64)
              * torch.exp2(torch.randint(-40, 40, (n,), generator=g).double())).to(src)
    edge = torch.cat([edge_values(src, dst) for dst in (torch.float32, torch.float16,
                                                        torch.bfloat16)] + [nan_patterns(src)])
    cycled = edge.repeat(n // edge.numel() + 1)[:n]
    which = torch.randint(0, 3, (n,), generator=g)
    out = torch.where(which == 0, raw, spread)
    return torch.where(which == 1, cycled, out)
