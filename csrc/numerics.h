// Numeric helpers shared by the CPU and CUDA kernels: correctly rounded
// narrowing, the Neumaier compensation step, and the canonical reduction order
// that makes the statistics bit-identical across thread counts and devices.
//
// Everything here must be compiled without -ffast-math / --use_fast_math and
// without FMA contraction (-ffp-contract=off, --fmad=false): reassociation
// deletes the compensation term and contraction changes the rounded results.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "formats.h"  // the formats' facts, and TC_HD

namespace torchcast {

template <typename To, typename From>
TC_HD To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
#if defined(__CUDACC__)
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
#else
  return __builtin_bit_cast(To, from);  // memcpy would block gcc's vectorizer
#endif
}

// ---------------------------------------------------------------------------
// Layout of the float64 stats tensor returned by cast_with_stats. Counts are
// stored in float64, exact up to 2^53 elements. X(index, Python name) for each
// entry in order: the enum and torchcast._C.stat_fields (ops.cpp) are both
// made from this one list, so they cannot disagree.
#define TORCHCAST_STATS(X)       \
  X(kNumel, "numel")             \
  X(kNan, "nan")                 \
  X(kInf, "inf")                 \
  X(kInexact, "inexact")         \
  X(kOverflow, "overflow")       \
  X(kSaturated, "saturated")     \
  X(kUnderflow, "underflow")     \
  X(kSubnormal, "subnormal")     \
  X(kMaxAbsErr, "max_abs_err")   \
  X(kMaxRelErr, "max_rel_err")   \
  X(kAmax, "amax")               \
  X(kSumAbsErr, "sum_abs_err")   \
  X(kSumSqErr, "sum_sq_err")     \
  X(kSumSq, "sum_sq")

#define TORCHCAST_STAT_INDEX(index, name) index,
enum StatIndex : int { TORCHCAST_STATS(TORCHCAST_STAT_INDEX) kNumStats };
#undef TORCHCAST_STAT_INDEX

// ---------------------------------------------------------------------------
// Neumaier's variant of Kahan summation: the compensation also captures the
// low bits of the running sum when the new term is the larger one.
//
TC_HD void neumaier_add(float& sum, float& comp, float v) {
  const float t = sum + v;
  const bool sum_bigger = fabsf(sum) >= fabsf(v);
  const float big = sum_bigger ? sum : v;
  const float small = sum_bigger ? v : sum;
  comp += (big - t) + small;
  sum = t;
}

// Folds the compensated pair (s2, c2) into (s, c). The compensations add
// plainly: they are tiny, and a sum that overflowed to inf carries a NaN
// compensation that must not reach the sum itself.
TC_HD void neumaier_merge(float& s, float& c, float s2, float c2) {
  neumaier_add(s, c, s2);
  c += c2;
}

// The one rule for a compensated pair (s, c) whose sum is not finite: its
// compensation no longer counts. Neumaier's correction turns inf into NaN
// ((inf - inf) in the correction term), so once s is inf or NaN the pair is
// worth s alone, the plain float32 sum of the same values, which is what
// IEEE arithmetic gives for inf, -inf, NaN and overflow.
TC_HD float settled(float s, float c) { return (s - s) == 0.f ? c : 0.f; }

// The value of a compensated pair, in float64.
TC_HD double neumaier_value(float s, float c) {
  return static_cast<double>(s) + settled(s, c);
}

// ---------------------------------------------------------------------------
// Narrowing with round-to-nearest-even, written with bit operations so that
// the CPU and CUDA kernels produce identical bits (NaN payloads included).
//
// NaNs. torch 2.13 on an x86 CPU (AVX2 or AVX-512 build) converts a NaN as
// follows, and these functions return the same bits where torch's answer does
// not depend on the layout:
//  - float32 -> float16 (F16C): sign kept, quiet bit set, the top 10 mantissa
//    bits kept: 0x7f802000 -> 0x7e01, 0xffffffff -> 0xffff. torch agrees at
//    every layout (with ATEN_CPU_CAPABILITY=default its strided loop alone
//    returns sign | 0x7e00).
//  - float64 -> float32: sign kept, quiet bit set, the top 23 payload bits
//    kept (float_from_double_nan), at every layout.
//  - float64 -> float16: the two steps above, as torch does them.
//  - float32 or float64 -> bfloat16: always 0x7fc0, c10::BFloat16's rule,
//    which torch follows for strided inputs, for the scalar tail of a float64
//    source and with ATEN_CPU_CAPABILITY=default. torch's vectorized loop over
//    a contiguous input returns 0xffff instead: there, and only there, the
//    bits differ from x.to(torch.bfloat16) (both are NaN).
// torch's CUDA casts return canonical NaNs (0x7fff, 0x7fffffff); torchcast's
// CUDA kernels return the CPU bits above.

