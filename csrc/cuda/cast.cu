// cast_with_stats on CUDA: one pass over x that writes the correctly rounded y
// and reduces the error statistics, in the canonical order of numerics.h, so
// that y and the stats are bit-identical to the CPU op's and run to run.
//
// One block of kBlockThreads threads handles one chunk of kChunk elements at a
// time (grid-stride over chunks, grid sized from the SM count). Thread t owns
// lanes [t*vec, t*vec+vec) of every lanes-wide step of its chunk and feeds
// them from one 16-byte load; each lane is a sequential sum (SumsOf). The
// chunk's per-thread results are combined by warp shuffles and then across the
// warps, and each chunk writes one partial; a second one-block kernel reduces
// the partials (no float atomics) and writes the stats tensor on the device,
// so the op never synchronizes with the host.
#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <ATen/cuda/detail/OffsetCalculator.cuh>

#include <algorithm>
#include <array>
#include <cstdint>

#include "../cast_common.h"
#include "block_reduce.cuh"
#include "launch.cuh"

namespace torchcast {
namespace {

// 16-byte loads each thread issues before consuming them: enough bytes in
// flight per SM to cover DRAM latency at full occupancy.
constexpr int kLoadBatch = 4;

// One thread's share of a chunk: vec lanes of sums (SumsOf), exact counts,
// maxima.
// Src: the source's element type, or the Target naming a 16-bit source.
template <typename Src, typename Target>
struct ThreadStats {
  using Format = SourceFormat<Src>;
  using Wide = typename Format::wide;
  static constexpr int kVec = vec_of<typename Format::storage>();
  SumsOf<Wide> lane[kVec];
  // At most kChunk / kBlockThreads elements per thread and chunk.
  CastCounts<int32_t> counts;
  Wide max_abs = 0, max_rel = 0, amax = 0;
  bool saturate, scaled;
  ScaleOf<Wide> scale;

  // scale: the scale's device address, nullptr for an unscaled cast (a
  // branch that is uniform across the grid).
  __device__ __forceinline__ ThreadStats(bool saturate_, const ScaleOf<Wide>* scale_)
      : saturate(saturate_), scaled(scale_ != nullptr),
        scale(scale_ != nullptr ? *scale_ : ScaleOf<Wide>(1)) {}

  // Measures x into lane v (a compile-time index after unrolling, so that the
  // lanes stay in registers) and returns the rounded value.
  __device__ __forceinline__ typename Target::storage add(int v, typename Format::storage x) {
    const Wide w = Format::widen(x);
    const auto m = scaled ? ElementMeasure<Target, Wide>(w, saturate, scale)
                          : ElementMeasure<Target, Wide>(w, saturate);
    counts.add(m);
    lane[v].add(m.abs_err, m.sq_err, m.sq);
    max_abs = m.abs_err > max_abs ? m.abs_err : max_abs;
    max_rel = m.rel_err > max_rel ? m.rel_err : max_rel;
    amax = m.amax > amax ? m.amax : amax;
    return m.y;
  }

