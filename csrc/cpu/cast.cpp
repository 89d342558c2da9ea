// cast_with_stats on the CPU: one pass over x that writes the correctly
// rounded y and reduces the error statistics, parallel over fixed-size chunks
// so that the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <torch/library.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <array>
#include <type_traits>

#include "../cast_common.h"
#include "cast_avx512.h"
#include "lanes.h"
#include "simd.h"

namespace torchcast {
namespace {

using cpu::LaneState;
using cpu::use_avx512;

// The portable loop: n <= kLanes - lane contiguous elements into lanes
// [lane, lane + n), one ElementMeasure each (of x * scale with kScaled).
// Counters are local and as wide as the source, the maxima kept per lane,
// and saturation a compile-time choice, so that the loop vectorizes.
template <typename Src, typename Target, bool kScaled, bool kSaturate>
TC_CPU_CLONES void portable_run(LaneState<Src>* __restrict__ st,
                                const typename SourceFormat<Src>::storage* __restrict__ x,
                                typename Target::storage* __restrict__ y, int lane, int n,
                                ScaleOf<typename SourceFormat<Src>::wide> scale) {
  using Format = SourceFormat<Src>;
  using Wide = typename Format::wide;
  using Count = std::conditional_t<sizeof(Wide) == 8, int64_t, int32_t>;
  // One restrict pointer per array and local counters: what gcc needs to
  // vectorize the loop.
  Wide* __restrict__ max_abs = st->max_abs + lane;
  Wide* __restrict__ max_rel = st->max_rel + lane;
  Wide* __restrict__ amax = st->amax + lane;
  double* __restrict__ abs_s = st->sums[cpu::kAbs] + lane;
  double* __restrict__ sq_err_s = st->sums[cpu::kSqErr] + lane;
  double* __restrict__ sq_s = st->sums[cpu::kSq] + lane;
  CastCounts<Count> counts;
  for (int j = 0; j < n; ++j) {
    const auto m = kScaled ? ElementMeasure<Target, Wide, double>(Format::widen(x[j]), kSaturate, scale)
                           : ElementMeasure<Target, Wide, double>(Format::widen(x[j]), kSaturate);
    y[j] = m.y;
    counts.add(m);
    max_abs[j] = m.abs_err > max_abs[j] ? m.abs_err : max_abs[j];
    max_rel[j] = m.rel_err > max_rel[j] ? m.rel_err : max_rel[j];
    amax[j] = m.amax > amax[j] ? m.amax : amax[j];
    abs_s[j] += static_cast<double>(m.abs_err);
    sq_err_s[j] += m.sq_err;
    sq_s[j] += m.sq;
  }
  st->counts.add(counts);
}

// What the AVX-512 loop (cast_avx512.h) covers beyond plain casts of every
// pair: saturating and scaled casts to float8 (scaled ones not from float64,
// with a scale in [2^-100, 2^100]).
template <typename Target>
constexpr bool kIsFloat8 =
    std::is_same<Target, Float8E4M3FNTarget>::value || std::is_same<Target, Float8E5M2Target>::value;

template <typename Src, typename Target>
bool avx512_covers(const CastOptions& o) {
  if constexpr (std::is_same<Src, double>::value) {
    if (o.scale != nullptr) return false;
  } else if (o.scale != nullptr) {
    const float scale = *o.scale_as<float>();
    return kIsFloat8<Target> && scale >= 0x1p-100f && scale <= 0x1p100f;
  }
  return kIsFloat8<Target> || !o.saturate;
}

template <typename Src, typename Target>
struct CastCpu {
  using From = typename SourceFormat<Src>::storage;
  using Storage = typename Target::storage;
  using State = LaneState<Src>;
  static constexpr int kLanes = State::kLanes;

  // n contiguous elements, the first in lane `lane`.
  static void run(State* st, const From* x, Storage* y, int lane, int64_t n, const CastOptions& o) {
#ifdef TORCHCAST_HAVE_AVX512
    if (use_avx512() && avx512_covers<Src, Target>(o)) {
      cpu::avx512::Kernel<Src, Target>::run(st, x, y, lane, n, o.saturate,
                                            std::is_same<Src, double>::value
                                                ? nullptr
                                                : o.scale_as<float>());
      return;
    }
#endif
    using Scale = ScaleOf<typename SourceFormat<Src>::wide>;
    const Scale scale = o.scale != nullptr ? *o.scale_as<Scale>() : Scale(1);
    const auto loop = o.scale != nullptr
                          ? (o.saturate ? portable_run<Src, Target, true, true>
                                        : portable_run<Src, Target, true, false>)
                          : (o.saturate ? portable_run<Src, Target, false, true>
                                        : portable_run<Src, Target, false, false>);
    while (n > 0) {
      const int k = static_cast<int>(std::min<int64_t>(n, kLanes - lane));
      loop(st, x, y, lane, k, scale);
      x += k;
      y += k;
      n -= k;
      lane = (lane + k) % kLanes;
    }
  }

