"""cast_with_stats on CUDA: y and stats bit-identical to the CPU op on the same
data, correctly rounded (against an independent numpy reference), for every
size class and layout, and well behaved under autocast, torch.compile, opcheck,
CUDA graphs, side streams and the sync debugger.

Every test here needs a GPU and is skipped, with that reason, without one.
The CPU op is the oracle for the bits; its own tests check it against numpy
float64 and math.fsum."""
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import torchcast
from torchcast import _ops
from torchcast._reference import cast as cast_ref
from torchcast.stats import CastStats

from numpy_ref import edge_values, round_to_format, stats_reference, to_numpy64

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine")

op = torch.ops.torchcast.cast_with_stats
LOSSY = cast_ref.LOSSY_PAIRS
EXACT = ((torch.float16, torch.float32), (torch.bfloat16, torch.float64),
         (torch.float32, torch.float32), (torch.float32, torch.float64),
         (torch.float64, torch.float64))
BITS = {torch.float64: torch.int64, torch.float32: torch.int32,
        torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Every element count where the chunk/lane mapping changes behaviour: empty,
# a partial first step, exactly one step of lanes (512 for float32, 256 for
# float64), a partial chunk, one chunk (2^16), a chunk plus a tail, several
# chunks with a ragged last step.
SIZES = (0, 1, 7, 255, 256, 257, 511, 512, 513, 4099, 65535, 65536, 65537,
         3 * 65536 + 1001, (1 << 20) + 17)


def pair_id(pair):
    return f"{str(pair[0])[6:]}->{str(pair[1])[6:]}"


def bits(t):
    return t.contiguous().view(BITS[t.dtype]) if t.dim() else t.reshape(1).view(BITS[t.dtype])


def _nan_patterns(dtype):
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
                                                        torch.bfloat16)] + [_nan_patterns(src)])
    cycled = edge.repeat(n // edge.numel() + 1)[:n]
    which = torch.randint(0, 3, (n,), generator=g)
    out = torch.where(which == 0, raw, spread)
    return torch.where(which == 1, cycled, out)


def assert_same(cpu, gpu):
    """(y, stats) from the CPU and the CUDA op: same bits, same layout."""
    y_cpu, s_cpu = cpu
    y_gpu, s_gpu = gpu
    assert y_gpu.is_cuda and s_gpu.is_cuda
    assert y_gpu.dtype == y_cpu.dtype and y_gpu.shape == y_cpu.shape
    assert y_gpu.stride() == y_cpu.stride()
    assert torch.equal(bits(y_gpu.cpu()), bits(y_cpu)), "y differs from the CPU op"
    s_gpu = s_gpu.cpu()
    assert torch.equal(s_gpu.view(torch.int64), s_cpu.view(torch.int64)), (
        "stats differ from the CPU op:\n"
        + "\n".join(f"  {f}: cpu {a!r} cuda {b!r}" for f, a, b in
                    zip(cast_ref.STAT_FIELDS, s_cpu.tolist(), s_gpu.tolist()) if a != b))


def both(base, dtype, view=lambda t: t):
    """Runs the op on view(base) on the CPU and on view(base.cuda()) on the GPU:
    same logical data, same strides, same storage offset."""
    return op(view(base), dtype), op(view(base.cuda()), dtype)


# ---------------------------------------------------------------------------
# bit-identity with the CPU op

def test_built_with_cuda_kernels():
    # On a GPU machine a build without the kernels would silently take the
    # slow fallback; setup.py builds them whenever CUDA is available.
    assert _ops.WITH_CUDA, "torchcast._C was built without CUDA kernels (TORCHCAST_CUDA=1)"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("torchcast::cast_with_stats", "CUDA")


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
@pytest.mark.parametrize("n", SIZES)
def test_matches_cpu(pair, n):
    src, dst = pair
    assert_same(*both(sample(n, src, seed=n), dst))


@pytest.mark.parametrize("pair", EXACT, ids=pair_id)
def test_exact_pairs_match_cpu(pair):
    src, dst = pair
    x = torch.randn(70001, dtype=torch.float64).to(src)
    cpu, gpu = both(x, dst)
    assert_same(cpu, gpu)
    assert gpu[1].cpu().tolist() == [70001.0] + [0.0] * (len(cast_ref.STAT_FIELDS) - 1)


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_zero_dim_and_empty_shapes(pair):
    src, dst = pair
    assert_same(*both(torch.tensor(1 / 3, dtype=torch.float64).to(src), dst))
    for shape in [(0,), (3, 0, 5), (0, 1 << 20)]:
        assert_same(*both(torch.empty(shape, dtype=src), dst))


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_run_to_run_identical(pair):
    src, dst = pair
    x = sample(5 * 65536 + 3, src, seed=7).cuda()
    y1, s1 = op(x, dst)
    for _ in range(3):
        y2, s2 = op(x, dst)
        assert torch.equal(bits(y1), bits(y2))
        assert torch.equal(s1.view(torch.int64), s2.view(torch.int64))


# Views applied identically to the CPU and the CUDA base tensor.
LAYOUTS = {
    "transposed": ((300, 257), lambda t: t.t()),
    "step_slice": ((64, 1000), lambda t: t[:, ::3]),
    "offset_1": ((70001,), lambda t: t[1:]),
    "offset_1_2d": ((130, 513), lambda t: t[1:, 1:]),
    "expanded": ((1, 5000), lambda t: t.expand(7, 5000)),
    "channels_last": ((2, 3, 37, 41), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "3d_strided": ((8, 300, 70), lambda t: t[::2, 5:, ::7]),
    "permuted": ((5, 6, 700), lambda t: t.permute(2, 0, 1)[1:]),
    "rows_offset_9": ((4, 65536 + 9), lambda t: t[:, 9:]),
}


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_cpu(pair, layout):
    src, dst = pair
    shape, view = LAYOUTS[layout]
    base = sample(math.prod(shape), src, seed=3).reshape(shape)
    assert_same(*both(base, dst, view))


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
@pytest.mark.parametrize("out_layout", ["contiguous", "transposed", "offset_1"])
def test_out_variant_matches_cpu(pair, out_layout):
    src, dst = pair
    x = sample(300 * 217, src, seed=11).reshape(300, 217)

    def make_out(device):
        if out_layout == "contiguous":
            return torch.empty(300, 217, dtype=dst, device=device)
        if out_layout == "transposed":
            return torch.empty(217, 300, dtype=dst, device=device).t()
        return torch.empty(300 * 217 + 1, dtype=dst, device=device)[1:].view(300, 217)

    out_cpu, out_gpu = make_out("cpu"), make_out("cuda")
    s_cpu = op.out(x, dst, out=out_cpu)
    s_gpu = op.out(x.cuda(), dst, out=out_gpu)
    assert_same((out_cpu, s_cpu), (out_gpu, s_gpu))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_shapes_and_strides_match_cpu(data):
    src, dst = data.draw(st.sampled_from(LOSSY), label="pair")
    ndim = data.draw(st.integers(1, 4), label="ndim")
    shape = data.draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim), label="shape")
    steps = data.draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim), label="steps")
    starts = data.draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim), label="starts")
    perm = data.draw(st.permutations(range(ndim)), label="perm")
    full = [sh * sp + s for sh, sp, s in zip(shape, steps, starts)]
    assume(math.prod(full) <= 1 << 20)
    base = sample(math.prod(full), src, seed=len(full)).reshape(full)

    def view(t):
        t = t[tuple(slice(s, None, sp) for s, sp in zip(starts, steps))]
        return t.permute(*perm)

    assert_same(*both(base, dst, view))


