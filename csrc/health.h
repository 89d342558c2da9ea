// tensor_health: what one element contributes, read from its bits, shared by
// the CPU and CUDA kernels (cpu/health.cpp, cuda/health.cu).
//
// Outputs of torchcast::tensor_health(x):
//   counts  int64 [5]: NaN, +inf, -inf, zeros (either sign), subnormals of
//           x's dtype;
//   hist    int64 [rows, 14]: each finite nonzero element once. Row r is the
//           binade 2^e <= |x| < 2^(e+1) with e = r + e_sub, e_sub the
//           exponent of the dtype's smallest subnormal (subnormals are
//           counted at their true exponent), up to the largest finite
//           value's. The column classifies the fraction f = |x| / 2^e - 1
//           (the bits after the leading one), by L, its number of leading
//           one bits: 0 for f == 0; 1 + min(L, 11) for f != 0; except 13
//           for f = 0.1101b followed by any nonzero bit (L = 2). Rounding
//           to q fraction bits carries an element to the next binade iff
//           L >= q + 1, so these columns make a cast to any format of at
//           most 10 fraction bits, at any power-of-two scale, predictable
//           exactly (torchcast/headroom.py); column 13 is float8_e4m3fn's
//           overflow boundary 1.1101b x 2^8 = 464, a tie that rounds down.
//   extrema float64 [2]: the largest |x| over finite elements (0 if none)
//           and the smallest nonzero finite |x| (inf if none).
#pragma once

#include <cstdint>

#include "numerics.h"

namespace torchcast {

constexpr int kHealthColumns = 14;
constexpr int kHealthCounts = 5;
enum HealthKind : int {
  kHealthFiniteNonzero = -1,
  kHealthNan = 0,
  kHealthPosInf = 1,
  kHealthNegInf = 2,
  kHealthZero = 3,
};
constexpr int kSubnormalCount = 4;

TC_HD int leading_zeros64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return __builtin_clzll(v);  // v != 0 at every call
#endif
}

// A binary floating format: Bits its storage, E exponent bits, M fraction
// bits; kFiniteOnly for float8_e4m3fn (no inf; S.1111.111 is its only NaN).
// The magnitude bits (the sign masked off) of finite values order as the
// values do: the kernels keep the extrema as bits.
template <typename Bits, int E, int M, bool FiniteOnly = false>
struct HealthFormat {
  using storage = Bits;
  static constexpr bool kFiniteOnly = FiniteOnly;
  static constexpr int kM = M;
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr int kESub = 1 - kBias - M;  // exponent of the smallest subnormal
  static constexpr int kEMax = kFiniteOnly ? (1 << E) - 1 - kBias : (1 << E) - 2 - kBias;
  static constexpr int kRows = kEMax - kESub + 1;
  static constexpr Bits kMagnitude = static_cast<Bits>((Bits(1) << (E + M)) - 1);
  static constexpr Bits kFractionMask = static_cast<Bits>((Bits(1) << M) - 1);
  static constexpr Bits kExponentMask = static_cast<Bits>(kMagnitude & ~kFractionMask);
};

using HealthF64 = HealthFormat<uint64_t, 11, 52>;
using HealthF32 = HealthFormat<uint32_t, 8, 23>;
using HealthF16 = HealthFormat<uint16_t, 5, 10>;
using HealthBF16 = HealthFormat<uint16_t, 8, 7>;
using HealthE4M3 = HealthFormat<uint8_t, 4, 3, true>;
using HealthE5M2 = HealthFormat<uint8_t, 5, 2>;

// One element: its kind, whether it is subnormal, and its histogram cell.
struct HealthElement {
  int kind;  // HealthKind
  bool subnormal;
  int cell;  // row * kHealthColumns + column, for kHealthFiniteNonzero
};

