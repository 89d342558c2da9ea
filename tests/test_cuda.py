"""What only CUDA has: the build's kernels, run-to-run determinism on the GPU,
64-bit indexing at sizes the CPU tests do not reach, streams, the sync
debugger, CUDA graphs, and operands on two devices; and every kernel on the
cases of kernel_cases.py, which test_cuda_emulated.py runs on the emulated
grid without a GPU.

The checks every device shares (against the references, and off the CPU bit
for bit against the CPU op) live in test_cast.py, test_reduce.py and
test_adam.py, parametrized over the device fixture of conftest.py.

Every test here needs a GPU and is skipped, with that reason, without one."""
import subprocess
import sys

import pytest
import torch

import torchcast
from torchcast import _ops
from torchcast._reference import cast as cast_ref

from adam_common import adam_kw, assert_same_bits, make_operands, operands_on
from cast_common import assert_same, bits, sample
from devices import on_device
from kernel_cases import KERNELS, Device
from reduce_common import assert_matches, spread_sample

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine")

op = torch.ops.torchcast.cast_with_stats
adam_op = torch.ops.torchcast.adam_step_
LOSSY = cast_ref.LOSSY_PAIRS


def pair_id(pair):
    return f"{str(pair[0])[6:]}->{str(pair[1])[6:]}"


# ---------------------------------------------------------------------------
# the build, and determinism from launch to launch

def test_built_with_cuda_kernels():
    # On a GPU machine a build without the kernels would silently take the
    # slow fallback; setup.py builds them whenever CUDA is available.
    assert _ops.WITH_CUDA, "torchcast._C was built without CUDA kernels (TORCHCAST_CUDA=1)"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("torchcast::cast_with_stats", "CUDA")


@pytest.mark.parametrize("pair", LOSSY, ids=pair_id)
def test_run_to_run_identical(pair):
    src, dst = pair
    x = sample(5 * 65536 + 3, src, seed=7).cuda()
    y1, s1 = op(x, dst)
    for _ in range(3):
        y2, s2 = op(x, dst)
        assert torch.equal(bits(y1), bits(y2))
        assert torch.equal(s1.view(torch.int64), s2.view(torch.int64))


# ---------------------------------------------------------------------------
# every kernel on the cases the emulated grid runs (tests/kernel_cases.py)

KERNEL_CASES = [(kernel, case) for kernel, (cases, _) in KERNELS.items() for case in cases]


@pytest.mark.parametrize("kernel,case", KERNEL_CASES, ids=[f"{k}-{c.id}" for k, c in KERNEL_CASES])
def test_kernel_cases(kernel, case):
    KERNELS[kernel][1](case, Device("cuda", torch.ops.torchcast))


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
    assert_same(cpu, gpu, x.dtype)


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_every_float32_bit_pattern(dst):
    # All 2^32 float32 inputs, in 16 slices of 2^28: y and stats agree with the CPU op's.
    step = 1 << 28
    for k in range(16):
        codes = torch.arange(k * step - (1 << 31), (k + 1) * step - (1 << 31),
                             dtype=torch.int64, device="cuda")
        x = codes.to(torch.int32).view(torch.float32)
        assert_same(op(x.cpu(), dst), op(x, dst), x.dtype)


def test_strided_beyond_32bit_offsets():
    # 2^29 elements at stride 2: byte offsets past 2^31, so the kernel takes
    # the 64-bit offset calculator.
    g = torch.Generator(device="cuda").manual_seed(2)
    base = torch.randn(1 << 30, generator=g, device="cuda") * 1e4
    assert_same(op(base.cpu()[::2], torch.bfloat16), op(base[::2], torch.bfloat16), base.dtype)


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
    assert_same(ref, got, src.dtype)


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
        assert_same(op(data, torch.float16), (y, stats), data.dtype)


def test_scale_check_does_not_sync_and_fails_on_the_device():
    # A good scale passes without a host synchronization; a zero one fails
    # at the next one, as a device-side assertion, which ends the CUDA
    # context: so in a child process.
    x = sample(65536, torch.float32, seed=31).cuda()
    scale = torch.tensor(2.0 ** 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op(x, torch.float8_e4m3fn, scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    child = subprocess.run(
        [sys.executable, "-c",
         "import torch, torchcast\n"
         "x = torch.ones(10, device='cuda')\n"
         "torchcast.cast_with_stats(x, torch.float16, scale=torch.zeros((), device='cuda'))\n"
         "torch.cuda.synchronize()\n"],
        capture_output=True, text=True, timeout=300)
    assert child.returncode != 0 and "assert" in (child.stderr + child.stdout).lower()


# ---------------------------------------------------------------------------
# operands on two devices

def test_errors_on_cuda():
    x = torch.randn(10, device="cuda")
    with pytest.raises(RuntimeError, match="out is on cpu but x is on cuda"):
        op.out(x, torch.float16, out=torch.empty(10, dtype=torch.float16))


def test_adam_errors_on_cuda():
    gen = torch.Generator().manual_seed(31)
    ops = operands_on(make_operands(torch.float32, torch.float32, "none", False, (3, 2), gen),
                      "cuda")
    ops[2] = [ops[2][0].cpu()]
    with pytest.raises(RuntimeError, match="exp_avg 0 is on cpu but its param is on cuda"):
        adam_op(*ops, **adam_kw("none"))


# ---------------------------------------------------------------------------
# adam_step_ and torchcast.optim on CUDA

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
    ops = operands_on(make_operands(torch.bfloat16, torch.float32, "remainder", True, (70_000,),
                                    gen), "cuda")
    strided = operands_on(make_operands(torch.float32, torch.float32, "kahan", False, (40, 30),
                                        gen, "strided"), "cuda")
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
    gpu = operands_on(ops, "cuda")
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


# ---------------------------------------------------------------------------
# kahan_sum / kahan_mean on CUDA. NaN results are NaN on both devices, but
# their payloads may differ (x86 keeps an operand's, CUDA makes the canonical
# one), so NaNs are compared by position.

KAHAN = {False: torch.ops.torchcast.kahan_sum, True: torch.ops.torchcast.kahan_mean}


@pytest.mark.parametrize("n", [(1 << 27) + 3, (1 << 30) + 7])
def test_kahan_large_matches_cpu(n):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n % 97)) - 0.25
    assert_matches(KAHAN[False](x.cuda()), KAHAN[False](x))
    rows = x[: n // 1024 * 1024].view(1024, -1)
    assert_matches(KAHAN[False](on_device(rows, "cuda"), [1]), KAHAN[False](rows, [1]))


def test_kahan_run_to_run_identical():
    x = spread_sample((300, 5000), torch.float32, seed=41).cuda()
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
    xs = [spread_sample((3 * 65536 + 5,), torch.float32).cuda(),
          spread_sample((3, 70000), torch.bfloat16).cuda(),
          spread_sample((70000, 3), torch.float64).cuda()]
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
        assert_matches(g, r)
