// tensor_health: what one element of x contributes, shared by the CPU kernel
// (csrc/cpu/health.cpp) and the CUDA kernel (csrc/cuda/health.cu), and
// restated in torchcast/_reference/health.py.
//
// Outputs (all counts exact int64; results are counts, maxima and minima, so
// they do not depend on the thread count, the chunking or the device):
//  - counts, int64 [kNumCounts]: NaN, +inf, -inf, zeros (+-0), subnormals
//    (nonzero |x| below the smallest normal of x's dtype).
//  - hist, int64 [kRows, kColumns]: every finite nonzero element once. Row b
//    is the binade of exponent e = b + kExpSub, e = floor(log2 |x|) (a
//    subnormal's true exponent too), kExpSub the exponent of the dtype's
//    smallest subnormal; the last row is the dtype's largest exponent. The
//    column is a category of the fraction f = |x| / 2^e - 1 = 0.b1 b2 b3 ...
//    (a subnormal normalized first: its leading one is the implicit bit).
//    With L the number of leading 1 bits of f:
//      column 0:      f == 0 (|x| is a power of two)
//      columns 1..12: 1 + min(L, 11), except
//      column 13:     b1 b2 b3 b4 = 1101 and a later bit set (L = 2; not in 3).
//    Rounding to any format with p <= 10 fraction bits, scaled by any power
//    of two, is then predictable from hist alone: at precision q an element
//    rounds up out of its binade iff L >= q + 1; to zero at half the smallest
//    subnormal iff f == 0 is a tie (rounds to even, zero); float8_e4m3fn's
//    overflow boundary 464 = 1.1101b x 2^8 is a tie that rounds down, so the
//    elements above it in that binade are columns 4..12 and 13. The headroom
//    computations rely on exactly this layout.
//  - extrema, float64 [kNumExtrema]: the largest finite |x| (0 when there is
//    none) and the smallest nonzero finite |x| (+inf when there is none),
//    exact: every supported dtype widens to float64 exactly.
#pragma once

#include <cstdint>
#include <type_traits>

#include "numerics.h"

namespace torchcast {
namespace health {

constexpr int kColumns = 14;
enum CountIndex : int { kNan = 0, kPosInf, kNegInf, kZero, kSubnormal, kNumCounts };
enum ExtremaIndex : int { kAmax = 0, kMinNonzero, kNumExtrema };

// One supported dtype's bit layout: Bits is the unsigned integer of its
// storage; kHasInf is false for float8_e4m3fn, whose only non-finite
// magnitude (all ones) is NaN and whose top exponent holds normal numbers.
template <typename Bits, int kFracBits, int kExpBits, bool kHasInf_>
struct Format {
  using bits_t = Bits;
  static constexpr int kFrac = kFracBits;
  static constexpr bool kHasInf = kHasInf_;
  static constexpr Bits kSign = static_cast<Bits>(Bits(1) << (kFracBits + kExpBits));
  static constexpr Bits kAbsMask = static_cast<Bits>(kSign - 1);
  static constexpr Bits kFracMask = static_cast<Bits>((Bits(1) << kFracBits) - 1);
  // The smallest magnitude (sign cleared) that is not finite: inf, or
  // float8_e4m3fn's NaN.
  static constexpr Bits kNonFinite =
      kHasInf ? static_cast<Bits>(((Bits(1) << kExpBits) - 1) << kFracBits) : kAbsMask;
  static constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  static constexpr int kExpSub = 1 - kBias - kFracBits;
  // A normal biased exponent E is row E + kFrac - 1; a subnormal is in a row
  // below kFrac (its leading one's position), so rows [0, kFrac) are exactly
  // the subnormals.
  static constexpr int kRows = (1 << kExpBits) - (kHasInf ? 2 : 1) + kFracBits;
  static constexpr int kBins = kRows * kColumns;
};

// A dtype's layout from its facts in formats.h.
template <typename Bits, typename F>
using FormatOf = Format<Bits, F::kMant, F::kExpBits, F::kHasInf>;
using Float64Format = FormatOf<uint64_t, FormatFloat64>;
using Float32Format = FormatOf<uint32_t, FormatFloat32>;
using Float16Format = FormatOf<uint16_t, FormatFloat16>;
using BFloat16Format = FormatOf<uint16_t, FormatBFloat16>;
using Float8E4M3FnFormat = FormatOf<uint8_t, FormatE4M3FN>;
using Float8E5M2Format = FormatOf<uint8_t, FormatE5M2>;

// The position of v's highest set bit, by an exact conversion to floating
// point rather than a count-leading-zeros, so that the CPU loops calling it
// vectorize (AVX2 has no vector lzcnt). v < 2^24 (float) or 2^53 (double);
// v == 0 gives a negative number.
TC_HD int highest_bit(uint32_t v) {
  return static_cast<int>(bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(v))) >> 23) -
         127;
}
TC_HD int highest_bit(uint64_t v) {
  return static_cast<int>(bit_cast<uint64_t>(static_cast<double>(static_cast<int64_t>(v))) >> 52) -
         1023;
}

