// The AVX-512 loop of the CPU block_cast kernel (block_cast.cpp) for float32,
// float16 and bfloat16 sources. It must agree with block::cast_element
// (block_cast.h) bit for bit in the elements, the counts and the maxima; only
// the sums are added lane by lane (within rounding of the element order, and
// the same whatever the thread count). What makes the vector path exact:
//  - The source widens to float32 lanes exactly, and v = x * multiplier is the
//    same float32 product as cast_element's.
//  - The element's bits and its value ev come from cast_avx512.h's Narrowed
//    (float8_bits_from_float's normal and subnormal branches); lanes where v
//    rounds past the format's largest value take +-max, as element_bits does.
//  - With x finite and the scale not NaN, y = ev * scale is finite and exact
//    in float64 (MX: |ev| <= 57344 and the scale a power of two up to 2^127;
//    NVFP4: |ev| <= 6 and the scale an e4m3 value times a positive finite
//    float32), so no element overflows, every one is measured, and y == 0
//    exactly where ev == 0 (every scale is > 0). The float64 error terms are
//    cast_element's operations, lane by lane.
//  - The multiplier is finite, so v is NaN only where x is. A vector with a
//    NaN or infinite x, every element of a NaN-scaled block, and every
//    element of an NVFP4 block whose float32 multiplier overflows (its
//    elements are scaled in float64: BlockScale::wide) take cast_element
//    element by element.
#pragma once

#include "cast_avx512.h"

#ifdef TORCHCAST_HAVE_AVX512

#include "../block_cast.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace torchcast {
namespace cpu {
namespace avx512 {

// Up to 16 elements of a source as float32 lanes (exactly), the lanes past
// the first `valid` ones 0.
template <typename Src>
TC_AVX512_INLINE __m512 load_widened(const typename Src::storage* p, __mmask16 valid) {
  if constexpr (std::is_same<Src, SourceFormat<float>>::value) {
    return _mm512_maskz_loadu_ps(valid, p);
  } else if constexpr (std::is_same<Src, SourceFormat<Float16Target>>::value) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, p));
  } else {
    static_assert(std::is_same<Src, SourceFormat<BFloat16Target>>::value, "a 16-bit source");
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

// Lanes 8 .. 15 of a float32 vector.
TC_AVX512_INLINE __m256 high_half(__m512 a) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

template <typename Src>
struct HasBlockLoop
    : std::integral_constant<bool, std::is_same<Src, SourceFormat<float>>::value ||
                                       std::is_same<Src, SourceFormat<Float16Target>>::value ||
                                       std::is_same<Src, SourceFormat<BFloat16Target>>::value> {};

// A run of blocks' vector terms, kept in registers across blocks and added
// into a block::Tally by flush().
struct BlockLanes {
  __m512d max_abs, max_rel, sum_abs, sum_sq_err, sum_sq;
  __m512 amax;
  int64_t inexact, saturated, underflow, subnormal;

  TC_AVX512_INLINE BlockLanes()
      : max_abs(_mm512_setzero_pd()), max_rel(_mm512_setzero_pd()), sum_abs(_mm512_setzero_pd()),
        sum_sq_err(_mm512_setzero_pd()), sum_sq(_mm512_setzero_pd()), amax(_mm512_setzero_ps()),
        inexact(0), saturated(0), underflow(0), subnormal(0) {}

  TC_AVX512_INLINE void flush(block::Tally& t) {
    t.inexact += static_cast<double>(inexact);
    t.saturated += static_cast<double>(saturated);
    t.underflow += static_cast<double>(underflow);
    t.subnormal += static_cast<double>(subnormal);
    t.max_abs_err = std::max(t.max_abs_err, _mm512_reduce_max_pd(max_abs));
    t.max_rel_err = std::max(t.max_rel_err, _mm512_reduce_max_pd(max_rel));
    t.amax = std::max(t.amax, static_cast<double>(_mm512_reduce_max_ps(amax)));
    t.sum_abs_err += _mm512_reduce_add_pd(sum_abs);
    t.sum_sq_err += _mm512_reduce_add_pd(sum_sq_err);
    t.sum_sq += _mm512_reduce_add_pd(sum_sq);
    *this = BlockLanes();
  }

  // The float64 terms of 8 lanes: x and the element's value ev.
  TC_AVX512_INLINE __mmask8 add(__m512d x, __m512d ev, __m512d scale) {
    const __m512d y = _mm512_mul_pd(ev, scale);
    const __m512d err = _mm512_abs_pd(_mm512_sub_pd(x, y));
    const __m512d ax = _mm512_abs_pd(x);
    const __mmask8 nonzero = _mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_NEQ_OQ);
    max_abs = _mm512_max_pd(max_abs, err);
    max_rel = _mm512_max_pd(max_rel, _mm512_maskz_div_pd(nonzero, err, ax));
    sum_abs = _mm512_add_pd(sum_abs, err);
    sum_sq_err = _mm512_add_pd(sum_sq_err, _mm512_mul_pd(err, err));
    sum_sq = _mm512_add_pd(sum_sq, _mm512_mul_pd(x, x));
    return _mm512_cmp_pd_mask(err, _mm512_setzero_pd(), _CMP_NEQ_OQ);
  }
};

