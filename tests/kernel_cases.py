"""The cases every CUDA kernel is checked on, shared by tests/test_cuda.py (on
a GPU) and tests/test_cuda_emulated.py (the same kernels on the emulated
grid, on the CPU): inputs sized and laid out for what differs on a GPU
(several blocks and a partial last one, grid-stride loops that wrap at the
emulated multiprocessor counts, the two-pass finish over many partials,
contended atomics, every source and target dtype, non-contiguous and
expanded inputs, NaN, +-inf, +-0 and subnormals), and the checks of a
kernel's results against the CPU op: bit for bit where the CPU op promises
it; where CUDA differs by design (docs/cuda.md) against the pure-PyTorch
reference run CUDA's way (cast_with_stats' compensated float32 sums), or
within the documented tolerance (block_cast's float64 sums, added in another
order).

A Device names where the kernels run: `device.op(name)` is the op whose
kernel runs there, `device.to(x)` a CPU tensor's data and layout there.
Each case carries the multiprocessor count the emulated device reports (its
grid sizes follow it) and the work units its first launch strides over
(`units`, `per_block`), and those of its finishing launch (`finish_units`,
a block each): the emulated tests check that the grid-stride loops wrap,
units > grid * per_block. Only cases named "specials" may expect mostly
NaN or infinite results (tests/test_kernel_cases.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from torchcast._reference import adam as adam_ref
from torchcast._reference import cast as cast_ref
from torchcast._reference import moments8 as moments8_ref
from torchcast.formats import BLOCK_FORMATS
from torchcast.stats import STAT_FIELDS

from adam_common import assert_same_bits, make_operands, operands_on
from cast_common import BITS, sample
from devices import on_device
from reduce_common import assert_matches_but_nan_payloads, spread_sample
from values import every_value

CHUNK = 1 << 16  # numerics.h's kChunk: elements per block of the cast and reduce kernels
ADAM_CHUNK = 1 << 14  # adam.cu's kAdamChunk
SUMS = ("sum_abs_err", "sum_sq_err", "sum_sq")
OPS = torch.ops.torchcast


@dataclass(frozen=True)
class Device:
    """Where the kernels under test run.

    Attributes:
        name: the device of its tensors ("cuda", or "cpu" for the emulated grid).
        ops: the op namespace whose kernels run there.
    """
    name: str
    ops: object

    def op(self, name: str):
        return getattr(self.ops, name)

    def to(self, x: torch.Tensor) -> torch.Tensor:
        return on_device(x, self.name)


@dataclass(frozen=True)
class Case:
    """One call of one kernel. make() builds its inputs on the CPU."""
    id: str
    make: Callable[[], dict] = field(repr=False)
    multiprocessors: int = 2
    units: int = 0      # work units of the first launch's grid-stride loop (0: none)
    per_block: int = 1  # units a block takes per turn of it
    finish_units: int = 0  # outputs of the last launch's grid-stride loop, a block each


def mixed(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values of dtype: every class of value (random bit patterns: NaN
    payloads, +-inf, +-0, subnormals), normal values spread over 2^+-40 and
    the targets' edge values (cast_common.sample); for 16- and 8-bit dtypes
    every bit pattern in turn instead of the edges."""
    if dtype in (torch.float32, torch.float64):
        return sample(n, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(BITS[dtype])
    raw = torch.randint(info.min, info.max, (n,), generator=g, dtype=BITS[dtype]).view(dtype)
    spread = (torch.randn(n, generator=g, dtype=torch.float64)
              * torch.exp2(torch.randint(-40, 40, (n,), generator=g).double())).to(dtype)
    every = every_value(dtype)
    every = every.repeat(n // every.numel() + 1)[:n]
    which = torch.randint(0, 3, (n,), generator=g)
    return torch.where(which == 0, raw, torch.where(which == 1, every, spread))


def chunks(n: int, size: int = CHUNK) -> int:
    return (n + size - 1) // size


def assert_stats_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Two float64 stats tensors (StatIndex order) hold the same bits."""
    got = got.cpu()
    differ = [f"  {f}: got {a!r}, want {b!r}" for f, a, b, ga, wb in
              zip(STAT_FIELDS, got.tolist(), want.tolist(),
                  got.view(torch.int64).tolist(), want.view(torch.int64).tolist()) if ga != wb]
    assert not differ, f"{what} differ:\n" + "\n".join(differ)


# ---------------------------------------------------------------------------
# cast_with_stats (csrc/cuda/cast.cu): a block per chunk of 65,536 elements,
# grid-stride, then one block folds the chunks' partials.

def _pair(src, dst):
    return f"{str(src)[6:]}-{str(dst)[6:]}"


def _cast_case(id, src, dst, n, layout="contiguous", seed=0, scale=None, saturate=None,
               out=None, multiprocessors=2, wraps=False):
    def make():
        if layout == "misaligned":  # scalar loads
            x = mixed(n + 1, src, seed)[1:]
        elif layout == "strided":  # TensorIterator's offsets
            x = mixed(2 * n, src, seed)[::2]
        elif layout == "expanded":  # a stride of 0
            x = mixed(n // 64, src, seed).view(-1, 1).expand(-1, 64)
        elif layout == "transposed":  # linear: y takes x's layout
            x = mixed(n, src, seed).view(-1, 1000).t()
        else:
            x = mixed(n, src, seed)
        return dict(x=x, dst=dst, scale=scale, saturate=saturate, out=out)
    return Case(id, make, multiprocessors, units=chunks(n) if wraps else 0)


CAST_CASES = [
    # Three chunks, the last partial and not a whole number of 16-byte steps,
    # over a grid of two blocks: block 0 takes chunks 0 and 2.
    *[_cast_case(f"wrap-{_pair(s, d)}", s, d, 2 * CHUNK + 4099, seed=i, wraps=True)
      for i, (s, d) in enumerate(cast_ref.LOSSY_PAIRS)],
    *[_cast_case(f"{layout}-{_pair(s, d)}", s, d, CHUNK + 7040, layout, seed=3)
      for layout in ("misaligned", "strided", "expanded")
      for s, d in [(torch.float32, torch.float16), (torch.float64, torch.bfloat16),
                   (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.bfloat16)]],
    _cast_case("transposed-f32-bf16", torch.float32, torch.bfloat16, 100_000, "transposed"),
    # out non-contiguous: y through TensorIterator's offsets.
    _cast_case("out-transposed-f64-f16", torch.float64, torch.float16, 130_000, out="transposed"),
    _cast_case("scaled-f32-e4m3", torch.float32, torch.float8_e4m3fn, CHUNK + 99, scale=2.0 ** -6),
    _cast_case("scaled-bf16-e5m2", torch.bfloat16, torch.float8_e5m2, CHUNK + 99, scale=3.0),
    _cast_case("saturate-f16-e5m2", torch.float16, torch.float8_e5m2, CHUNK + 99, saturate=True),
    _cast_case("no-saturate-f64-e4m3", torch.float64, torch.float8_e4m3fn, CHUNK + 99,
               saturate=False),
    # Tiny and empty: most threads idle; no chunk, the finishing block alone.
    *[_cast_case(f"n{n}-f32-f16", torch.float32, torch.float16, n) for n in (0, 1, 5)],
    # 130 chunks: each thread of the finishing block folds one or two partials.
    _cast_case("many-partials-f64-f32", torch.float64, torch.float32, 130 * CHUNK + 77,
               multiprocessors=4, wraps=True),
]


def _out_like(x, dtype, layout):
    if layout == "transposed":
        return torch.empty(x.shape[::-1], dtype=dtype).t()
    return torch.empty(x.shape, dtype=dtype)


def check_cast(case: Case, device: Device) -> None:
    """y and the stats equal the CPU op's bits; the sums of float32 and
    narrower sources (compensated float32 on CUDA) the reference's, run
    CUDA's way."""
    a = case.make()
    x, dst, saturate = a["x"], a["dst"], a["saturate"]
    scale = torch.tensor(a["scale"], dtype=torch.float32) if a["scale"] is not None else None
    dev_scale = device.to(scale) if scale is not None else None
    op = device.op("cast_with_stats")
    if a["out"] is not None:
        y = device.to(_out_like(x, dst, a["out"]))
        stats = op.out(device.to(x), dst, dev_scale, saturate=saturate, out=y)
        want_y = _out_like(x, dst, a["out"])
        want = OPS.cast_with_stats.out(x, dst, scale, saturate=saturate, out=want_y)
    else:
        y, stats = op(device.to(x), dst, dev_scale, saturate=saturate)
        want_y, want = OPS.cast_with_stats(x, dst, scale, saturate=saturate)
    assert y.stride() == want_y.stride(), (y.stride(), want_y.stride())
    assert torch.equal(y.cpu().contiguous().view(BITS[dst]), want_y.contiguous().view(BITS[dst])), \
        "y differs from the CPU op's"
    if x.dtype != torch.float64:
        _, ref = cast_ref.cast_with_stats(x, dst, saturate=saturate, scale=scale, cuda_sums=True)
        sums = [STAT_FIELDS.index(f) for f in SUMS]
        want = want.clone()
        want[sums] = ref[sums]
    assert_stats_bits(stats, want, "the stats (sums: the reference's, run CUDA's way)")


# ---------------------------------------------------------------------------
# kahan_sum / kahan_mean (csrc/cuda/reduce.cu): the three schemes of
# reduce_common.h, each grid capped at 16 blocks a multiprocessor, and the
# finishing kernel over each output's segment partials.

def spread(shape, dtype, seed=0, specials=False):
    """reduce_common.spread_sample (float16: scaled by 2^-16, to 2^-36 ..
    2^3, so that no value and no sum of millions overflows it: its 2^19
    would make most sums NaN, which matches NaN and checks nothing); with
    specials, a NaN, +-inf, +-0 and two subnormals at random places."""
    if dtype == torch.float16:
        x = (spread_sample(shape, torch.float64, seed) * 2.0 ** -16).to(dtype)
    else:
        x = spread_sample(shape, dtype, seed)
    if specials:
        g = torch.Generator().manual_seed(seed)
        tiny = torch.finfo(dtype).smallest_normal
        values = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, tiny / 4, -tiny / 8],
                              dtype=torch.float64).to(dtype)
        k = min(values.numel(), x.numel())
        x.view(-1)[torch.randperm(x.numel(), generator=g)[:k]] = values[:k]
    return x