// Every path below is computed and then selected, without branches, so that
// the CPU loops vectorize.

// float32 -> float16 bits. The subnormal path lets the FPU do the rounding by
// adding 0.5f, whose ulp (2^-24) is the float16 subnormal spacing. The normal
// path rebiases the exponent (127 -> 15) and adds just under half an ulp plus
// the odd bit: ties go to even, and a carry out of the mantissa bumps the
// exponent (up to inf for [65520, 65536)).
TC_HD uint16_t half_bits_from_float(float f) {
  const uint32_t w = bit_cast<uint32_t>(f);
  const uint32_t sign = (w >> 16) & 0x8000u;
  const uint32_t u = w & 0x7fffffffu;
  // A NaN keeps its top 10 mantissa bits and is quieted; inf stays inf.
  const uint32_t special = u > 0x7f800000u ? (0x7e00u | ((u >> 13) & 0x3ffu)) : 0x7c00u;
  const uint32_t subnormal = bit_cast<uint32_t>(bit_cast<float>(u) + 0.5f) - 0x3f000000u;
  const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t mag = u >= 0x47800000u ? special : (u < 0x38800000u ? subnormal : normal);
  return static_cast<uint16_t>(sign | mag);
}

TC_HD uint16_t bfloat16_bits_from_float(float f) {
  const uint32_t u = bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // NaN (|u| above infinity's bits) as all-ones from the borrow's sign, and
  // the select written as masks: a compare-and-select here is a boolean that
  // gcc's vectorizer then cannot mix with the float compares around it.
  const uint32_t nan = static_cast<uint32_t>(static_cast<int32_t>(0x7f800000u - (u & 0x7fffffffu)) >> 31);
  return static_cast<uint16_t>((nan & 0x7fc0u) | (~nan & rounded));
}

TC_HD float float_from_half_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t special = 0x7f800000u | ((em & 0x3ffu) << 13);
  const uint32_t normal = (em + (112u << 10)) << 13;
  // Subnormal or zero: em * 2^-24 is exact in float32.
  const uint32_t subnormal = bit_cast<uint32_t>(static_cast<float>(em) * 5.9604644775390625e-8f);
  const uint32_t mag = em >= 0x7c00u ? special : (em >= 0x0400u ? normal : subnormal);
  return bit_cast<float>(sign | mag);
}

TC_HD float float_from_bfloat16_bits(uint16_t b) {
  return bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// float64 -> float32 of a NaN as x86 (and AArch64) convert it: sign kept,
// quieted, the top 23 payload bits. A GPU's conversion returns a canonical NaN
// instead, so every float64 -> float32 step below selects this explicitly and
// y is the same bits on every device.
TC_HD float float_from_double_nan(double d) {
  const uint64_t b = bit_cast<uint64_t>(d);
  const uint32_t sign = static_cast<uint32_t>(b >> 32) & 0x80000000u;
  const uint32_t payload = static_cast<uint32_t>(b >> 29) & 0x007fffffu;
  return bit_cast<float>(sign | 0x7fc00000u | payload);
}

// float64 -> float32 rounded to nearest even, NaNs as above.
TC_HD float float_from_double(double d) {
  const float f = static_cast<float>(d);
  return d != d ? float_from_double_nan(d) : f;
}

// float64 -> float32 rounded to odd: truncate toward zero and set the last bit
// when inexact. A second round-to-nearest-even from float32 (24 bits) to a
// format of p <= 22 bits then equals one correct rounding from float64
// (Boldo & Melquiond, "When double rounding is odd"). torch's own
// float64 -> float16/bfloat16 cast rounds to nearest twice instead.
TC_HD float float_round_to_odd(double d) {
  const float f = float_from_double(d);
  const double back = static_cast<double>(f);
  const uint32_t u = bit_cast<uint32_t>(f);
  const uint32_t toward_zero = fabs(back) > fabs(d) ? u - 1u : u;
  const bool inexact = back != d && f == f;
  return bit_cast<float>(inexact ? (toward_zero | 1u) : u);
}

// Narrow formats (OCP FP8, and FP4 e2m1; their facts in formats.h): kMant
// mantissa bits, exponent bias kBias. float32 -> the format's bits with
// round-to-nearest-even, branch-free like half_bits_from_float: the
// subnormal path lets the FPU round by adding a float whose ulp is the
// format's subnormal spacing 2^(1 - kBias - kMant); the normal path rebiases
// and adds just under half an ulp plus the odd bit. |f| >= kFirstOverflow
// rounds past the largest finite value: that (and inf) becomes kOverflow, the
// format's own answer (e5m2: inf; e4m3fn, which has no inf: NaN; e2m1, which
// has neither: its largest). NaN becomes kNaN with f's sign, as c10 writes it.
using Float8E4M3FNBits = FormatE4M3FN;
using Float8E5M2Bits = FormatE5M2;

template <typename F8>
TC_HD uint8_t float8_bits_from_float(float f) {
  constexpr int kShift = 23 - F8::kMant;
  constexpr uint32_t kMagic = static_cast<uint32_t>(151 - F8::kBias - F8::kMant) << 23;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - F8::kBias) << 23;
  const uint32_t w = bit_cast<uint32_t>(f);
  const uint32_t sign = (w >> (32 - F8::kBits)) & F8::kSignBit;
  const uint32_t u = w & 0x7fffffffu;
  const uint32_t subnormal = bit_cast<uint32_t>(bit_cast<float>(u) + bit_cast<float>(kMagic)) - kMagic;
  const uint32_t normal = (u - (static_cast<uint32_t>(127 - F8::kBias) << 23) +
                           ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u)) >> kShift;
  const uint32_t mag = u > 0x7f800000u ? F8::kNaN
                       : u >= F8::kFirstOverflow ? F8::kOverflow
                       : u < kMinNormal          ? subnormal
                                                 : normal;
  return static_cast<uint8_t>(sign | mag);
}