# ---------------------------------------------------------------------------
# correct rounding, against numpy (independent of torch and of the kernels)

@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_y_correctly_rounded(pair):
    src, dst = pair
    x = sample(200003, src, seed=5)
    y, _ = op(x.cuda(), dst)
    got = to_numpy64(y)
    want = round_to_format(to_numpy64(x), dst)
    np.testing.assert_array_equal(got, want)  # NaN == NaN here
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_double_rounding_case():
    # 1 + 2^-11 + 2^-40 is just above the float16 tie between 1 and 1 + 2^-10;
    # through float32 it becomes the tie itself, which rounds to even (1.0).
    x = torch.tensor([1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -8 + 2 ** -35], dtype=torch.float64,
                     device="cuda")
    y16, _ = op(x[:1], torch.float16)
    ybf, _ = op(x[1:], torch.bfloat16)
    assert y16.item() == 1 + 2 ** -10
    assert ybf.item() == 1 + 2 ** -7


def test_torch_cuda_cast_rounds_twice():
    # The observation behind "torch's own float64 -> float16/bfloat16 cast rounds
    # twice" (numerics.h, README): shown here on CUDA, not assumed.
    x = torch.tensor([1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -8 + 2 ** -35], dtype=torch.float64,
                     device="cuda")
    assert x[:1].to(torch.float16).item() == 1.0
    assert x[1:].to(torch.bfloat16).item() == 1.0


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_stats_against_numpy_and_fsum(pair):
    # Independent of the canonical order: exact counts and maxima, and sums
    # within the compensated float32 bound (as tests/test_cast.py holds the CPU op).
    src, dst = pair
    x = sample(300001, src, seed=9)
    _, stats = op(x.cuda(), dst)
    s = CastStats.from_tensor(stats, src, dst)
    ref = stats_reference(x, dst)
    for f in ("numel", "nan", "inexact", "overflow", "underflow", "subnormal",
              "max_abs_err", "max_rel_err"):
        assert getattr(s, f) == ref[f], f
    for f in ("sum_abs_err", "sum_sq_err", "sum_sq"):
        if math.isinf(getattr(s, f)):  # float32 accumulators overflow past 3.4e38
            assert ref[f] > 3.0e38, f
        else:
            assert abs(getattr(s, f) - ref[f]) <= 1e-6 * abs(ref[f]) + s.numel * 2.0 ** -150, f


