// block_cast: one block of a block-scaled cast (MXFP8, MXFP4, NVFP4), shared
// by the CPU kernel (csrc/cpu/block_cast.cpp) and the CUDA kernel
// (csrc/cuda/block_cast.cu), restated in torchcast/_reference/block_cast.py.
// The formats' facts come from formats.h; docs/formats.md states the rules.
//
// A block is up to block_size consecutive elements of a row (the last one of a
// row may be shorter: a ragged block is scaled by its own amax). Its scale:
//  - MX (e8m0): 2^e, e = floor(log2(amax)) - emax_elem ("floor", OCP MX
//    v1.0 section 6.3) or torchao's other ScaleCalculationModes: "ceil"
//    (ceil(log2 amax) - emax), "even" (amax rounded to emax's mantissa width
//    first), "rceil" (ceil(log2(amax / max_elem)), amax / max_elem rounded in
//    the source's float type: cuBLAS's rule); e clamped to [-127, 127]; a
//    NaN anywhere in the block: 0xff (NaN); an inf amax reads as 2^128 (its
//    float32 exponent field, as torchao reads it), "rceil": e = 127.
//    Elements: x / 2^e, rounded to nearest even, clamped to +-max_elem.
//  - NVFP4 (e4m3 block scale s, float32 tensor scale t): s = e4m3(clamp(
//    (amax / 6) / t, 2^-6, 448)) (NaN stays NaN); elements x * ((1 / t) / s)
//    rounded to e2m1, clamped to +-6 (torchao's and NVIDIA's arithmetic, in
//    float32 for float32 and narrower sources, float64 for float64 ones).
// The value an element stands for, y = element * scale (* t), is exact in
// float64, and the statistics compare it with x (ElementMeasure's
// definitions, numerics.h): a finite x in a NaN block reads back NaN and
// counts as an overflow.
#pragma once

#include <cstdint>

#include "formats.h"
#include "numerics.h"

namespace torchcast {
namespace block {

// torchao's ScaleCalculationMode, in torchcast/formats.py's MX_SCALE_MODES
// order; NVFP4 has one rule (kAmax).
enum class ScaleMode : int { kFloor = 0, kCeil = 1, kEven = 2, kRceil = 3, kAmax = 4 };

// Per-block facts: how many blocks, how many had an element saturate, how
// many had more than half of their elements underflow to zero, how many have
// a NaN scale.
enum BlockCountIndex : int {
  kBlocks = 0, kSaturatedBlocks, kUnderflowBlocks, kNanBlocks, kNumBlockCounts
};
// The histogram of scale bytes: e8m0 bits (2^(b - 127), 255 NaN) or e4m3 bits.
constexpr int kScaleBins = 256;

// The bits of a float or double.
template <typename W>
struct WideBits;
template <>
struct WideBits<float> {
  using U = uint32_t;
  static constexpr int kMant = 23, kBias = 127;
  static constexpr U kExpMask = 0xffu;
};
template <>
struct WideBits<double> {
  using U = uint64_t;
  static constexpr int kMant = 52, kBias = 1023;
  static constexpr U kExpMask = 0x7ffu;
};

// ceil(log2(d)) for d >= 0 finite, exact (where it is below -127 the scale
// clamps, so subnormals need only tell -126 from below).
template <typename W>
TC_HD int ceil_log2(W d) {
  using B = WideBits<W>;
  using U = typename B::U;
  const U u = bit_cast<U>(d);
  const int field = static_cast<int>((u >> B::kMant) & B::kExpMask);
  const U mant = u & ((U(1) << B::kMant) - 1u);
  const int subnormal = u > (U(1) << (B::kMant - 1)) ? 1 - B::kBias : -B::kBias;
  return field == 0 ? subnormal : field - B::kBias + (mant != 0 ? 1 : 0);
}

// The e8m0 bits of an MX block whose largest |x| is amax (NaN when the block
// holds a NaN).
template <typename Elem, typename W>
TC_HD uint32_t mx_scale_bits(W amax, ScaleMode mode) {
  using B = WideBits<W>;
  using U = typename B::U;
  if (amax != amax) return FormatE8M0::kNaN;
  const bool inf = !((amax - amax) == W(0));
  int e;
  if (mode == ScaleMode::kRceil) {
    if (inf) return FormatE8M0::kMaxBits;
    e = ceil_log2<W>(amax / static_cast<W>(Elem::kMax));
  } else {
    U u = bit_cast<U>(amax);
    if (mode == ScaleMode::kEven) {
      // Round amax to Elem's mantissa width (ties away: add half an ulp of
      // it), then keep the exponent.
      u = (u + (U(1) << (B::kMant - Elem::kMant - 1))) & ~((U(1) << B::kMant) - 1u);
    }
    const int field = static_cast<int>((u >> B::kMant) & B::kExpMask);
    e = inf ? 128 : field - B::kBias;
    if (mode == ScaleMode::kCeil) e += (u & ((U(1) << B::kMant) - 1u)) != 0 ? 1 : 0;
    e -= Elem::kEmax;
  }
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return static_cast<uint32_t>(e + 127);
}

// 2^(bits - 127) as a W: the divisor of an MX block's elements. bits 0 is
// 2^-127 (a float32 subnormal), bits 255 (NaN) divides as inf: every finite
// element of a NaN block becomes 0, and NaN or inf ones NaN.
template <typename W>
TC_HD W e8m0_divisor(uint32_t bits) {
  const float f = bits == 0u ? bit_cast<float>(0x00400000u) : bit_cast<float>(bits << 23);
  return static_cast<W>(f);
}

// The value of an e8m0 scale in float64 (NaN for 0xff).
TC_HD double e8m0_value(uint32_t bits) {
  return bits == FormatE8M0::kNaN ? static_cast<double>(bit_cast<float>(0x7fc00000u))
                                  : static_cast<double>(e8m0_divisor<float>(bits));
}

// Elem's bits of a scaled value v (float, or double rounded to odd first so
// that one more rounding is exact), clamped to +-max: saturated says it was
// (|v| rounds past max, inf included).
template <typename Elem>
TC_HD uint32_t element_bits(float v, bool& saturated) {
  const uint32_t u = bit_cast<uint32_t>(v) & 0x7fffffffu;
  saturated = (u >= Elem::kFirstOverflow) & (u <= 0x7f800000u);
  const uint32_t sign = (bit_cast<uint32_t>(v) >> (32 - Elem::kBits)) & Elem::kSignBit;
  return saturated ? (sign | Elem::kMaxBits) : float8_bits_from_float<Elem>(v);
}
template <typename Elem>
TC_HD uint32_t element_bits(double v, bool& saturated) {
  return element_bits<Elem>(float_round_to_odd(v), saturated);
}

// What the elements of a run of blocks lost: cast_with_stats' statistics
// (StatIndex, numerics.h) and the per-block counts, all exact but the sums
// (plain float64 sums, in the element order).
struct Tally {
  double nan = 0, inf = 0, inexact = 0, overflow = 0, saturated = 0, underflow = 0,
         subnormal = 0;
  double max_abs_err = 0, max_rel_err = 0, amax = 0;
  double sum_abs_err = 0, sum_sq_err = 0, sum_sq = 0;
  double blocks[kNumBlockCounts] = {0, 0, 0, 0};