// The float32 value of a narrow format's bits (exact).
template <typename F8>
TC_HD float float_from_float8_bits(uint8_t b) {
  constexpr int kShift = 23 - F8::kMant;
  // 2^(1 - kBias - kMant), the subnormal spacing: em times it is exact.
  constexpr float kSpacing = 1.0f / static_cast<float>(1u << (F8::kBias + F8::kMant - 1));
  const uint32_t sign = static_cast<uint32_t>(b & F8::kSignBit) << (32 - F8::kBits);
  const uint32_t em = b & (F8::kSignBit - 1u);
  const uint32_t normal = (em << kShift) + (static_cast<uint32_t>(127 - F8::kBias) << 23);
  const uint32_t subnormal = bit_cast<uint32_t>(static_cast<float>(em) * kSpacing);
  const uint32_t mag = F8::special(em) ? F8::special_bits(em)
                       : em >= (1u << F8::kMant) ? normal
                                                 : subnormal;
  return bit_cast<float>(sign | mag);
}

// Target formats: storage bits, correctly rounded narrowing from float32 or
// float64, exact widening back, the smallest normal magnitude, and the
// largest finite value of either sign (what saturation clamps to).
struct Float32Target {
  using storage = float;
  static constexpr float min_normal = FormatFloat32::kMinNormal;
  TC_HD static float round(double d) { return float_from_double(d); }
  TC_HD static float round(float f) { return f; }
  TC_HD static float widen(float s) { return s; }
  TC_HD static bool finite(float s) { return (s - s) == 0.f; }
  TC_HD static float largest(bool negative) {
    return negative ? -FormatFloat32::kMax : FormatFloat32::kMax;
  }
};

// Formats with at most 22 significant bits (float16, bfloat16, float8):
// Bits converts float32 to the format and back; float64 goes through
// float_round_to_odd so that the two roundings equal one.
template <typename Bits>
struct NarrowTarget {
  using storage = typename Bits::storage;
  static constexpr float min_normal = Bits::min_normal;
  TC_HD static storage round(float f) { return Bits::from_float(f); }
  TC_HD static storage round(double d) { return Bits::from_float(float_round_to_odd(d)); }
  TC_HD static float widen(storage s) { return Bits::to_float(s); }
  // From the bits alone: cheaper than widening and testing the float (10-15%
  // of the portable loop for float8_e4m3fn, whose NaN widens by a special case).
  TC_HD static bool finite(storage s) { return Bits::finite(s); }
  TC_HD static storage largest(bool negative) {
    return static_cast<storage>(Bits::kMaxBits | (negative ? Bits::kSignBit : 0u));
  }
};