// The column of a finite nonzero element from the first 11 bits of its
// (normalized) fraction, top = b1 ... b11, and whether any later bit is set.
// L >= 11 needs no more bits than those 11, and the later bits only decide
// f == 0 and column 13. Non-short-circuit & and | keep it branch-free.
TC_HD int column_of(uint32_t top, bool rest) {
  // Leading ones of top: 10 - (the highest zero's position), 11 when none.
  const int ones = 10 - highest_bit(~top & 0x7ffu);
  const int col = 1 + (ones < 11 ? ones : 11);
  const bool zero = (top == 0) & !rest;
  const bool col13 = ((top >> 7) == 0xdu) & (((top & 0x7fu) != 0) | rest);
  return zero ? 0 : col13 ? 13 : col;
}

// The bin of one element given its storage bits: row * kColumns + column for
// a finite nonzero x, otherwise kBins + its CountIndex (kNan, kPosInf,
// kNegInf or kZero). Branch-free (every case computed, one selected), so
// that the CPU loops vectorize. kSubnormals = false: the caller knows that x
// is not subnormal, and the normalization is left out.
template <typename F, bool kSubnormals = true>
TC_HD int bin_of(typename F::bits_t bits) {
  // Work at least 32 bits wide: the 8- and 16-bit formats promote anyway.
  using W = std::conditional_t<sizeof(typename F::bits_t) == 8, uint64_t, uint32_t>;
  constexpr int kWidth = 8 * static_cast<int>(sizeof(W));
  const W u = static_cast<W>(bits) & F::kAbsMask;
  const W exponent = u >> F::kFrac;
  const W fraction = u & F::kFracMask;
  int row = static_cast<int>(exponent) + F::kFrac - 1;
  W normalized = fraction;
  if constexpr (kSubnormals) {
    // A subnormal's leading one; its fraction is the bits after it. The
    // shift is masked: for anything else `lead` is meaningless and not used.
    const int lead = highest_bit(fraction);
    const bool normal = exponent != 0;
    const W shifted = fraction << ((F::kFrac - lead) & (kWidth - 1));
    row = normal ? row : lead;
    normalized = normal ? fraction : shifted & F::kFracMask;
  }
  uint32_t top;
  bool rest = false;
  if constexpr (F::kFrac >= 11) {
    top = static_cast<uint32_t>(normalized >> (F::kFrac - 11));
    rest = (normalized & ((W(1) << (F::kFrac - 11)) - 1)) != 0;
  } else {
    top = static_cast<uint32_t>(normalized << (11 - F::kFrac));
  }
  const int finite = row * kColumns + column_of(top, rest);
  const bool nan = F::kHasInf ? u > F::kNonFinite : u == F::kNonFinite;
  const bool negative = (static_cast<W>(bits) & F::kSign) != 0;
  const int inf = negative ? kNegInf : kPosInf;
  const int special = nan ? kNan : (u == F::kNonFinite ? inf : kZero);
  return ((u == 0) | (u >= F::kNonFinite)) ? F::kBins + special : finite;
}

// The magnitude |x| of finite storage bits u (sign cleared), exactly, in
// float64. Magnitudes order like their bits, so the kernels track the
// extrema as bits and convert once.
template <typename F>
TC_HD double magnitude_of(typename F::bits_t u) {
  const uint64_t exponent = static_cast<uint64_t>(u) >> F::kFrac;
  const uint64_t fraction = static_cast<uint64_t>(u) & F::kFracMask;
  const uint64_t significand = exponent != 0 ? fraction | (uint64_t(1) << F::kFrac) : fraction;
  const int scale = (exponent != 0 ? static_cast<int>(exponent) : 1) + F::kExpSub - 1;
  return ldexp(static_cast<double>(significand), scale);
}

}  // namespace health
}  // namespace torchcast
