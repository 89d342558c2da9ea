// all_finite (all_finite.h): an element is non-finite when its exponent bits
// are all ones (float8_e4m3fn has no inf: its only non-finite pattern is
// S.1111.111). The loop ORs a per-element test into an integer, with no early exit inside a
// block, so that it vectorizes; blocks run in parallel and stop early once
// one found a non-finite value.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "../all_finite.h"

namespace torchcast {
namespace {

constexpr int64_t kBlock = 1 << 14;

template <typename Bits>
bool bits_all_finite(const void* data, int64_t n, Bits mask, Bits nonfinite) {
  const Bits* p = static_cast<const Bits*>(data);
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && !bad.load(std::memory_order_relaxed); b += kBlock) {
      const int64_t stop = std::min(end, b + kBlock);
      Bits any = 0;  // as wide as the elements: a bool accumulator does not vectorize
      for (int64_t i = b; i < stop; ++i) any |= Bits((p[i] & mask) == nonfinite);
      if (any) bad.store(true, std::memory_order_relaxed);
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
