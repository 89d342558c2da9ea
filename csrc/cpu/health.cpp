// tensor_health on the CPU: one pass over x, parallel over contiguous ranges
// of elements, each thread counting into its own uint32 histogram that is
// added to the int64 outputs when it finishes. Counts, maxima and minima do
// not depend on how the elements are split, so neither do the results.
//
// Per block of kBlock elements: the bins (health.h's bin_of, computed in a
// loop that vectorizes for float32/float64, looked up in a table of every bit
// pattern for the 8- and 16-bit dtypes) and the extreme finite magnitudes,
// then one increment per element.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "../health_common.h"
#include "simd.h"

namespace torchcast {
namespace {

using health::bin_of;
using health::kColumns;

// Elements classified at a time: their bins stay in L1 for the increments.
constexpr int kBlock = 1024;
// Each bin has kCopies interleaved counters, and element j of a block
// increments copy j % kCopies: neighbours that land in the same bin (common:
// half of all fractions are column 1 of the same binade) touch different
// words, so no increment waits for the store of the previous one.
constexpr int kCopies = 8;
// The uint32 counters are added to the outputs before they could wrap.
constexpr int64_t kFlushEvery = int64_t{1} << 31;
// Elements per thread at least: below this one thread does it all.
constexpr int64_t kGrain = int64_t{1} << 16;
constexpr int kSpecials = health::kZero + 1;  // NaN, +inf, -inf, zero: bins kBins + index

template <typename F>
using bits_of = typename F::bits_t;

// Every bit pattern's bin, for the 8- and 16-bit dtypes (128 KiB at most).
template <typename F>
const uint16_t* bin_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(size_t{1} << (8 * sizeof(bits_of<F>)));
    for (size_t i = 0; i < t.size(); ++i) {
      t[i] = static_cast<uint16_t>(bin_of<F>(static_cast<bits_of<F>>(i)));
    }
    return t;
  }();
  return table.data();
}

template <typename F, bool kSubnormals>
TC_CPU_CLONES void compute_bins(const bits_of<F>* __restrict__ x, int n,
                                uint16_t* __restrict__ bins) {
  for (int j = 0; j < n; ++j) bins[j] = static_cast<uint16_t>(bin_of<F, kSubnormals>(x[j]));
}

// The smallest nonzero finite magnitude is tracked minus one, as bits, so
// that a zero (u - 1 wraps) and "none yet" are both the largest value.
constexpr uint64_t kNone = ~uint64_t{0};

// The largest finite magnitude and the smallest nonzero one of n elements,
// as bits (sign cleared), folded into amax and amin_less (the smallest minus
// one; kNone for none). Masks, not selects, so that gcc vectorizes the two
// reductions.
template <typename F>
TC_CPU_CLONES void extreme_bits(const bits_of<F>* __restrict__ x, int n, uint64_t& amax,
                                uint64_t& amin_less) {
  using W = std::conditional_t<sizeof(bits_of<F>) == 8, uint64_t, uint32_t>;
  W hi = static_cast<W>(amax), lo = static_cast<W>(amin_less);
  for (int j = 0; j < n; ++j) {
    const W u = static_cast<W>(x[j]) & F::kAbsMask;
    const W finite = W(0) - static_cast<W>(u < F::kNonFinite);  // all ones when finite
    hi = std::max(hi, u & finite);
    lo = std::min(lo, (u - 1) | ~finite);
  }
  amax = hi;
  amin_less = lo == static_cast<W>(kNone) ? kNone : lo;
}

// What the threads add their counts into.
template <typename F>
struct Totals {
  int64_t* hist;    // kBins
  int64_t* counts;  // CountIndex
  uint64_t amax = 0, amin_less = kNone;  // as extreme_bits
  std::mutex mutex;
};

