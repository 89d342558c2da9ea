// tensor_health on the CPU: one pass over x, each thread counting into its
// own histogram, merged at the end (integer counts and extrema: the result
// does not depend on the thread count). Layout and classification: health.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "../health_dispatch.h"

namespace torchcast {
namespace {

constexpr int64_t kGrain = 1 << 15;
constexpr int64_t kFlush = int64_t{1} << 30;  // elements per flush of the uint32 histograms

const uint8_t* column_table() {
  static const auto table = [] {
    std::array<uint8_t, 1 << kFractionIndexBits> t{};
    for (uint32_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint8_t>(column_of_index(i));
    return t;
  }();
  return table.data();
}

template <typename F, typename Scalar>
std::tuple<at::Tensor, at::Tensor, at::Tensor> health_of(const at::Tensor& x) {
  using Bits = typename F::storage;
  static_assert(sizeof(Bits) == sizeof(Scalar), "the format's bits are the scalar's");
  const at::Tensor xc = x.contiguous();
  const Bits* p = static_cast<const Bits*>(xc.const_data_ptr());
  const auto longs = x.options().dtype(at::kLong);
  at::Tensor counts = at::zeros({kHealthCounts}, longs);
  at::Tensor hist = at::zeros({F::kRows, kHealthColumns}, longs);
  int64_t* total_counts = counts.data_ptr<int64_t>();
  int64_t* total_hist = hist.data_ptr<int64_t>();
  Bits max_u = 0, min_u = F::kMagnitude;  // kMagnitude: a NaN pattern, above every finite
  std::mutex merge;
  at::parallel_for(0, xc.numel(), kGrain, [&](int64_t begin, int64_t end) {
    // uint32 counts, flushed before they could wrap; the column from a table
    // (computing it takes several times the rest of the loop).
    constexpr int kCells = F::kRows * kHealthColumns;
    const uint8_t* columns = column_table();
    std::vector<uint32_t> sub(kCells, 0);
    std::vector<int64_t> local(kCells, 0);
    int64_t local_counts[kHealthCounts] = {0, 0, 0, 0, 0};
    Bits local_max = 0, local_min = F::kMagnitude;
    for (int64_t block = begin; block < end; block += kFlush) {
      const int64_t stop = std::min(end, block + kFlush);
      for (int64_t i = block; i < stop; ++i) {
        const Bits bits = p[i];
        const Bits u = bits & F::kMagnitude;
        if (C10_LIKELY(is_normal<F>(u))) {
          ++sub[normal_row<F>(u) * kHealthColumns + columns[fraction_index<F>(u)]];
        } else {
          const HealthElement el = classify_health<F>(bits);
          if (el.kind != kHealthFiniteNonzero) {
            ++local_counts[el.kind];
            continue;
          }
          ++local_counts[kSubnormalCount];
          ++sub[el.cell];
        }
        local_max = u > local_max ? u : local_max;
        local_min = u < local_min ? u : local_min;
      }
      for (int k = 0; k < kCells; ++k) {
        local[k] += sub[k];
        sub[k] = 0;
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int k = 0; k < kHealthCounts; ++k) total_counts[k] += local_counts[k];
    for (int k = 0; k < kCells; ++k) total_hist[k] += local[k];
    max_u = local_max > max_u ? local_max : max_u;
    min_u = local_min < min_u ? local_min : min_u;
  });
  at::Tensor extrema = at::empty({2}, x.options().dtype(at::kDouble));
  double* e = extrema.data_ptr<double>();
  e[0] = static_cast<double>(c10::bit_cast<Scalar>(max_u));
  e[1] = min_u == F::kMagnitude ? std::numeric_limits<double>::infinity()
                                : static_cast<double>(c10::bit_cast<Scalar>(min_u));
  return {counts, hist, extrema};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tensor_health_cpu(const at::Tensor& x) {
  return visit_health_dtype(x, [&]<typename F, typename Scalar>() { return health_of<F, Scalar>(x); });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("tensor_health", &tensor_health_cpu);
}

}  // namespace torchcast
