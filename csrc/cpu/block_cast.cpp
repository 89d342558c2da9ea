// block_cast on the CPU: one pass over x, a block at a time (its amax, its
// scale, its elements and what they lost: block_cast.h's pieces), parallel over
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
#include "block_cast_avx512.h"
#include "simd.h"

namespace torchcast {
namespace {

// Blocks per task: the unit of parallel work and of the merge order.
constexpr int64_t kTaskBlocks = 2048;
// Elements whose bits are staged before they are stored (even: 4-bit
// elements pack in pairs).
constexpr int kPiece = 256;

// The largest |x| of a block, NaN if any is NaN (block::block_amax,
// vectorized).
template <typename Src>
TC_CPU_CLONES typename Src::wide amax_of(const typename Src::storage* __restrict__ x, int n) {
  using W = typename Src::wide;
  W amax = W(0);
  int any_nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : any_nan)
  for (int i = 0; i < n; ++i) {
    const W v = Src::widen(x[i]);
    any_nan |= v != v;
    const W a = fabs(v);
    amax = a > amax ? a : amax;
  }
  return any_nan ? static_cast<W>(bit_cast<float>(0x7fc00000u)) : amax;
}

// One block: block::cast_block's pieces, the element loop an omp simd loop
// whose sums may be added lane by lane (within rounding of cast_block's
// element-order sums; the same whatever the threads). Counts and maxima are
// cast_block's. gcc vectorizes this loop under -march=x86-64-v4 but not in
// its target clones (objdump of the v4 clone: scalar), so it runs scalar;
// float32 and 16-bit sources take block_cast_avx512.h's loop where the CPU
// has AVX-512, float64 ones and other CPUs this one.
template <typename BF, typename Src>
TC_CPU_CLONES uint32_t cast_block_simd(const typename Src::storage* __restrict__ x, int n,
                                       block::ScaleMode mode, float tensor_scale,
                                       uint8_t* __restrict__ data, block::Tally& t) {
  using W = typename Src::wide;
  using Elem = typename BF::element;
  const block::BlockScale<W> s = block::block_scale<BF, W>(amax_of<Src>(x, n), mode, tensor_scale);
  int32_t nan = 0, inf = 0, inexact = 0, overflow = 0, saturated = 0, underflow = 0,
          subnormal = 0;
  double max_abs = 0, max_rel = 0, amax = 0, sum_abs = 0, sum_sq_err = 0, sum_sq = 0;
  uint8_t bits[kPiece];
  for (int base = 0; base < n; base += kPiece) {
    const int len = std::min(kPiece, n - base);
#pragma omp simd reduction(+ : nan, inf, inexact, overflow, saturated, underflow, subnormal, \
                               sum_abs, sum_sq_err, sum_sq) reduction(max : max_abs, max_rel, amax)
    for (int i = 0; i < len; ++i) {
      const block::ElementFacts f = block::cast_element<BF, Src>(Src::widen(x[base + i]), s);
      bits[i] = static_cast<uint8_t>(f.bits);
      nan += f.nan;
      inf += f.inf;
      inexact += f.inexact;
      overflow += f.overflow;
      saturated += f.saturated;
      underflow += f.underflow;
      subnormal += f.subnormal;
      max_abs = f.err > max_abs ? f.err : max_abs;
      max_rel = f.rel > max_rel ? f.rel : max_rel;
      amax = f.amax > amax ? f.amax : amax;
      sum_abs += f.err;
      sum_sq_err += f.err * f.err;
      sum_sq += f.sq;
    }
    if constexpr (Elem::kBits == 4) {
      uint8_t* out = data + base / 2;
      for (int i = 0; i + 1 < len; i += 2) {
        out[i / 2] = static_cast<uint8_t>(bits[i] | (bits[i + 1] << 4));
      }
      if (len % 2 == 1) out[len / 2] = bits[len - 1];
    } else {
      std::memcpy(data + base, bits, static_cast<size_t>(len));
    }
  }
  t.CastCounts<double>::add(
      CastCounts<int32_t>{nan, inf, inexact, overflow, saturated, underflow, subnormal});
  t.max_abs_err = std::max(t.max_abs_err, max_abs);
  t.max_rel_err = std::max(t.max_rel_err, max_rel);
  t.amax = std::max(t.amax, amax);
  t.sum_abs_err += sum_abs;
  t.sum_sq_err += sum_sq_err;
  t.sum_sq += sum_sq;
  block::count_block(t, n, underflow, saturated > 0, s.nan);
  return s.bits;
}