// n counters for this thread, kept for the thread's life (the largest asked
// for: 940 KiB for float64's histogram, 124 KiB for float32's). Allocated per
// call, they went back to the system at each free and were faulted in again
// at the next call: 40 us of a module output's 50 under track(health=True).
// One LocalHealth at a time uses them in a thread (a task ends before the
// thread takes another).
uint32_t* thread_counters(size_t n) {
  thread_local std::unique_ptr<uint32_t[]> counters;
  thread_local size_t size = 0;
  if (size < n) {
    counters.reset(new uint32_t[n]);
    size = n;
  }
  return counters.get();
}

// One thread's counts. Only the bins of the binades seen so far, [lo, hi),
// and the special bins are kept zeroed: a float64 histogram has 29k bins,
// and a tensor usually touches a few hundred of them.
template <typename F>
class LocalHealth {
 public:
  using B = bits_of<F>;

  LocalHealth() : h_(thread_counters((F::kBins + kSpecials) * kCopies)) {
    std::fill_n(h_ + F::kBins * kCopies, kSpecials * kCopies, 0u);
  }

  // n <= kBlock elements.
  void add(const B* x, int n, Totals<F>& totals) {
    uint64_t block_max = 0, block_min_less = kNone;
    extreme_bits<F>(x, n, block_max, block_min_less);
    if (block_min_less != kNone) {
      // Rows grow with the magnitude: the block's bins lie between these.
      cover(bin_of<F>(static_cast<B>(block_min_less + 1)) / kColumns * kColumns,
            (bin_of<F>(static_cast<B>(block_max)) / kColumns + 1) * kColumns);
      amax_ = std::max(amax_, block_max);
      amin_less_ = std::min(amin_less_, block_min_less);
    }
    if constexpr (sizeof(B) <= 2) {
      const uint16_t* table = bin_table<F>();
      count(x, n, [table](B v) { return table[v]; });
    } else {
      // Most blocks hold no subnormal (their smallest magnitude says so),
      // and their bins cost a quarter less without the normalization.
      uint16_t bins[kBlock];
      if (block_min_less + 1 < (uint64_t{1} << F::kFrac)) {
        compute_bins<F, true>(x, n, bins);
      } else {
        compute_bins<F, false>(x, n, bins);
      }
      count(bins, n, [](uint16_t b) { return b; });
    }
    since_flush_ += n;
    if (since_flush_ >= kFlushEvery) flush(totals);
  }

  void flush(Totals<F>& totals) {
    uint32_t* h = h_;
    {
      const std::lock_guard<std::mutex> lock(totals.mutex);
      for (int b = lo_; b < hi_; ++b) totals.hist[b] += sum_copies(h + b * kCopies);
      for (int s = 0; s < kSpecials; ++s) {
        totals.counts[s] += sum_copies(h + (F::kBins + s) * kCopies);
      }
      totals.amax = std::max(totals.amax, amax_);
      totals.amin_less = std::min(totals.amin_less, amin_less_);
    }
    std::fill(h + lo_ * kCopies, h + hi_ * kCopies, 0u);
    std::fill_n(h + F::kBins * kCopies, kSpecials * kCopies, 0u);
    since_flush_ = 0;
  }

 private:
  static int64_t sum_copies(const uint32_t* c) {
    int64_t s = 0;
    for (int k = 0; k < kCopies; ++k) s += c[k];
    return s;
  }

  // Extends the zeroed bins to [lo, hi).
  void cover(int lo, int hi) {
    uint32_t* h = h_;
    if (lo_ == hi_) {
      std::fill(h + lo * kCopies, h + hi * kCopies, 0u);
      lo_ = lo;
      hi_ = hi;
      return;
    }
    if (lo < lo_) {
      std::fill(h + lo * kCopies, h + lo_ * kCopies, 0u);
      lo_ = lo;
    }
    if (hi > hi_) {
      std::fill(h + hi_ * kCopies, h + hi * kCopies, 0u);
      hi_ = hi;
    }
  }

