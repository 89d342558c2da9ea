// The dtype switch of tensor_health's host drivers (cpu/health.cpp,
// cuda/health.cu): which HealthFormat and scalar type a tensor's dtype is.
#pragma once

#include <ATen/ATen.h>

#include "cast_common.h"
#include "health.h"

namespace torchcast {

// Returns fn.template operator()<Format, Scalar>() for x's dtype; a TypeError
// naming the dtype and the supported ones for any other.
template <typename Fn>
auto visit_health_dtype(const at::Tensor& x, Fn&& fn) {
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16 ||
                       t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2,
                   "torchcast.tensor_health: x is ", dtype_name(t),
                   "; supported dtypes: torch.float64, torch.float32, torch.float16, "
                   "torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2");
  switch (t) {
    case at::kFloat: return fn.template operator()<HealthF32, float>();
    case at::kHalf: return fn.template operator()<HealthF16, c10::Half>();
    case at::kBFloat16: return fn.template operator()<HealthBF16, c10::BFloat16>();
    case at::kFloat8_e4m3fn: return fn.template operator()<HealthE4M3, c10::Float8_e4m3fn>();
    case at::kFloat8_e5m2: return fn.template operator()<HealthE5M2, c10::Float8_e5m2>();
    default: return fn.template operator()<HealthF64, double>();  // kDouble, checked above
  }
}

}  // namespace torchcast
