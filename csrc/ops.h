// Kernels behind the torchcast ops, one declaration per backend; registered
// in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace torchcast {

std::tuple<at::Tensor, at::Tensor> cast_with_stats_cpu(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_cpu(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);

// Autograd kernel (csrc/cast_autograd.cpp), for every backend.
std::tuple<at::Tensor, at::Tensor> cast_with_stats_autograd(const at::Tensor& x, at::ScalarType dtype);

#ifdef TORCHCAST_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> cast_with_stats_cuda(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_cuda(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);
#endif

}  // namespace torchcast