struct HalfBits {
  using storage = uint16_t;
  static constexpr float min_normal = FormatFloat16::kMinNormal;
  static constexpr uint32_t kMaxBits = FormatFloat16::kMaxBits, kSignBit = FormatFloat16::kSignBit;
  TC_HD static uint16_t from_float(float f) { return half_bits_from_float(f); }
  TC_HD static float to_float(uint16_t h) { return float_from_half_bits(h); }
  TC_HD static bool finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }
};
using Float16Target = NarrowTarget<HalfBits>;

struct BFloat16Bits {
  using storage = uint16_t;
  static constexpr float min_normal = FormatBFloat16::kMinNormal;
  static constexpr uint32_t kMaxBits = FormatBFloat16::kMaxBits, kSignBit = FormatBFloat16::kSignBit;
  TC_HD static uint16_t from_float(float f) { return bfloat16_bits_from_float(f); }
  TC_HD static float to_float(uint16_t b) { return float_from_bfloat16_bits(b); }
  TC_HD static bool finite(uint16_t b) { return (b & 0x7f80u) != 0x7f80u; }
};
using BFloat16Target = NarrowTarget<BFloat16Bits>;

template <typename F8>
struct Float8Bits {
  using storage = uint8_t;
  static constexpr float min_normal = F8::kMinNormal;
  static constexpr uint32_t kMaxBits = F8::kMaxBits, kSignBit = F8::kSignBit;
  TC_HD static uint8_t from_float(float f) { return float8_bits_from_float<F8>(f); }
  TC_HD static float to_float(uint8_t b) { return float_from_float8_bits<F8>(b); }
  TC_HD static bool finite(uint8_t b) { return !F8::special(b & 0x7fu); }
};
using Float8E4M3FNTarget = NarrowTarget<Float8Bits<Float8E4M3FNBits>>;
using Float8E5M2Target = NarrowTarget<Float8Bits<Float8E5M2Bits>>;

// Source formats: how an element of x is stored, and the type its error is
// computed in, which holds every value of x exactly. float and double are
// their own; a float16 or bfloat16 source (named by its Target) widens to
// float32.
template <typename S>
struct SourceFormat {
  using storage = S;
  using wide = S;
  TC_HD static S widen(S x) { return x; }
};

template <typename Bits>
struct SourceFormat<NarrowTarget<Bits>> {
  using storage = typename Bits::storage;
  using wide = float;
  TC_HD static float widen(storage s) { return Bits::to_float(s); }
};

// A scaled cast's scale, for a source read as From: float64 for float64
// sources (whose amax can lie far beyond float32's range, where no float32
// scale reaches), float32 for the others.
template <typename From>
using ScaleOf = std::conditional_t<std::is_same<From, double>::value, double, float>;

// x * scale for a scaled cast, rounded to odd in float64 (float_round_to_odd
// one level up), so that rounding it to a narrower format equals one correct
// rounding of the exact product. For a float32 x the product is exact (24 x
// 24 bits); for a float64 x the product rounded to nearest is corrected by
// its exact error (fma). An infinite or NaN product is returned as it is.
TC_HD double scaled_to_odd(float x, float scale) {
  return static_cast<double>(x) * static_cast<double>(scale);
}

TC_HD double scaled_to_odd(double x, double s) {
  const double p = x * s;
  const double e = fma(x, s, -p);
  const uint64_t u = bit_cast<uint64_t>(p);
  // Toward zero: one ulp down in magnitude where the exact product is smaller.
  const uint64_t toward_zero = (e < 0.0) != (p < 0.0) ? u - 1u : u;
  const bool inexact = e != 0.0 && (p - p) == 0.0;
  return inexact ? bit_cast<double>(toward_zero | 1u) : p;
}

// ---------------------------------------------------------------------------
// What one element contributes to the statistics. The error terms are over
// finite x whose y is finite; the relative error also needs x != 0.
// saturate: x beyond the target's range (rounding past its largest finite
// value, or +-inf) becomes that largest value, with x's sign.
// A scaled cast rounds x * scale (scaled_to_odd) and measures y / scale
// (rounded once, in From: exact for a power-of-two scale; in double where it
// overflows From) against x; its
// overflow, saturation, underflow and subnormal results are y's.
// The terms of the sums, (x - y)^2 and x^2, are formed in Term: From on
// CUDA, float64 on the CPU, where the square of a float32 error or x is exact
// and never overflows (SumsOf).
template <typename Target, typename From, typename Term = From>
struct ElementMeasure {
  typename Target::storage y;
  bool nan, inf, inexact, overflow, saturated, underflow, subnormal;
  From abs_err, rel_err, amax;
  Term sq_err, sq;  // over the measured elements

