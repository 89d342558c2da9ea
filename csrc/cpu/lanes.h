// State of one chunk of the CPU cast_with_stats kernel while it is being
// reduced, and the reductions that finish it. Shared by the portable loop
// (cast.cpp) and the AVX-512 one (cast_avx512.h), which must agree bit for
// bit with each other and with torchcast/_reference/cast.py.
#pragma once

#include <cstdint>

#include "../cast_common.h"
#include "../numerics.h"
#include "simd.h"

namespace torchcast {
namespace cpu {

// Per-lane compensated sums, structure-of-arrays so that the hot loops
// update 16 consecutive lanes with one vector per array.
enum SumArray : int { kAbsS = 0, kAbsC, kSqErrS, kSqErrC, kSqS, kSqC, kNumSumArrays };

template <typename From>
struct LaneState {
  static constexpr int kLanes = lanes_of<From>();

  alignas(64) float sums[kNumSumArrays][kLanes];
  // Per-lane maxima: the portable loop keeps one per lane so that it
  // vectorizes without a max reduction; the AVX-512 loop folds its
  // registers into the first vector.
  alignas(64) From max_abs[kLanes];
  alignas(64) From max_rel[kLanes];
  CastCounts<int64_t> counts;

  void reset() {
    for (auto& a : sums) {
      for (float& v : a) v = 0.f;
    }
    for (int l = 0; l < kLanes; ++l) max_abs[l] = max_rel[l] = From(0);
    counts = {};
  }

  // Counts and maxima (sums left empty: finish_lanes reduces them).
  ChunkStats<From> exact() const {
    ChunkStats<From> out;
    out.counts = counts;
    for (int l = 0; l < kLanes; ++l) {
      out.max_abs_err = max_abs[l] > out.max_abs_err ? max_abs[l] : out.max_abs_err;
      out.max_rel_err = max_rel[l] > out.max_rel_err ? max_rel[l] : out.max_rel_err;
    }
    return out;
  }
};

// The canonical order of numerics.h for one chunk: each thread folds its
// vec lanes (lane 0 first) into an empty sum, then block_tree_reduce.
ErrorSums finish_lanes(const float (&sums)[kNumSumArrays][lanes_of<float>()]);
ErrorSums finish_lanes(const float (&sums)[kNumSumArrays][lanes_of<double>()]);

// reduce_partials (numerics.h) for chunk sums given as arrays:
// partial[a][i] for array a and chunk i. Each array is read in whole
// vectors, so it must hold n rounded up to a multiple of 16 entries (the
// padding is ignored).
ErrorSums reduce_chunk_sums(const float* const (&partial)[kNumSumArrays], int64_t n);

}  // namespace cpu
}  // namespace torchcast
