"""8-bit Adam moments (state_dtype="8bit"), restated from
csrc/adam_moments8.h (Moments8, MomentTally) in float32 torch operations,
each correctly rounded, in the kernel's order: codes, scales and what a
step's quantization lost. Operands are flat, in the order the kernel steps
a param; ``block`` gives each element's block."""
import torch

BLOCK = 256
M_LEVELS, ROOT_LEVELS = 126, 253
M_NOT_FINITE, ROOT_NOT_FINITE = -128, 255  # NaN
M_INFINITE, ROOT_INFINITE = 127, 254  # +inf (-127: -inf)
# 1 / levels^2 rounded once to float32, as the C++ constants: a level is
# q^2 times it; code 0 of sqrt(exp_avg_sq) is half a step, (1/2)^2 in place of q^2.
M_STEP2 = torch.tensor(1.0 / M_LEVELS ** 2, dtype=torch.float32).item()
ROOT_STEP2 = torch.tensor(1.0 / ROOT_LEVELS ** 2, dtype=torch.float32).item()
_SMALLEST_SCALE = 2.0 ** -126
_NAN, _INF = float("nan"), float("inf")


def blocks_of(numel: int) -> int:
    """The number of scale blocks of a tensor of numel elements."""
    return -(-numel // BLOCK)


def _squared(q):
    f = q.float()
    return f * f


def _root_squared(q):
    return torch.where(q == 0, 0.25, _squared(q))


def m_level(a):
    """Moments8::m_level: exp_avg's level of codes a >= 0 (int tensor), in
    units of the scale."""
    return _squared(a) * M_STEP2


def root_level(q):
    """Moments8::root_level: sqrt(exp_avg_sq)'s level of codes q."""
    return _root_squared(q) * ROOT_STEP2


def m_of(q, s):
    """Moments8::m_of: exp_avg of int8 codes q with their blocks' scales s."""
    a = q.to(torch.int32).abs()
    mag = torch.where(a > M_LEVELS, _INF, m_level(a) * s)
    return torch.where(q == M_NOT_FINITE, _NAN, torch.where(q < 0, -mag, mag))


def root_of(q, s):
    """Moments8::root_of: sqrt(exp_avg_sq) of uint8 codes q."""
    q = q.to(torch.int32)
    r = torch.where(q == ROOT_INFINITE, _INF, root_level(q) * s)
    return torch.where(q == ROOT_NOT_FINITE, _NAN, r)


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


def fraction_of(r16):
    """Moments8::fraction_of: 16 random bits (int64) as (2 r16 + 1) / 2^17."""
    return (2 * r16 + 1).float() * 2.0 ** -17


def m_fraction(bits):
    """exp_avg's fraction of an element's 32 random bits (the top half)."""
    return fraction_of(bits >> 16)


def root_fraction(bits):
    """exp_avg_sq's fraction (the low half)."""
    return fraction_of(bits & 0xFFFF)


def _code(x, r, root):
    """Moments8::code_of: q = floor(sqrt(x) * levels) in float32 (clamped
    to levels - 1), then one up where x (x^2 for sqrt(exp_avg_sq)) is above
    the threshold lo + r * (hi - lo), computed as the kernel computes it."""
    levels = ROOT_LEVELS if root else M_LEVELS
    q = torch.clamp((torch.sqrt(x) * float(levels)).to(torch.int32), max=levels - 1)
    if root:
        lo, hi = _root_squared(q), _squared(q + 1)
        lo2 = lo * lo
        step4 = torch.tensor(ROOT_STEP2, dtype=torch.float32) ** 2
        threshold = (lo2 + r * (hi * hi - lo2)) * step4
        x = x * x
    else:
        qf = q.float()
        threshold = (_squared(q) + r * (qf + qf + 1.0)) * M_STEP2
    return q + (threshold < x).to(torch.int32)


def _ratio(a, inv):
    x = a * inv
    return torch.where(x < 1.0, x, 1.0)  # NaN compares false: clamped, its code replaced


def m_code(m, inv, r):
    """Moments8::m_code: int8 codes of exp_avg m, blocks' inverse scales inv,
    random fractions r (float32 in (0, 1))."""
    q = _code(_ratio(m.abs(), inv), r, False)
    q = torch.where(_finite(m), q, M_INFINITE)
    q = torch.where(m < 0, -q, q)
    return torch.where(torch.isnan(m), M_NOT_FINITE, q).to(torch.int8)


def root_code(root, inv, r):
    """Moments8::root_code: uint8 codes of sqrt(exp_avg_sq), rounded in
    exp_avg_sq's domain."""
    q = _code(_ratio(root, inv), r, True)
    q = torch.where(_finite(root), q, ROOT_INFINITE)
    return torch.where(torch.isnan(root), ROOT_NOT_FINITE, q).to(torch.uint8)


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


def quantize(m, v, r=None):
    """Float32 moments (exp_avg m, exp_avg_sq v, flat in step order) as
    (int8 codes, uint8 codes, float32 (2, blocks) scales): rounded to the
    nearest code in the value domain (r=None), as loading a wider state
    does, or with the random bits r (32 an element, as the step draws them).
    The inverse of ``dequantize``'s codes where the moments are exactly
    representable."""
    n = m.numel()
    block = torch.arange(n, device=m.device) // BLOCK
    root = torch.sqrt(v.double()).float()
    scales = torch.stack([block_scales(m, block, blocks_of(n)),
                          block_scales(root, block, blocks_of(n))])
    half = torch.full((n,), 0.5, device=m.device)
    rm, rr = (half, half) if r is None else (m_fraction(r), root_fraction(r))
    inv = 1.0 / torch.where(scales > 0, scales, float("inf"))
    return m_code(m, inv[0][block], rm), root_code(root, inv[1][block], rr), scales


def dequantize(qm, qr, scales):
    """(exp_avg, exp_avg_sq) in float32 of flat codes in step order."""
    block = torch.arange(qm.numel(), device=qm.device) // BLOCK
    root = root_of(qr, scales[1][block])
    return m_of(qm, scales[0][block]), root * root