  // y = round(x). Beyond the range: x is +-inf, or finite and rounded to
  // inf/NaN.
  TC_HD ElementMeasure(From x, bool saturate) {
    const typename Target::storage rounded = Target::round(x);
    measure<false>(x, rounded, (x == x) & !Target::finite(rounded), saturate, ScaleOf<From>(1));
  }

  // y = round(x * scale).
  TC_HD ElementMeasure(From x, bool saturate, ScaleOf<From> scale) {
    const double xs = scaled_to_odd(x, scale);
    const typename Target::storage rounded = Target::round(xs);
    measure<true>(x, rounded, (xs == xs) & !Target::finite(rounded), saturate, scale);
  }

 private:
  template <bool kScaled>
  TC_HD void measure(From x, typename Target::storage rounded, bool beyond, bool saturate,
                     ScaleOf<From> scale) {
    // x - x is 0 exactly for finite x and NaN for inf/NaN: a branch-free
    // test. Conditions combine with & and |, not && and ||: short-circuits
    // become branches, which keep the CPU loops from vectorizing.
    const bool x_finite = (x - x) == From(0);
    saturated = saturate & beyond;
    y = saturated ? Target::largest(x < From(0)) : rounded;
    const float yw = Target::widen(y);
    const From back = kScaled ? static_cast<From>(yw) / static_cast<From>(scale) : static_cast<From>(yw);
    const bool y_finite = (yw - yw) == 0.f;
    const bool measured = x_finite & y_finite;
    nan = x != x;
    inf = (x == x) & !x_finite;
    inexact = x_finite & (back != x);
    overflow = x_finite & !y_finite;
    underflow = (x != From(0)) & (yw == 0.f);
    subnormal = (yw != 0.f) & (fabsf(yw) < Target::min_normal);
    amax = x_finite ? fabs(x) : From(0);
    // x - back is exact where back is x rounded to a narrower format; a
    // saturated x may be far from back, and then it is rounded once. A
    // finite y read back past From's range (a float32 x near its largest,
    // scale < 1: y / scale overflows float32) is read back in double, where
    // it fits, and its error rounded once to From. In double (a float64 x
    // within a rounding of float64's largest, a scale below 2^-896, where
    // top / scale can pass 2^1024) both halves are halved, which is exact.
    From err = fabs(x - back);
    if constexpr (kScaled && sizeof(From) < sizeof(double)) {
      const bool back_over = y_finite & !((back - back) == From(0));
      const From wide = static_cast<From>(
          fabs(static_cast<double>(x) - static_cast<double>(yw) / static_cast<double>(scale)));
      err = back_over ? wide : err;
    } else if constexpr (kScaled) {
      if (scale < 0x1p-896) {  // the same for every element
        const bool back_over = y_finite & !((back - back) == From(0));
        const double halved = fabs(x * 0.5 - static_cast<double>(yw) / (scale * 2.0)) * 2.0;
        err = back_over ? halved : err;
      }
    }
    abs_err = measured ? err : From(0);
    const From denom = (measured & (x != From(0))) ? fabs(x) : From(1);
    rel_err = abs_err / denom;
    sq_err = static_cast<Term>(abs_err) * static_cast<Term>(abs_err);
    sq = measured ? static_cast<Term>(x) * static_cast<Term>(x) : Term(0);
  }
};

// The exact counts of a cast (Count: as wide as the caller needs).
template <typename Count>
struct CastCounts {
  Count nan = 0, inf = 0, inexact = 0, overflow = 0, saturated = 0, underflow = 0, subnormal = 0;

  // Adds another CastCounts, or the flags of one ElementMeasure or
  // block::ElementFacts (same names).
  template <typename Counts>
  TC_HD void add(const Counts& o) {
    nan += o.nan;
    inf += o.inf;
    inexact += o.inexact;
    overflow += o.overflow;
    saturated += o.saturated;
    underflow += o.underflow;
    subnormal += o.subnormal;
  }
};

