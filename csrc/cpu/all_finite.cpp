// all_finite (all_finite.h): an element is non-finite when its exponent bits
// are all ones (float8_e4m3fn has no inf: its only non-finite pattern is
// S.1111.111). Blocks run in parallel and stop early once one found a
// non-finite value.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "../all_finite.h"
#include "simd.h"

namespace torchcast {
namespace {

constexpr int64_t kBlock = 1 << 14;  // elements between looks at the other threads' answer
// Elements per thread: waking a second thread costs more than it saves below.
constexpr int64_t kGrain = 1 << 17;

// Whether any of p[0, n) is non-finite. An accumulator as wide as the
// elements (a bool one does not vectorize); compiled for AVX-512, AVX2 and the
// baseline, the widest the CPU has chosen at load time.
template <typename Bits>
TC_CPU_CLONES bool any_nonfinite(const Bits* __restrict__ p, int64_t n, Bits mask,
                                 Bits nonfinite) {
  Bits any = 0;
  for (int64_t i = 0; i < n; ++i) any |= Bits((p[i] & mask) == nonfinite);
  return any != 0;
}

template <typename Bits>
bool bits_all_finite(const void* data, int64_t n, Bits mask, Bits nonfinite) {
  const Bits* p = static_cast<const Bits*>(data);
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && !bad.load(std::memory_order_relaxed); b += kBlock) {
      if (any_nonfinite(p + b, std::min(end, b + kBlock) - b, mask, nonfinite)) {
        bad.store(true, std::memory_order_relaxed);
      }
    }
  });
  return !bad.load();
}

}  // namespace

bool all_finite(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "torchcast all_finite: expected a CPU tensor, got ",
              x.device());
  const auto dtype = x.scalar_type();
  if (!at::isFloatingType(dtype) && !at::isComplexType(dtype)) return true;
  if (!x.is_contiguous() || x.is_conj() || x.is_neg()) {
    return at::isfinite(x).all().item<bool>();
  }
  const void* p = x.const_data_ptr();
  const int64_t n = x.numel();
  switch (dtype) {
    case at::kDouble:
      return bits_all_finite<uint64_t>(p, n, 0x7ff0000000000000ull, 0x7ff0000000000000ull);
    case at::kComplexDouble:
      return bits_all_finite<uint64_t>(p, 2 * n, 0x7ff0000000000000ull, 0x7ff0000000000000ull);
    case at::kFloat:
      return bits_all_finite<uint32_t>(p, n, 0x7f800000u, 0x7f800000u);
    case at::kComplexFloat:
      return bits_all_finite<uint32_t>(p, 2 * n, 0x7f800000u, 0x7f800000u);
    case at::kHalf:
      return bits_all_finite<uint16_t>(p, n, 0x7c00, 0x7c00);
    case at::kComplexHalf:
      return bits_all_finite<uint16_t>(p, 2 * n, 0x7c00, 0x7c00);
    case at::kBFloat16:
      return bits_all_finite<uint16_t>(p, n, 0x7f80, 0x7f80);
    case at::kFloat8_e5m2:
      return bits_all_finite<uint8_t>(p, n, 0x7c, 0x7c);
    case at::kFloat8_e4m3fn:
      return bits_all_finite<uint8_t>(p, n, 0x7f, 0x7f);
    default:
      return at::isfinite(x).all().item<bool>();
  }
}

}  // namespace torchcast
