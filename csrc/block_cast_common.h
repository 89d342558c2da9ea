// Host side of block_cast, shared by the CPU and CUDA kernels: the checks of
// the arguments (all before anything is allocated or written), the outputs'
// layout, and the switch from (format, x's dtype) to the templated kernel.
// The per-block math is block_cast.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "block_cast.h"
#include "numerics.h"

namespace torchcast {

enum class BlockFormatId : int { kMxfp8E4M3 = 0, kMxfp8E5M2, kMxfp4, kNvfp4 };

// A checked block_cast call: x as a contiguous tensor of rows x n elements
// (blocks run along the last dimension), and the outputs to fill.
struct BlockCastPlan {
  BlockFormatId format;
  block::ScaleMode mode;
  at::Tensor x;  // contiguous
  int64_t rows, n, block, blocks_per_row;
  // NVFP4's float32 tensor scale, on x's device (read by the kernel there,
  // never on the host); undefined for MX.
  at::Tensor tensor_scale;
  at::Tensor data, scales, stats, scale_hist, block_counts;
};

// Checks the arguments (x a float64/32/16 or bfloat16 tensor of at least one
// dimension; a known format; block_size >= 1, even for 4-bit elements; a
// scale mode of that format; tensor_scale given exactly for nvfp4, a
// one-element float32 tensor on x's device) and allocates the outputs.
BlockCastPlan plan_block_cast(const at::Tensor& x, c10::string_view format, int64_t block_size,
                              c10::string_view scale_mode,
                              const std::optional<at::Tensor>& tensor_scale);

using BlockCastResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Calls f(BlockFormat{}, SourceFormat{}) with the types of plan's format and
// x's dtype.
template <typename F>
void dispatch_block_cast(const BlockCastPlan& plan, F&& f) {
  const auto with_source = [&](auto bf) {
    switch (plan.x.scalar_type()) {
      case at::kDouble: f(bf, SourceFormat<double>{}); break;
      case at::kFloat: f(bf, SourceFormat<float>{}); break;
      case at::kHalf: f(bf, SourceFormat<Float16Target>{}); break;
      default: f(bf, SourceFormat<BFloat16Target>{}); break;  // bfloat16: checked by the plan
    }
  };
  switch (plan.format) {
    case BlockFormatId::kMxfp8E4M3: with_source(Mxfp8E4M3{}); break;
    case BlockFormatId::kMxfp8E5M2: with_source(Mxfp8E5M2{}); break;
    case BlockFormatId::kMxfp4: with_source(Mxfp4{}); break;
    case BlockFormatId::kNvfp4: with_source(Nvfp4{}); break;
  }
}

// The kernel entry for one backend: Backend::template run<BF, Src>(plan)
// fills plan's outputs.
template <typename Backend>
BlockCastResult block_cast(const at::Tensor& x, c10::string_view format, int64_t block_size,
                           c10::string_view scale_mode,
                           const std::optional<at::Tensor>& tensor_scale) {
  BlockCastPlan plan = plan_block_cast(x, format, block_size, scale_mode, tensor_scale);
  dispatch_block_cast(plan, [&](auto bf, auto src) {
    Backend::template run<decltype(bf), decltype(src)>(plan);
  });
  return {plan.data, plan.scales, plan.stats, plan.scale_hist, plan.block_counts};
}

}  // namespace torchcast
