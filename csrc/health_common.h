// Host side of tensor_health shared by the CPU and CUDA kernels: the dtype
// switch, how x's elements are laid out, and the outputs (layout in health.h).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "health.h"
#include "reduce_common.h"

namespace torchcast {

using HealthResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// x's elements as a kernel reads them. The results do not depend on the
// order of the elements, so a dense x (its dims in any order) is one flat
// run of numel elements from x's data pointer. Otherwise `axes` walks them:
// x's dims by decreasing stride, coalesced (xstride only), outermost first.
struct HealthInput {
  int64_t numel = 0;
  bool flat = true;
  Axes axes;
};

HealthInput health_input(const at::Tensor& x);

// The outputs on x's device: counts and hist zero, extrema (0, +inf), the
// values of a tensor without finite nonzero elements.
HealthResult health_outputs(const at::Tensor& x, int rows);

// TypeError naming x's dtype and the supported ones.
[[noreturn]] void unsupported_health_dtype(at::ScalarType dtype);

// Calls fn(F{}) with the health::Format F of dtype, for the six floating
// dtypes whose bits torchcast reads (tensor_health, and count_nonfinite and
// all_finite in cpu/all_finite.cpp); returns false, calling nothing, for any
// other dtype.
template <typename Fn>
bool with_health_format(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kDouble: fn(health::Float64Format{}); return true;
    case at::kFloat: fn(health::Float32Format{}); return true;
    case at::kHalf: fn(health::Float16Format{}); return true;
    case at::kBFloat16: fn(health::BFloat16Format{}); return true;
    case at::kFloat8_e4m3fn: fn(health::Float8E4M3FnFormat{}); return true;
    case at::kFloat8_e5m2: fn(health::Float8E5M2Format{}); return true;
    default: return false;
  }
}

// The kernel of tensor_health for one backend, whose
// Backend::template run<Format>(x, input) returns the three outputs; each
// backend registers this with its own Backend.
template <typename Backend>
HealthResult tensor_health(const at::Tensor& x) {
  HealthResult result;
  const bool known = with_health_format(x.scalar_type(), [&](auto format) {
    result = Backend::template run<decltype(format)>(x, health_input(x));
  });
  if (!known) unsupported_health_dtype(x.scalar_type());
  return result;
}

}  // namespace torchcast
