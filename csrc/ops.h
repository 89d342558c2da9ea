// Kernels behind the torchcast ops, one declaration per backend; registered
// in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace torchcast {

std::tuple<at::Tensor, at::Tensor> cast_with_stats_cpu(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_cpu(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);

// kahan_sum / kahan_mean (csrc/cpu/reduce.cpp; order in csrc/reduce_common.h).
at::Tensor kahan_sum_cpu(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                         std::optional<at::ScalarType> dtype);
at::Tensor kahan_mean_cpu(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                          std::optional<at::ScalarType> dtype);

#ifdef TORCHCAST_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> cast_with_stats_cuda(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_cuda(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);
#endif

}  // namespace torchcast
