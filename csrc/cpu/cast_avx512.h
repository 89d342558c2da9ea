// The AVX-512 loop of the CPU cast_with_stats kernel. It updates the same
// LaneState as the portable loop in cast.cpp and must agree with it (and so
// with ElementMeasure, numerics.h) bit for bit; only the instructions differ:
//  - float32 -> float16 is vcvtps2ph, which rounds to nearest even like
//    half_bits_from_float, and quiets NaNs keeping their top mantissa bits,
//    as there.
//    vcvtph2ps widens exactly, like float_from_half_bits.
//  - Round to odd (float_round_to_odd) converts with rounding toward zero and
//    sets the last bit where that conversion is inexact, which is the value
//    float_round_to_odd derives from the round-to-nearest result. float64
//    sources only need it where rounding to nearest float32 first could
//    change the result (see Source<double>).
//  - The relative error divides by |x| (0 where x is not finite, as for amax)
//    and the maximum skips NaN quotients:
//    wherever the element is measured and x != 0 that is ElementMeasure's
//    quotient, and elsewhere the absolute error is 0, so ElementMeasure's
//    quotient is 0 and this one is 0 or NaN (0/0, 0/NaN), neither of which
//    can raise a maximum that starts at 0. float64 sources divide only where
//    a quotient could raise the lane's maximum M: in some lane with y != x,
//    t >= fl(M |x|) (or where the step took its rare path). That test is
//    exact: fl(t / |x|) > M needs t > M |x|, and then the float t is at least
//    the float nearest M |x| (round to nearest; M |x| <= |x| is finite).
//    For float32 sources the test costs more than the division it saves
//    (measured on one thread: 0.24 against 0.22 ns an element, to float16).
//  - The sums are plain float64 (PlainSums). A float32 term widens exactly
//    and its square is exact in float64, so one fma is the portable loop's
//    multiply and add.
//  - Counts come from the float32 view of the result: NaN x <=> NaN y,
//    inexact = #(y != x) - #NaN, overflow = #(y != x and y = +-inf),
//    underflow = #(y != x and y = 0).
//  - Only elements that are NaN, infinite, overflow, underflow or have a
//    subnormal result need the NaN rewrite, the masking of unmeasured error
//    terms and the rare counts; a vector with none of them (the common case)
//    skips that work.
//  - 16-bit sources widen to float32 lanes exactly (vcvtph2ps, a shift) and
//    then take the float32 path.
//  - float8 targets round in vectors where |f| lies in the format's normal
//    range (Narrowed::kInRangeOnly), and where it lies below it (the
//    subnormal branch) in unscaled casts; a vector with any other lane
//    (overflow, saturation, NaN, inf, or a scaled cast's tiny product)
//    takes ElementMeasure lane by lane, which is the portable loop's
//    arithmetic, and so also serves saturate=True. float64 sources flag the
//    lanes whose f lands on a float8 halfway point and redo the vector
//    from f rounded to odd.
// float32 sources go 16 elements per register; float64 sources 8 (one
// register of float64 next to a half-width one of float32). A block keeps one
// vector of lanes of the sums in registers across up to kRowBlock rows.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCHCAST_HAVE_AVX512 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "lanes.h"

// gcc's own intrinsics headers trip -W(maybe-)uninitialized (their
// _mm512_undefined_* placeholders) once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#define TC_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,popcnt,prfchw")))
#define TC_AVX512_INLINE TC_AVX512 inline __attribute__((always_inline))

