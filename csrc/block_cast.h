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
//    Where the float32 multiplier (1 / t) / s overflows (t * s below about
//    2^-128: a tiny tensor's default t, or a small block's s beside it),
//    the multiplier and x times it are taken in float64, where they fit, as
//    for a float64 source; torchao multiplies by inf there (zeros become NaN,
//    everything else +-6).
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

// 2^(bits - 127) as a W. bits 0 is 2^-127 (a float32 subnormal).
template <typename W>
TC_HD W e8m0_divisor(uint32_t bits) {
  const float f = bits == 0u ? bit_cast<float>(0x00400000u) : bit_cast<float>(bits << 23);
  return static_cast<W>(f);
}

// 2^(127 - bits) as a W, exactly the reciprocal of e8m0_divisor, so that
// x times it is x divided by the scale (the same exact value, rounded once).
// bits 254 gives 2^-127 (a float32 subnormal); bits 255 (NaN) gives 0, which
// turns every finite element of a NaN block into 0 and NaN or inf ones into
// NaN, as dividing by inf would.
template <typename W>
TC_HD W e8m0_multiplier(uint32_t bits) {
  const uint32_t u = bits == 255u ? 0u : (bits == 254u ? 0x00400000u : (254u - bits) << 23);
  return static_cast<W>(bit_cast<float>(u));
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

// What one element of a block becomes and loses: its bits, and its terms of
// the statistics (counts 0 or 1; the error terms 0 where not measured).
struct ElementFacts {
  uint32_t bits;
  int32_t nan, inf, inexact, overflow, saturated, underflow, subnormal;
  double err, rel, amax, sq;
};

// What the elements of a run of blocks lost: cast_with_stats' statistics
// (StatIndex, numerics.h) and the per-block counts, all exact but the sums
// (plain float64 sums, in the element order).
struct Tally : CastCounts<double> {
  double max_abs_err = 0, max_rel_err = 0, amax = 0;
  double sum_abs_err = 0, sum_sq_err = 0, sum_sq = 0;
  double blocks[kNumBlockCounts] = {0, 0, 0, 0};

  TC_HD void merge(const Tally& o) {
    CastCounts<double>::add(o);
    max_abs_err = o.max_abs_err > max_abs_err ? o.max_abs_err : max_abs_err;
    max_rel_err = o.max_rel_err > max_rel_err ? o.max_rel_err : max_rel_err;
    amax = o.amax > amax ? o.amax : amax;
    sum_abs_err += o.sum_abs_err;
    sum_sq_err += o.sum_sq_err;
    sum_sq += o.sum_sq;
    for (int i = 0; i < kNumBlockCounts; ++i) blocks[i] += o.blocks[i];
  }

  TC_HD void add(const ElementFacts& f) {
    CastCounts<double>::add(f);
    max_abs_err = f.err > max_abs_err ? f.err : max_abs_err;
    max_rel_err = f.rel > max_rel_err ? f.rel : max_rel_err;
    amax = f.amax > amax ? f.amax : amax;
    sum_abs_err += f.err;
    sum_sq_err += f.err * f.err;
    sum_sq += f.sq;
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

// A block's scale, from its amax: its bits, the multiplier that maps an x
// to the element's unrounded value, and what one unit of an element stands
// for (the scale, times NVFP4's tensor scale) in float64.
template <typename W>
struct BlockScale {
  uint32_t bits;
  W multiplier;
  // NVFP4 only: the multiplier overflows W (a float), and this one, in
  // float64, is used instead.
  bool wide;
  double wide_multiplier;
  double value;
  bool nan;
};

// The largest |x| of a block of n elements, NaN if any is NaN.
template <typename Src>
TC_HD typename Src::wide block_amax(const typename Src::storage* x, int n) {
  using W = typename Src::wide;
  W amax = W(0);
  bool any_nan = false;
  for (int i = 0; i < n; ++i) {
    const W v = Src::widen(x[i]);
    any_nan |= v != v;
    const W a = fabs(v);
    amax = a > amax ? a : amax;
  }
  return any_nan ? static_cast<W>(bit_cast<float>(0x7fc00000u)) : amax;
}

// tensor_scale: NVFP4's float32 tensor scale (ignored for MX).
template <typename BF, typename W>
TC_HD BlockScale<W> block_scale(W amax, ScaleMode mode, float tensor_scale) {
  using Elem = typename BF::element;
  BlockScale<W> s;
  if constexpr (BF::kKind == BlockKind::kMx) {
    s.bits = mx_scale_bits<Elem, W>(amax, mode);
    s.multiplier = e8m0_multiplier<W>(s.bits);
    s.value = e8m0_value(s.bits);
    s.nan = s.bits == FormatE8M0::kNaN;
    s.wide = false;
    s.wide_multiplier = 0.0;
  } else {
    const W pts = static_cast<W>(tensor_scale);
    const W scaled = (amax / W(6)) / pts;
    const W lo = static_cast<W>(FormatE4M3FN::kMinNormal), hi = static_cast<W>(FormatE4M3FN::kMax);
    const W clamped = scaled != scaled ? scaled : (scaled < lo ? lo : (scaled > hi ? hi : scaled));
    bool unused;
    s.bits = element_bits<FormatE4M3FN>(clamped, unused);
    const float f = float_from_float8_bits<FormatE4M3FN>(static_cast<uint8_t>(s.bits));
    s.multiplier = (W(1) / pts) / static_cast<W>(f);
    s.value = static_cast<double>(f) * static_cast<double>(tensor_scale);
    s.nan = f != f;
    // An infinite multiplier (never in float64: t >= 2^-149, s >= 2^-6).
    s.wide = !s.nan & !((s.multiplier - s.multiplier) == W(0));
    s.wide_multiplier = (1.0 / static_cast<double>(tensor_scale)) / static_cast<double>(f);
  }
  return s;
}

template <typename BF, typename Src>
TC_HD ElementFacts cast_element(typename Src::wide xv, const BlockScale<typename Src::wide>& s) {
  using Elem = typename BF::element;
  using W = typename Src::wide;
  ElementFacts f;
  bool sat;
  f.bits = s.wide ? element_bits<Elem>(static_cast<double>(xv) * s.wide_multiplier, sat)
                  : element_bits<Elem>(xv * s.multiplier, sat);
  const float ev = float_from_float8_bits<Elem>(static_cast<uint8_t>(f.bits));
  const double y = static_cast<double>(ev) * s.value;
  const double xd = static_cast<double>(xv);
  const bool x_nan = xv != xv;
  const bool x_finite = (xv - xv) == W(0);
  const bool y_finite = (y - y) == 0.0;
  const bool measured = x_finite & y_finite;
  f.nan = x_nan;
  f.inf = !x_nan & !x_finite;
  f.inexact = x_finite & (y != xd);
  f.overflow = x_finite & !y_finite;
  f.saturated = sat;
  f.underflow = (xv != W(0)) & !x_nan & (y == 0.0);
  f.subnormal = (y == y) & (ev != 0.f) & (fabsf(ev) < Elem::kMinNormal);
  f.err = measured ? fabs(xd - y) : 0.0;
  f.rel = (measured & (xd != 0.0)) ? f.err / fabs(xd) : 0.0;
  f.amax = x_finite ? fabs(xd) : 0.0;
  f.sq = measured ? xd * xd : 0.0;
  return f;
}

// Stores element i's bits: one byte, or for a 4-bit element a nibble (the
// first of a byte in the low nibble; the high nibble of the last byte of an
// odd-length block stays 0).
template <typename Elem>
TC_HD void store_element(uint8_t* data, int i, uint32_t bits) {
  if constexpr (Elem::kBits == 4) {
    if (i % 2 == 0) {
      data[i / 2] = static_cast<uint8_t>(bits);
    } else {
      data[i / 2] = static_cast<uint8_t>(data[i / 2] | (bits << 4));
    }
  } else {
    data[i] = static_cast<uint8_t>(bits);
  }
}

// The per-block counts of a block of n elements.
TC_HD void count_block(Tally& t, int n, double underflows, bool any_saturated, bool nan_scale) {
  t.blocks[kBlocks] += 1;
  t.blocks[kSaturatedBlocks] += any_saturated;
  t.blocks[kUnderflowBlocks] += 2 * underflows > n;
  t.blocks[kNanBlocks] += nan_scale;
}

// One block of n elements x[0], x[1], ..., element by element (the CUDA
// kernel's loop; the CPU's is csrc/cpu/block_cast.cpp's, over the same
// pieces): writes its elements to data, adds to t in element order, and
// returns the scale's bits.
template <typename BF, typename Src>
TC_HD uint32_t cast_block(const typename Src::storage* x, int n, ScaleMode mode,
                          float tensor_scale, uint8_t* data, Tally& t) {
  using W = typename Src::wide;
  const BlockScale<W> s = block_scale<BF, W>(block_amax<Src>(x, n), mode, tensor_scale);
  double underflows = 0;
  bool any_saturated = false;
  for (int i = 0; i < n; ++i) {
    const ElementFacts f = cast_element<BF, Src>(Src::widen(x[i]), s);
    store_element<typename BF::element>(data, i, f.bits);
    t.add(f);
    underflows += f.underflow;
    any_saturated |= f.saturated != 0;
  }
  count_block(t, n, underflows, any_saturated, s.nan);
  return s.bits;
}

}  // namespace block
}  // namespace torchcast
