#include "health_common.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "cast_common.h"

namespace torchcast {

HealthInput health_input(const at::Tensor& x) {
  HealthInput in;
  in.numel = x.numel();
  if (in.numel == 0 || x.is_non_overlapping_and_dense()) return in;
  // Strides are never negative, so element 0 is the lowest address; any
  // order of the dims visits every element once.
  for (int64_t d = 0; d < x.dim(); ++d) in.axes.push_back({x.size(d), x.stride(d), 0});
  std::stable_sort(in.axes.begin(), in.axes.end(),
                   [](const Axis& a, const Axis& b) { return a.xstride > b.xstride; });
  in.axes = coalesce(in.axes);
  in.flat = in.axes.size() == 1 && in.axes[0].xstride == 1;
  return in;
}

HealthResult health_outputs(const at::Tensor& x, int rows) {
  const auto longs = x.options().dtype(at::kLong);
  auto extrema = at::empty({health::kNumExtrema}, x.options().dtype(at::kDouble));
  extrema.fill_(std::numeric_limits<double>::infinity());
  extrema.narrow(0, health::kAmax, 1).zero_();
  return {at::zeros({health::kNumCounts}, longs), at::zeros({rows, health::kColumns}, longs),
          extrema};
}

void unsupported_health_dtype(at::ScalarType dtype) {
  C10_THROW_ERROR(TypeError, c10::str("torchcast.tensor_health: x is ", dtype_name(dtype),
                                      "; supported dtypes: torch.float64, torch.float32, "
                                      "torch.float16, torch.bfloat16, torch.float8_e4m3fn, "
                                      "torch.float8_e5m2"));
}

}  // namespace torchcast