namespace torchcast {
namespace cpu {
namespace avx512 {

// Rows of the chunk that a block keeps a vector of sums in registers for. A
// block reads x and writes y in kRowBlock streams a row apart, which the
// hardware prefetchers follow poorly, so each step prefetches its lanes of
// the next block.
constexpr int kRowBlock = 4;

// fpclass categories.
constexpr int kClassNaN = 0x01 | 0x80;
constexpr int kClassZero = 0x02 | 0x04;
constexpr int kClassInf = 0x08 | 0x10;
constexpr int kClassDenormal = 0x20;

// Prefetches p + ahead elements (which may lie past the end of the array:
// prefetches do not fault, and the address is formed as an integer).
template <typename T>
TC_AVX512_INLINE void prefetch(const T* p, int write, int64_t ahead) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(ahead) * sizeof(T);
  if (write) {
    __builtin_prefetch(reinterpret_cast<const void*>(at), 1, 3);
  } else {
    __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 3);
  }
}

TC_AVX512_INLINE uint64_t count(uint32_t mask) {
  return static_cast<uint64_t>(__builtin_popcount(mask));
}

// The operations of a float32 vector type whose intrinsics differ only in the
// width written into their names: P and B for the vector (_mm512 and 512),
// HP and HB for the 16-bit half-width one (_mm256 and 256).
#define TC_F32_VECTOR_OPS(P, B, HP, HB)                                                          \
  TC_AVX512_INLINE static V load(const float* p) { return P##_load_ps(p); }                     \
  TC_AVX512_INLINE static V loadu(const float* p) { return P##_loadu_ps(p); }                   \
  TC_AVX512_INLINE static void store(float* p, V v) { P##_store_ps(p, v); }                     \
  TC_AVX512_INLINE static void storeu(float* p, V v) { P##_storeu_ps(p, v); }                   \
  TC_AVX512_INLINE static V zero() { return P##_setzero_ps(); }                                 \
  TC_AVX512_INLINE static V set1(float v) { return P##_set1_ps(v); }                            \
  TC_AVX512_INLINE static V add(V a, V b) { return P##_add_ps(a, b); }                          \
  TC_AVX512_INLINE static V sub(V a, V b) { return P##_sub_ps(a, b); }                          \
  TC_AVX512_INLINE static V mul(V a, V b) { return P##_mul_ps(a, b); }                          \
  TC_AVX512_INLINE static V div(V a, V b) { return P##_div_ps(a, b); }                          \
  TC_AVX512_INLINE static V max(V a, V b) { return P##_max_ps(a, b); }                          \
  TC_AVX512_INLINE static V min(V a, V b) { return P##_min_ps(a, b); }                          \
  TC_AVX512_INLINE static V mask_mov(V src, Mask k, V a) { return P##_mask_mov_ps(src, k, a); } \
  TC_AVX512_INLINE static V maskz_mov(Mask k, V a) { return P##_maskz_mov_ps(k, a); }           \
  template <int kPred>                                                                           \
  TC_AVX512_INLINE static Mask cmp(V a, V b) { return P##_cmp_ps_mask(a, b, kPred); }           \
  template <int kPred>                                                                           \
  TC_AVX512_INLINE static Mask mask_cmp(Mask k, V a, V b) {                                      \
    return P##_mask_cmp_ps_mask(k, a, b, kPred);                                                 \
  }                                                                                              \
  template <int kClass>                                                                          \
  TC_AVX512_INLINE static Mask fpclass(V a) { return P##_fpclass_ps_mask(a, kClass); }          \
                                                                                                 \
  TC_AVX512_INLINE static I bits(V v) { return P##_castps_si##B(v); }                           \
  TC_AVX512_INLINE static V from_bits(I i) { return P##_castsi##B##_ps(i); }                    \
  TC_AVX512_INLINE static I set1i(int v) { return P##_set1_epi32(v); }                          \
  TC_AVX512_INLINE static I addi(I a, I b) { return P##_add_epi32(a, b); }                      \
  TC_AVX512_INLINE static I subi(I a, I b) { return P##_sub_epi32(a, b); }                      \
  TC_AVX512_INLINE static I maxi(I a, I b) { return P##_max_epi32(a, b); }                      \
  TC_AVX512_INLINE static I andi(I a, I b) { return P##_and_si##B(a, b); }                      \
  TC_AVX512_INLINE static I ori(I a, I b) { return P##_or_si##B(a, b); }                        \
  TC_AVX512_INLINE static I mask_movi(I src, Mask k, I a) { return P##_mask_mov_epi32(src, k, a); } \
  TC_AVX512_INLINE static Mask cmpgt_u(I a, I b) { return P##_cmpgt_epu32_mask(a, b); }         \
  TC_AVX512_INLINE static Mask cmplt_u(I a, I b) { return P##_cmplt_epu32_mask(a, b); }         \
  TC_AVX512_INLINE static Mask cmpeq_i(I a, I b) { return P##_cmpeq_epi32_mask(a, b); }         \
  TC_AVX512_INLINE static I mask_ori(I src, Mask k, I a, I b) {                                 \
    return P##_mask_or_epi32(src, k, a, b);                                                      \
  }                                                                                              \
  template <int kShift>                                                                          \
  TC_AVX512_INLINE static I srli(I a) { return P##_srli_epi32(a, kShift); }                    \
  template <int kShift>                                                                          \
  TC_AVX512_INLINE static I slli(I a) { return P##_slli_epi32(a, kShift); }                    \
  TC_AVX512_INLINE static H narrow16(I a) { return P##_cvtepi32_epi16(a); }                     \
                                                                                                 \
  TC_AVX512_INLINE static H to_half(V v) {                                                       \
    return P##_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                      \
  }                                                                                              \
  TC_AVX512_INLINE static V from_half(H h) { return P##_cvtph_ps(h); }                          \
  TC_AVX512_INLINE static void store_h(uint16_t* p, H h) {                                       \
    HP##_storeu_si##HB(reinterpret_cast<H*>(p), h);                                              \
  }

// float32 vectors of 16 lanes (float32 sources) and 8 lanes (float64 sources).
struct F32x16 {
  using V = __m512;
  using I = __m512i;
  using H = __m256i;  // 16-bit lanes
  using Mask = __mmask16;
  static constexpr int kWidth = 16;

  TC_F32_VECTOR_OPS(_mm512, 512, _mm256, 256)
  TC_AVX512_INLINE static V abs(V a) { return _mm512_abs_ps(a); }
  // The low byte of each lane, stored.
  TC_AVX512_INLINE static void store_bytes(uint8_t* p, I a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
  }
};

struct F32x8 {
  using V = __m256;
  using I = __m256i;
  using H = __m128i;
  using Mask = __mmask8;
  static constexpr int kWidth = 8;

  TC_F32_VECTOR_OPS(_mm256, 256, _mm, 128)
  TC_AVX512_INLINE static void store_bytes(uint8_t* p, I a) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_cvtepi32_epi8(a));
  }
  // AVX-512VL has no 256-bit abs: the sign bits are cleared.
  TC_AVX512_INLINE static V abs(V a) { return from_bits(andi(bits(a), set1i(0x7fffffff))); }
};

#undef TC_F32_VECTOR_OPS

// Targets with float32's exponent range (bfloat16, float32): the rare lanes
// and the subnormal results, from the result `back`. Before fix_nans a NaN f
// rounds to +-0, +-inf or NaN, with y != x.
template <typename W>
TC_AVX512_INLINE typename W::Mask float32_range_rare(typename W::V back, typename W::Mask ne) {
  return W::template fpclass<kClassNaN | kClassInf | kClassDenormal>(back) |
         (ne & W::template fpclass<kClassZero>(back));
}

template <typename W>
TC_AVX512_INLINE typename W::Mask float32_range_subnormal(typename W::V back) {
  return W::template fpclass<kClassDenormal>(back);
}

// The target's storage bits and their exact float32 value `back`, from the
// float32 f that Target::round(float) takes. NaNs are left as the rounding
// makes them (already final for float16, possibly not NaN for bfloat16)
// until fix_nans().
template <typename Target, typename W>
struct Narrowed;

template <typename W>
struct Narrowed<Float16Target, W> {
  static constexpr bool kInRangeOnly = false;
  typename W::H bits;
  typename W::V back;

  TC_AVX512_INLINE explicit Narrowed(typename W::V f) : bits(W::to_half(f)), back(W::from_half(bits)) {}
  // vcvtps2ph already quiets a NaN the way half_bits_from_float does.
  TC_AVX512_INLINE void fix_nans(typename W::Mask) {}
  TC_AVX512_INLINE void store(uint16_t* p) const { W::store_h(p, bits); }
  // (The rare lanes come from f's magnitude: Source::rare.)
  TC_AVX512_INLINE typename W::Mask subnormal(typename W::Mask zero) const {
    const typename W::Mask small =
        W::template cmp<_CMP_LT_OQ>(W::abs(back), W::set1(Float16Target::min_normal));
    return small & ~zero;
  }
};

template <typename W>
struct Narrowed<BFloat16Target, W> {
  static constexpr bool kInRangeOnly = false;
  typename W::I bits;  // in 32-bit lanes
  typename W::V back;

  TC_AVX512_INLINE explicit Narrowed(typename W::V f) {
    const typename W::I u = W::bits(f);
    const typename W::I hi = W::template srli<16>(u);
    const typename W::I odd = W::andi(hi, W::set1i(1));
    bits = W::template srli<16>(W::addi(W::addi(u, W::set1i(0x7fff)), odd));
    back = W::from_bits(W::template slli<16>(bits));
  }
  TC_AVX512_INLINE void fix_nans(typename W::Mask nan) {
    bits = W::mask_ori(bits, nan, W::set1i(0x7fc0), W::set1i(0));  // bfloat16_bits_from_float's NaN
    back = W::from_bits(W::template slli<16>(bits));
  }
  TC_AVX512_INLINE void store(uint16_t* p) const { W::store_h(p, W::narrow16(bits)); }
  TC_AVX512_INLINE typename W::Mask rare(typename W::Mask ne) const { return float32_range_rare<W>(back, ne); }
  TC_AVX512_INLINE typename W::Mask subnormal(typename W::Mask) const { return float32_range_subnormal<W>(back); }
};

template <typename W>
struct Narrowed<Float32Target, W> {
  static constexpr bool kInRangeOnly = false;
  typename W::V back;

  TC_AVX512_INLINE explicit Narrowed(typename W::V f) : back(f) {}
  TC_AVX512_INLINE void fix_nans(typename W::Mask) {}
  TC_AVX512_INLINE void store(float* p) const { W::storeu(p, back); }
  TC_AVX512_INLINE typename W::Mask rare(typename W::Mask ne) const { return float32_range_rare<W>(back, ne); }
  TC_AVX512_INLINE typename W::Mask subnormal(typename W::Mask) const { return float32_range_subnormal<W>(back); }
};

// The float32 mantissa bits a Target drops (0: none, float32 itself).
template <typename Target>
struct DroppedBits : std::integral_constant<int, 0> {};
template <>
struct DroppedBits<Float16Target> : std::integral_constant<int, 13> {};
template <>
struct DroppedBits<BFloat16Target> : std::integral_constant<int, 16> {};
template <typename F8>
struct DroppedBits<NarrowTarget<Float8Bits<F8>>> : std::integral_constant<int, 23 - F8::kMant> {};

// Lanes whose float32 f lies exactly halfway between two Target values:
// rounding f to Target may differ from rounding the value f was rounded from.
template <typename Target, typename W>
TC_AVX512_INLINE typename W::Mask halfway(typename W::V f) {
  constexpr int kShift = DroppedBits<Target>::value;
  if constexpr (kShift == 0) {
    return 0;
  } else {
    return W::cmpeq_i(W::andi(W::bits(f), W::set1i((1 << kShift) - 1)), W::set1i(1 << (kShift - 1)));
  }
}

// float8 (or float4_e2m1fn, for block_cast_avx512.h) from float32 lanes
// whose |f| lies in [min_normal, largest finite] or is 0 (Source::rare flags every other lane): float8_bits_from_float's
// normal branch, whose rounded magnitude, kept as float32 bits, is also the
// exact value back; and its subnormal branch for the lanes subnormals()
// names. A vector with a NaN, infinite or too large lane is measured lane by
// lane instead.
template <typename F8, typename W>
struct Narrowed<NarrowTarget<Float8Bits<F8>>, W> {
  static constexpr bool kInRangeOnly = true;
  static constexpr int kShift = DroppedBits<NarrowTarget<Float8Bits<F8>>>::value;
  using V = typename W::V;
  using I = typename W::I;
  I bits;  // in 32-bit lanes
  V back;

  TC_AVX512_INLINE explicit Narrowed(V f) {
    const I u = W::bits(f);
    const I sign = W::andi(u, W::set1i(static_cast<int>(0x80000000u)));
    const I mag = W::andi(u, W::set1i(0x7fffffff));
    const I odd = W::andi(W::template srli<kShift>(mag), W::set1i(1));
    const I rounded = W::andi(W::addi(W::addi(mag, W::set1i((1 << (kShift - 1)) - 1)), odd),
                              W::set1i(-(1 << kShift)));
    back = W::from_bits(W::ori(rounded, sign));
    // Exponent rebiased; max with 0 keeps a zero x's bits 0.
    const I em = W::maxi(
        W::subi(W::template srli<kShift>(rounded), W::set1i((127 - F8::kBias) << F8::kMant)), W::set1i(0));
    bits = W::ori(em, W::template srli<32 - F8::kBits>(sign));
  }
  // The lanes in `small` (|f| < min_normal) rounded at the subnormal spacing
  // 2^(1 - kBias - kMant): adding a float whose ulp that is rounds |f| to
  // nearest even, the sum's bits minus the float's count the spacings, and
  // subtracting it back is exact.
  TC_AVX512_INLINE void subnormals(V f, typename W::Mask small) {
    const I magic_bits = W::set1i((151 - F8::kBias - F8::kMant) << 23);
    const V magic = W::from_bits(magic_bits);
    const I sign = W::andi(W::bits(f), W::set1i(static_cast<int>(0x80000000u)));
    const V sum = W::add(W::abs(f), magic);
    const I em = W::subi(W::bits(sum), magic_bits);
    back = W::mask_mov(back, small, W::from_bits(W::ori(W::bits(W::sub(sum, magic)), sign)));
    bits = W::mask_movi(bits, small, W::ori(em, W::template srli<32 - F8::kBits>(sign)));
  }
  TC_AVX512_INLINE void store(uint8_t* p) const { W::store_bytes(p, bits); }
};

// Target's normal range [min_normal, largest finite] on the bits of a
// float32 magnitude (they order like the values): where the rounding of f
// cannot give a subnormal, zero, inf, NaN or saturated result.
template <typename Target, typename W>
struct NormalRange {
  using I = typename W::I;
  TC_AVX512_INLINE static I lo() { return W::set1i(bit_cast<int32_t>(Target::min_normal)); }
  TC_AVX512_INLINE static I hi() { return W::set1i(bit_cast<int32_t>(Target::widen(Target::largest(false)))); }
  // Magnitude bits outside the range: one unsigned compare.
  TC_AVX512_INLINE static typename W::Mask outside(I mag) {
    return W::cmpgt_u(W::subi(mag, lo()), W::subi(hi(), lo()));
  }
  // |f| above the range, or NaN; |f| below it.
  TC_AVX512_INLINE static typename W::Mask above(typename W::V f) { return W::cmpgt_u(W::bits(W::abs(f)), hi()); }
  TC_AVX512_INLINE static typename W::Mask below(typename W::V f) { return W::cmplt_u(W::bits(W::abs(f)), lo()); }
};

// One vector of source elements: x, the float32 f that the target rounds,
// and ElementMeasure's error terms once the result is known.
template <typename From, typename Target>
struct Source;

// 16 float32 lanes: float32 sources, and 16-bit ones widened exactly (the
// Source specializations after it).
template <typename Target>
struct F32Source {
  using W = F32x16;
  using V = W::V;
  V x;
  V fv;  // what Target rounds: x, or x * scale (scale_by)
  V t;   // |x - y|, zeroed where x or y is not finite (after mask_unmeasured)
  V xm;  // x, zeroed likewise: the sum of squares' term
  V ax;  // |x|, zeroed where x is not finite (amax)

  static constexpr bool kRoundsTwice = false;

  TC_AVX512_INLINE explicit F32Source(V v) : x(v), fv(v) {}
  TC_AVX512_INLINE V f() const { return fv; }
  // A scaled cast's f (float8 Targets): x * scale rounded to nearest
  // float32, then, where that product was inexact and f lies exactly halfway
  // between two Target values, moved one float32 ulp toward the exact
  // product, so that rounding f to the Target gives the correctly rounded
  // product, as ElementMeasure's round to odd does. (The halfway points are
  // float32 values, and rounding to nearest keeps the product and f on the
  // same side of each.) The product's error is exact in float32 (fma)
  // wherever f lies in a float8 range; lanes outside it are rare, and
  // measured element by element. Halfway points are common (0.75% of
  // bfloat16 randn data times 448 / 496, amax_scale's scale for an amax of
  // 496), which rules out sending them down the element-by-element path; for
  // float32 x, rounding f as it is would go the wrong way for about half of
  // the inexact ones (tests/test_float8.py).
  TC_AVX512_INLINE void scale_by(V scale) {
    fv = W::mul(x, scale);
    const W::Mask ties = halfway<Target, W>(fv);
    if (__builtin_expect(ties == 0, 1)) return;
    const V err = _mm512_fmsub_ps(x, scale, fv);
    const W::Mask inexact = _mm512_mask_cmp_ps_mask(ties, err, W::zero(), _CMP_NEQ_UQ);
    // +1 on the bits where err and f agree in sign (the magnitude grows), -1
    // where they differ.
    const __m512i toward = _mm512_or_si512(
        _mm512_srai_epi32(_mm512_xor_si512(W::bits(err), W::bits(fv)), 31), _mm512_set1_epi32(1));
    fv = W::from_bits(_mm512_mask_add_epi32(W::bits(fv), inexact, W::bits(fv), toward));
  }
  TC_AVX512_INLINE W::Mask measure(V back) {
    t = W::abs(W::sub(x, back));
    xm = x;
    ax = W::abs(x);
    return W::cmp<_CMP_NEQ_UQ>(back, x);
  }
  // Lanes that may need the rare work. To float16 and float8, from f alone
  // (after measure): f is NaN or infinite, or |f| lies outside [Target's
  // smallest normal, its largest finite value], where the result may be
  // subnormal, zero, inf or saturated; x = +-0 excepted, which casts
  // exactly. On the bits: a zero is moved into the window, then one unsigned
  // compare tests it. Measured on one thread, in cache, this costs 0.195 ns
  // an element to float16 where Narrowed's test of the result costs 0.22;
  // to bfloat16 it is the other way round (0.205 against 0.195).
  TC_AVX512_INLINE W::Mask rare(const Narrowed<Target, W>& y, W::Mask ne) const {
    if constexpr (std::is_same<Target, BFloat16Target>::value) {
      return y.rare(ne);
    } else {
      using Range = NormalRange<Target, W>;
      const __m512i zero = _mm512_srai_epi32(_mm512_sub_epi32(W::bits(ax), _mm512_set1_epi32(1)), 31);
      // |f| | (zero & lo)
      return Range::outside(_mm512_ternarylogic_epi32(W::bits(W::abs(fv)), zero, Range::lo(), 0xf8));
    }
  }
  // Lanes whose |f| exceeds Target's largest finite value, or is NaN; and
  // those below its smallest normal.
  TC_AVX512_INLINE W::Mask beyond() const { return NormalRange<Target, W>::above(fv); }
  TC_AVX512_INLINE W::Mask below_normal() const { return NormalRange<Target, W>::below(fv); }
  TC_AVX512_INLINE W::Mask x_inf() const { return W::template fpclass<kClassInf>(x); }
  // Zeroes the error terms where x or y is not finite, and |x| where x is not.
  TC_AVX512_INLINE void mask_unmeasured() {
    const W::Mask measured = W::cmp<_CMP_LT_OQ>(t, W::set1(std::numeric_limits<float>::infinity()));
    t = W::maskz_mov(measured, t);
    xm = W::maskz_mov(measured, xm);
    ax = W::maskz_mov(~W::template fpclass<kClassNaN | kClassInf>(x), ax);
  }
  struct Maxima {
    V abs, rel, amax;
    TC_AVX512_INLINE Maxima() : abs(W::zero()), rel(W::zero()), amax(W::zero()) {}
    TC_AVX512_INLINE void absorb(const float* a, const float* r, const float* m) {
      abs = W::max(W::load(a), abs);
      rel = W::max(W::load(r), rel);
      amax = W::max(W::load(m), amax);
    }
    TC_AVX512_INLINE void fold_into(float* max_abs, float* max_rel, float* amax_out) const {
      W::store(max_abs, W::max(abs, W::load(max_abs)));
      W::store(max_rel, W::max(rel, W::load(max_rel)));
      W::store(amax_out, W::max(amax, W::load(amax_out)));
    }
  };
  TC_AVX512_INLINE void maxima(Maxima& m, W::Mask, bool) const {
    m.abs = W::max(t, m.abs);
    m.amax = W::max(ax, m.amax);
    m.rel = W::max(W::div(t, ax), m.rel);
  }
  // One vector of lanes of the float64 sums: lanes l .. l + 7 and
  // l + 8 .. l + 15 of each array.
  struct Sums {
    __m512d v[kNumSumArrays][2];
    template <int kLanes>
    TC_AVX512_INLINE void load(const double (*sums)[kLanes], int l) {
      for (int p = 0; p < kNumSumArrays; ++p) {
        for (int h = 0; h < 2; ++h) v[p][h] = _mm512_load_pd(sums[p] + l + 8 * h);
      }
    }
    template <int kLanes>
    TC_AVX512_INLINE void store(double (*sums)[kLanes], int l) const {
      for (int p = 0; p < kNumSumArrays; ++p) {
        for (int h = 0; h < 2; ++h) _mm512_store_pd(sums[p] + l + 8 * h, v[p][h]);
      }
    }
    TC_AVX512_INLINE void add_terms(const double (*terms)[16]) {
      for (int p = 0; p < kNumSumArrays; ++p) {
        for (int h = 0; h < 2; ++h) v[p][h] = _mm512_add_pd(v[p][h], _mm512_load_pd(terms[p] + 8 * h));
      }
    }
  };
  // Adds the terms |x - y|, (x - y)^2 and x^2; with kMasked only in `lanes`.
  template <bool kMasked>
  TC_AVX512_INLINE void add_to(Sums& s, W::Mask lanes) const {
    const __m512d td[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(t)),
                           _mm512_cvtps_pd(_mm512_extractf32x8_ps(t, 1))};
    const __m512d xd[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(xm)),
                           _mm512_cvtps_pd(_mm512_extractf32x8_ps(xm, 1))};
    for (int h = 0; h < 2; ++h) {
      if (kMasked) {
        const __mmask8 k = static_cast<__mmask8>(lanes >> (8 * h));
        s.v[kAbs][h] = _mm512_mask_add_pd(s.v[kAbs][h], k, s.v[kAbs][h], td[h]);
        s.v[kSqErr][h] = _mm512_mask3_fmadd_pd(td[h], td[h], s.v[kSqErr][h], k);
        s.v[kSq][h] = _mm512_mask3_fmadd_pd(xd[h], xd[h], s.v[kSq][h], k);
      } else {
        s.v[kAbs][h] = _mm512_add_pd(s.v[kAbs][h], td[h]);
        s.v[kSqErr][h] = _mm512_fmadd_pd(td[h], td[h], s.v[kSqErr][h]);
        s.v[kSq][h] = _mm512_fmadd_pd(xd[h], xd[h], s.v[kSq][h]);
      }
    }
  }
};

template <typename Target>
struct Source<float, Target> : F32Source<Target> {
  TC_AVX512_INLINE explicit Source(const float* p) : F32Source<Target>(_mm512_loadu_ps(p)) {}
};

// 16-bit sources: vcvtph2ps and a shift widen exactly, as SourceFormat does.
template <typename Target>
struct Source<Float16Target, Target> : F32Source<Target> {
  TC_AVX512_INLINE explicit Source(const uint16_t* p)
      : F32Source<Target>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))) {}
};

template <typename Target>
struct Source<BFloat16Target, Target> : F32Source<Target> {
  TC_AVX512_INLINE explicit Source(const uint16_t* p)
      : F32Source<Target>(_mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))) {}
};

// float64 sources, 8 elements. An exact shortcut over ElementMeasure: f is
// x rounded to nearest float32, not to odd. Rounding f to a narrower Target
// gives the correctly rounded result unless f is exactly halfway between two
// Target values (Target's midpoints are float32 values, and rounding to
// nearest keeps x and f on the same side of each) or lies in Target's
// subnormal range; rare() flags those lanes and the step redoes the vector
// with round to odd.
template <typename Target>
struct Source<double, Target> {
  using W = F32x8;
  using V = W::V;
  static constexpr bool kRoundsTwice = !std::is_same<Target, Float32Target>::value;
  // Targets whose rare lanes are found from f's magnitude (as F32Source does).
  static constexpr bool kWindow =
      std::is_same<Target, Float16Target>::value || Narrowed<Target, W>::kInRangeOnly;
  __m512d x;
  V fv;
  __m512d t, xx;
  __m512d ax;  // |x|, zeroed where x is not finite (amax)

  TC_AVX512_INLINE explicit Source(const double* p) : x(_mm512_loadu_pd(p)), fv(_mm512_cvtpd_ps(x)) {}
  TC_AVX512_INLINE V f() const { return fv; }
  // float_round_to_odd: truncate, and set the last bit where that is inexact.
  TC_AVX512_INLINE void round_to_odd() {
    const __m256 z = _mm512_cvt_roundpd_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask8 inexact = _mm512_cmp_pd_mask(_mm512_cvtps_pd(z), x, _CMP_NEQ_OQ);  // false for NaN
    fv = W::from_bits(W::mask_ori(W::bits(z), inexact, W::bits(z), W::set1i(1)));
  }
  TC_AVX512_INLINE W::Mask measure(V back) {
    const __m512d b = _mm512_cvtps_pd(back);
    t = _mm512_abs_pd(_mm512_sub_pd(x, b));
    xx = _mm512_mul_pd(x, x);
    ax = _mm512_abs_pd(x);
    return _mm512_cmp_pd_mask(b, x, _CMP_NEQ_UQ);
  }
  // To float16 and float8: f outside the window of F32Source::rare, x = +-0
  // excepted (a tiny x whose f is 0 is not); otherwise Narrowed's test of the
  // result. And every lane whose f is a Target halfway point (bfloat16's
  // subnormals are float32's: that test covers them; the other Targets'
  // subnormal range is outside the window).
  TC_AVX512_INLINE W::Mask rare(const Narrowed<Target, W>& y, W::Mask ne) const {
    const W::Mask ties = halfway<Target, W>(fv);
    if constexpr (kWindow) {
      using Range = NormalRange<Target, W>;
      const __mmask8 zero = _mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_EQ_OQ);
      return Range::outside(W::mask_movi(W::bits(W::abs(fv)), zero, Range::lo())) | ties;
    } else {
      return y.rare(ne) | ties;
    }
  }
  TC_AVX512_INLINE W::Mask beyond() const { return NormalRange<Target, W>::above(fv); }
  TC_AVX512_INLINE W::Mask below_normal() const { return NormalRange<Target, W>::below(fv); }
  TC_AVX512_INLINE W::Mask x_inf() const { return _mm512_fpclass_pd_mask(x, kClassInf); }
  TC_AVX512_INLINE void mask_unmeasured() {
    const __mmask8 measured =
        _mm512_cmp_pd_mask(t, _mm512_set1_pd(std::numeric_limits<double>::infinity()), _CMP_LT_OQ);
    t = _mm512_maskz_mov_pd(measured, t);
    xx = _mm512_maskz_mov_pd(measured, xx);
    ax = _mm512_maskz_mov_pd(static_cast<__mmask8>(~_mm512_fpclass_pd_mask(x, kClassNaN | kClassInf)), ax);
  }
  struct Maxima {
    __m512d abs, rel, amax;
    TC_AVX512_INLINE Maxima() : abs(_mm512_setzero_pd()), rel(_mm512_setzero_pd()), amax(_mm512_setzero_pd()) {}
    TC_AVX512_INLINE void absorb(const double* a, const double* r, const double* m) {
      abs = _mm512_max_pd(_mm512_load_pd(a), abs);
      rel = _mm512_max_pd(_mm512_load_pd(r), rel);
      amax = _mm512_max_pd(_mm512_load_pd(m), amax);
    }
    TC_AVX512_INLINE void fold_into(double* max_abs, double* max_rel, double* amax_out) const {
      _mm512_store_pd(max_abs, _mm512_max_pd(abs, _mm512_load_pd(max_abs)));
      _mm512_store_pd(max_rel, _mm512_max_pd(rel, _mm512_load_pd(max_rel)));
      _mm512_store_pd(amax_out, _mm512_max_pd(amax, _mm512_load_pd(amax_out)));
    }
  };
  // ne: the lanes with y != x (t > 0 where measured); rare: the step took
  // its rare path.
  TC_AVX512_INLINE void maxima(Maxima& m, W::Mask ne, bool rare) const {
    m.abs = _mm512_max_pd(t, m.abs);
    m.amax = _mm512_max_pd(ax, m.amax);
    if (rare || _mm512_mask_cmp_pd_mask(ne, t, _mm512_mul_pd(m.rel, ax), _CMP_GE_OQ) != 0) {
      m.rel = _mm512_max_pd(_mm512_div_pd(t, ax), m.rel);
    }
  }
  // One vector of lanes of the plain float64 sums (SumArray order).
  struct Sums {
    __m512d v[kNumSumArrays];
    template <int kLanes>
    TC_AVX512_INLINE void load(const double (*sums)[kLanes], int l) {
      for (int p = 0; p < kNumSumArrays; ++p) v[p] = _mm512_load_pd(sums[p] + l);
    }
    template <int kLanes>
    TC_AVX512_INLINE void store(double (*sums)[kLanes], int l) const {
      for (int p = 0; p < kNumSumArrays; ++p) _mm512_store_pd(sums[p] + l, v[p]);
    }
    TC_AVX512_INLINE void add_terms(const double (*terms)[8]) {
      for (int p = 0; p < kNumSumArrays; ++p) v[p] = _mm512_add_pd(v[p], _mm512_load_pd(terms[p]));
    }
  };
  template <bool kMasked>
  TC_AVX512_INLINE void add_to(Sums& s, W::Mask lanes) const {
    const __m512d terms[kNumSumArrays] = {t, _mm512_mul_pd(t, t), xx};
    for (int p = 0; p < kNumSumArrays; ++p) {
      s.v[p] = kMasked ? _mm512_mask_add_pd(s.v[p], lanes, s.v[p], terms[p])
                       : _mm512_add_pd(s.v[p], terms[p]);
    }
  }
};

// From: the source's element type, or the Target naming a 16-bit source
// (SourceFormat); In: how x is stored.
template <typename From, typename Target>
struct Kernel {
  using In = typename SourceFormat<From>::storage;
  using Storage = typename Target::storage;
  using State = LaneState<From>;
  using Src = Source<From, Target>;
  using W = typename Src::W;
  using V = typename W::V;
  using Mask = typename W::Mask;
  using Sums = typename Src::Sums;
  static constexpr int kWidth = W::kWidth;
  static constexpr int kLanes = State::kLanes;
  static constexpr int kYLine = 64 / sizeof(Storage);  // elements of y per cache line
  static_assert(kLanes % kWidth == 0, "lanes come in whole vectors");
  static_assert(kWidth * sizeof(In) <= 64, "a vector of x fits a cache line");

  // What the cast does beyond rounding (CastOptions, resolved).
  struct Options {
    bool saturate;
    bool scaled;
    float scale;
  };

  struct Acc {
    uint64_t nan, inf, ne, overflow, saturated, underflow, subnormal;
    typename Src::Maxima max;

    TC_AVX512_INLINE Acc()
        : nan(0), inf(0), ne(0), overflow(0), saturated(0), underflow(0), subnormal(0) {}
  };

  // One vector measured lane by lane with ElementMeasure (what the portable
  // loop computes), for the vectors Narrowed cannot round (kInRangeOnly):
  // y, the counts and the maxima lane by lane, then the terms added to the
  // sums in vector order. Lanes of a partial vector outside the step hold
  // x = 0, whose terms are +0 and leave every sum as it is.
  static TC_AVX512_INLINE void by_element(const In* xp, Storage* yp, const Options& o, Sums& s,
                                          Acc& acc) {
    using Wide = typename State::Wide;
    alignas(64) Wide abs[kWidth], rel[kWidth], amax[kWidth];
    alignas(64) double terms[kNumSumArrays][kWidth];
    for (int j = 0; j < kWidth; ++j) {
      const Wide xj = SourceFormat<From>::widen(xp[j]);
      const auto m = o.scaled ? ElementMeasure<Target, Wide, double>(xj, o.saturate, o.scale)
                              : ElementMeasure<Target, Wide, double>(xj, o.saturate);
      yp[j] = m.y;
      acc.nan += m.nan;
      acc.inf += m.inf;
      acc.ne += m.inexact + m.nan;  // y != x, as the vector path counts it
      acc.overflow += m.overflow;
      acc.saturated += m.saturated;
      acc.underflow += m.underflow;
      acc.subnormal += m.subnormal;
      abs[j] = m.abs_err;
      rel[j] = m.rel_err;
      amax[j] = m.amax;
      terms[kAbs][j] = m.abs_err;
      terms[kSqErr][j] = m.sq_err;
      terms[kSq][j] = m.sq;
    }
    acc.max.absorb(abs, rel, amax);
    s.add_terms(terms);
  }

  // One vector of elements into the sums s. With kMasked only the lanes in
  // `lanes` take the step; the others must hold x = 0, which counts nothing
  // and leaves the maxima alone.
  template <bool kMasked, bool kScaled>
  static TC_AVX512_INLINE void step(const In* xp, Storage* yp, Mask lanes, const Options& o, Sums& s,
                                    Acc& acc) {
    Src src(xp);
    if constexpr (kScaled) src.scale_by(W::set1(o.scale));
    Narrowed<Target, W> y(src.f());
    // A scaled cast measures y / scale against x (rounded once, in float32,
    // as ElementMeasure does).
    Mask ne = src.measure(kScaled ? W::div(y.back, W::set1(o.scale)) : y.back);
    const Mask rare = src.rare(y, ne);
    if (__builtin_expect(rare != 0, 0)) {
      if constexpr (Narrowed<Target, W>::kInRangeOnly) {
        // Below the normal range or on a halfway point only, and unscaled:
        // in vectors, from f rounded to odd (float64 sources); subnormal and
        // zero results through subnormals(). Anything else lane by lane.
        if (kScaled || src.beyond() != 0) {
          by_element(xp, yp, o, s, acc);
          return;
        }
        if constexpr (Src::kRoundsTwice) {
          src.round_to_odd();
          y = Narrowed<Target, W>(src.f());
        }
        const Mask small = rare & src.below_normal();  // x = +-0 is never rare
        y.subnormals(src.f(), small);
        ne = src.measure(y.back);
        const Mask zero = W::template fpclass<kClassZero>(y.back);
        acc.underflow += count(small & zero);
        // (|f| just below the smallest normal rounds up to it.)
        acc.subnormal += count(W::template mask_cmp<_CMP_LT_OQ>(small & ~zero, W::abs(y.back),
                                                                W::set1(Target::min_normal)));
      } else {
        rare_lanes(src, y, ne, acc);
      }
    }
    y.store(yp);
    acc.ne += count(ne);
    src.maxima(acc.max, ne, rare != 0);
    src.template add_to<kMasked>(s, lanes);
  }

  // The vector path's rare work: NaN, infinite, overflowing, underflowing
  // and subnormal lanes, counted, and their unmeasured terms zeroed.
  static TC_AVX512_INLINE void rare_lanes(Src& src, Narrowed<Target, W>& y, Mask& ne, Acc& acc) {
    if constexpr (Src::kRoundsTwice) {
      src.round_to_odd();
      y = Narrowed<Target, W>(src.f());
      ne = src.measure(y.back);
    }
    const Mask nan = W::template cmp<_CMP_UNORD_Q>(src.f(), src.f());
    y.fix_nans(nan);
    src.mask_unmeasured();
    const Mask zero = W::template fpclass<kClassZero>(y.back);
    acc.nan += count(nan);
    acc.inf += count(src.x_inf());
    acc.overflow += count(ne & W::template fpclass<kClassInf>(y.back));
    acc.underflow += count(ne & zero);
    acc.subnormal += count(y.subnormal(zero));
  }

  // Rows [0, rows) of lanes [l0, l1) (whole vectors): x and y point at lane
  // l0 of the first row.
  template <bool kScaled>
  static TC_AVX512_INLINE void block(State* st, const In* x, Storage* y, int l0, int l1, int rows,
                                     const Options& o, Acc& acc_io) {
    Acc acc = acc_io;
    for (int l = l0; l < l1; l += kWidth) {
      Sums s;
      s.load(st->sums, l);
      for (int r = 0; r < rows; ++r) {
        const int64_t at = static_cast<int64_t>(r) * kLanes + (l - l0);
        prefetch(x + at, 0, kLanes * kRowBlock);  // a vector of x lies in one cache line
        if (l % kYLine == 0) prefetch(y + at, 1, kLanes * kRowBlock);
        step<false, kScaled>(x + at, y + at, static_cast<Mask>(~0u), o, s, acc);
      }
      s.store(st->sums, l);
    }
    acc_io = acc;
  }

  // Casts n contiguous elements, the first of which falls in lane `lane`.
  // saturate and scale (nullptr: unscaled) serve Targets whose vectors
  // Narrowed rounds only in range (the others take the portable loop for
  // them, as do scaled float64 sources), and scale must lie in
  // [2^-100, 2^100], so that y / scale is finite wherever y is.
  static TC_AVX512 void run(State* st, const In* x, Storage* y, int lane, int64_t n, bool saturate,
                            const float* scale) {
    const Options o{saturate, scale != nullptr, scale != nullptr ? *scale : 1.f};
    if constexpr (Narrowed<Target, W>::kInRangeOnly && !std::is_same<From, double>::value) {
      if (o.scaled) return run_with<true>(st, x, y, lane, n, o);
    }
    run_with<false>(st, x, y, lane, n, o);
  }

  template <bool kScaled>
  static TC_AVX512_INLINE void run_with(State* st, const In* x, Storage* y, int lane, int64_t n,
                                        const Options& o) {
    Acc acc;
    while (n > 0) {
      const int off = lane % kWidth;
      int64_t done;
      if (off != 0 || n < kWidth) {
        // A partial vector, through zero-padded buffers.
        const int k = static_cast<int>(std::min<int64_t>(kWidth - off, n));
        alignas(64) In xb[kWidth] = {};
        alignas(64) Storage yb[kWidth];
        std::memcpy(xb + off, x, sizeof(In) * k);
        Sums s;
        s.load(st->sums, lane - off);
        step<true, kScaled>(xb, yb, static_cast<Mask>(((1u << k) - 1u) << off), o, s, acc);
        s.store(st->sums, lane - off);
        std::memcpy(y, yb + off, sizeof(Storage) * k);
        done = k;
      } else if (lane == 0 && n >= kLanes) {
        const int rows = static_cast<int>(std::min<int64_t>(n / kLanes, kRowBlock));
        block<kScaled>(st, x, y, 0, kLanes, rows, o, acc);
        done = static_cast<int64_t>(rows) * kLanes;
      } else {
        const int64_t whole = n - n % kWidth;
        const int end = static_cast<int>(std::min<int64_t>(kLanes, lane + whole));
        block<kScaled>(st, x, y, lane, end, 1, o, acc);
        done = end - lane;
      }
      x += done;
      y += done;
      n -= done;
      lane = static_cast<int>((lane + done) % kLanes);
    }
    st->counts.nan += static_cast<int64_t>(acc.nan);
    st->counts.inf += static_cast<int64_t>(acc.inf);
    st->counts.inexact += static_cast<int64_t>(acc.ne - acc.nan);
    st->counts.overflow += static_cast<int64_t>(acc.overflow);
    st->counts.saturated += static_cast<int64_t>(acc.saturated);
    st->counts.underflow += static_cast<int64_t>(acc.underflow);
    st->counts.subnormal += static_cast<int64_t>(acc.subnormal);
    acc.max.fold_into(st->max_abs, st->max_rel, st->amax);
  }
};

}  // namespace avx512
}  // namespace cpu
}  // namespace torchcast

#pragma GCC diagnostic pop

#endif
