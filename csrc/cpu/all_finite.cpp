// all_finite and count_nonfinite (all_finite.h): an element is non-finite
// when its exponent bits are all ones (float8_e4m3fn has no inf: its only
// non-finite pattern is S.1111.111). Finite magnitudes order as their bits do,
// so NaN is a magnitude above infinity's bits and amax a maximum of integers:
// every test is an integer compare that gcc vectorizes.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../all_finite.h"
#include "../health.h"
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

// Counts within a block, as wide as the elements (mixed widths do not
// vectorize), so a block holds at most the counter's maximum.
template <typename Bits>
struct BlockCounts {
  Bits nan = 0, inf = 0, amax = 0;
};

// F: the dtype's health::Format (health.h), whose kNonFinite is the smallest
// magnitude that is not finite: infinity's, or float8_e4m3fn's NaN.
template <typename F>
TC_CPU_CLONES BlockCounts<typename F::bits_t> count_block(const typename F::bits_t* __restrict__ p,
                                                          int64_t n) {
  using Bits = typename F::bits_t;
  Bits nan = 0, inf = 0, amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Bits a = p[i] & F::kAbsMask;
    nan += Bits(F::kHasInf ? a > F::kNonFinite : a == F::kNonFinite);
    if constexpr (F::kHasInf) inf += Bits(a == F::kNonFinite);
    // A mask, not a select: gcc 12 does not vectorize a conditional maximum.
    amax = std::max<Bits>(amax, Bits(a & Bits(-Bits(a < F::kNonFinite))));
  }
  return {nan, inf, amax};
}

template <typename F>
NonfiniteCounts format_nonfinite_counts(const at::Tensor& x) {
  using Bits = typename F::bits_t;
  const Bits* p = static_cast<const Bits*>(x.const_data_ptr());
  constexpr int64_t kCountMax =
      std::numeric_limits<Bits>::max() < uint64_t{kBlock} ? std::numeric_limits<Bits>::max()
                                                          : kBlock;
  struct Partial {
    int64_t nan = 0, inf = 0;
    Bits amax = 0;
  };
  const auto combine = [](Partial a, Partial b) {
    return Partial{a.nan + b.nan, a.inf + b.inf, std::max(a.amax, b.amax)};
  };
  const Partial total = at::parallel_reduce(
      0, x.numel(), kGrain, Partial{},
      [&](int64_t begin, int64_t end, Partial acc) {
        for (int64_t b = begin; b < end; b += kCountMax) {
          const auto c = count_block<F>(p + b, std::min(end, b + kCountMax) - b);
          acc = combine(acc, Partial{int64_t(c.nan), int64_t(c.inf), c.amax});
        }
        return acc;
      },
      combine);
  return {total.nan, total.inf, health::magnitude_of<F>(total.amax)};
}

}  // namespace

NonfiniteCounts count_nonfinite(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_non_overlapping_and_dense(),
              "torchcast count_nonfinite: expected a dense CPU tensor");
  switch (x.scalar_type()) {
    case at::kDouble: return format_nonfinite_counts<health::Float64Format>(x);
    case at::kFloat: return format_nonfinite_counts<health::Float32Format>(x);
    case at::kHalf: return format_nonfinite_counts<health::Float16Format>(x);
    case at::kBFloat16: return format_nonfinite_counts<health::BFloat16Format>(x);
    case at::kFloat8_e4m3fn: return format_nonfinite_counts<health::Float8E4M3FnFormat>(x);
    case at::kFloat8_e5m2: return format_nonfinite_counts<health::Float8E5M2Format>(x);
    default:
      TORCH_CHECK_TYPE(false, "torchcast count_nonfinite: expected a floating dtype, got ",
                       x.scalar_type());
  }
}

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