def _reduce_case(id, make_x, dim=None, keepdim=False, dtype=None, mean=False, multiprocessors=1,
                 units=0, per_block=1, finish_units=0):
    def make():
        return dict(x=make_x(), dim=dim, keepdim=keepdim, dtype=dtype, mean=mean)
    return Case(id, make, multiprocessors, units, per_block, finish_units)


_F32, _F16, _BF16, _F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
REDUCE_CASES = [
    # Scheme 1 (one output): 18 chunks on a grid of 16 blocks; 16-byte loads,
    # then scalar ones (misaligned, strided, expanded).
    _reduce_case("full-vector-f32", lambda: spread((17 * CHUNK + 123,), _F32, 1),
                 units=18),
    _reduce_case("full-misaligned-bf16", lambda: spread((17 * CHUNK + 124,), _BF16, 2)[1:],
                 mean=True, units=18),
    _reduce_case("full-strided-f16", lambda: spread((2 * (17 * CHUNK + 5),), _F16, 3)[::2],
                 dtype=_F32, units=18),
    _reduce_case("full-expanded-f64", lambda: spread((300, 1), _F64, 4).expand(300, 4000),
                 units=chunks(1_200_000)),
    _reduce_case("full-specials-f32", lambda: spread((3 * CHUNK + 1,), _F32, 5, specials=True)),
    # 131 chunks: the finishing block's threads fold one or two partials each.
    _reduce_case("full-many-partials-f16", lambda: spread((130 * CHUNK + 5,), _F16, 6),
                 units=131),
    # Scheme 2 (warp lanes): 70 outputs on 16 blocks of 4 warps; then several
    # segments per output, finished per output.
    _reduce_case("warp-lanes-f32", lambda: spread((70, 300), _F32, 7), dim=[1], units=70,
                 per_block=4),
    _reduce_case("warp-lanes-segments-bf16", lambda: spread((3, 2 * CHUNK + 100), _BF16, 8),
                 dim=[1], keepdim=True, mean=True),
    _reduce_case("warp-lanes-specials-f16", lambda: spread((40, 500), _F16, 9, specials=True),
                 dim=[1], dtype=_F64),
    # Scheme 3 (one lane): 2,100 outputs on 16 blocks of 128 threads; then
    # several segments per output; an expanded reduced dim.
    _reduce_case("one-lane-f32", lambda: spread((5, 2100), _F32, 10), dim=[0], units=2100,
                 per_block=128),
    _reduce_case("one-lane-segments-f64", lambda: spread((CHUNK + 4465, 3), _F64, 11), dim=[0],
                 mean=True),
    _reduce_case("one-lane-expanded-bf16",
                 lambda: spread((1, 50), _BF16, 12).expand(3000, 50), dim=[0]),
    _reduce_case("one-lane-specials-f32", lambda: spread((300, 70), _F32, 13, specials=True),
                 dim=[0], dtype=_F16),
    # finish_kernel's grid-stride loop wraps: 40 and 20 outputs of two
    # segments each, finished on 16 blocks.
    _reduce_case("one-lane-segments-finish-wraps-f16", lambda: spread((CHUNK + 40, 40), _F16, 14),
                 dim=[0], finish_units=40),
    _reduce_case("warp-lanes-segments-finish-wraps-f32",
                 lambda: spread((20, CHUNK + 300), _F32, 15), dim=[1], finish_units=20),
]