  // n elements at strides sx, sy (in elements), through contiguous buffers.
  static void run_strided(State* st, const From* x, int64_t sx, Storage* y, int64_t sy, int lane,
                          int64_t n, const CastOptions& o) {
    constexpr int kBuffer = 1024;
    alignas(64) From xb[kBuffer];
    alignas(64) Storage yb[kBuffer];
    for (int64_t done = 0; done < n;) {
      const int k = static_cast<int>(std::min<int64_t>(kBuffer, n - done));
      for (int i = 0; i < k; ++i) xb[i] = x[(done + i) * sx];
      run(st, xb, yb, lane, k, o);
      for (int i = 0; i < k; ++i) y[(done + i) * sy] = yb[i];
      lane = static_cast<int>((lane + k) % kLanes);
      done += k;
    }
  }

  // Chunk partials, reduced in the canonical order. Inline storage covers
  // tensors of up to 16 chunks without touching the heap.
  struct Partials {
    using Stats = typename State::Stats;
    c10::SmallVector<Stats, 16> chunks;

    explicit Partials(int64_t n) : chunks(static_cast<size_t>(n)) {}
    void set(int64_t c, const State& st) { chunks[static_cast<size_t>(c)] = st.finish(); }
    at::Tensor stats(const at::Tensor& x, int64_t numel) const {
      Stats total;
      // Counts and maxima are exact in any order; the sums are set below,
      // in the canonical order.
      for (const auto& e : chunks) total.merge(e);
      // One chunk: its sums, as merged (the tree only adds zeros to them).
      if (chunks.size() > 1) {
        c10::SmallVector<PlainSums, 16> sums;
        for (const auto& e : chunks) sums.push_back(e.sums);
        total.sums = reduce_partials(sums.data(), static_cast<int64_t>(sums.size()));
      }
      auto out = at::empty({kNumStats}, x.options().dtype(at::kDouble));
      total.write(out.data_ptr<double>(), numel);
      return out;
    }
  };

  // Runs body(state, chunk) over all chunks, in parallel, each chunk from a
  // reset state, and collects the partials.
  template <typename Body>
  static Partials over_chunks(int64_t numel, const Body& body) {
    const int64_t nchunks = (numel + kChunk - 1) / kChunk;
    Partials partials(nchunks);
    const auto task = [&](int64_t first, int64_t last) {
      State st;
      for (int64_t c = first; c < last; ++c) {
        st.reset(std::min(kChunk, numel - c * kChunk));
        body(&st, c);
        partials.set(c, st);
      }
    };
    if (nchunks == 1) {
      task(0, 1);  // no thread pool round trip for small tensors
    } else {
      at::parallel_for(0, nchunks, 1, task);
    }
    return partials;
  }

  static at::Tensor cast(const at::Tensor& x, at::Tensor& y, const CastOptions& o) {
    const int64_t numel = x.numel();
    // Dense tensors laid out alike: TensorIterator's order is memory order.
    if (x.is_non_overlapping_and_dense() && y.is_non_overlapping_and_dense() &&
        x.strides() == y.strides()) {
      at::assert_no_internal_overlap(y);
      at::assert_no_partial_overlap(y, x);
      const From* xp = static_cast<const From*>(x.const_data_ptr());
      Storage* yp = reinterpret_cast<Storage*>(y.data_ptr());
      return over_chunks(numel, [&](State* st, int64_t c) {
                   const int64_t begin = c * kChunk;
                   run(st, xp + begin, yp + begin, 0, std::min(numel - begin, kChunk), o);
                 })
          .stats(x, numel);
    }
    auto iter = cast_iterator(x, y);
    return over_chunks(numel, [&](State* st, int64_t c) {
             int64_t pos = 0;  // position inside the chunk: decides the lane
             auto loop = [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
               const int64_t sy = strides[0] / static_cast<int64_t>(sizeof(Storage));
               const int64_t sx = strides[1] / static_cast<int64_t>(sizeof(From));
               for (int64_t r = 0; r < size1; ++r) {
                 auto* yp = reinterpret_cast<Storage*>(data[0] + r * strides[2]);
                 auto* xp = reinterpret_cast<const From*>(data[1] + r * strides[3]);
                 const int lane = static_cast<int>(pos % kLanes);
                 if (sx == 1 && sy == 1) {
                   run(st, xp, yp, lane, size0, o);
                 } else {
                   run_strided(st, xp, sx, yp, sy, lane, size0, o);
                 }
                 pos += size0;
               }
             };
             iter.serial_for_each(loop, {c * kChunk, std::min(numel, (c + 1) * kChunk)});
           })
        .stats(x, numel);
  }
};

struct CpuCast {
  template <typename Src, typename Target>
  static at::Tensor narrowing(const at::Tensor& x, at::Tensor& y, const CastOptions& o) {
    return CastCpu<Src, Target>::cast(x, y, o);
  }
};

}  // namespace

namespace cpu {

bool use_avx512() {
#ifdef TORCHCAST_HAVE_AVX512
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          at::get_cpu_capability() == "AVX512";
  return yes;
#else
  return false;
#endif
}

}  // namespace cpu

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("cast_with_stats", &cast_with_stats<CpuCast>);
  m.impl("cast_with_stats.out", &cast_with_stats_out<CpuCast>);
}

}  // namespace torchcast