# ---------------------------------------------------------------------------
# large sizes: 64-bit indexing

@pytest.mark.parametrize("pair,n", [((torch.float64, torch.bfloat16), (1 << 24) + 3),
                                    ((torch.float32, torch.float16), 1 << 30)],
                         ids=["f64->bf16-2^24+3", "f32->f16-2^30"])
def test_large_matches_cpu(pair, n):
    src, dst = pair
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(n, generator=g, device="cuda", dtype=torch.float64 if src == torch.float64
                     else torch.float32) * 300)
    gpu = op(x, dst)
    cpu = op(x.cpu(), dst)
    assert gpu[1][0].item() == n
    assert_same(cpu, gpu)


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_every_float32_bit_pattern(dst):
    # All 2^32 float32 inputs, in 16 slices of 2^28: y and stats equal the CPU op's.
    step = 1 << 28
    for k in range(16):
        codes = torch.arange(k * step - (1 << 31), (k + 1) * step - (1 << 31),
                             dtype=torch.int64, device="cuda")
        x = codes.to(torch.int32).view(torch.float32)
        assert_same(op(x.cpu(), dst), op(x, dst))


def test_strided_beyond_32bit_offsets():
    # 2^29 elements at stride 2: byte offsets past 2^31, so the kernel takes
    # the 64-bit offset calculator.
    g = torch.Generator(device="cuda").manual_seed(2)
    base = torch.randn(1 << 30, generator=g, device="cuda") * 1e4
    assert_same(op(base.cpu()[::2], torch.bfloat16), op(base[::2], torch.bfloat16))


# ---------------------------------------------------------------------------
# autocast, torch.compile, opcheck, autograd

@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_autocast_passes_through(autocast_dtype, pair):
    src, dst = pair
    x = sample(40000, src, seed=13).cuda()
    ref = op(x, dst)
    with torch.autocast("cuda", dtype=autocast_dtype):
        got = op(x, dst)
        y_auto = torchcast.safe_to(x, policy="record")  # dtype=None: the autocast dtype
        s_auto = torchcast.last_stats()
    assert got[0].dtype == dst
    assert_same((ref[0].cpu(), ref[1].cpu()), got)
    want_y, want_stats = op(x.cpu(), autocast_dtype)
    assert y_auto.dtype == autocast_dtype and torch.equal(bits(y_auto.cpu()), bits(want_y))
    assert s_auto == CastStats.from_tensor(want_stats, src, autocast_dtype)


