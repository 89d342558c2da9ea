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
#include "../health_common.h"
#include "simd.h"

namespace torchcast {
namespace {

constexpr int64_t kBlock = 1 << 14;  // elements between looks at the other threads' answer
// Elements per thread: waking a second thread costs more than it saves below.
constexpr int64_t kGrain = 1 << 17;

// Whether any of p[0, n) is non-finite: its exponent bits (float8_e4m3fn:
// all its bits but the sign) all ones, which is F::kNonFinite in both
// senses. An accumulator as wide as the elements (a bool one does not
// vectorize); compiled for AVX-512, AVX2 and the baseline, the widest the CPU
// has chosen at load time.
template <typename F>
TC_CPU_CLONES bool any_nonfinite(const typename F::bits_t* __restrict__ p, int64_t n) {
  using Bits = typename F::bits_t;
  Bits any = 0;
  for (int64_t i = 0; i < n; ++i) any |= Bits((p[i] & F::kNonFinite) == F::kNonFinite);
  return any != 0;
}

// F: a health::Format (health.h).
template <typename F>
bool format_all_finite(const void* data, int64_t n) {
  const auto* p = static_cast<const typename F::bits_t*>(data);
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && !bad.load(std::memory_order_relaxed); b += kBlock) {
      if (any_nonfinite<F>(p + b, std::min(end, b + kBlock) - b)) {
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
  NonfiniteCounts counts;
  const bool known = with_health_format(x.scalar_type(), [&](auto format) {
    counts = format_nonfinite_counts<decltype(format)>(x);
  });
  TORCH_CHECK_TYPE(known, "torchcast count_nonfinite: expected a floating dtype, got ",
                   x.scalar_type());
  return counts;
}

bool all_finite(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "torchcast all_finite: expected a CPU tensor, got ",
              x.device());
  const auto dtype = x.scalar_type();
  if (!at::isFloatingType(dtype) && !at::isComplexType(dtype)) return true;
  // at::isfinite has no kernel for the float8 dtypes torchcast does not read
  // by their bits (e4m3fnuz, e5m2fnuz, e8m0fnu): they widen to float64 exactly.
  const auto isfinite_all = [&x] {
    const bool direct = x.is_complex() || with_health_format(x.scalar_type(), [](auto) {});
    return at::isfinite(direct ? x : x.to(at::kDouble)).all().item<bool>();
  };
  // A dense tensor in any order of its dims (a transposed or channels-last
  // result) is numel elements from its data pointer on, in some order.
  if (!x.is_non_overlapping_and_dense() || x.is_conj() || x.is_neg()) return isfinite_all();
  // A complex tensor is twice as many elements of its real dtype.
  const void* p = x.const_data_ptr();
  const int64_t n = x.is_complex() ? 2 * x.numel() : x.numel();
  bool finite = true;
  const bool known = with_health_format(c10::toRealValueType(dtype), [&](auto format) {
    finite = format_all_finite<decltype(format)>(p, n);
  });
  return known ? finite : isfinite_all();
}

bool all_finite_amax(const at::Tensor& x, double& amax) {
  amax = 0;
  if (x.numel() == 0) return true;
  if (x.is_non_overlapping_and_dense()) {  // one read of the bits
    NonfiniteCounts c;
    const bool known = with_health_format(x.scalar_type(), [&](auto format) {
      c = format_nonfinite_counts<decltype(format)>(x);
    });
    if (known) {
      amax = c.amax;
      return c.nan == 0 && c.inf == 0;
    }
  }
  if (!all_finite(x)) return false;
  const auto real = x.is_complex() ? at::view_as_real(x) : x;
  const auto wide = real.is_floating_point() && real.element_size() == 1 ? real.to(at::kFloat) : real;
  amax = at::abs(wide).max().item<double>();
  return true;
}

}  // namespace torchcast