def check_reduce(case: Case, device: Device) -> None:
    """The result equals the CPU op's bits (NaNs by position: a GPU makes the
    canonical NaN)."""
    a = case.make()
    name = "kahan_mean" if a["mean"] else "kahan_sum"
    got = device.op(name)(device.to(a["x"]), a["dim"], a["keepdim"], dtype=a["dtype"])
    want = getattr(OPS, name)(a["x"], a["dim"], a["keepdim"], dtype=a["dtype"])
    assert_matches_but_nan_payloads(got.cpu(), want)


# ---------------------------------------------------------------------------
# tensor_health (csrc/cuda/health.cu): 256-thread blocks over tiles of 16
# bytes a thread, at most 8 blocks a multiprocessor, a shared histogram per
# block (float64: the binades of exponents [-128, 127] only; the others go to
# the output directly).

HEALTH_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                 torch.float8_e4m3fn, torch.float8_e5m2)


def _tile(dtype):
    return 256 * (16 // dtype.itemsize)


def _health_case(id, dtype, make_x, tiles=0):
    return Case(f"{id}-{str(dtype)[6:]}", lambda: dict(x=make_x()), 1, units=tiles)


def _health_cases(dtype):
    n = 9 * _tile(dtype) + 37  # ten tiles, the last partial, on eight blocks
    return [
        _health_case("wrap", dtype, lambda: mixed(n, dtype, 21), tiles=10),
        _health_case("misaligned", dtype, lambda: mixed(n + 1, dtype, 22)[1:], tiles=10),
        _health_case("strided", dtype, lambda: mixed(4 * n, dtype, 23).view(4, n)[:, 1::2],
                     tiles=10),
        _health_case("expanded", dtype,
                     lambda: mixed(n // 16, dtype, 24).view(-1, 1).expand(-1, 16)),
        # Every lane of every warp in one bin: the shared and global atomics contended.
        _health_case("constant", dtype, lambda: torch.full((n,), 1.5, dtype=dtype), tiles=10),
        _health_case("constant-subnormal", dtype,
                     lambda: torch.full((n,), torch.finfo(dtype).smallest_normal / 2,
                                        dtype=torch.float64).to(dtype), tiles=10),
    ]


HEALTH_CASES = [
    *[c for dtype in HEALTH_DTYPES for c in _health_cases(dtype)],
    *[_health_case("every-value", dtype, lambda dtype=dtype: every_value(dtype))
      for dtype in HEALTH_DTYPES[2:]],
    # float64 binades outside the shared window: global atomics, contended.
    _health_case("constant-huge", torch.float64, lambda: torch.full((5000,), -1e300,
                                                                     dtype=torch.float64)),
]


def check_health(case: Case, device: Device) -> None:
    """counts, hist and extrema equal the CPU op's."""
    x = case.make()["x"]
    got = device.op("tensor_health")(device.to(x))
    want = OPS.tensor_health(x)
    for name, g, w in zip(("counts", "hist", "extrema"), got, want):
        assert torch.equal(g.cpu(), w), f"{name} differs from the CPU op's"


# ---------------------------------------------------------------------------
# block_cast (csrc/cuda/block_cast.cu): a thread per block of x, grid-stride,
# at most 8 CUDA blocks a multiprocessor; the scale histogram by atomicAdd.

SOURCES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def block_data(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """spread() rows with specials, then a row of zeros and a row at
    +-dtype's largest finite value (saturation)."""
    x = spread((rows, n), dtype, seed, specials=True)
    if rows > 2:
        x[0] = 0
        x[1] = torch.finfo(dtype).max
        x[1, ::3] *= -1
    return x


def _block_case(id, fmt, mode, src, rows=40, n=1000, block_size=None, tensor_scale=2.0 ** -4,
                seed=0, wraps=False):
    b = BLOCK_FORMATS[fmt]
    block_size = block_size or b.block_size
    per_row = (n + block_size - 1) // block_size

    def make():
        return dict(x=block_data(rows, n, src, seed), fmt=fmt, mode=mode, block_size=block_size,
                    tensor_scale=tensor_scale if b.tensor_scale else None)
    return Case(f"{id}-{fmt}-{mode}-{str(src)[6:]}", make, 1,
                units=rows * per_row if wraps else 0, per_block=128)


BLOCK_CASES = [
    # 40 rows of 1,000 (a ragged last block per row) on 8 blocks of 128
    # threads: 1,280 blocks of 32 or 2,520 of 16, so the loop wraps. Every
    # (format, source) pair, the scale modes in turn.
    *[_block_case("wrap", fmt, modes[i % len(modes)], src, seed=i, wraps=True)
      for fmt, modes in ((f, BLOCK_FORMATS[f].scale_modes) for f in BLOCK_FORMATS)
      for i, src in enumerate(SOURCES)],
    # 4-bit elements, odd-length last blocks: the last byte's high nibble.
    _block_case("ragged", "mxfp4", "even", torch.float32, rows=7, n=333, block_size=6),
    _block_case("ragged", "nvfp4", "amax", torch.bfloat16, rows=9, n=101, block_size=10),
    _block_case("tiny", "nvfp4", "amax", torch.float32, rows=1, n=2),
    _block_case("tiny", "mxfp8_e4m3", "floor", torch.float16, rows=1, n=1),
]


def check_block_cast(case: Case, device: Device) -> None:
    """data, scales, the scale histogram, block counts, counts and maxima
    equal the CPU op's; the float64 sums, added in another order, within
    1e-12 (docs/cuda.md)."""
    a = case.make()
    x, ts = a["x"], a["tensor_scale"]
    ts = torch.tensor(ts, dtype=torch.float32) if ts is not None else None
    args = (a["fmt"], a["block_size"], a["mode"])
    got = device.op("block_cast")(device.to(x), *args, device.to(ts) if ts is not None else None)
    want = OPS.block_cast(x, *args, ts)
    for name, g, w in zip(("data", "scales", "scale_hist", "block_counts"),
                          (got[0], got[1], got[3], got[4]), (want[0], want[1], want[3], want[4])):
        assert torch.equal(g.cpu().view(torch.uint8) if g.element_size() == 1 else g.cpu(),
                           w.view(torch.uint8) if w.element_size() == 1 else w), name
    stats, want_stats = got[2].cpu(), want[2]
    sums = [STAT_FIELDS.index(f) for f in SUMS]
    torch.testing.assert_close(stats[sums], want_stats[sums], rtol=1e-12, atol=0)
    stats[sums] = want_stats[sums]
    assert_stats_bits(stats, want_stats, "the stats (but the sums)")


# ---------------------------------------------------------------------------
# adam_step_ (csrc/cuda/adam.cu): one launch for the group, a block per chunk
# of 16,384 elements of the concatenated tensors.

# (param dtype, state dtype, compensation): a new state format is a row here.
ADAM_FORMATS = [
    (torch.float32, torch.float32, "none"), (torch.float32, torch.float32, "kahan"),
    (torch.float64, torch.float64, "none"),
    (torch.bfloat16, torch.float32, "kahan"), (torch.bfloat16, torch.float32, "remainder"),
    (torch.bfloat16, torch.bfloat16, "none"), (torch.bfloat16, torch.bfloat16, "stochastic"),
    (torch.float16, torch.float32, "kahan"), (torch.float16, torch.float32, "stochastic"),
    # 8-bit moments (state_dtype="8bit"): codes and a scale per block of 256.
    (torch.bfloat16, "8bit", "stochastic"), (torch.bfloat16, "8bit", "remainder8"),
    (torch.float16, "8bit", "kahan"),
]
# Tensors of the group: one across two chunk boundaries, one element, exactly
# a chunk, a short one, one across two more: nine blocks.
ADAM_SIZES = (2 * ADAM_CHUNK + 5, 1, ADAM_CHUNK, 3, 40_000)
# Variants of the step: (id, options).
ADAM_VARIANTS = [
    ("plain", dict()),
    ("amsgrad-tracked-scaled", dict(amsgrad=True, track=True, grad_scale=1024.0, edge=True)),
    ("tensor-lr-adamw-maximize", dict(tensor_lr=True, decoupled=True, wd=0.1, maximize=True)),
    ("strided-l2", dict(layout="strided", wd=0.01)),
    # 8-bit moments only: a gradient of 1 heading each block of small ones
    # (1e-6: sqrt(v)'s code falls to its floor while m's may not), and the
    # format's largest finite gradient in places (bfloat16: its square
    # overflows, exp_avg_sq becomes inf and reads back as inf).
    ("outliers-huge", dict(outliers=True, wd=0.01, decoupled=True)),
]


def _adam_case(fmt, variant, seed):
    pdtype, sdtype, mode = fmt
    id, o = variant

    def make():
        gen = torch.Generator().manual_seed(seed)
        ops = [[] for _ in range(7)]
        scales = []
        for n in ADAM_SIZES:
            if sdtype == "8bit":
                one = make_operands(pdtype, torch.float32, mode, False, (n,), gen,
                                    o.get("layout", "contiguous"), o.get("edge", False))
                # the moments as codes, a scale per block for each
                one[2] = [t.new_empty(t.shape, dtype=torch.int8).copy_(
                    torch.randint(-128, 128, t.shape, generator=gen)) for t in one[2]]
                one[3] = [t.new_empty(t.shape, dtype=torch.uint8).copy_(
                    torch.randint(0, 256, t.shape, generator=gen)) for t in one[3]]
                scales.append(torch.rand(2, moments8_ref.blocks_of(n), generator=gen) * 0.01)
                if o.get("outliers"):
                    g = one[1][0]
                    g.mul_(1e-6)
                    g[::moments8_ref.BLOCK] = 1.0
                    g[3::997] = torch.finfo(pdtype).max
            else:
                one = make_operands(pdtype, sdtype, mode, o.get("amsgrad", False), (n,), gen,
                                    o.get("layout", "contiguous"), o.get("edge", False))
            for lst, t in zip(ops, one):
                lst += t
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=o.get("wd", 0.0), eps=1e-8,
                  amsgrad=o.get("amsgrad", False), maximize=o.get("maximize", False),
                  decoupled_weight_decay=o.get("decoupled", False), compensation=mode,
                  seed=seed * 0x9E3779B97F4A7C15 % 2 ** 63)
        if o.get("tensor_lr"):
            kw["lr"] = torch.tensor(1e-3, dtype=torch.float64)
        if "grad_scale" in o:
            kw["grad_scale"] = torch.tensor(o["grad_scale"])
        if o.get("track"):
            kw["update_stats"] = [torch.zeros(len(adam_ref.UPDATE_STAT_FIELDS), dtype=torch.int64)
                                  for _ in ADAM_SIZES]
        if scales:
            kw["moment_scales"] = scales
        return dict(ops=ops, kw=kw)
    name = f"{str(pdtype)[6:]}-{str(sdtype).replace('torch.', '')}-{mode}-{id}"
    return Case(name, make)


ADAM_CASES = [_adam_case(fmt, variant, i * 10 + j) for i, fmt in enumerate(ADAM_FORMATS)
              for j, variant in enumerate(ADAM_VARIANTS)
              if not (fmt[1] == "8bit" and variant[1].get("amsgrad"))  # 8-bit: no amsgrad
              and (fmt[1] == "8bit" or not variant[1].get("outliers"))]
ADAM_OPERANDS = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "compensation",
                 "step")


def check_adam(case: Case, device: Device) -> None:
    """One step on the device leaves every operand (grads unscaled in place
    included) and the update counts with the CPU op's bits (NaNs: any NaN)."""
    a = case.make()
    ops, kw = a["ops"], a["kw"]
    want = [[x.clone() for x in lst] for lst in ops]
    listed = ("update_stats", "moment_scales")  # written by the step: a copy each
    want_kw = {k: [t.clone() for t in v] if k in listed else v for k, v in kw.items()}
    overload = "tensor_lr" if isinstance(kw["lr"], torch.Tensor) else "default"
    getattr(OPS.adam_step_, overload)(*want, **want_kw)
    got = operands_on(ops, device.name)
    got_kw = {k: ([device.to(t).clone() for t in v] if k in listed else
                  device.to(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    getattr(device.op("adam_step_"), overload)(*got, **got_kw)
    for name, lw, lg in zip(ADAM_OPERANDS, want, got):
        for i, (w, g) in enumerate(zip(lw, lg)):
            assert g.stride() == w.stride(), name
            assert_same_bits(w, g.cpu(), f"{name} {i}")
    for i, (w, g) in enumerate(zip(want_kw.get("moment_scales", []),
                                   got_kw.get("moment_scales", []))):
        assert_same_bits(w, g.cpu(), f"moment_scales {i}")
    counts = zip(want_kw.get("update_stats", []), got_kw.get("update_stats", []))
    for i, (w, g) in enumerate(counts):
        assert torch.equal(w, g.cpu()), f"update_stats {i}: {g.tolist()} != {w.tolist()}"


# Each kernel's cases and check, by the op's name.
KERNELS = {
    "cast_with_stats": (CAST_CASES, check_cast),
    "kahan_sum": (REDUCE_CASES, check_reduce),
    "tensor_health": (HEALTH_CASES, check_health),
    "block_cast": (BLOCK_CASES, check_block_cast),
    "adam_step_": (ADAM_CASES, check_adam),
}