def test_torch_compile():
    def f(x, scale):
        y, stats = op(x * scale, torch.bfloat16)
        return y.float() + 1, stats

    def g(x):
        return torchcast.safe_to(x, torch.float16, policy="record").float() * 2

    torch._dynamo.reset()
    compiled_f = torch.compile(f, fullgraph=True, dynamic=True)
    compiled_g = torch.compile(g, fullgraph=True)
    for n in (1000, 70001, 3 * 65536):
        x = sample(n, torch.float32, seed=n).cuda()
        eager = f(x, 3.0)
        got = compiled_f(x, 3.0)
        assert torch.equal(bits(eager[0]), bits(got[0]))
        assert torch.equal(eager[1].view(torch.int64), got[1].view(torch.int64))
        assert torch.equal(bits(g(x)), bits(compiled_g(x)))


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_opcheck(pair):
    src, dst = pair
    x = torch.randn(3, 70, dtype=src, device="cuda")
    torch.library.opcheck(op.default, (x, dst))
    torch.library.opcheck(op.default, (x.t().requires_grad_(), dst))
    out = torch.empty(3, 70, dtype=dst, device="cuda")
    torch.library.opcheck(op.out, (x, dst), {"out": out})


def test_backward_on_cuda():
    x = torch.randn(1000, dtype=torch.float64, device="cuda", requires_grad=True)
    y, _ = op(x, torch.float16)
    (y.float() * 2).sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.is_cuda
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


# ---------------------------------------------------------------------------
# streams and synchronization

