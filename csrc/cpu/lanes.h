// State of one chunk of the CPU cast_with_stats kernel while it is being
// reduced, and the reduction that finishes it. Shared by the portable loop
// (cast.cpp) and the AVX-512 one (cast_avx512.h), which must agree bit for
// bit with each other and with torchcast/_reference/cast.py.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../cast_common.h"
#include "../numerics.h"

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
  // in the canonical order of numerics.h.
  Stats finish() const;
};

// The canonical order of numerics.h for one chunk's sums: each thread folds
// its vec lanes (lane 0 first) into an empty sum, then block_tree_reduce.
// Lanes past `used` are zero and left out. Scalar code: it runs once per
// chunk, and for a small tensor over its few live lanes only.
template <int kLanes>
PlainSums finish_lanes(const double (&sums)[kNumSumArrays][kLanes], int used) {
  constexpr int kVec = kLanes / kBlockThreads;
  PlainSums threads[kBlockThreads];
  for (int t = 0; t * kVec < used; ++t) {
    for (int v = 0; v < kVec; ++v) {
      const int l = t * kVec + v;
      threads[t].merge(PlainSums{sums[kAbs][l], sums[kSqErr][l], sums[kSq][l]});
    }
  }
  block_tree_reduce(threads);
  return threads[0];
}

template <typename Src>
typename LaneState<Src>::Stats LaneState<Src>::finish() const {
  Stats out;
  out.counts = counts;
  for (int l = 0; l < used; ++l) {
    out.max_abs_err = max_abs[l] > out.max_abs_err ? max_abs[l] : out.max_abs_err;
    out.max_rel_err = max_rel[l] > out.max_rel_err ? max_rel[l] : out.max_rel_err;
    out.amax = amax[l] > out.amax ? amax[l] : out.amax;
  }
  out.sums = finish_lanes<kLanes>(sums, used);
  return out;
}

}  // namespace cpu
}  // namespace torchcast
