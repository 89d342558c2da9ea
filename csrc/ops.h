// Kernels behind the torchcast ops, one declaration per backend; registered
// in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace torchcast {

std::tuple<at::Tensor, at::Tensor> cast_with_stats_cpu(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_cpu(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);

// kahan_sum / kahan_mean (csrc/cpu/reduce.cpp; order in csrc/reduce_common.h).
at::Tensor kahan_sum_cpu(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                         std::optional<at::ScalarType> dtype);
at::Tensor kahan_mean_cpu(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                          std::optional<at::ScalarType> dtype);

// Autograd kernel (csrc/cast_autograd.cpp), for every backend.
std::tuple<at::Tensor, at::Tensor> cast_with_stats_autograd(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_autograd(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);

#ifdef TORCHCAST_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> cast_with_stats_cuda(const at::Tensor& x, at::ScalarType dtype);
at::Tensor cast_with_stats_out_cuda(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out);
// csrc/cuda/reduce.cu: bit-identical to the CPU kernels.
at::Tensor kahan_sum_cuda(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                          std::optional<at::ScalarType> dtype);
at::Tensor kahan_mean_cuda(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                           std::optional<at::ScalarType> dtype);
#endif

// ---------------------------------------------------------------------------
// adam_step_ (torchcast.optim.Adam/AdamW): one fused step over a dtype group.
void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                   at::TensorList compensations, at::TensorList state_steps, double lr,
                   double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                   bool maximize, bool decoupled_weight_decay, std::string_view compensation,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf);
void adam_step_tensor_lr_cpu(at::TensorList params, at::TensorList grads,
                             at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                             at::TensorList max_exp_avg_sqs, at::TensorList compensations,
                             at::TensorList state_steps, const at::Tensor& lr, double beta1,
                             double beta2, double weight_decay, double eps, bool amsgrad,
                             bool maximize, bool decoupled_weight_decay,
                             std::string_view compensation,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf);
#ifdef TORCHCAST_WITH_CUDA
void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    at::TensorList compensations, at::TensorList state_steps, double lr,
                    double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                    bool maximize, bool decoupled_weight_decay, std::string_view compensation,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf);
void adam_step_tensor_lr_cuda(at::TensorList params, at::TensorList grads,
                              at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                              at::TensorList max_exp_avg_sqs, at::TensorList compensations,
                              at::TensorList state_steps, const at::Tensor& lr, double beta1,
                              double beta2, double weight_decay, double eps, bool amsgrad,
                              bool maximize, bool decoupled_weight_decay,
                              std::string_view compensation,
                              const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf);
#endif

}  // namespace torchcast