def test_no_sync_inside_op():
    xs = {src: sample(3 * 65536 + 5, src, seed=17).cuda() for src in (torch.float64, torch.float32)}
    empty = torch.empty(0, device="cuda")
    strided = xs[torch.float32][::3]
    misaligned = xs[torch.float32][1:]
    out = torch.empty(xs[torch.float32].shape, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for src, dst in LOSSY:
            op(xs[src], dst)
        op(empty, torch.float16)
        op(strided, torch.bfloat16)
        op(misaligned, torch.float16)
        op.out(xs[torch.float32], torch.float16, out=out)
        op(xs[torch.float32], torch.float64)  # exact: a copy, no pass
        # safe_to promises no synchronization for these two policies
        torchcast.safe_to(xs[torch.float64], torch.bfloat16, policy="record")
        torchcast.safe_to(xs[torch.float64], torch.float16, policy="ignore")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_runs_on_current_stream():
    # The input is written on a side stream after a long sleep; a kernel that
    # ran on another stream would read it before the write.
    src = sample(4 * 65536, torch.float32, seed=19)
    ref = op(src, torch.float16)
    x = torch.zeros(src.shape, device="cuda")
    host = src.pin_memory()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x.copy_(host, non_blocking=True)
        got = op(x, torch.float16)
    side.synchronize()
    assert_same(ref, got)


def test_cuda_graph_capture():
    # Capture fails on any synchronization or launch off the capturing stream.
    x = torch.zeros(2 * 65536 + 77, dtype=torch.float64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x, torch.float16)  # warm-up, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, stats = op(x, torch.float16)
    for seed in (23, 29):
        data = sample(x.numel(), torch.float64, seed=seed)
        x.copy_(data)
        graph.replay()
        assert_same(op(data, torch.float16), (y, stats))


# ---------------------------------------------------------------------------
# errors

def test_errors_on_cuda():
    x = torch.randn(10, device="cuda")
    with pytest.raises(TypeError, match="torch.float32 to torch.int32"):
        op(x, torch.int32)
    with pytest.raises(RuntimeError, match="out is on cpu but x is on cuda"):
        op.out(x, torch.float16, out=torch.empty(10, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="out has dtype torch.bfloat16"):
        op.out(x, torch.float16, out=torch.empty(10, dtype=torch.bfloat16, device="cuda"))


# ---------------------------------------------------------------------------
# adam_step_ on CUDA: every operand bit-identical to the CPU op after each
# step (the CPU op is checked against the pure-PyTorch reference and
# torch.optim.Adam in test_adam.py).

from test_adam import COMBOS, COMBO_IDS, assert_same_bits, make_operands  # noqa: E402

adam_op = torch.ops.torchcast.adam_step_
ADAM_NAMES = ["param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "compensation", "step"]


def to_cuda(ops):
    """The operands on the GPU; the step counts stay on the CPU, as
    torchcast.optim keeps them."""
    return [[x.clone() if i == 6 else x.cuda() for x in lst] for i, lst in enumerate(ops)]


def adam_both(ops, steps=3, **kw):
    """steps CPU and CUDA steps from the same operands, compared every step."""
    cpu = [[x.clone() for x in lst] for lst in ops]
    gpu = to_cuda(ops)
    for s in range(steps):
        gkw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        op_ = adam_op.tensor_lr if isinstance(kw["lr"], torch.Tensor) else adam_op.default
        op_(*cpu, **kw)
        op_(*gpu, **gkw)
        for name, la, lb in zip(ADAM_NAMES, cpu, gpu):
            for x, y in zip(la, lb):
                assert y.device.type == ("cpu" if name == "step" else "cuda"), name
                assert y.stride() == x.stride(), name
                assert_same_bits(x, y.cpu(), f"{name} after step {s + 1}")
    return cpu, gpu


def adam_kw(mode, amsgrad=False, maximize=False, decoupled=False, wd=0.0, lr=1e-3, beta1=0.9):
    return dict(lr=lr, beta1=beta1, beta2=0.999, weight_decay=wd, eps=1e-8, amsgrad=amsgrad,
                maximize=maximize, decoupled_weight_decay=decoupled, compensation=mode)


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("wd,decoupled", [(0.0, False), (0.1, False), (0.1, True)])
def test_adam_matches_cpu(combo, amsgrad, maximize, wd, decoupled):
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(7)
    # Edge values (+-0, +-inf, NaN, subnormals) and a tensor over several
    # chunks, an empty one and a 0-d one, in one launch.
    parts = [make_operands(pdtype, sdtype, mode, amsgrad, s, gen, edge=True)
             for s in [(40_000,), (0,), (), (3, 5)]]
    ops = [sum((p[i] for p in parts), []) for i in range(7)]
    adam_both(ops, **adam_kw(mode, amsgrad, maximize, decoupled, wd))


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_adam_layouts_match_cpu(combo, layout):
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(11)
    ops = make_operands(pdtype, sdtype, mode, True, (33, 17), gen, layout)
    adam_both(ops, **adam_kw(mode, True, wd=0.01, decoupled=True))


@pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
def test_adam_tensor_lr_and_grad_scale_match_cpu(combo, lr_dtype):
    """lr and grad_scale as device tensors: read on the GPU, constants
    computed there with the host's float64 expressions."""
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(13)
    ops = make_operands(pdtype, sdtype, mode, False, (5000,), gen, edge=True)
    kw = adam_kw(mode, wd=0.05, decoupled=True, lr=torch.tensor(3e-3, dtype=lr_dtype))
    kw.update(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    adam_both(ops, **kw)


@settings(max_examples=30, deadline=None)
@given(combo=st.sampled_from(COMBOS), amsgrad=st.booleans(), maximize=st.booleans(),
       decoupled=st.booleans(), wd=st.sampled_from([0.0, 0.01, 0.5]),
       beta1=st.sampled_from([0.0, 0.5, 0.9]), lr=st.sampled_from([1e-3, 0.1, 1e-7]),
       shapes=st.lists(st.lists(st.integers(0, 70), min_size=0, max_size=3), min_size=1,
                       max_size=4),
       layout=st.sampled_from(["contiguous", "strided", "transposed"]),
       edge=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_adam_random_matches_cpu(combo, amsgrad, maximize, decoupled, wd, beta1, lr, shapes,
                                 layout, edge, seed):
    pdtype, sdtype, mode = combo
    gen = torch.Generator().manual_seed(seed)
    parts = [make_operands(pdtype, sdtype, mode, amsgrad, tuple(s) or (), gen,
                           layout if s else "contiguous", edge) for s in shapes]
    ops = [sum((p[i] for p in parts), []) for i in range(7)]
    adam_both(ops, steps=2, **adam_kw(mode, amsgrad, maximize, decoupled, wd, lr, beta1))


def test_adam_found_inf_skips_on_cuda():
    gen = torch.Generator().manual_seed(17)
    ops = to_cuda(make_operands(torch.bfloat16, torch.float32, "kahan", True, (70_000,), gen))
    before = [[x.clone() for x in lst] for lst in ops]
    kw = adam_kw("kahan", True)
    adam_op(*ops, **kw, grad_scale=torch.tensor(8.0, device="cuda"),
            found_inf=torch.tensor(1.0, device="cuda"))
    for name, la, lb in zip(ADAM_NAMES, ops, before):
        for x, y in zip(la, lb):
            assert_same_bits(x.cpu(), y.cpu(), name)


def test_adam_grad_scaler_matches_cpu():
    """torch.amp.GradScaler drives torchcast.optim.AdamW on the GPU as on the
    CPU: same params and compensation after scaled steps, a step with an inf
    gradient skipped (step count unchanged). The loss is linear in the params
    so that the scaled gradients are the same bits on both devices."""
    def run(device):
        g = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter(torch.randn(5000, generator=g).to(device, torch.bfloat16))
        opt = torchcast.optim.AdamW([p], lr=1e-2)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
        for i in range(4):
            w = torch.randn(5000, generator=g).to(device, torch.bfloat16)
            loss = (p.float() * w.float()).sum()
            if i == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return p, opt

    p_cpu, o_cpu = run("cpu")
    p_gpu, o_gpu = run("cuda")
    assert_same_bits(p_cpu.detach(), p_gpu.detach().cpu())
    assert float(o_gpu.state[p_gpu]["step"]) == float(o_cpu.state[p_cpu]["step"]) == 3.0
    for key in ("exp_avg", "exp_avg_sq", "compensation"):
        assert_same_bits(o_cpu.state[p_cpu][key], o_gpu.state[p_gpu][key].cpu(), key)


def test_adam_optimizer_uses_cuda_kernel():
    assert _ops.has_kernel("adam_step_", torch.device("cuda"))
    p = torch.nn.Parameter(torch.randn(100, device="cuda"))
    p.grad = torch.randn(100, device="cuda")
    opt = torchcast.optim.Adam([p], fused=True)  # raises where no kernel exists
    opt.step()
    assert p.is_cuda and opt.state[p]["exp_avg"].is_cuda


def test_adam_no_sync():
    gen = torch.Generator().manual_seed(19)
    ops = to_cuda(make_operands(torch.bfloat16, torch.float32, "remainder", True, (70_000,), gen))
    strided = to_cuda(make_operands(torch.float32, torch.float32, "kahan", False, (40, 30), gen,
                                    "strided"))
    scale = torch.tensor(256.0, device="cuda")
    lr = torch.tensor(1e-3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adam_op(*ops, **adam_kw("remainder", True), grad_scale=scale)
        adam_op.tensor_lr(*ops, **dict(adam_kw("remainder", True), lr=lr), grad_scale=scale)
        adam_op(*strided, **adam_kw("kahan", wd=0.1, decoupled=True))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_adam_runs_on_current_stream():
    gen = torch.Generator().manual_seed(23)
    ops = make_operands(torch.float32, torch.float32, "kahan", False, (300_000,), gen)
    ref = [[x.clone() for x in lst] for lst in ops]
    adam_op(*ref, **adam_kw("kahan"))
    gpu = to_cuda(ops)
    grad = gpu[1][0]
    host = grad.cpu().pin_memory()
    grad.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        grad.copy_(host, non_blocking=True)
        adam_op(*gpu, **adam_kw("kahan"))
    side.synchronize()
    assert_same_bits(ref[0][0], gpu[0][0].cpu())


def test_adam_opcheck_on_cuda():
    gen = torch.Generator().manual_seed(29)
    for pdtype, sdtype, mode in [(torch.float32, torch.float32, "none"),
                                 (torch.bfloat16, torch.float32, "kahan"),
                                 (torch.bfloat16, torch.bfloat16, "remainder")]:
        ops = to_cuda([lst * 2 for lst in make_operands(pdtype, sdtype, mode, True, (4, 5), gen)])
        kw = dict(adam_kw(mode, True, wd=0.01, decoupled=True),
                  grad_scale=torch.tensor(2.0, device="cuda"),
                  found_inf=torch.tensor(0.0, device="cuda"))
        torch.library.opcheck(adam_op.default, ops, kw)
        torch.library.opcheck(adam_op.tensor_lr, ops,
                              dict(kw, lr=torch.tensor(1e-3, device="cuda")))


def test_adam_errors_on_cuda():
    gen = torch.Generator().manual_seed(31)
    ops = to_cuda(make_operands(torch.float32, torch.float32, "none", False, (3, 2), gen))
    ops[2] = [ops[2][0].cpu()]
    with pytest.raises(RuntimeError, match="exp_avg 0 is on cpu but its param is on cuda"):
        adam_op(*ops, **adam_kw("none"))


# ---------------------------------------------------------------------------
# kahan_sum / kahan_mean on CUDA: bit-identical to the CPU op (which
# test_reduce.py checks against its PyTorch restatement, numpy float64 and
# math.fsum), for every scheme of csrc/reduce_common.h. NaN results are NaN on
# both, but their payloads may differ (x86 keeps an operand's, CUDA makes the
# canonical one), so NaNs are compared by position.

from test_reduce import make_input, reductions  # noqa: E402
from torchcast._reference import reduce as R  # noqa: E402

KAHAN = {False: torch.ops.torchcast.kahan_sum, True: torch.ops.torchcast.kahan_mean}


def assert_same_reduction(cpu, gpu):
    assert gpu.is_cuda and gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    gpu = gpu.cpu()
    nan = torch.isnan(cpu)
    assert torch.equal(nan, torch.isnan(gpu)), (cpu, gpu)
    keep = ~nan
    assert torch.equal(bits(cpu[keep]), bits(gpu[keep])), (cpu, gpu)


def kahan_both(x, dim=None, keepdim=False, dtype=None, mean=False):
    """The op on x (CPU) and on the same logical view of x's storage on the GPU."""
    cuda_base = x._base.cuda() if x._base is not None else None
    if cuda_base is not None:
        x_gpu = cuda_base.as_strided(x.shape, x.stride(), x.storage_offset())
    else:
        x_gpu = x.cuda()
    assert x_gpu.stride() == x.stride()
    return (KAHAN[mean](x, dim, keepdim, dtype=dtype), KAHAN[mean](x_gpu, dim, keepdim, dtype=dtype))


def reduce_sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 20, shape, generator=g).double())
    return x.to(dtype)


REDUCE_CASES = [  # (shape, view, dim, scheme)
    ((0,), None, None, None),
    ((1,), None, None, "full"),
    ((1000,), None, None, "full"),
    ((65537,), None, None, "full"),
    ((3 * 65536 + 5,), None, None, "full"),
    ((3 * 65536 + 5,), lambda t: t[1:], None, "full"),           # misaligned: scalar loads
    ((700, 300), lambda t: t.t(), None, "full"),                # transposed: strided offsets
    ((2 * 65536 + 9, 3), lambda t: t[:, 1], None, "full"),      # strided run
    ((6, 105), None, [1], "warp"),
    ((3, 70000), None, [1], "warp"),                             # two segments per output
    ((5, 333, 80), None, [0, 2], "warp"),                        # non-adjacent dims
    ((9, 70), lambda t: t.t(), [0], "warp"),
    ((10, 63), None, [1], "one"),                                # a run shorter than 2 warps
    ((70000, 3), None, [0], "one"),                              # two segments per output
    ((4096, 257), None, [0], "one"),
    ((15, 42), lambda t: t[:, ::2], [1], "one"),
    ((6, 105), lambda t: t[:1].expand(4, 105), [0], "one"),      # stride-0 dim
    ((5, 7, 18), None, [0, 2], "one"),                           # two unmergeable dims
    ((5, 7, 18), lambda t: t.permute(2, 0, 1), [0, 2], "warp"),  # permuted dims that merge
    ((4, 0, 3), None, [1], None),                                # empty reduction: 0 / NaN
]


@pytest.mark.parametrize("case", REDUCE_CASES, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
def test_kahan_matches_cpu(case, dtype):
    shape, view, dim, scheme = case
    x = reduce_sample(shape, dtype, seed=len(shape))
    if view is not None:
        x = view(x)
    if scheme is not None:
        assert R.plan(x, R.reduce_dims(x, dim))[2] == scheme
    for mean in (False, True):
        for out_dtype in (None, torch.float16, torch.float64):
            for keepdim in (False, True):
                assert_same_reduction(*kahan_both(x, dim, keepdim, out_dtype, mean))


@settings(max_examples=150, deadline=None)
@given(reductions())
def test_kahan_random_layouts_match_cpu(case):
    x = make_input(case)
    assert_same_reduction(*kahan_both(x, case["dim"], case["keepdim"], case["out_dtype"],
                                      case["mean"]))


@pytest.mark.parametrize("values", [
    [1.0, float("inf"), 2.0], [float("-inf"), float("inf")], [float("nan"), 1.0],
    [3e38, 3e38, -3e38], [1e-45, 1e-45, 2e-45], [-0.0, -0.0],
])
def test_kahan_special_values_match_cpu(values):
    x = torch.tensor(values * 3000, dtype=torch.float32)
    for shape, dim in (((len(values) * 3000,), None), ((3000, len(values)), [1]),
                       ((3000, len(values)), [0])):
        assert_same_reduction(*kahan_both(x.reshape(shape), dim))


@pytest.mark.parametrize("n", [(1 << 27) + 3, (1 << 30) + 7])
def test_kahan_large_matches_cpu(n):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n % 97)) - 0.25
    assert_same_reduction(*kahan_both(x))
    rows = x[: n // 1024 * 1024].view(1024, -1)
    assert_same_reduction(*kahan_both(rows, [1]))


def test_kahan_run_to_run_identical():
    x = reduce_sample((300, 5000), torch.float32, seed=41).cuda()
    for dim in (None, [0], [1]):
        first = torchcast.kahan_sum(x, dim)
        for _ in range(3):
            assert torch.equal(bits(first), bits(torchcast.kahan_sum(x, dim)))


def test_kahan_uses_cuda_kernel_without_warning():
    import warnings
    assert torch._C._dispatch_has_kernel_for_dispatch_key("torchcast::kahan_sum", "CUDA")
    assert _ops.has_kernel("kahan_sum", torch.device("cuda"))
    x = torch.randn(1000, device="cuda", requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torchcast.kahan_mean(x)
    y.backward()
    assert torch.equal(x.grad, torch.full_like(x, 1 / 1000))


def test_kahan_no_sync_and_current_stream():
    xs = [reduce_sample((3 * 65536 + 5,), torch.float32).cuda(),
          reduce_sample((3, 70000), torch.bfloat16).cuda(),
          reduce_sample((70000, 3), torch.float64).cuda()]
    cases = [(xs[0], None), (xs[0][1:], None), (xs[1], [1]), (xs[2], [0])]
    ref = [KAHAN[False](x.cpu(), d) for x, d in cases]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            fresh = [x.clone() for x, _ in cases]  # written late, on the side stream
            got = [KAHAN[False](f, d) for f, (_, d) in zip(fresh, cases)]
            got.append(KAHAN[True](fresh[0], None))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side.synchronize()
    for r, g in zip(ref, got):
        assert_same_reduction(r, g)


def test_kahan_opcheck_and_compile_on_cuda():
    x = torch.randn(4, 70, device="cuda")
    for fn in (torch.ops.torchcast.kahan_sum.default, torch.ops.torchcast.kahan_mean.default):
        torch.library.opcheck(fn, (x, [1], False), {"dtype": torch.float64})
        torch.library.opcheck(fn, (x.t().requires_grad_(), None, True))

    def f(t):
        return torchcast.kahan_sum(t * 2, 0) + torchcast.kahan_mean(t)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(bits(f(x)), bits(compiled(x)))