  // Lanes merged lane 0 first into an empty sum, as cpu::finish_lanes does.
  __device__ __forceinline__ ChunkStats<Wide> finish() const {
    ChunkStats<Wide> out;
    out.counts.add(counts);
    out.max_abs_err = max_abs;
    out.max_rel_err = max_rel;
    out.amax = amax;
#pragma unroll
    for (int v = 0; v < kVec; ++v) out.sums.merge(lane[v]);
    return out;
  }
};

// Where linear (TensorIterator-order) index i lives in y and x, in elements.
struct ElementOffsets {
  int64_t y, x;
};

// Both operands contiguous in iteration order.
struct LinearOffsets {
  __device__ __forceinline__ ElementOffsets operator()(int64_t i) const { return {i, i}; }
};

// Any strides, through TensorIterator's own offset calculator (operand 0 is
// y, operand 1 is x), so the order is the CPU kernel's without a copy.
// Index is uint32_t where TensorIterator allows 32-bit indexing (cheap
// divisions), uint64_t otherwise.
template <typename Index>
struct IterOffsets {
  OffsetCalculator<2, Index> calc;
  __device__ __forceinline__ ElementOffsets operator()(int64_t i) const {
    const auto o = calc.get(static_cast<Index>(i));
    return {static_cast<int64_t>(o[0]), static_cast<int64_t>(o[1])};
  }
};

template <typename Index>
IterOffsets<Index> iter_offsets(const at::TensorIteratorBase& iter) {
  const std::array<const int64_t*, 2> strides{iter.strides(0).data(), iter.strides(1).data()};
  const std::array<int64_t, 2> element_sizes{iter.element_size(0), iter.element_size(1)};
  return {OffsetCalculator<2, Index>(iter.ndim(), iter.shape().data(), strides.data(),
                                     element_sizes.data())};
}

// Elements [first, n) of the chunk starting at linear index base, one scalar
// access each, with the lane mapping of the vector path.
template <typename Src, typename Target, typename Offsets,
          typename From = typename SourceFormat<Src>::storage>
__device__ __forceinline__ void scalar_steps(ThreadStats<Src, Target>& st,
                                             const From* __restrict__ x,
                                             typename Target::storage* __restrict__ y,
                                             const Offsets& offsets, int64_t base, int first,
                                             int n) {
  constexpr int kVec = vec_of<From>();
  constexpr int kLanes = lanes_of<From>();
  for (int s = first; s < n; s += kLanes) {
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int e = s + static_cast<int>(threadIdx.x) * kVec + v;
      if (e < n) {
        const ElementOffsets o = offsets(base + e);
        y[o.y] = st.add(v, x[o.x]);
      }
    }
  }
}

// Full lanes-wide steps of a contiguous chunk whose x is 16-byte aligned and
// whose y is aligned to vec elements: one 16-byte load and one vec-wide store
// per thread and step, kLoadBatch loads in flight.
template <typename Src, typename Target, typename From = typename SourceFormat<Src>::storage>
__device__ __forceinline__ int vector_steps(ThreadStats<Src, Target>& st,
                                            const From* __restrict__ x,
                                            typename Target::storage* __restrict__ y, int n) {
  using Storage = typename Target::storage;
  constexpr int kVec = vec_of<From>();
  constexpr int kLanes = lanes_of<From>();
  const int steps = n / kLanes;
  const From* xt = x + threadIdx.x * kVec;
  Storage* yt = y + threadIdx.x * kVec;
  auto consume = [&](const Packet<From, kVec>& in, int s) {
    Packet<Storage, kVec> out;
#pragma unroll
    for (int v = 0; v < kVec; ++v) out.v[v] = st.add(v, in.v[v]);
    *reinterpret_cast<Packet<Storage, kVec>*>(yt + s * kLanes) = out;
  };
  int s = 0;
  for (; s + kLoadBatch <= steps; s += kLoadBatch) {
    Packet<From, kVec> in[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      in[u] = *reinterpret_cast<const Packet<From, kVec>*>(xt + (s + u) * kLanes);
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) consume(in[u], s + u);
  }
  for (; s < steps; ++s) consume(*reinterpret_cast<const Packet<From, kVec>*>(xt + s * kLanes), s);
  return steps * kLanes;
}

template <typename Src, typename Target, typename Offsets, bool kVector,
          typename From = typename SourceFormat<Src>::storage,
          typename Wide = typename SourceFormat<Src>::wide>
__global__ void __launch_bounds__(kBlockThreads)
    cast_stats_kernel(const From* __restrict__ x, typename Target::storage* __restrict__ y,
                      Offsets offsets, int64_t numel, CastOptions options,
                      ChunkStats<Wide>* __restrict__ partials) {
  ChunkStats<Wide>* smem = shared_scratch<ChunkStats<Wide>>();
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t base = c * kChunk;
    const int64_t rest = numel - base;  // std::min would take kChunk by reference: host-only
    const int n = static_cast<int>(rest < kChunk ? rest : kChunk);
    ThreadStats<Src, Target> st(options.saturate, options.template scale_as<Wide>());
    int done = 0;
    if constexpr (kVector) done = vector_steps(st, x + base, y + base, n);
    scalar_steps(st, x, y, offsets, base, done, n);
    const ChunkStats<Wide> chunk = block_reduce(st.finish(), smem);
    if (threadIdx.x == 0) partials[c] = chunk;
  }
}