// ---------------------------------------------------------------------------
// Canonical reduction order for the compensated sums (counts and maxima are
// exact in any order). A chunk of kChunk consecutive elements (in
// TensorIterator order) is one CUDA block or one CPU task. Inside a chunk,
// element e goes to lane e % lanes, lanes = kBlockThreads * vec, where vec is
// the number of source elements in 16 bytes: a CUDA thread t owns lanes
// [t*vec, t*vec+vec) and feeds them from one vector load. Each lane sums its
// elements in order. Lanes are then combined by the tree a CUDA block uses
// (per thread, then shuffle-down inside each warp, then across warps), and the
// chunk partials by the same tree. The CPU kernel emulates this tree exactly.
constexpr int kBlockThreads = 128;
constexpr int kWarp = 32;
constexpr int64_t kChunk = int64_t{1} << 16;

template <typename From>
constexpr int vec_of() { return static_cast<int>(16 / sizeof(From)); }

template <typename From>
constexpr int lanes_of() { return kBlockThreads * vec_of<From>(); }

// The three sums of the cast statistics, sum |x - y|, sum (x - y)^2 and
// sum x^2, for float32 and narrower sources on CUDA: compensated float32
// pairs (float64 arithmetic is slow on many GPUs, and the kernel must stay
// memory-bound).
struct ErrorSums {
  float abs_s = 0.f, abs_c = 0.f;
  float sq_err_s = 0.f, sq_err_c = 0.f;
  float sq_s = 0.f, sq_c = 0.f;

  TC_HD void add(float abs_err, float sq_err, float sq) {
    neumaier_add(abs_s, abs_c, abs_err);
    neumaier_add(sq_err_s, sq_err_c, sq_err);
    neumaier_add(sq_s, sq_c, sq);
  }
  TC_HD void merge(const ErrorSums& o) {
    neumaier_merge(abs_s, abs_c, o.abs_s, o.abs_c);
    neumaier_merge(sq_err_s, sq_err_c, o.sq_err_s, o.sq_err_c);
    neumaier_merge(sq_s, sq_c, o.sq_s, o.sq_c);
  }
  TC_HD void write(double* abs_out, double* sq_err_out, double* sq_out) const {
    *abs_out = neumaier_value(abs_s, abs_c);
    *sq_err_out = neumaier_value(sq_err_s, sq_err_c);
    *sq_out = neumaier_value(sq_s, sq_c);
  }
};

// The same sums for float64 sources, and for every source on the CPU: plain
// float64 sums. A square exceeds float32's range from |x| ~ 1.8e19 on (and
// underflows it below ~1e-23), while float64 holds the square of every
// float32 value exactly and of every value a narrower target keeps finite;
// n plain additions of nonnegative terms stay within n * 2^-53 of the exact
// sum (a lane adds at most kChunk / lanes terms before the tree combines it).
// On the CPU they are also faster than compensated float32 pairs: two
// operations a term instead of six.
struct PlainSums {
  double abs = 0.0, sq_err = 0.0, sq = 0.0;

  TC_HD void add(double abs_err, double sq_err_term, double sq_term) {
    abs += abs_err;
    sq_err += sq_err_term;
    sq += sq_term;
  }
  TC_HD void merge(const PlainSums& o) {
    abs += o.abs;
    sq_err += o.sq_err;
    sq += o.sq;
  }
  TC_HD void write(double* abs_out, double* sq_err_out, double* sq_out) const {
    *abs_out = abs;
    *sq_err_out = sq_err;
    *sq_out = sq;
  }
};

// The sums of a source whose errors are computed in Wide (float or double),
// on CUDA; the CPU kernel takes PlainSums for all.
template <typename Wide>
struct SumsOfT {
  using type = ErrorSums;
};
template <>
struct SumsOfT<double> {
  using type = PlainSums;
};
template <typename Wide>
using SumsOf = typename SumsOfT<Wide>::type;

// Reduces kBlockThreads per-thread values (already combined over their vec
// lanes, lane 0 first) in place, in the order of a CUDA block doing
// shuffle-down within warps and then across the warps' results. The result is
// in v[0]. Host-side emulation of the device tree.
template <typename T>
inline void block_tree_reduce(T* v) {
  for (int w = 0; w < kBlockThreads; w += kWarp) {
    for (int off = kWarp / 2; off > 0; off /= 2) {
      for (int i = 0; i < off; ++i) v[w + i].merge(v[w + i + off]);
    }
  }
  constexpr int warps = kBlockThreads / kWarp;
  for (int off = warps / 2; off > 0; off /= 2) {
    for (int i = 0; i < off; ++i) v[i * kWarp].merge(v[(i + off) * kWarp]);
  }
}