  // One increment per element: bin_at(v[j]) is element j's bin.
  template <typename V, typename BinAt>
  void count(const V* __restrict__ v, int n, BinAt bin_at) {
    uint32_t* __restrict__ h = h_;
    int j = 0;
    for (; j + kCopies <= n; j += kCopies) {
      for (int k = 0; k < kCopies; ++k) ++h[bin_at(v[j + k]) * kCopies + k];
    }
    for (; j < n; ++j) ++h[bin_at(v[j]) * kCopies + j % kCopies];
  }

  uint32_t* h_;  // bin b, copy k at b * kCopies + k (thread_counters)
  int lo_ = 0, hi_ = 0;
  uint64_t amax_ = 0, amin_less_ = kNone;
  int64_t since_flush_ = 0;
};

// The elements of a non-flat x from position `pos` on, in row-major order of
// its axes.
template <typename B>
class StridedReader {
 public:
  StridedReader(const B* x, const Axes& axes, int64_t pos) : x_(x), axes_(axes) {
    index_.resize(axes.size());
    for (int d = static_cast<int>(axes.size()) - 1; d >= 0; --d) {
      index_[d] = pos % axes[d].size;
      pos /= axes[d].size;
      offset_ += index_[d] * axes[d].xstride;
    }
  }

  // The next n elements into out.
  void read(B* out, int n) {
    const int last = static_cast<int>(axes_.size()) - 1;
    const Axis& inner = axes_[last];
    for (int done = 0; done < n;) {
      const int k = static_cast<int>(std::min<int64_t>(inner.size - index_[last], n - done));
      for (int i = 0; i < k; ++i) out[done + i] = x_[offset_ + i * inner.xstride];
      done += k;
      index_[last] += k;
      offset_ += k * inner.xstride;
      for (int d = last; d > 0 && index_[d] == axes_[d].size; --d) {
        offset_ += axes_[d - 1].xstride - index_[d] * axes_[d].xstride;
        index_[d] = 0;
        ++index_[d - 1];
      }
    }
  }

 private:
  const B* x_;
  const Axes& axes_;
  c10::SmallVector<int64_t, 8> index_;
  int64_t offset_ = 0;
};

struct CpuHealth {
  template <typename F>
  static HealthResult run(const at::Tensor& x, const HealthInput& in) {
    using B = bits_of<F>;
    at::Tensor counts, hist, extrema;
    std::tie(counts, hist, extrema) = health_outputs(x, F::kRows);
    Totals<F> totals;
    totals.hist = hist.data_ptr<int64_t>();
    totals.counts = counts.data_ptr<int64_t>();
    const B* data = static_cast<const B*>(x.const_data_ptr());
    const auto task = [&](int64_t begin, int64_t end) {
      LocalHealth<F> local;
      if (in.flat) {
        for (int64_t p = begin; p < end; p += kBlock) {
          local.add(data + p, static_cast<int>(std::min<int64_t>(kBlock, end - p)), totals);
        }
      } else {
        StridedReader<B> reader(data, in.axes, begin);
        B buffer[kBlock];
        for (int64_t p = begin; p < end; p += kBlock) {
          const int n = static_cast<int>(std::min<int64_t>(kBlock, end - p));
          reader.read(buffer, n);
          local.add(buffer, n, totals);
        }
      }
      local.flush(totals);
    };
    if (in.numel <= kGrain) {
      if (in.numel > 0) task(0, in.numel);  // no thread pool round trip for small tensors
    } else {
      at::parallel_for(0, in.numel, kGrain, task);
    }
    // The subnormals are the rows below kFrac (health.h).
    int64_t subnormal = 0;
    for (int b = 0; b < F::kFrac * kColumns; ++b) subnormal += totals.hist[b];
    totals.counts[health::kSubnormal] = subnormal;
    double* e = extrema.data_ptr<double>();
    e[health::kAmax] = health::magnitude_of<F>(static_cast<B>(totals.amax));
    if (totals.amin_less != kNone) {
      e[health::kMinNonzero] = health::magnitude_of<F>(static_cast<B>(totals.amin_less + 1));
    }
    return {counts, hist, extrema};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("tensor_health", &tensor_health<CpuHealth>);
}

}  // namespace torchcast
