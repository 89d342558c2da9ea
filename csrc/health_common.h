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

// The kernel of tensor_health for one backend, whose
// Backend::template run<Format>(x, input) returns the three outputs; each
// backend registers this with its own Backend.
template <typename Backend>
HealthResult tensor_health(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kDouble: return Backend::template run<health::Float64Format>(x, health_input(x));
    case at::kFloat: return Backend::template run<health::Float32Format>(x, health_input(x));
    case at::kHalf: return Backend::template run<health::Float16Format>(x, health_input(x));
    case at::kBFloat16: return Backend::template run<health::BFloat16Format>(x, health_input(x));
    case at::kFloat8_e4m3fn:
      return Backend::template run<health::Float8E4M3FnFormat>(x, health_input(x));
    case at::kFloat8_e5m2:
      return Backend::template run<health::Float8E5M2Format>(x, health_input(x));
    default: unsupported_health_dtype(x.scalar_type());
  }
}

}  // namespace torchcast
