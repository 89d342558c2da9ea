"""What the Adam kernel's tests share (tests/test_adam.py, tests/test_cuda.py):
adam_step_'s operands, made on the CPU and moved to a device in their
layouts, its keyword arguments, and the bit-for-bit comparison."""
import torch

from devices import on_device


def bits(t):
    """Integer view for bitwise comparison."""
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bits(a, b, what=""):
    """Bit-identical, except that any NaN matches any NaN (torch's own casts
    canonicalize NaN payloads)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.is_floating_point():
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), what
        ok = (bits(a) == bits(b)) | na
        assert bool(ok.all()), f"{what}: {int((~ok).sum())} elements differ"
    else:
        assert torch.equal(a, b), what


def edgy(shape, dtype, gen, scale=1.0):
    """Random values with a sprinkling of +-0, +-inf, NaN and subnormals."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    flat = x.view(-1)
    if flat.numel() >= 8:
        idx = torch.randperm(flat.numel(), generator=gen)[:8]
        tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else 1e-300
        flat[idx] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                  tiny / 4, -tiny / 3, 1e30], dtype=torch.float64)
    return x.to(dtype)


def make_operands(pdtype, sdtype, mode, amsgrad, shape, gen, layout="contiguous", edge=False):
    def t(dtype, scale=1.0):
        full = (*shape[:-1], 2 * shape[-1] + 1) if layout == "strided" else shape
        if edge:
            x = edgy(full, dtype, gen, scale)
        else:
            x = (torch.randn(full, generator=gen, dtype=torch.float64) * scale).to(dtype)
        if layout == "strided":
            x = x[..., 1::2]
        if layout == "transposed" and x.dim() >= 2:
            x = x.transpose(0, -1).contiguous().transpose(0, -1)
        return x
    params = [t(pdtype)]
    grads = [t(pdtype, 0.1)]
    m = [t(sdtype, 0.01)]
    v = [t(sdtype, 0.01).abs()]
    vmax = [t(sdtype, 0.01).abs()] if amsgrad else []
    if mode == "kahan":
        comps = [t(pdtype, 1e-4)]
    elif mode == "remainder":
        comps = [torch.randint(-2 ** 15, 2 ** 15, shape, generator=gen, dtype=torch.int16)]
    elif mode == "remainder8":
        comps = [torch.randint(-2 ** 7, 2 ** 7, shape, generator=gen, dtype=torch.int8)]
    else:
        comps = []
    steps = [torch.tensor(float(torch.randint(0, 50, (), generator=gen)))]
    return [params, grads, m, v, vmax, comps, steps]


def operands_on(ops, device):
    """Copies of the operands on device, in their layouts; the step counts stay
    on the CPU, as torchcast.optim keeps them."""
    return [[x.clone() if i == 6 else on_device(x, device).clone() for x in lst]
            for i, lst in enumerate(ops)]


def adam_kw(mode, amsgrad=False, maximize=False, decoupled=False, wd=0.0, lr=1e-3, beta1=0.9):
    return dict(lr=lr, beta1=beta1, beta2=0.999, weight_decay=wd, eps=1e-8, amsgrad=amsgrad,
                maximize=maximize, decoupled_weight_decay=decoupled, compensation=mode)
