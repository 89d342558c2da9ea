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

// Per-lane sums, structure-of-arrays so that the hot loops update 16
// consecutive lanes with one vector per array: compensated float32 pairs
// (ErrorSums) for float32 and narrower sources, plain float64 sums
// (PlainSums) for float64 sources.
enum SumArray : int { kAbsS = 0, kAbsC, kSqErrS, kSqErrC, kSqS, kSqC, kNumSumArrays };
enum PlainArray : int { kAbs = 0, kSqErr, kSq, kNumPlainArrays };

template <typename Wide>
struct SumLayout {
  using type = float;
  static constexpr int kArrays = kNumSumArrays;
};
template <>
struct SumLayout<double> {
  using type = double;
  static constexpr int kArrays = kNumPlainArrays;
};

// Src: the source's element type, or the Target naming a 16-bit source
// (SourceFormat, numerics.h).
template <typename Src>
struct LaneState {
  using Wide = typename SourceFormat<Src>::wide;
  static constexpr int kLanes = lanes_of<typename SourceFormat<Src>::storage>();

  using Sum = typename SumLayout<Wide>::type;
  static constexpr int kSumArrays = SumLayout<Wide>::kArrays;

  alignas(64) Sum sums[kSumArrays][kLanes];
  // Per-lane maxima: the portable loop keeps one per lane so that it
  // vectorizes without a max reduction; the AVX-512 loop folds its
  // registers into the first vector.
  alignas(64) Wide max_abs[kLanes];
  alignas(64) Wide max_rel[kLanes];
  alignas(64) Wide amax[kLanes];
  CastCounts<int64_t> counts;

  void reset() {
    for (auto& a : sums) {
      for (Sum& v : a) v = Sum(0);
    }
    for (int l = 0; l < kLanes; ++l) max_abs[l] = max_rel[l] = amax[l] = Wide(0);
    counts = {};
  }

  // Counts and maxima (sums left empty: finish_lanes reduces them).
  ChunkStats<Wide> exact() const {
    ChunkStats<Wide> out;
    out.counts = counts;
    for (int l = 0; l < kLanes; ++l) {
      out.max_abs_err = max_abs[l] > out.max_abs_err ? max_abs[l] : out.max_abs_err;
      out.max_rel_err = max_rel[l] > out.max_rel_err ? max_rel[l] : out.max_rel_err;
      out.amax = amax[l] > out.amax ? amax[l] : out.amax;
    }
    return out;
  }
};

// The canonical order of numerics.h for one chunk: each thread folds its
// vec lanes (lane 0 first) into an empty sum, then block_tree_reduce.
ErrorSums finish_lanes(const float (&sums)[kNumSumArrays][lanes_of<float>()]);
ErrorSums finish_lanes(const float (&sums)[kNumSumArrays][lanes_of<uint16_t>()]);
PlainSums finish_lanes(const double (&sums)[kNumPlainArrays][lanes_of<double>()]);

// reduce_partials (numerics.h) for chunk sums given as arrays:
// partial[a][i] for array a and chunk i. Each array is read in whole
// vectors, so it must hold n rounded up to a multiple of 16 entries (the
// padding is ignored).
ErrorSums reduce_chunk_sums(const float* const (&partial)[kNumSumArrays], int64_t n);

}  // namespace cpu
}  // namespace torchcast