// The column of a fraction whose kM bits sit at the top of t (see above).
// Branch-free: the 0.1101b test is true for 1 fraction in 16, which a branch
// would mispredict.
TC_HD int health_column(uint64_t t) {
  const int ones = leading_zeros64(~t);  // ~t != 0: its low bits are ones
  const int by_ones = 1 + (ones < 11 ? ones : 11);
  const int above_1101 = static_cast<int>((t >> 60) == 0xD) & static_cast<int>((t << 4) != 0);
  const int column = by_ones + above_1101 * (13 - by_ones);
  return column * static_cast<int>(t != 0);
}

// Whether a magnitude u is a normal number of F (neither zero, subnormal, inf
// nor NaN); then its cell is normal_cell<F>(u). The kernels' fast path.
template <typename F>
TC_HD bool is_normal(typename F::storage u) {
  const auto field = static_cast<uint32_t>(u >> F::kM);
  constexpr uint32_t kTop = static_cast<uint32_t>(F::kExponentMask >> F::kM);
  return F::kFiniteOnly ? field != 0 && u != F::kMagnitude : field - 1u < kTop - 1u;
}

// The histogram row of a normal magnitude u: e - kESub, with e = field - kBias
// and kESub = 1 - kBias - kM.
template <typename F>
TC_HD int normal_row(typename F::storage u) {
  return static_cast<int>(u >> F::kM) - 1 + F::kM;
}

template <typename F>
TC_HD int normal_cell(typename F::storage u) {
  return normal_row<F>(u) * kHealthColumns +
         health_column(static_cast<uint64_t>(u & F::kFractionMask) << (64 - F::kM));
}

// A fraction's column depends only on its first 12 bits and on whether any
// later bit is set: the index of a 2^13-entry table of health_column (the
// CPU kernel's fast path), (first 12 bits) * 2 + (later bit set).
constexpr int kFractionIndexBits = 13;

template <typename F>
TC_HD uint32_t fraction_index(typename F::storage u) {
  const uint64_t fraction = static_cast<uint64_t>(u & F::kFractionMask);
  if constexpr (F::kM <= 12) {
    return static_cast<uint32_t>(fraction << (12 - F::kM)) << 1;
  } else {
    constexpr uint64_t kLater = (uint64_t{1} << (F::kM - 12)) - 1;
    return static_cast<uint32_t>((fraction >> (F::kM - 12)) << 1) |
           static_cast<uint32_t>((fraction & kLater) != 0);
  }
}

// health_column of the fractions fraction_index maps to i.
TC_HD int column_of_index(uint32_t i) {
  return health_column((static_cast<uint64_t>(i >> 1) << 52) |
                       (static_cast<uint64_t>(i & 1) << 40));
}

template <typename F>
TC_HD HealthElement classify_health(typename F::storage bits) {
  using Bits = typename F::storage;
  const Bits u = bits & F::kMagnitude;
  const bool negative = (bits >> (sizeof(Bits) * 8 - 1)) != 0;
  HealthElement out{kHealthFiniteNonzero, false, 0};
  if (F::kFiniteOnly ? u == F::kMagnitude : (u & F::kExponentMask) == F::kExponentMask) {
    out.kind = (F::kFiniteOnly || (u & F::kFractionMask) != 0) ? kHealthNan
               : negative                                     ? kHealthNegInf
                                                              : kHealthPosInf;
    return out;
  }
  if (u == 0) {
    out.kind = kHealthZero;
    return out;
  }
  const int biased = static_cast<int>(u >> F::kM);
  uint64_t fraction = static_cast<uint64_t>(u & F::kFractionMask);
  int e;
  if (biased == 0) {  // subnormal: the leading one is the highest set bit
    out.subnormal = true;
    const int top = 63 - leading_zeros64(fraction);  // its position, < M
    e = F::kESub + top;
    fraction = (fraction << (F::kM - top)) & static_cast<uint64_t>(F::kFractionMask);
  } else {
    e = biased - F::kBias;
  }
  out.cell = (e - F::kESub) * kHealthColumns + health_column(fraction << (64 - F::kM));
  return out;
}

}  // namespace torchcast
