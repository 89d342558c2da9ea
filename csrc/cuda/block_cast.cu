// block_cast on CUDA: one thread a block of x (block_cast.h's cast_block,
// the CPU kernel's per-block math), grid-stride; each CUDA block tree-reduces
// its threads' tallies (block_reduce.cuh) into one partial, the scale bytes
// go to the histogram with one atomicAdd each, and a one-thread kernel folds
// the partials in order. Counts and maxima equal the CPU kernel's; the
// float64 sums are added in another order (within rounding of the CPU's).
// Nothing synchronizes with the host: NVFP4's tensor scale is read on the
// device.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "../block_cast_common.h"
#include "block_reduce.cuh"
#include "launch.cuh"

namespace torchcast {
namespace {

template <typename BF, typename Src>
__global__ void __launch_bounds__(kBlockThreads)
    block_cast_kernel(const typename Src::storage* __restrict__ x, int64_t n, int64_t block,
                      int64_t per_row, int64_t total, int64_t row_bytes, block::ScaleMode mode,
                      const float* __restrict__ tensor_scale, uint8_t* __restrict__ data,
                      uint8_t* __restrict__ scales, unsigned long long* __restrict__ hist,
                      block::Tally* __restrict__ partials) {
  const float ts = tensor_scale != nullptr ? *tensor_scale : 1.f;
  block::Tally t;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < total;
       b += stride) {
    const int64_t row = b / per_row, start = (b % per_row) * block;
    const int len = static_cast<int>(n - start < block ? n - start : block);
    uint8_t* out = data + row * row_bytes + (BF::element::kBits == 4 ? start / 2 : start);
    const uint32_t bits = block::cast_block<BF, Src>(x + row * n + start, len, mode, ts, out, t);
    scales[b] = static_cast<uint8_t>(bits);
    atomicAdd(hist + bits, 1ull);
  }
  t = block_reduce(t, shared_scratch<block::Tally>());
  if (threadIdx.x == 0) partials[blockIdx.x] = t;
}

// Folds the partials in order and writes the stats and the block counts.
__global__ void block_cast_finish(const block::Tally* __restrict__ partials, int parts,
                                  double numel, double* __restrict__ stats,
                                  int64_t* __restrict__ block_counts) {
  block::Tally all;
  for (int i = 0; i < parts; ++i) all.merge(partials[i]);
  all.write(stats, numel);
  for (int i = 0; i < block::kNumBlockCounts; ++i) {
    block_counts[i] = static_cast<int64_t>(all.blocks[i]);
  }
}

struct CudaBlockCast {
  template <typename BF, typename Src>
  static void run(BlockCastPlan& plan) {
    const Launcher launch(plan.x.device());
    const int64_t total = plan.rows * plan.blocks_per_row;
    const int64_t wanted = (total + kBlockThreads - 1) / kBlockThreads;
    const int64_t cap = int64_t{launch.multiprocessors()} * 8;
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
    at::Tensor partials = at::empty({static_cast<int64_t>(grid * sizeof(block::Tally))},
                                    plan.x.options().dtype(at::kByte));
    plan.scale_hist.zero_();
    launch(block_cast_kernel<BF, Src>, grid, kBlockThreads,
           reinterpret_cast<const typename Src::storage*>(plan.x.const_data_ptr()), plan.n,
           plan.block, plan.blocks_per_row, total, plan.data.size(-1), plan.mode,
           plan.tensor_scale.defined() ? plan.tensor_scale.const_data_ptr<float>() : nullptr,
           static_cast<uint8_t*>(plan.data.data_ptr()),
           static_cast<uint8_t*>(plan.scales.data_ptr()),
           reinterpret_cast<unsigned long long*>(plan.scale_hist.data_ptr<int64_t>()),
           reinterpret_cast<block::Tally*>(partials.data_ptr()));
    launch(block_cast_finish, 1, 1,
           reinterpret_cast<const block::Tally*>(partials.const_data_ptr()), grid,
           static_cast<double>(plan.x.numel()), plan.stats.data_ptr<double>(),
           plan.block_counts.data_ptr<int64_t>());
  }
};

}  // namespace

TORCHCAST_CUDA_KERNELS(m) {
  m.impl("block_cast", &block_cast<CudaBlockCast>);
}

}  // namespace torchcast
