// block_cast on the CPU: one pass over x, a block at a time (its amax, its
// scale, its elements and what they lost, block_cast.h), parallel over
// fixed runs of blocks whose tallies merge in order, so that the result does
// not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "../block_cast_common.h"

namespace torchcast {
namespace {

// Blocks per task: the unit of parallel work and of the merge order.
constexpr int64_t kTaskBlocks = 2048;

struct TaskTally {
  block::Tally tally;
  std::array<int64_t, block::kScaleBins> hist{};
};

struct CpuBlockCast {
  template <typename BF, typename Src>
  static void run(BlockCastPlan& plan) {
    using S = typename Src::storage;
    const S* xp = reinterpret_cast<const S*>(plan.x.const_data_ptr());
    uint8_t* dp = static_cast<uint8_t*>(plan.data.data_ptr());
    uint8_t* sp = static_cast<uint8_t*>(plan.scales.data_ptr());
    const float tensor_scale =
        plan.tensor_scale.defined() ? *plan.tensor_scale.const_data_ptr<float>() : 1.f;
    const int64_t n = plan.n, block = plan.block, per_row = plan.blocks_per_row;
    const int64_t row_bytes = plan.data.size(-1);
    const int64_t total = plan.rows * per_row;
    const int64_t tasks = (total + kTaskBlocks - 1) / kTaskBlocks;
    std::vector<TaskTally> partials(static_cast<size_t>(tasks));
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        TaskTally& part = partials[static_cast<size_t>(task)];
        const int64_t last = std::min(total, (task + 1) * kTaskBlocks);
        for (int64_t b = task * kTaskBlocks; b < last; ++b) {
          const int64_t row = b / per_row, start = (b % per_row) * block;
          const int len = static_cast<int>(std::min(block, n - start));
          uint8_t* out = BF::element::kBits == 4 ? dp + row * row_bytes + start / 2
                                                 : dp + row * row_bytes + start;
          const uint32_t bits = block::cast_block<BF, Src>(xp + row * n + start, len, plan.mode,
                                                           tensor_scale, out, part.tally);
          sp[b] = static_cast<uint8_t>(bits);
          part.hist[bits] += 1;
        }
      }
    });
    TaskTally all;
    for (const TaskTally& part : partials) {
      all.tally.merge(part.tally);
      for (int i = 0; i < block::kScaleBins; ++i) all.hist[i] += part.hist[i];
    }
    all.tally.write(plan.stats.data_ptr<double>(), static_cast<double>(plan.x.numel()));
    std::memcpy(plan.scale_hist.data_ptr<int64_t>(), all.hist.data(), sizeof(all.hist));
    int64_t* counts = plan.block_counts.data_ptr<int64_t>();
    for (int i = 0; i < block::kNumBlockCounts; ++i) {
      counts[i] = static_cast<int64_t>(all.tally.blocks[i]);
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("block_cast", &block_cast<CpuBlockCast>);
}

}  // namespace torchcast