// Reduces n chunk partials (anything with merge()) into out, in the order of
// the CUDA finishing pass: thread t folds partials t, t + kBlockThreads, ...
// in sequence, then the block tree combines the threads.
template <typename T>
inline T reduce_partials(const T* partials, int64_t n) {
  T acc[kBlockThreads];
  for (int t = 0; t < kBlockThreads; ++t) {
    acc[t] = T();
    for (int64_t i = t; i < n; i += kBlockThreads) acc[t].merge(partials[i]);
  }
  block_tree_reduce(acc);
  return acc[0];
}

// ---------------------------------------------------------------------------
// Compensated parameter updates (the Adam kernels). A parameter kept in a
// narrow format carries what its last rounding lost, either as a Kahan buffer
// of its own dtype or, for bfloat16, as the low half of a float32 master
// weight (an int16 "remainder").

// x rounded to Target, and the rounding error x - widen(result). The error is
// exact: the two values are within a factor of two (Sterbenz) or the result
// is zero.
template <typename Target>
TC_HD typename Target::storage round_with_error(float x, float& err) {
  const typename Target::storage y = Target::round(x);
  err = x - Target::widen(y);
  return y;
}

// One Kahan step on a parameter stored in Target: p + c + u is formed in
// float32 (the error of p + (u + c) kept exactly by the Neumaier step), and
// the new parameter and compensation come out of one rounding of it. When the
// sum is not finite the compensation restarts from zero instead of turning
// into NaN.
template <typename Target>
TC_HD void kahan_update(float p, typename Target::storage& p_out, typename Target::storage& c,
                        float u) {
  float t = p, e = 0.f;
  neumaier_add(t, e, u + Target::widen(c));
  float r;
  p_out = round_with_error<Target>(t, r);
  const float rest = r + e;
  c = Target::round((t - t) == 0.f ? rest : 0.f);
}

// A float32 master weight held as a bfloat16 parameter and an int16
// remainder, bit-exactly. The parameter is the master's top half rounded to
// nearest (ties away from zero), so the model computes with the nearest
// bfloat16; the remainder is the low half read as a signed offset from it.
// A NaN master keeps a NaN parameter (quiet bit set) instead of letting the
// round-up carry into the sign, and a zero remainder: NaN payloads differ
// between devices, the remainder must not.
TC_HD void split_bf16_remainder(float master, uint16_t& hi, int16_t& rem) {
  const uint32_t u = bit_cast<uint32_t>(master);
  const uint32_t lo = u & 0xffffu;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  hi = static_cast<uint16_t>(nan ? ((u >> 16) | 0x0040u) : (u >> 16) + (lo >> 15));
  rem = bit_cast<int16_t>(static_cast<uint16_t>(nan ? 0u : lo));
}

TC_HD float join_bf16_remainder(uint16_t hi, int16_t rem) {
  // A negative remainder means hi was rounded up: the wrap-around sum borrows
  // it back.
  return bit_cast<float>((static_cast<uint32_t>(hi) << 16) +
                         static_cast<uint32_t>(static_cast<int32_t>(rem)));
}

// A 24-bit master weight (float32 with its low 8 bits zero) held as a
// bfloat16 parameter and an int8 remainder (compensation="remainder8"): the
// float32 result is first rounded to 24 bits stochastically, adding 8 random
// bits (the top of r) below bit 8 and truncating, so the master is unbiased
// and even an update far below its last bit moves it on average; then split
// as split_bf16_remainder splits (the parameter the nearest bfloat16, ties
// away from zero), the remainder the low half's top byte (its low byte is
// zero: the shift is exact). A NaN master keeps a NaN parameter and a zero
// remainder.
TC_HD void split_bf16_remainder8(float master, uint32_t r, uint16_t& hi, int8_t& rem) {
  const uint32_t u = bit_cast<uint32_t>(master);
  const uint32_t nan = static_cast<uint32_t>(static_cast<int32_t>(0x7f800000u - (u & 0x7fffffffu)) >> 31);
  const uint32_t u24 = (u + (r >> 24)) & 0xffffff00u;
  const uint32_t lo = u24 & 0xffffu;
  hi = static_cast<uint16_t>((nan & ((u >> 16) | 0x0040u)) | (~nan & ((u24 >> 16) + (lo >> 15))));
  rem = static_cast<int8_t>(~nan & static_cast<uint32_t>(static_cast<int32_t>(bit_cast<int16_t>(static_cast<uint16_t>(lo))) >> 8));
}

TC_HD float join_bf16_remainder8(uint16_t hi, int8_t rem) {
  return bit_cast<float>((static_cast<uint32_t>(hi) << 16) +
                         (static_cast<uint32_t>(static_cast<int32_t>(rem)) << 8));
}