  TC_HD void merge(const Tally& o) {
    nan += o.nan;
    inf += o.inf;
    inexact += o.inexact;
    overflow += o.overflow;
    saturated += o.saturated;
    underflow += o.underflow;
    subnormal += o.subnormal;
    max_abs_err = o.max_abs_err > max_abs_err ? o.max_abs_err : max_abs_err;
    max_rel_err = o.max_rel_err > max_rel_err ? o.max_rel_err : max_rel_err;
    amax = o.amax > amax ? o.amax : amax;
    sum_abs_err += o.sum_abs_err;
    sum_sq_err += o.sum_sq_err;
    sum_sq += o.sum_sq;
    for (int i = 0; i < kNumBlockCounts; ++i) blocks[i] += o.blocks[i];
  }

  // The stats tensor's values (StatIndex order), with cast_with_stats' rule
  // that the maxima are inf when every finite x overflowed.
  TC_HD void write(double* out, double numel) const {
    out[kNumel] = numel;
    out[kNan] = nan;
    out[kInf] = inf;
    out[kInexact] = inexact;
    out[kOverflow] = overflow;
    out[kSaturated] = saturated;
    out[kUnderflow] = underflow;
    out[kSubnormal] = subnormal;
    const bool all_overflowed = overflow > 0 && overflow == numel - nan - inf;
    const double infinity = bit_cast<double>(uint64_t{0x7ff0000000000000});
    out[kMaxAbsErr] = all_overflowed ? infinity : max_abs_err;
    out[kMaxRelErr] = all_overflowed ? infinity : max_rel_err;
    out[kAmax] = amax;
    out[kSumAbsErr] = sum_abs_err;
    out[kSumSqErr] = sum_sq_err;
    out[kSumSq] = sum_sq;
  }
};

// One block of n elements x[0], x[1], ... (Src: a
// SourceFormat): writes its elements to data (one byte each, or for a 4-bit
// element two a byte, the first in the low nibble; n odd leaves the last high
// nibble 0), adds to t, and returns the scale's bits. tensor_scale: NVFP4's
// float32 tensor scale (ignored for MX).
template <typename BF, typename Src>
TC_HD uint32_t cast_block(const typename Src::storage* x, int n, ScaleMode mode,
                          float tensor_scale, uint8_t* data, Tally& t) {
  using Elem = typename BF::element;
  using W = typename Src::wide;
  W amax = W(0);
  bool any_nan = false;
  for (int i = 0; i < n; ++i) {
    const W v = Src::widen(x[i]);
    any_nan |= v != v;
    const W a = fabs(v);
    amax = a > amax ? a : amax;
  }
  const W nan = static_cast<W>(bit_cast<float>(0x7fc00000u));
  amax = any_nan ? nan : amax;

  uint32_t scale_bits;
  W divisor = W(1), factor = W(1);  // element = x / divisor * factor
  double scale_value;                // what an element stands for, times it
  bool nan_scale;
  if constexpr (BF::kKind == BlockKind::kMx) {
    scale_bits = mx_scale_bits<Elem, W>(amax, mode);
    divisor = e8m0_divisor<W>(scale_bits);
    scale_value = e8m0_value(scale_bits);
    nan_scale = scale_bits == FormatE8M0::kNaN;
  } else {
    const W pts = static_cast<W>(tensor_scale);
    const W scaled = (amax / W(6)) / pts;
    const W lo = static_cast<W>(FormatE4M3FN::kMinNormal), hi = static_cast<W>(FormatE4M3FN::kMax);
    const W clamped = scaled != scaled ? scaled : (scaled < lo ? lo : (scaled > hi ? hi : scaled));
    bool unused;
    scale_bits = element_bits<FormatE4M3FN>(clamped, unused);
    const float s = float_from_float8_bits<FormatE4M3FN>(static_cast<uint8_t>(scale_bits));
    factor = (W(1) / pts) / static_cast<W>(s);
    scale_value = static_cast<double>(s) * static_cast<double>(tensor_scale);
    nan_scale = s != s;
  }

  double underflows = 0;
  bool any_saturated = false;
  for (int i = 0; i < n; ++i) {
    const W xv = Src::widen(x[i]);
    const W v = BF::kKind == BlockKind::kMx ? xv / divisor : xv * factor;
    bool sat;
    const uint32_t bits = element_bits<Elem>(v, sat);
    if constexpr (Elem::kBits == 4) {
      if (i % 2 == 0) {
        data[i / 2] = static_cast<uint8_t>(bits);
      } else {
        data[i / 2] = static_cast<uint8_t>(data[i / 2] | (bits << 4));
      }
    } else {
      data[i] = static_cast<uint8_t>(bits);
    }
    const float ev = float_from_float8_bits<Elem>(static_cast<uint8_t>(bits));
    const double y = static_cast<double>(ev) * scale_value;
    const double xd = static_cast<double>(xv);
    const bool x_nan = xv != xv;
    const bool x_finite = (xv - xv) == W(0);
    const bool y_finite = (y - y) == 0.0;
    const bool measured = x_finite & y_finite;
    const bool under = (xv != W(0)) & !x_nan & (y == 0.0);
    t.nan += x_nan;
    t.inf += !x_nan & !x_finite;
    t.inexact += x_finite & (y != xd);
    t.overflow += x_finite & !y_finite;
    t.saturated += sat;
    t.underflow += under;
    t.subnormal += (y == y) & (ev != 0.f) & (fabsf(ev) < Elem::kMinNormal);
    const double err = measured ? fabs(xd - y) : 0.0;
    const double rel = (measured & (xd != 0.0)) ? err / fabs(xd) : 0.0;
    t.max_abs_err = err > t.max_abs_err ? err : t.max_abs_err;
    t.max_rel_err = rel > t.max_rel_err ? rel : t.max_rel_err;
    const double a = x_finite ? fabs(xd) : 0.0;
    t.amax = a > t.amax ? a : t.amax;
    t.sum_abs_err += err;
    t.sum_sq_err += err * err;
    t.sum_sq += measured ? xd * xd : 0.0;
    underflows += under;
    any_saturated |= sat;
  }
  if constexpr (Elem::kBits == 4) {
    if (n % 2 == 1) data[n / 2] &= 0x0fu;
  }
  t.blocks[kBlocks] += 1;
  t.blocks[kSaturatedBlocks] += any_saturated;
  t.blocks[kUnderflowBlocks] += 2 * underflows > n;
  t.blocks[kNanBlocks] += nan_scale;
  return scale_bits;
}

}  // namespace block
}  // namespace torchcast
