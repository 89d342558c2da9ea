// State of one chunk of the CPU cast_with_stats kernel while it is being
// reduced, and the reduction that finishes it. Shared by the portable loop
// (cast.cpp) and the AVX-512 one (cast_avx512.h), which must agree bit for
// bit with each other and with torchcast/_reference/cast.py.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../cast_common.h"
#include "../numerics.h"
#include "simd.h"

namespace torchcast {
namespace cpu {

// Per-lane plain float64 sums (PlainSums), structure-of-arrays so that the
// hot loops update consecutive lanes with one vector per array.
enum SumArray : int { kAbs = 0, kSqErr, kSq, kNumSumArrays };

// Lanes are reset, folded and reduced in whole groups of this many: a
// 64-byte vector of the widest loop's float32 lanes.
constexpr int kLaneGroup = 16;

// Src: the source's element type, or the Target naming a 16-bit source
// (SourceFormat, numerics.h).
template <typename Src>
struct LaneState {
  using Wide = typename SourceFormat<Src>::wide;
  using Stats = ChunkStats<Wide, PlainSums>;
  static constexpr int kLanes = lanes_of<typename SourceFormat<Src>::storage>();
  static_assert(kLanes % kLaneGroup == 0, "lanes come in whole groups");

  alignas(64) double sums[kNumSumArrays][kLanes];
  // Per-lane maxima: the portable loop keeps one per lane so that it
  // vectorizes without a max reduction; the AVX-512 loop folds its
  // registers into the first group.
  alignas(64) Wide max_abs[kLanes];
  alignas(64) Wide max_rel[kLanes];
  alignas(64) Wide amax[kLanes];
  CastCounts<int64_t> counts;
  // Lanes [0, used) are live: a chunk of n elements touches min(n, kLanes)
  // lanes, and a lane never touched holds zeros, which leave every sum and
  // maximum unchanged. Resetting and folding only the live ones keeps a
  // small tensor's fixed cost proportional to its size.
  int used = kLanes;

  // Starts a chunk of n elements.
  void reset(int64_t n) {
    const int64_t live = n < kLanes ? (n + kLaneGroup - 1) / kLaneGroup * kLaneGroup : kLanes;
    used = static_cast<int>(live);
    for (auto& a : sums) std::fill(a, a + used, 0.0);
    std::fill(max_abs, max_abs + used, Wide(0));
    std::fill(max_rel, max_rel + used, Wide(0));
    std::fill(amax, amax + used, Wide(0));
    counts = {};
  }

  // The chunk's stats: exact counts and maxima, and the lanes' sums folded
  // in the canonical order of numerics.h. Cloned for wide vectors: its loops
  // over the lanes are much of a small tensor's call.
  TC_CPU_CLONES Stats finish() const;
};

// One component of PlainSums: the tree of numerics.h adds each component
// on its own, so reducing the three as separate arrays is the same
// arithmetic, in loops that vectorize.
struct SumOf {
  double s;  // set by finish_lanes, for every thread (no zeroing first)
  void merge(const SumOf& o) { s += o.s; }
};

// The canonical order of numerics.h for one chunk's sums: each thread folds
// its vec lanes (lane 0 first) into an empty sum, then block_tree_reduce.
// Lanes past `used` are zero and left out. It runs once per chunk: for a
// small tensor it is much of the call.
template <int kLanes>
inline __attribute__((always_inline)) PlainSums finish_lanes(
    const double (&sums)[kNumSumArrays][kLanes], int used) {
  constexpr int kVec = kLanes / kBlockThreads;
  const int live = (used + kVec - 1) / kVec;
  double out[kNumSumArrays];
  for (int a = 0; a < kNumSumArrays; ++a) {
    SumOf threads[kBlockThreads];
    for (int t = 0; t < live; ++t) {
      double s = 0.0;
      for (int v = 0; v < kVec; ++v) s += sums[a][t * kVec + v];
      threads[t].s = s;
    }
    for (int t = live; t < kBlockThreads; ++t) threads[t].s = 0.0;
    block_tree_reduce(threads);
    out[a] = threads[0].s;
  }
  return PlainSums{out[kAbs], out[kSqErr], out[kSq]};
}

template <typename T>
struct LaneGroupOf;  // kLaneGroup lanes of T as one GCC vector
template <>
struct LaneGroupOf<float> {
  typedef float type __attribute__((vector_size(kLaneGroup * sizeof(float))));
};
template <>
struct LaneGroupOf<double> {
  typedef double type __attribute__((vector_size(kLaneGroup * sizeof(double))));
};

// The largest of a[0, used) (used a multiple of kLaneGroup), NaN skipped,
// 0 at least: a vector of running maxima, lane by lane (a single running
// maximum is a chain of dependent compares, much of a small tensor's call).
template <typename T>
inline __attribute__((always_inline)) T max_over_lanes(const T* a, int used) {
  using Group = typename LaneGroupOf<T>::type;
  Group group = {};
  for (int l = 0; l < used; l += kLaneGroup) {
    Group v;
    std::memcpy(&v, a + l, sizeof(v));
    group = v > group ? v : group;
  }
  T out = 0;
  for (int j = 0; j < kLaneGroup; ++j) out = group[j] > out ? group[j] : out;
  return out;
}

template <typename Src>
TC_CPU_CLONES typename LaneState<Src>::Stats LaneState<Src>::finish() const {
  Stats out;
  out.counts = counts;
  out.max_abs_err = max_over_lanes(max_abs, used);
  out.max_rel_err = max_over_lanes(max_rel, used);
  out.amax = max_over_lanes(amax, used);
  out.sums = finish_lanes<kLanes>(sums, used);
  return out;
}

}  // namespace cpu
}  // namespace torchcast