// ---------------------------------------------------------------------------
// Stochastic rounding (compensation="stochastic"): a float32 value rounded to
// bfloat16 up or down at random, up with probability equal to the fraction of
// an ulp it lies above the value below, so that the rounded result equals the
// float32 value in expectation. The random bits are a counter-based hash of
// (seed, tensor, step, element index): the same seed gives the same bits
// whatever the thread count, the chunking or the device.

// splitmix64's finalizer (Steele, Lea & Flood): keys from seed, tensor and step.
TC_HD uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Wellons' "lowbias32" 32-bit mixer: 32-bit multiplies and shifts only, so
// the CPU loop vectorizes it.
TC_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one tensor at one step: two 32-bit halves of a 64-bit hash.
struct StochasticKey {
  uint32_t lo, hi;
};

TC_HD StochasticKey stochastic_key(uint64_t seed, uint64_t tensor, uint64_t step) {
  const uint64_t z = splitmix64(splitmix64(splitmix64(seed) ^ tensor) ^ step);
  return {static_cast<uint32_t>(z), static_cast<uint32_t>(z >> 32)};
}

// 32 random bits for element `index` of the tensor keyed by k: two rounds of
// the mixer, the second keyed by the index's high half.
TC_HD uint32_t stochastic_bits(StochasticKey k, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  return mix32(mix32(static_cast<uint32_t>(i) ^ k.lo) + (static_cast<uint32_t>(i >> 32) ^ k.hi));
}

// stochastic_bits for indices that share their high half, the second
// mixer's addend computed once (high = stochastic_high(k, any of them)):
// 32-bit lanes only, where the 64-bit index costs a loop twice the lanes.
TC_HD uint32_t stochastic_high(StochasticKey k, int64_t index) {
  return static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32) ^ k.hi;
}
TC_HD uint32_t stochastic_bits_low(StochasticKey k, uint32_t high, uint32_t index_low) {
  return mix32(mix32(index_low ^ k.lo) + high);
}

// f rounded to bfloat16 with the random bits r: adding 16 random bits below
// the bfloat16 mantissa carries into it with probability (low 16 bits of f) /
// 2^16, exactly the fraction of an ulp f lies above its truncation (the
// magnitude rounds, so both signs are unbiased, subnormals included). An
// exact f is unchanged, inf stays inf, a value within an ulp of the largest
// finite one becomes inf with that probability, and NaN becomes 0x7fc0 (as
// bfloat16_bits_from_float).
TC_HD uint16_t bfloat16_bits_stochastic(float f, uint32_t r) {
  const uint32_t u = bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + (r >> 16)) >> 16;
  const uint32_t nan = static_cast<uint32_t>(static_cast<int32_t>(0x7f800000u - (u & 0x7fffffffu)) >> 31);
  return static_cast<uint16_t>((nan & 0x7fc0u) | (~nan & rounded));
}

// f rounded to float16 with the random bits r. float16's dropped bits are
// not at a fixed place (13 for normals, more for subnormals), so the
// rounding is done in values: low, f's float16 neighbour toward zero (the
// nearest one, stepped back in magnitude where it rounded away), spacing,
// the distance to the next one away from zero, and up with probability
// frac = (|f| - |low|) / spacing (exact: Sterbenz, and a power-of-two
// spacing), against 24 random bits: exactly frac whenever frac has at most
// 24 bits (every normal float16 result; a subnormal one is within 2^-24
// of it). The spacing is taken from low's last bit flipped, so that it is
// 32 at the largest finite value and a value past 65536 always rounds to
// inf; inf and NaN stay as the nearest rounding leaves them (frac NaN).
TC_HD uint16_t half_bits_stochastic(float f, uint32_t r) {
  const float a = fabsf(f);
  const uint16_t nearest = half_bits_from_float(f);
  const uint16_t low = static_cast<uint16_t>(
      nearest - (fabsf(float_from_half_bits(nearest)) > a ? 1u : 0u));
  const float low_value = float_from_half_bits(low);
  const float spacing = fabsf(float_from_half_bits(static_cast<uint16_t>(low ^ 1u)) - low_value);
  const float frac = (a - fabsf(low_value)) / spacing;
  const float threshold = static_cast<float>(r >> 8) * 5.9604644775390625e-8f;  // 2^-24
  return static_cast<uint16_t>(low + (threshold < frac ? 1u : 0u));
}

}  // namespace torchcast