// One block of n elements (block::cast_block's result): its elements to data,
// its exact terms to t and lanes, its vector terms to lanes; returns the
// scale's bits.
template <typename BF, typename Src>
TC_AVX512 uint32_t cast_block(const typename Src::storage* x, int n, block::ScaleMode mode,
                              float tensor_scale, uint8_t* data, block::Tally& t,
                              BlockLanes& lanes) {
  using Elem = typename BF::element;
  using W = F32x16;
  using Round = Narrowed<NarrowTarget<Float8Bits<Elem>>, W>;
  const auto valid = [n](int i) -> __mmask16 {
    return n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
  };
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int i = 0; i < n; i += 16) {
    const __m512 v = load_widened<Src>(x + i, valid(i));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
  }
  const float amax = nan ? bit_cast<float>(0x7fc00000u) : _mm512_reduce_max_ps(top);
  const block::BlockScale<float> s = block::block_scale<BF, float>(amax, mode, tensor_scale);

  int64_t underflows = 0;
  bool any_saturated = false;
  const auto one_by_one = [&](int i, int len) {
    for (int j = i; j < i + len; ++j) {
      const block::ElementFacts f = block::cast_element<BF, Src>(Src::widen(x[j]), s);
      block::store_element<Elem>(data, j, f.bits);
      t.add(f);
      underflows += f.underflow;
      any_saturated |= f.saturated != 0;
    }
  };
  if (s.nan | s.wide) {
    one_by_one(0, n);
  } else {
    const __m512 multiplier = _mm512_set1_ps(s.multiplier);
    const __m512d scale = _mm512_set1_pd(s.value);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i sign_mask = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512i first_overflow = _mm512_set1_epi32(static_cast<int>(Elem::kFirstOverflow));
    const __m512i min_normal = _mm512_set1_epi32(bit_cast<int32_t>(Elem::kMinNormal));
    const __m512i max_bits = _mm512_set1_epi32(static_cast<int>(Elem::kMaxBits));
    const __m512 max_value = _mm512_set1_ps(Elem::kMax);
    for (int i = 0; i < n; i += 16) {
      const int len = std::min(16, n - i);
      const __m512 xv = load_widened<Src>(x + i, valid(i));
      const __m512 v = _mm512_mul_ps(xv, multiplier);
      if (_mm512_fpclass_ps_mask(xv, kClassNaN | kClassInf)) {
        one_by_one(i, len);
        continue;
      }
      const __m512i mag = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
      const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), sign_mask);
      const __mmask16 saturated = _mm512_cmpge_epu32_mask(mag, first_overflow);
      Round r(v);
      r.subnormals(v, _mm512_cmplt_epu32_mask(mag, min_normal));
      r.bits = _mm512_mask_or_epi32(r.bits, saturated, _mm512_srli_epi32(sign, 32 - Elem::kBits),
                                    max_bits);
      r.back = _mm512_mask_mov_ps(
          r.back, saturated,
          _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(max_value), sign)));

      const __mmask16 ev_zero = _mm512_cmp_ps_mask(r.back, _mm512_setzero_ps(), _CMP_EQ_OQ);
      const __mmask16 x_zero = _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_EQ_OQ);
      const __mmask16 subnormal =
          ~ev_zero & _mm512_cmp_ps_mask(_mm512_abs_ps(r.back), _mm512_set1_ps(Elem::kMinNormal),
                                        _CMP_LT_OQ);
      const int64_t under = count(static_cast<uint32_t>(~x_zero & ev_zero));
      const int64_t sat = count(static_cast<uint32_t>(saturated));
      underflows += under;
      any_saturated |= sat != 0;
      lanes.underflow += under;
      lanes.saturated += sat;
      lanes.subnormal += count(static_cast<uint32_t>(subnormal));
      lanes.amax = _mm512_max_ps(lanes.amax, _mm512_abs_ps(xv));
      const __mmask8 inexact_lo = lanes.add(_mm512_cvtps_pd(_mm512_castps512_ps256(xv)),
                                            _mm512_cvtps_pd(_mm512_castps512_ps256(r.back)), scale);
      const __mmask8 inexact_hi =
          lanes.add(_mm512_cvtps_pd(high_half(xv)), _mm512_cvtps_pd(high_half(r.back)), scale);
      lanes.inexact += count(inexact_lo) + count(inexact_hi);

      if constexpr (Elem::kBits == 4) {
        // Lanes 2k and 2k + 1 into the low and high nibble of byte k.
        const __m512i pairs = _mm512_or_si512(r.bits, _mm512_srli_epi64(r.bits, 28));
        const __mmask8 bytes = static_cast<__mmask8>((1u << ((len + 1) / 2)) - 1u);
        _mm512_mask_cvtepi64_storeu_epi8(data + i / 2, bytes, pairs);
      } else {
        _mm512_mask_cvtepi32_storeu_epi8(data + i, valid(i), r.bits);
      }
    }
  }
  block::count_block(t, n, static_cast<double>(underflows), any_saturated, s.nan);
  return s.bits;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace torchcast

#pragma GCC diagnostic pop

#endif  // TORCHCAST_HAVE_AVX512
