#include "block_cast_common.h"

#include <c10/util/Exception.h>

#include <cstdint>

#include "cast_common.h"

namespace torchcast {

namespace {

constexpr const char* kBadTensorScale =
    "torchcast.block_cast: tensor_scale must be positive and finite (each element is x / "
    "(tensor_scale * its block's scale)); leave it out for amax(|x|) / (448 * 6), as "
    "torchcast.block.nvfp4_tensor_scale(x) gives it";

constexpr const char* kFormats = "'mxfp8_e4m3', 'mxfp8_e5m2', 'mxfp4', 'nvfp4'";

BlockFormatId format_id(c10::string_view format) {
  if (format == "mxfp8_e4m3") return BlockFormatId::kMxfp8E4M3;
  if (format == "mxfp8_e5m2") return BlockFormatId::kMxfp8E5M2;
  if (format == "mxfp4") return BlockFormatId::kMxfp4;
  if (format == "nvfp4") return BlockFormatId::kNvfp4;
  TORCH_CHECK_VALUE(false, "torchcast.block_cast: unknown format '", std::string(format),
                    "'; expected one of ", kFormats);
}

block::ScaleMode scale_mode_id(BlockFormatId format, c10::string_view mode) {
  if (format == BlockFormatId::kNvfp4) {
    TORCH_CHECK_VALUE(mode == "amax", "torchcast.block_cast: nvfp4 has one scale rule, 'amax' ",
                      "(amax / 6 over the tensor scale, rounded to e4m3); got scale_mode '",
                      std::string(mode), "'");
    return block::ScaleMode::kAmax;
  }
  if (mode == "floor") return block::ScaleMode::kFloor;
  if (mode == "ceil") return block::ScaleMode::kCeil;
  if (mode == "even") return block::ScaleMode::kEven;
  if (mode == "rceil") return block::ScaleMode::kRceil;
  TORCH_CHECK_VALUE(false, "torchcast.block_cast: unknown scale_mode '", std::string(mode),
                    "' for an MX format; expected one of 'floor' (OCP MX v1.0), 'ceil', 'even', "
                    "'rceil'");
}

}  // namespace

BlockCastPlan plan_block_cast(const at::Tensor& x, c10::string_view format, int64_t block_size,
                              c10::string_view scale_mode,
                              const std::optional<at::Tensor>& tensor_scale) {
  BlockCastPlan plan;
  plan.format = format_id(format);
  plan.mode = scale_mode_id(plan.format, scale_mode);
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kDouble || dtype == at::kFloat || dtype == at::kHalf ||
                       dtype == at::kBFloat16,
                   "torchcast.block_cast: x is ", dtype_name(dtype),
                   "; expected torch.float64, float32, float16 or bfloat16 (x.float() first)");
  TORCH_CHECK_VALUE(x.dim() >= 1, "torchcast.block_cast: x is 0-d; blocks run along a "
                    "dimension (x.reshape(1) for a single value)");
  const bool four_bit = plan.format == BlockFormatId::kMxfp4 || plan.format == BlockFormatId::kNvfp4;
  // A block's length is an int in the kernels (block_cast.h).
  TORCH_CHECK_VALUE(block_size >= 1 && block_size <= INT32_MAX &&
                        (!four_bit || block_size % 2 == 0),
                    "torchcast.block_cast: block_size is ", block_size, "; expected ",
                    four_bit ? "a positive even number (two 4-bit elements share a byte)"
                             : "a positive number",
                    " up to 2^31 - 1");
  const bool nvfp4 = plan.format == BlockFormatId::kNvfp4;
  TORCH_CHECK_VALUE(tensor_scale.has_value() == nvfp4, "torchcast.block_cast: tensor_scale is ",
                    nvfp4 ? "required for nvfp4" : "only for nvfp4, not for an MX format");
  if (nvfp4) {
    const at::Tensor& t = *tensor_scale;
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device() == x.device(),
                      "torchcast.block_cast: tensor_scale must be a one-element torch.float32 "
                      "tensor on x's device (", x.device(), "); got ", dtype_name(t.scalar_type()),
                      " with ", t.numel(), " elements on ", t.device());
    check_scale_value(t, kBadTensorScale);
    plan.tensor_scale = t.reshape({});
  }
  plan.x = x.contiguous();
  plan.n = x.size(-1);
  plan.rows = plan.n == 0 ? 0 : x.numel() / plan.n;
  plan.block = block_size;
  plan.blocks_per_row = (plan.n + block_size - 1) / block_size;

  auto data_shape = x.sizes().vec();
  auto scale_shape = x.sizes().vec();
  data_shape.back() = four_bit ? (plan.n + 1) / 2 : plan.n;
  scale_shape.back() = plan.blocks_per_row;
  const auto data_dtype = plan.format == BlockFormatId::kMxfp8E4M3   ? at::kFloat8_e4m3fn
                          : plan.format == BlockFormatId::kMxfp8E5M2 ? at::kFloat8_e5m2
                                                                     : at::kByte;
  const auto opts = x.options();
  plan.data = at::empty(data_shape, opts.dtype(data_dtype));
  plan.scales = at::empty(scale_shape, opts.dtype(nvfp4 ? at::kFloat8_e4m3fn : at::kFloat8_e8m0fnu));
  plan.stats = at::empty({kNumStats}, opts.dtype(at::kDouble));
  plan.scale_hist = at::empty({block::kScaleBins}, opts.dtype(at::kLong));
  plan.block_counts = at::empty({block::kNumBlockCounts}, opts.dtype(at::kLong));
  return plan;
}

}  // namespace torchcast