// reduce_partials (numerics.h) on the device: thread t folds partials t,
// t + kBlockThreads, ... in order, then the block tree; thread 0 writes stats.
template <typename Wide>
__global__ void __launch_bounds__(kBlockThreads)
    finish_stats_kernel(const ChunkStats<Wide>* __restrict__ partials, int64_t nchunks,
                        int64_t numel, double* __restrict__ stats) {
  ChunkStats<Wide> acc;
  for (int64_t i = threadIdx.x; i < nchunks; i += kBlockThreads) acc.merge(partials[i]);
  acc = block_reduce(acc, shared_scratch<ChunkStats<Wide>>());
  if (threadIdx.x == 0) acc.write(stats, numel);
}

template <typename Src, typename Target, typename Offsets, bool kVector,
          typename From = typename SourceFormat<Src>::storage,
          typename Wide = typename SourceFormat<Src>::wide>
void launch_cast(const Launcher& launch, const From* x, typename Target::storage* y,
                 const Offsets& offsets, int64_t numel, const CastOptions& options,
                 ChunkStats<Wide>* partials) {
  const auto kernel = cast_stats_kernel<Src, Target, Offsets, kVector>;
  // Residency depends only on the kernel and the architecture; cached once
  // per kernel (a mixed-architecture machine would get a suboptimal grid
  // size, never a different result: the chunking fixes the order).
  static const int blocks_per_sm = Launcher::blocks_per_sm(kernel, kBlockThreads);
  const int64_t resident = static_cast<int64_t>(launch.multiprocessors()) * blocks_per_sm;
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  // As many rounds as the resident blocks need, then as few blocks as cover
  // the chunks in that many rounds, so every block does the same work (+-1).
  const int64_t rounds = (nchunks + resident - 1) / resident;
  const int64_t grid = (nchunks + rounds - 1) / rounds;
  launch(kernel, static_cast<unsigned>(grid), kBlockThreads, x, y, offsets, numel, options,
         partials);
}

// The backend of cast_with_stats<> (cast_common.h).
struct CudaCast {
  template <typename Src, typename Target>
  static at::Tensor narrowing(const at::Tensor& x, at::Tensor& y, const CastOptions& options) {
    using From = typename SourceFormat<Src>::storage;
    using Partial = ChunkStats<typename SourceFormat<Src>::wide>;
    using Storage = typename Target::storage;
    constexpr int kVec = vec_of<From>();
    const Launcher launch(x.device());

    auto iter = cast_iterator(x, y);
    const int64_t numel = iter.numel();
    const int64_t nchunks = (numel + kChunk - 1) / kChunk;

    auto stats = at::empty({kNumStats}, x.options().dtype(at::kDouble));
    auto partial_bytes = at::empty(
        {std::max<int64_t>(nchunks, 1) * static_cast<int64_t>(sizeof(Partial))},
        x.options().dtype(at::kByte));
    auto* partials = static_cast<Partial*>(partial_bytes.data_ptr());

    if (numel > 0) {
      auto* yp = static_cast<Storage*>(iter.data_ptr(0));
      const auto* xp = static_cast<const From*>(iter.data_ptr(1));
      if (iter.is_contiguous()) {
        const bool aligned = reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&
                             reinterpret_cast<uintptr_t>(yp) % (kVec * sizeof(Storage)) == 0;
        if (aligned) {
          launch_cast<Src, Target, LinearOffsets, true>(launch, xp, yp, {}, numel, options,
                                                        partials);
        } else {
          launch_cast<Src, Target, LinearOffsets, false>(launch, xp, yp, {}, numel, options,
                                                         partials);
        }
      } else if (iter.can_use_32bit_indexing()) {
        launch_cast<Src, Target, IterOffsets<uint32_t>, false>(
            launch, xp, yp, iter_offsets<uint32_t>(iter), numel, options, partials);
      } else {
        launch_cast<Src, Target, IterOffsets<uint64_t>, false>(
            launch, xp, yp, iter_offsets<uint64_t>(iter), numel, options, partials);
      }
    }
    launch(finish_stats_kernel<typename SourceFormat<Src>::wide>, 1, kBlockThreads, partials,
           nchunks, numel, stats.data_ptr<double>());
    return stats;
  }
};

}  // namespace

TORCHCAST_CUDA_KERNELS(m) {
  m.impl("cast_with_stats", &cast_with_stats<CudaCast>);
  m.impl("cast_with_stats.out", &cast_with_stats_out<CudaCast>);
}

}  // namespace torchcast
