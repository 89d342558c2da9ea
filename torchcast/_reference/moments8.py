"""8-bit Adam moments (state_dtype="8bit"), restated from
csrc/adam_moments8.h (Moments8, MomentTally) in float32 torch operations,
each correctly rounded, in the kernel's order: codes, scales and what a
step's quantization lost. Operands are flat, in the order the kernel steps
a param; ``block`` gives each element's block."""
import torch

BLOCK = 256
M_LEVELS, ROOT_LEVELS = 127, 254
M_NOT_FINITE, ROOT_NOT_FINITE = -128, 255
# 1 / levels rounded once to float32, as the C++ constants.
M_STEP = (torch.tensor(1.0) / M_LEVELS).item()
ROOT_STEP = (torch.tensor(1.0) / ROOT_LEVELS).item()
_SMALLEST_SCALE = 2.0 ** -126
_NAN = float("nan")


def blocks_of(numel: int) -> int:
    """The number of scale blocks of a tensor of numel elements."""
    return -(-numel // BLOCK)


def m_of(q, s):
    """Moments8::m_of: exp_avg of int8 codes q with their blocks' scales s."""
    t = q.to(torch.int32).abs().float() * M_STEP
    mag = (t * t) * s
    return torch.where(q == M_NOT_FINITE, _NAN, torch.where(q < 0, -mag, mag))


def root_of(q, s):
    """Moments8::root_of: sqrt(exp_avg_sq) of uint8 codes q."""
    t = q.float() * ROOT_STEP
    return torch.where(q == ROOT_NOT_FINITE, _NAN, (t * t) * s)


def _finite(x):
    return (x.view(torch.int32) & 0x7F800000) != 0x7F800000


def block_scales(x, block, nblocks):
    """Moments8::scale_of of each block's largest finite |x| (0 below
    float32's smallest normal)."""
    u = x.view(torch.int32) & 0x7FFFFFFF
    u = torch.where(u < 0x7F800000, u, 0)
    largest = torch.zeros(nblocks, dtype=torch.int32, device=x.device).scatter_reduce_(
        0, block, u, "amax")
    a = largest.view(torch.float32)
    return torch.where(a >= _SMALLEST_SCALE, a, 0.0)


def _code(a, inv, levels, r16):
    x = a * inv
    c = torch.where(x < 1.0, x, 1.0)  # NaN compares false: clamped, its code replaced
    y = torch.sqrt(c.double()).float() * float(levels) + r16.float() * 2.0 ** -16
    return torch.clamp(y.to(torch.int32), max=levels)


def m_code(m, inv, r16):
    """Moments8::m_code: int8 codes of exp_avg m, blocks' inverse scales inv,
    16 random bits r16 (int64)."""
    q = _code(m.abs(), inv, M_LEVELS, r16)
    q = torch.where(m < 0, -q, q)
    return torch.where(_finite(m), q, M_NOT_FINITE).to(torch.int8)


def root_code(root, inv, r16):
    """Moments8::root_code: uint8 codes of sqrt(exp_avg_sq)."""
    q = _code(root, inv, ROOT_LEVELS, r16)
    return torch.where(_finite(root), q, ROOT_NOT_FINITE).to(torch.uint8)


def tally(stats, m, qm, sm, root, qr, sr):
    """MomentTally summed into an update_stats tensor's last four entries
    (exp_avg lost, off; exp_avg_sq lost, off)."""
    md = m_of(qm, sm)
    fm = _finite(m)
    m_lost = fm & (m != 0) & (qm == 0)
    m_off = fm & (2.0 * (md - m).abs() > m.abs())
    rd = root_of(qr, sr)
    v = root * root
    fv = _finite(root)
    v_lost = fv & (root != 0) & (qr == 0)
    v_off = fv & (2.0 * (rd * rd - v).abs() > v)
    for i, count in enumerate((m_lost, m_off, v_lost, v_off), start=6):
        stats[i] += int(count.sum())


def quantize(m, v, nearest=True, r=None):
    """Float32 moments (exp_avg m, exp_avg_sq v, flat in step order) as
    (int8 codes, uint8 codes, float32 (2, blocks) scales): rounded to the
    nearest code (r=None), as loading a wider state does, or with the random
    bits r. The inverse of ``dequantize``'s codes where the moments are
    exactly representable."""
    n = m.numel()
    block = torch.arange(n, device=m.device) // BLOCK
    root = torch.sqrt(v.double()).float()
    scales = torch.stack([block_scales(m, block, blocks_of(n)),
                          block_scales(root, block, blocks_of(n))])
    half = torch.full((n,), 1 << 15, dtype=torch.int64, device=m.device)
    rm, rr = (half, half) if r is None else (r >> 16, r & 0xFFFF)
    inv = 1.0 / torch.where(scales > 0, scales, float("inf"))
    return m_code(m, inv[0][block], rm), root_code(root, inv[1][block], rr), scales


def dequantize(qm, qr, scales):
    """(exp_avg, exp_avg_sq) in float32 of flat codes in step order."""
    block = torch.arange(qm.numel(), device=qm.device) // BLOCK
    root = root_of(qr, scales[1][block])
    return m_of(qm, scales[0][block]), root * root
