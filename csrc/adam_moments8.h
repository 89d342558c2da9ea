// 8-bit Adam moments (state_dtype="8bit"): per-element math, host and
// device alike (the CPU loop in cpu/adam.cpp, the CUDA kernel in
// cuda/adam.cu, restated by torchcast/_reference/adam.py).
//
// The elements of a tensor, in the order the step visits them, form blocks
// of kBlock; each block keeps one float32 scale per moment (the op's
// moment_scales: row 0 exp_avg's, row 1 exp_avg_sq's) and one byte per
// element and moment:
//  - exp_avg as int8 q in [-127, 127]: m = sign(q) * s * (|q| / 127)^2. The
//    square root companding spends the codes where the values are small, so
//    a moment at 1% of its block's largest keeps about 6% precision where a
//    linear code would keep none.
//  - exp_avg_sq through its square root (the quantity the update divides
//    by), as uint8 q in [0, 254]: sqrt(v) = s * (q / 254)^2, companded again,
//    so that sqrt(v) spans 2^16 and v 2^32 of its block's largest.
//  - the scale is the block's largest finite magnitude (of m, of sqrt(v)),
//    0 where it is below float32's smallest normal (those blocks read as 0);
//  - codes are rounded stochastically in the companded domain (16 random
//    bits each), so that an exp_avg_sq that moves by 0.1% a step (beta2 =
//    0.999, far below its code's spacing) still moves on average, where
//    rounding to nearest would freeze it;
//  - a moment that is not finite is stored as -128 (exp_avg) or 255
//    (exp_avg_sq) and reads back as NaN, that element only.
// A step's update uses the moments it computes in float32; the codes are
// what the next step starts from.
#pragma once

#include <cstdint>

#include "numerics.h"

namespace torchcast {

struct Moments8 {
  static constexpr int64_t kBlock = 256;
  static constexpr int kMLevels = 127;
  static constexpr int kRootLevels = 254;
  static constexpr int8_t kMNotFinite = -128;
  static constexpr uint8_t kRootNotFinite = 255;
  static constexpr float kMStep = 1.0f / 127.0f;  // rounded once
  static constexpr float kRootStep = 1.0f / 254.0f;
  static constexpr float kRandomUnit = 0x1p-16f;  // 16 random bits as [0, 1)
  static constexpr float kSmallestScale = 0x1p-126f;

  // The moment format's storage, for dispatch and operand pointers.
  using storage = int8_t;
  using root_storage = uint8_t;

  TC_HD static bool finite(float x) { return (bit_cast<uint32_t>(x) & 0x7f800000u) != 0x7f800000u; }

  // exp_avg of code q in a block of scale s.
  TC_HD static float m_of(int8_t q, float s) {
    const int a = q < 0 ? -static_cast<int>(q) : static_cast<int>(q);
    const float t = static_cast<float>(a) * kMStep;
    const float mag = (t * t) * s;
    const float m = q < 0 ? -mag : mag;
    return q == kMNotFinite ? bit_cast<float>(0x7fc00000u) : m;
  }

  // sqrt(exp_avg_sq) of code q in a block of scale s.
  TC_HD static float root_of(uint8_t q, float s) {
    const float t = static_cast<float>(q) * kRootStep;
    const float r = (t * t) * s;
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

  // The code of magnitude a (>= 0) with `levels` steps: sqrt(a / s) * levels
  // plus a random fraction, truncated. a * inv is clamped to 1 (inv is
  // rounded), and a non-finite a is clamped too: its code is replaced.
  TC_HD static int code_of(float a, float inv, int levels, uint32_t r16) {
    const float x = a * inv;
    const float c = x < 1.0f ? x : 1.0f;
    const float y = sqrtf(c) * static_cast<float>(levels) + static_cast<float>(r16) * kRandomUnit;
    const int q = static_cast<int>(y);
    return q < levels ? q : levels;
  }

  TC_HD static int8_t m_code(float m, float inv, uint32_t r16) {
    const int32_t bits = bit_cast<int32_t>(m);
    const int q = code_of(bit_cast<float>(bits & 0x7fffffff), inv, kMLevels, r16);
    const int32_t sign = bits >> 31;  // all ones for a negative m: q negated as (q ^ -1) + 1
    const int signed_q = (q ^ sign) - sign;
    return static_cast<int8_t>(finite(m) ? signed_q : static_cast<int>(kMNotFinite));
  }

  TC_HD static uint8_t root_code(float root, float inv, uint32_t r16) {
    const int q = code_of(root, inv, kRootLevels, r16);
    return static_cast<uint8_t>(finite(root) ? q : static_cast<int>(kRootNotFinite));
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
