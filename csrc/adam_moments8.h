// 8-bit Adam moments (state_dtype="8bit"): per-element math, host and
// device alike (the CPU loop in cpu/adam.cpp, the CUDA kernel in
// cuda/adam.cu, restated by torchcast/_reference/adam.py).
//
// The elements of a tensor, in the order the step visits them, form blocks
// of kBlock; each block keeps one float32 scale per moment (the op's
// moment_scales: row 0 exp_avg's, row 1 exp_avg_sq's) and one byte per
// element and moment:
//  - exp_avg as int8 q in [-126, 126]: m = sign(q) * s * (|q| / 126)^2. The
//    square root companding spends the codes where the values are small, so
//    a moment at 1% of its block's largest keeps about 6% precision where a
//    linear code would keep none.
//  - exp_avg_sq through its square root (the quantity the update divides
//    by), as uint8 q in [0, 253]: sqrt(v) = s * (q / 253)^2, companded again,
//    so that sqrt(v) spans 2^16 and v 2^32 of its block's largest; code 0
//    reads as half a step, s * (1 / 506)^2, not 0: an update can never
//    divide by eps alone because sqrt(v)'s code fell to 0 (docs/adam.md: the
//    bound);
//  - the scale is the block's largest finite magnitude (of m, of sqrt(v)),
//    0 where it is below float32's smallest normal (those blocks read as 0);
//  - codes are rounded stochastically *in the value domain* (exp_avg in m,
//    exp_avg_sq in v = sqrt(v)^2): between the two levels around the value,
//    up with the probability that makes the expected decoded value the
//    value itself, so the decoded moments are unbiased (exp_avg_sq above its
//    floor), and an exp_avg_sq that moves by 0.1% a step (beta2 = 0.999, far
//    below its code's spacing) still moves on average, where rounding to
//    nearest would freeze it. 16 random bits each, the two halves of one
//    32-bit draw (a stream apart from the weight's): with 8, a moment whose
//    step adds less than 1/512 of a code step (an EMA's (1 - beta) * g in
//    a block with an outlier) would never round up;
//  - the levels are q^2 (an exact integer) times 1 / levels^2, and the code
//    below the value is floor(sqrt(x) * levels) with IEEE float32 sqrt, on
//    every platform the same bits;
//  - a moment that is not finite keeps its value: +-inf as 127 / -127
//    (exp_avg) or 254 (exp_avg_sq), NaN as -128 or 255, that element only
//    (an infinite exp_avg_sq reads back as infinite, and its update is
//    m / inf = 0, as with float32 states and in torch).
// A step's update uses the moments it computes in float32; the codes are
// what the next step starts from.
#pragma once

#include <cstdint>

#include "numerics.h"

namespace torchcast {

struct Moments8 {
  static constexpr int64_t kBlock = 256;
  static constexpr int kMLevels = 126;
  static constexpr int kRootLevels = 253;
  static constexpr int8_t kMNotFinite = -128;  // NaN
  static constexpr int8_t kMInfinite = 127;    // +inf; -127 is -inf
  static constexpr uint8_t kRootInfinite = 254;
  static constexpr uint8_t kRootNotFinite = 255;  // NaN
  // 1 / levels^2, rounded once: a level is q^2 (an exact integer) times it.
  static constexpr float kMStep2 = 1.0f / (126.0f * 126.0f);
  static constexpr float kRootStep2 = 1.0f / (253.0f * 253.0f);
  static constexpr float kSmallestScale = 0x1p-126f;

  // The moment format's storage, for dispatch and operand pointers.
  using storage = int8_t;
  using root_storage = uint8_t;

  TC_HD static bool finite(float x) { return (bit_cast<uint32_t>(x) & 0x7f800000u) != 0x7f800000u; }

  // The levels, in units of the block's scale: exp_avg's code a >= 0 reads
  // as m_level(a) * s, sqrt(exp_avg_sq)'s code q as root_level(q) * s.
  // q^2 in float32 (exact: q <= 253), and the level's q^2 of sqrt(exp_avg_sq),
  // whose code 0 is half a step: (1/2)^2 in place of 0.
  TC_HD static float squared(int q) {
    const float f = static_cast<float>(q);
    return f * f;
  }
  TC_HD static float root_squared(int q) { return q == 0 ? 0.25f : squared(q); }
  TC_HD static float m_level(int a) { return squared(a) * kMStep2; }
  TC_HD static float root_level(int q) { return root_squared(q) * kRootStep2; }

  // exp_avg of code q in a block of scale s.
  TC_HD static float m_of(int8_t q, float s) {
    const int a = q < 0 ? -static_cast<int>(q) : static_cast<int>(q);
    const float mag = a > kMLevels ? bit_cast<float>(0x7f800000u) : m_level(a) * s;
    const float m = q < 0 ? -mag : mag;
    return q == kMNotFinite ? bit_cast<float>(0x7fc00000u) : m;
  }

  // sqrt(exp_avg_sq) of code q in a block of scale s.
  TC_HD static float root_of(uint8_t q, float s) {
    const float r = q == kRootInfinite ? bit_cast<float>(0x7f800000u) : root_level(q) * s;
    return q == kRootNotFinite ? bit_cast<float>(0x7fc00000u) : r;
  }

  // |x| as bits where x is finite, else 0: a block's largest magnitude is
  // the integer max of these (bit order is value order), in any order.
  // Signed: gcc vectorizes a signed max reduction, not this unsigned one.
  TC_HD static int32_t magnitude_bits(float x) {
    const int32_t u = bit_cast<int32_t>(x) & 0x7fffffff;
    return u < 0x7f800000 ? u : 0;
  }

