// The finishing reductions of the CPU cast_with_stats kernel, in the
// canonical order of numerics.h. The compensated float32 sums (float32 and
// 16-bit sources) go 16 merges at a time: each vector lane
// performs exactly the scalar neumaier_merge of one tree node, so the result
// is the scalar tree's, bit for bit; vectors only group independent merges
// (different threads, or the nodes of one tree level), and shuffles move
// values between lanes without touching them. The plain float64 sums of
// float64 sources take the scalar tree.
// The 64-byte vectors below never cross a call boundary (everything is
// inlined), so the ABI note gcc gives for them on non-AVX-512 targets is moot.
// Set before the includes: numerics.h's templates are instantiated on them.
#pragma GCC diagnostic ignored "-Wpsabi"

#include "lanes.h"

#include <cstring>
#include <utility>

namespace torchcast {
namespace cpu {

typedef float VF __attribute__((vector_size(64)));
typedef int32_t VI __attribute__((vector_size(64)));

}  // namespace cpu

// The helpers are inlined into each clone of the functions below; called out
// of line they would be compiled for the baseline ISA, 64-byte vectors in
// memory.
#define TC_VEC_INLINE inline __attribute__((always_inline))

// |v| lane by lane, so that neumaier_add (numerics.h) runs on 16 lanes at once.
template <>
struct Magnitude<cpu::VF> {
  TC_VEC_INLINE static cpu::VF of(cpu::VF v) {
    return bit_cast<cpu::VF>(bit_cast<cpu::VI>(v) & 0x7fffffff);
  }
};

namespace cpu {
namespace {

constexpr int kV = 16;
constexpr int kPairs = kNumSumArrays / 2;
constexpr int kGroups = kBlockThreads / kV;
static_assert(kBlockThreads == 128 && kWarp == 32, "the tree below is written for 4 warps of 32");

TC_VEC_INLINE VF vload(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The compensated sums of 16 threads: ErrorSums, one thread per lane.
struct Group {
  VF s[kPairs], c[kPairs];
};

TC_VEC_INLINE Group zero_group() {
  Group g;
  for (int p = 0; p < kPairs; ++p) g.s[p] = g.c[p] = VF{};
  return g;
}

// ErrorSums::merge (neumaier_merge) lane by lane; only lanes where keep is
// nonzero change.
TC_VEC_INLINE void merge(Group& a, const Group& b, VI keep = VI{} == 0) {
  for (int p = 0; p < kPairs; ++p) {
    VF s = a.s[p], c = a.c[p];
    neumaier_merge(s, c, b.s[p], b.c[p]);
    a.s[p] = keep ? s : a.s[p];
    a.c[p] = keep ? c : a.c[p];
  }
}

// Applies a lane permutation to every vector of one or two groups.
template <VF (*F)(VF, VF)>
TC_VEC_INLINE Group map(const Group& a, const Group& b) {
  Group out;
  for (int p = 0; p < kPairs; ++p) {
    out.s[p] = F(a.s[p], b.s[p]);
    out.c[p] = F(a.c[p], b.c[p]);
  }
  return out;
}

template <int K, int... I>
TC_VEC_INLINE VF shift_down(VF v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, (I + K)...);
}

// Lane i is lane i + K of a (lanes past the end: don't care).
template <int K>
TC_VEC_INLINE VF shift(VF a, VF) {
  return shift_down<K>(a, std::make_integer_sequence<int, kV>());
}

template <int K>
TC_VEC_INLINE Group shifted(const Group& g) {
  return map<shift<K>>(g, g);
}

// Shuffles for tree_reduce's transposition.
TC_VEC_INLINE VF pair_lo(VF a, VF b) {
  return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
TC_VEC_INLINE VF pair_hi(VF a, VF b) {
  return __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}
TC_VEC_INLINE VF quad_lo(VF a, VF b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
}
TC_VEC_INLINE VF quad_hi(VF a, VF b) {
  return __builtin_shufflevector(a, b, 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
}

// block_tree_reduce (numerics.h) on 128 threads, group k holding threads
// 16k .. 16k + 15.
TC_VEC_INLINE ErrorSums tree_reduce(Group (&th)[kGroups]) {
  // Within each warp, offset 16: the warp's second group into its first.
  for (int w = 0; w < kGroups / 2; ++w) merge(th[2 * w], th[2 * w + 1]);
  // Lane l of warp w to position 4 l + w, so that each later level merges
  // one contiguous range into the one before it.
  const Group w01_lo = map<pair_lo>(th[0], th[2]), w01_hi = map<pair_hi>(th[0], th[2]);
  const Group w23_lo = map<pair_lo>(th[4], th[6]), w23_hi = map<pair_hi>(th[4], th[6]);
  Group m0 = map<quad_lo>(w01_lo, w23_lo), m1 = map<quad_hi>(w01_lo, w23_lo);
  const Group m2 = map<quad_lo>(w01_hi, w23_hi), m3 = map<quad_hi>(w01_hi, w23_hi);
  // Offsets 8 and 4: lanes 0..7 then 0..3 of every warp.
  merge(m0, m2);
  merge(m1, m3);
  merge(m0, m1);
  // Offsets 2 and 1, then across the warps' lane 0 (positions 0..3).
  merge(m0, shifted<8>(m0));
  merge(m0, shifted<4>(m0));
  merge(m0, shifted<2>(m0));
  merge(m0, shifted<1>(m0));
  return ErrorSums{m0.s[0][0], m0.c[0][0], m0.s[1][0], m0.c[1][0], m0.s[2][0], m0.c[2][0]};
}

// Lane v of 16 consecutive threads, from the lanes array a.
template <int kVec>
TC_VEC_INLINE void deinterleave(const float* a, VF (&out)[kVec]);

// Lanes 0 and 1 (lo) or 2 and 3 (hi) of the 8 threads in p, q.
TC_VEC_INLINE VF quarters_lo(VF p, VF q) {
  return __builtin_shufflevector(p, q, 0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
}
TC_VEC_INLINE VF quarters_hi(VF p, VF q) {
  return __builtin_shufflevector(p, q, 2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
}

template <>
TC_VEC_INLINE void deinterleave<4>(const float* a, VF (&out)[4]) {
  const VF x0 = vload(a), x1 = vload(a + kV), x2 = vload(a + 2 * kV), x3 = vload(a + 3 * kV);
  const VF l01 = quarters_lo(x0, x1), h01 = quarters_hi(x0, x1);
  const VF l23 = quarters_lo(x2, x3), h23 = quarters_hi(x2, x3);
  out[0] = __builtin_shufflevector(l01, l23, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  out[1] = __builtin_shufflevector(l01, l23, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  out[2] = __builtin_shufflevector(h01, h23, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  out[3] = __builtin_shufflevector(h01, h23, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// 16-bit sources: 8 lanes a thread, gathered element by element (once per
// chunk of 64K elements, so plain copies are cheap enough).
template <>
TC_VEC_INLINE void deinterleave<8>(const float* a, VF (&out)[8]) {
  for (int v = 0; v < 8; ++v) {
    for (int t = 0; t < kV; ++t) out[v][t] = a[t * 8 + v];
  }
}

template <int kVec>
TC_VEC_INLINE ErrorSums finish(const float (&sums)[kNumSumArrays][kBlockThreads * kVec]) {
  Group th[kGroups];
  for (int k = 0; k < kGroups; ++k) {
    // Lane v of each array for threads 16k .. 16k + 15.
    VF lanes[kNumSumArrays][kVec];
    for (int a = 0; a < kNumSumArrays; ++a) deinterleave<kVec>(sums[a] + k * kV * kVec, lanes[a]);
    th[k] = zero_group();
    for (int v = 0; v < kVec; ++v) {
      Group lane;
      for (int p = 0; p < kPairs; ++p) {
        lane.s[p] = lanes[2 * p][v];
        lane.c[p] = lanes[2 * p + 1][v];
      }
      merge(th[k], lane);
    }
  }
  return tree_reduce(th);
}

TC_CPU_CLONES void finish4(const float (&sums)[kNumSumArrays][kBlockThreads * 4], ErrorSums* out) {
  *out = finish<4>(sums);
}

TC_CPU_CLONES void finish8(const float (&sums)[kNumSumArrays][kBlockThreads * 8], ErrorSums* out) {
  *out = finish<8>(sums);
}

TC_CPU_CLONES void reduce(const float* const (&partial)[kNumSumArrays], int64_t n, ErrorSums* out) {
  Group th[kGroups];
  for (auto& g : th) g = zero_group();
  VI lane;
  for (int l = 0; l < kV; ++l) lane[l] = l;
  // Thread t folds partials t, t + kBlockThreads, ... in sequence.
  for (int64_t row = 0; row < n; row += kBlockThreads) {
    for (int k = 0; k < kGroups; ++k) {
      const int64_t first = row + k * kV;
      if (first >= n) break;
      Group g;
      for (int p = 0; p < kPairs; ++p) {
        g.s[p] = vload(partial[2 * p] + first);
        g.c[p] = vload(partial[2 * p + 1] + first);
      }
      const int64_t left = n - first;
      merge(th[k], g, lane < static_cast<int32_t>(left < kV ? left : kV));
    }
  }
  *out = tree_reduce(th);
}

}  // namespace

ErrorSums finish_lanes(const float (&sums)[kNumSumArrays][lanes_of<float>()]) {
  static_assert(vec_of<float>() == 4, "float32 threads own 4 lanes");
  ErrorSums out;
  finish4(sums, &out);
  return out;
}

ErrorSums finish_lanes(const float (&sums)[kNumSumArrays][lanes_of<uint16_t>()]) {
  static_assert(vec_of<uint16_t>() == 8, "16-bit sources' threads own 8 lanes");
  ErrorSums out;
  finish8(sums, &out);
  return out;
}

PlainSums finish_lanes(const double (&sums)[kNumPlainArrays][lanes_of<double>()]) {
  // Plain float64 additions in the same tree: scalar code is fast enough
  // once per chunk of 64K elements.
  constexpr int kVec = vec_of<double>();
  PlainSums threads[kBlockThreads];
  for (int t = 0; t < kBlockThreads; ++t) {
    for (int v = 0; v < kVec; ++v) {
      const int l = t * kVec + v;
      threads[t].merge(PlainSums{sums[kAbs][l], sums[kSqErr][l], sums[kSq][l]});
    }
  }
  block_tree_reduce(threads);
  return threads[0];
}

ErrorSums reduce_chunk_sums(const float* const (&partial)[kNumSumArrays], int64_t n) {
  ErrorSums out;
  reduce(partial, n, &out);
  return out;
}

}  // namespace cpu
}  // namespace torchcast
