// tensor_health on CUDA: one grid-stride kernel, nothing synchronizing with
// the host. Each block counts its elements' bins (health.h's bin_of) in a
// uint32 histogram in shared memory and adds it to the int64 output with one
// atomicAdd per nonzero bin when it finishes; its counts and extrema go out
// through warp reductions and one atomic per warp. Lanes of a warp that land
// in the same bin (common: a constant tensor, or column 1 of a busy binade)
// add once, together (__match_any_sync), so no address is hammered by 32
// lanes. Results are counts, maxima and minima: the same whatever the grid.
//
// float64's histogram (2098 x 14) does not fit in shared memory: the block
// keeps the 256 binades of exponents [-128, 127] (float32's range, where
// nearly all data lives) there, and the other bins go straight to the output
// with global atomics, still one per group of lanes.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../health_common.h"
#include "block_reduce.cuh"
#include "launch.cuh"

namespace torchcast {
namespace {

using health::bin_of;
using health::kColumns;

constexpr int kThreads = 256;
// Axes a kernel indexes on the device (torch's own limit for CUDA
// iterators); an x with more (after coalescing) is copied contiguous first.
constexpr int kMaxDeviceAxes = 25;
// The binades a block keeps in shared memory: all of them, or for float64
// the rows of exponents [-128, 127].
constexpr int kMaxWindowRows = 277;  // float32's, the most of the other dtypes

template <typename F>
struct Window {
  static constexpr bool kAll = F::kRows <= kMaxWindowRows;
  static constexpr int kFirstRow = kAll ? 0 : -128 - F::kExpSub;
  static constexpr int kRows = kAll ? F::kRows : 256;
  static constexpr int kBins = kRows * kColumns;
};

// A non-flat x's axes (HealthInput), outermost first.
struct DeviceAxes {
  int nd;
  int64_t size[kMaxDeviceAxes], stride[kMaxDeviceAxes];

  // Element offset of row-major position pos.
  __device__ __forceinline__ int64_t offset(int64_t pos) const {
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      off += (pos % size[d]) * stride[d];
      pos /= size[d];
    }
    return off;
  }
};

// How a kernel reads x: one 16-byte aligned flat run (16-byte loads for
// whole tiles), a flat run, or through DeviceAxes.
enum class Reading { kVector, kFlat, kStrided };

template <typename F>
using wide_of = std::conditional_t<sizeof(typename F::bits_t) == 8, uint64_t, uint32_t>;

struct Add {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct Min {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};

// Folds v over the warp with op; the result is in lane 0.
template <typename T, typename Op>
__device__ __forceinline__ T warp_fold(T v, Op op) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ void add_to(int64_t* out, unsigned long long v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(out), v);
}

// Every thread of a block runs the same number of tiles of kTile elements
// (the loop bound is the block's), so whole warps call __match_any_sync.
template <typename F, Reading kReading>
__global__ void __launch_bounds__(kThreads)
    health_kernel(const typename F::bits_t* __restrict__ x, int64_t n, DeviceAxes axes,
                  int64_t* __restrict__ counts, int64_t* __restrict__ hist,
                  unsigned long long* __restrict__ extrema) {
  using B = typename F::bits_t;
  using W = wide_of<F>;
  using Win = Window<F>;
  constexpr int kVec = 16 / static_cast<int>(sizeof(B));
  constexpr int64_t kTile = int64_t{kThreads} * kVec;
  __shared__ uint32_t window[Win::kBins];
  for (int i = threadIdx.x; i < Win::kBins; i += kThreads) window[i] = 0;
  __syncthreads();

  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  uint32_t nan = 0, posinf = 0, neginf = 0, zero = 0, subnormal = 0;
  // The extremes as bits: the largest finite magnitude, and the smallest
  // nonzero one minus one (a zero wraps to all ones, which also means none).
  W amax = 0, amin_less = ~W(0);

  for (int64_t base = blockIdx.x * kTile; base < n; base += static_cast<int64_t>(gridDim.x) * kTile) {
    B bits[kVec];
    bool valid[kVec];
    if (kReading == Reading::kVector && base + kTile <= n) {
      const auto in = *reinterpret_cast<const Packet<B, kVec>*>(x + base + threadIdx.x * kVec);
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        bits[v] = in.v[v];
        valid[v] = true;
      }
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const int64_t i = base + v * kThreads + threadIdx.x;  // neighbours read neighbours
        valid[v] = i < n;
        const int64_t at = kReading == Reading::kStrided ? axes.offset(valid[v] ? i : 0) : i;
        bits[v] = valid[v] ? x[at] : B(0);
      }
    }
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int bin = bin_of<F>(bits[v]);
      const bool ok = valid[v];
      nan += ok && bin == F::kBins + health::kNan;
      posinf += ok && bin == F::kBins + health::kPosInf;
      neginf += ok && bin == F::kBins + health::kNegInf;
      zero += ok && bin == F::kBins + health::kZero;
      const bool finite = ok && bin < F::kBins;  // and nonzero
      subnormal += finite && bin < F::kFrac * kColumns;
      const W u = static_cast<W>(bits[v]) & F::kAbsMask;
      amax = finite && u > amax ? u : amax;
      amin_less = finite && u - 1 < amin_less ? u - 1 : amin_less;
      // Lanes with the same bin add once; those without one form a group
      // that adds nothing.
      const unsigned peers = __match_any_sync(0xffffffffu, finite ? bin : -1);
      if (finite && lane == __ffs(peers) - 1) {
        const int w = bin - Win::kFirstRow * kColumns;
        if (Win::kAll || (w >= 0 && w < Win::kBins)) {
          atomicAdd(&window[w], static_cast<uint32_t>(__popc(peers)));
        } else {
          add_to(hist + bin, static_cast<unsigned long long>(__popc(peers)));
        }
      }
    }
  }

  const uint32_t sums[health::kNumCounts] = {warp_fold(nan, Add()), warp_fold(posinf, Add()),
                                             warp_fold(neginf, Add()), warp_fold(zero, Add()),
                                             warp_fold(subnormal, Add())};
  amax = warp_fold(amax, Max());
  amin_less = warp_fold(amin_less, Min());
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < health::kNumCounts; ++i) {
      if (sums[i] != 0) add_to(counts + i, sums[i]);
    }
    // Non-negative doubles order like their bits.
    if (amax != 0) {
      atomicMax(extrema + health::kAmax, static_cast<unsigned long long>(__double_as_longlong(
                                             health::magnitude_of<F>(static_cast<B>(amax)))));
    }
    if (amin_less != ~W(0)) {
      atomicMin(extrema + health::kMinNonzero,
                static_cast<unsigned long long>(__double_as_longlong(
                    health::magnitude_of<F>(static_cast<B>(amin_less + 1)))));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < Win::kBins; i += kThreads) {
    if (window[i] != 0) add_to(hist + Win::kFirstRow * kColumns + i, window[i]);
  }
}