struct TaskTally {
  block::Tally tally;
  std::array<int64_t, block::kScaleBins> hist{};
};

// The blocks of a checked plan, numbered row by row.
template <typename BF, typename Src>
struct Blocks {
  using S = typename Src::storage;
  const S* x;
  uint8_t* data;
  uint8_t* scales;
  int64_t n, block, per_row, row_bytes;
  block::ScaleMode mode;
  float tensor_scale;

  // Calls cast(x, len, out) -> scale bits for blocks [first, last) in order,
  // storing each block's scale and counting it in part's histogram.
  template <typename Cast>
  void for_each(int64_t first, int64_t last, TaskTally& part, Cast&& cast) const {
    for (int64_t b = first; b < last; ++b) {
      const int64_t row = b / per_row, start = (b % per_row) * block;
      const int len = static_cast<int>(std::min(block, n - start));
      uint8_t* out = data + row * row_bytes + (BF::element::kBits == 4 ? start / 2 : start);
      const uint32_t bits = cast(x + row * n + start, len, out);
      scales[b] = static_cast<uint8_t>(bits);
      part.hist[bits] += 1;
    }
  }
};

#ifdef TORCHCAST_HAVE_AVX512
template <typename BF, typename Src>
TC_AVX512 void cast_task_avx512(const Blocks<BF, Src>& r, int64_t first, int64_t last,
                                TaskTally& part) {
  cpu::avx512::BlockLanes lanes;
  r.for_each(first, last, part, [&](const typename Src::storage* x, int len, uint8_t* out) {
    return cpu::avx512::cast_block<BF, Src>(x, len, r.mode, r.tensor_scale, out, part.tally,
                                            lanes);
  });
  lanes.flush(part.tally);
}
#endif

template <typename BF, typename Src>
void cast_task(const Blocks<BF, Src>& r, int64_t first, int64_t last, TaskTally& part) {
#ifdef TORCHCAST_HAVE_AVX512
  if constexpr (cpu::avx512::HasBlockLoop<Src>::value) {
    if (cpu::use_avx512()) return cast_task_avx512<BF, Src>(r, first, last, part);
  }
#endif
  r.for_each(first, last, part, [&](const typename Src::storage* x, int len, uint8_t* out) {
    return cast_block_simd<BF, Src>(x, len, r.mode, r.tensor_scale, out, part.tally);
  });
}

struct CpuBlockCast {
  template <typename BF, typename Src>
  static void run(BlockCastPlan& plan) {
    const float tensor_scale =
        plan.tensor_scale.defined() ? *plan.tensor_scale.const_data_ptr<float>() : 1.f;
    const Blocks<BF, Src> r{reinterpret_cast<const typename Src::storage*>(plan.x.const_data_ptr()),
                            static_cast<uint8_t*>(plan.data.data_ptr()),
                            static_cast<uint8_t*>(plan.scales.data_ptr()),
                            plan.n, plan.block, plan.blocks_per_row, plan.data.size(-1),
                            plan.mode, tensor_scale};
    const int64_t total = plan.rows * plan.blocks_per_row;
    const int64_t tasks = (total + kTaskBlocks - 1) / kTaskBlocks;
    std::vector<TaskTally> partials(static_cast<size_t>(tasks));
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        cast_task<BF, Src>(r, task * kTaskBlocks, std::min(total, (task + 1) * kTaskBlocks),
                           partials[static_cast<size_t>(task)]);
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