  // A block's scale from its largest magnitude's bits, and its inverse.
  TC_HD static float scale_of(int32_t largest) {
    const float a = bit_cast<float>(largest);
    return a >= kSmallestScale ? a : 0.0f;
  }
  TC_HD static float inverse(float s) { return s > 0.0f ? 1.0f / s : 0.0f; }

  // The fractions of one element's 32 random bits (stochastic_bits of the
  // moment key) that each code takes: the top half exp_avg's, the low half
  // exp_avg_sq's. Disjoint bits of one uniform draw are independent
  // (tested).
  TC_HD static float m_fraction(uint32_t bits) { return fraction_of(bits >> 16); }
  TC_HD static float root_fraction(uint32_t bits) { return fraction_of(bits & 0xffffu); }
  // 16 random bits as a fraction in (0, 1), the middle of their 1/65536:
  // the probability of rounding up is then the nearest multiple of 1/65536
  // to the exact one (the expected value off by at most 2^-17 of a step).
  TC_HD static float fraction_of(uint32_t r16) {
    return static_cast<float>(2u * r16 + 1u) * 0x1p-17f;
  }

  // The code (in [0, levels]) of x = |moment| / scale in [0, 1], r a
  // fraction in (0, 1): q = floor(sqrt(x) * levels) (clamped to
  // levels - 1), the code whose level is at most x, then q + 1 where x is
  // above lo + r * (hi - lo) (lo, hi: the levels of q and q + 1; for
  // sqrt(exp_avg_sq) their squares against x^2, exp_avg_sq's domain), so
  // that the expected level is x (above level(0)): with probability
  // (x - lo) / (hi - lo). The threshold is computed in units of the levels'
  // q^2 (exact integers) and scaled once. Where sqrt's rounding puts x
  // within an ulp or two of a level on the wrong side of it, the
  // probability is clamped to 0 or 1: a bias of that ulp or two.
  template <bool kRoot>
  TC_HD static int code_of(float x, float r) {
    constexpr int levels = kRoot ? kRootLevels : kMLevels;
    const int c = static_cast<int>(sqrtf(x) * static_cast<float>(levels));
    const int q = c < levels - 1 ? c : levels - 1;
    float threshold;
    if constexpr (kRoot) {
      const float lo = root_squared(q), hi = squared(q + 1);
      const float lo2 = lo * lo;
      threshold = (lo2 + r * (hi * hi - lo2)) * (kRootStep2 * kRootStep2);
      x = x * x;
    } else {
      const float lo = squared(q), qf = static_cast<float>(q);
      threshold = (lo + r * (qf + qf + 1.0f)) * kMStep2;
    }
    return q + (threshold < x ? 1 : 0);
  }

  // a * inv (inv the block's inverse scale) clamped to [0, 1]; a non-finite
  // a is clamped too: its code is replaced.
  TC_HD static float ratio(float a, float inv) {
    const float x = a * inv;
    return x < 1.0f ? x : 1.0f;
  }

  // exp_avg m's code in a block of inverse scale inv, with the fraction r.
  TC_HD static int8_t m_code(float m, float inv, float r) {
    const int32_t bits = bit_cast<int32_t>(m);
    const float a = bit_cast<float>(bits & 0x7fffffff);
    const int q = code_of<false>(ratio(a, inv), r);
    const int magnitude = finite(m) ? q : (a == a ? static_cast<int>(kMInfinite) : 128);
    const int32_t sign = bits >> 31;  // all ones for a negative m: negated as (q ^ -1) + 1
    const int signed_q = (magnitude ^ sign) - sign;
    return static_cast<int8_t>(magnitude == 128 ? static_cast<int>(kMNotFinite) : signed_q);
  }

  // sqrt(exp_avg_sq)'s code, rounded in exp_avg_sq's domain.
  TC_HD static uint8_t root_code(float root, float inv, float r) {
    const int q = code_of<true>(ratio(root, inv), r);
    const int nf = root == root ? static_cast<int>(kRootInfinite) : static_cast<int>(kRootNotFinite);
    return static_cast<uint8_t>(finite(root) ? q : nf);
  }
};

// What quantizing one element's moments lost (track_updates): a finite,
// non-zero moment stored as code 0 ("lost"), and one whose stored value
// differs from it by more than half of it ("off"); exp_avg_sq compared as
// the second moment itself (its root squared).
struct MomentTally {
  int32_t m_lost = 0, m_off = 0, v_lost = 0, v_off = 0;

  TC_HD static MomentTally of(float m, int8_t qm, float sm, float root, uint8_t qr, float sr) {
    MomentTally t;
    const float md = Moments8::m_of(qm, sm);
    const float am = m < 0.0f ? -m : m;
    const float em = md - m;
    const int32_t fm = Moments8::finite(m);
    t.m_lost = fm & (m != 0.0f) & (qm == 0);
    t.m_off = fm & (2.0f * (em < 0.0f ? -em : em) > am);
    const float rd = Moments8::root_of(qr, sr);
    const float v = root * root;
    const float ev = rd * rd - v;
    const int32_t fv = Moments8::finite(root);
    t.v_lost = fv & (root != 0.0f) & (qr == 0);
    t.v_off = fv & (2.0f * (ev < 0.0f ? -ev : ev) > v);
    return t;
  }
};

}  // namespace torchcast