struct CudaHealth {
  template <typename F>
  static HealthResult run(const at::Tensor& x_in, const HealthInput& layout_in) {
    using B = typename F::bits_t;
    const Launcher launch(x_in.device());
    HealthResult outputs = health_outputs(x_in, F::kRows);
    if (layout_in.numel == 0) return outputs;
    at::Tensor x = x_in;
    HealthInput layout = layout_in;
    if (!layout.flat && layout.axes.size() > static_cast<size_t>(kMaxDeviceAxes)) {
      x = x_in.contiguous();
      layout = health_input(x);
    }
    DeviceAxes axes{};
    if (!layout.flat) {
      axes.nd = static_cast<int>(layout.axes.size());
      for (int d = 0; d < axes.nd; ++d) {
        axes.size[d] = layout.axes[d].size;
        axes.stride[d] = layout.axes[d].xstride;
      }
    }
    const auto* xp = static_cast<const B*>(x.const_data_ptr());
    const int64_t n = layout.numel;
    constexpr int64_t kTile = int64_t{kThreads} * (16 / static_cast<int64_t>(sizeof(B)));
    // A few blocks per SM (the loop is grid-stride), and enough that no
    // block counts 2^30 elements into its uint32 shared histogram.
    const int64_t sms = launch.multiprocessors();
    const int64_t tiles = (n + kTile - 1) / kTile;
    const int64_t blocks = std::max(std::min(tiles, sms * 8), (n >> 30) + 1);
    const dim3 grid(static_cast<unsigned>(blocks));
    auto* counts = std::get<0>(outputs).data_ptr<int64_t>();
    auto* hist = std::get<1>(outputs).data_ptr<int64_t>();
    auto* extrema = reinterpret_cast<unsigned long long*>(std::get<2>(outputs).data_ptr<double>());
    if (!layout.flat) {
      launch(health_kernel<F, Reading::kStrided>, grid, kThreads, xp, n, axes, counts, hist,
             extrema);
    } else if (reinterpret_cast<uintptr_t>(xp) % 16 == 0) {
      launch(health_kernel<F, Reading::kVector>, grid, kThreads, xp, n, axes, counts, hist,
             extrema);
    } else {
      launch(health_kernel<F, Reading::kFlat>, grid, kThreads, xp, n, axes, counts, hist,
             extrema);
    }
    return outputs;
  }
};

}  // namespace

TORCHCAST_CUDA_KERNELS(m) {
  m.impl("tensor_health", &tensor_health<CudaHealth>);
}

}  // namespace torchcast
