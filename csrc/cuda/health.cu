// tensor_health on CUDA: a grid-stride pass over x (made contiguous), each
// block counting into a shared-memory histogram (global atomics where the
// dtype's histogram is too large: float64's 2098 x 14 cells), then adding
// its counts to the outputs with integer atomics; the extrema travel as the
// bits of non-negative doubles, which order as the values do, through
// atomicMax / atomicMin. Integer results: the same on every run and as the
// CPU kernel's. Layout and classification: health.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../health_dispatch.h"

namespace torchcast {
namespace {

constexpr int kThreads = 256;
// Cells a block keeps in shared memory (uint32 each): every dtype but float64.
constexpr int kSharedCells = 277 * kHealthColumns;

template <typename Scalar>
__device__ __forceinline__ double magnitude_of(Scalar v) {
  const double d = static_cast<double>(v);
  return d < 0 ? -d : d;
}

template <typename F, typename Scalar, bool kShared>
__global__ void health_kernel(const typename F::storage* __restrict__ x, int64_t n,
                              unsigned long long* __restrict__ counts,
                              unsigned long long* __restrict__ hist,
                              unsigned long long* __restrict__ extrema_bits) {
  using Bits = typename F::storage;
  constexpr int kCells = F::kRows * kHealthColumns;
  __shared__ uint32_t shared_hist[kShared ? kCells : 1];
  __shared__ unsigned long long block_counts[kHealthCounts];
  __shared__ unsigned long long block_max, block_min;
  if (kShared) {
    for (int i = threadIdx.x; i < kCells; i += blockDim.x) shared_hist[i] = 0;
  }
  if (threadIdx.x < kHealthCounts) block_counts[threadIdx.x] = 0;
  if (threadIdx.x == 0) {
    block_max = 0;
    block_min = ~0ull;
  }
  __syncthreads();
  unsigned long long local_counts[kHealthCounts] = {0, 0, 0, 0, 0};
  Bits local_max = 0, local_min = F::kMagnitude;  // kMagnitude: a NaN pattern, above all finite
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const Bits bits = x[i];
    const HealthElement el = classify_health<F>(bits);
    if (el.kind != kHealthFiniteNonzero) {
      ++local_counts[el.kind];
      continue;
    }
    local_counts[kSubnormalCount] += el.subnormal;
    if (kShared) {
      atomicAdd(&shared_hist[el.cell], 1u);
    } else {
      atomicAdd(&hist[el.cell], 1ull);
    }
    const Bits u = bits & F::kMagnitude;
    local_max = u > local_max ? u : local_max;
    local_min = u < local_min ? u : local_min;
  }
  for (int k = 0; k < kHealthCounts; ++k) {
    if (local_counts[k]) atomicAdd(&block_counts[k], local_counts[k]);
  }
  // Bits to doubles here, so the global extrema compare doubles' bits.
  const double vmax = magnitude_of(bit_cast<Scalar>(local_max));
  atomicMax(&block_max, bit_cast<unsigned long long>(vmax));
  if (local_min != F::kMagnitude) {
    atomicMin(&block_min, bit_cast<unsigned long long>(magnitude_of(bit_cast<Scalar>(local_min))));
  }
  __syncthreads();
  if (kShared) {
    for (int i = threadIdx.x; i < kCells; i += blockDim.x) {
      if (shared_hist[i]) atomicAdd(&hist[i], static_cast<unsigned long long>(shared_hist[i]));
    }
  }
  if (threadIdx.x < kHealthCounts && block_counts[threadIdx.x]) {
    atomicAdd(&counts[threadIdx.x], block_counts[threadIdx.x]);
  }
  if (threadIdx.x == 0) {
    atomicMax(&extrema_bits[0], block_max);
    atomicMin(&extrema_bits[1], block_min);
  }
}

template <typename F, typename Scalar>
std::tuple<at::Tensor, at::Tensor, at::Tensor> health_of(const at::Tensor& x) {
  static_assert(sizeof(typename F::storage) == sizeof(Scalar), "the format's bits are the scalar's");
  constexpr bool kShared = F::kRows * kHealthColumns <= kSharedCells;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const auto longs = x.options().dtype(at::kLong);
  at::Tensor counts = at::zeros({kHealthCounts}, longs);
  at::Tensor hist = at::zeros({F::kRows, kHealthColumns}, longs);
  // [amax, min nonzero] start at 0 and +inf (filled on the device: no host copy).
  at::Tensor extrema = at::empty({2}, x.options().dtype(at::kDouble));
  extrema.select(0, 0).fill_(0.0);
  extrema.select(0, 1).fill_(std::numeric_limits<double>::infinity());
  const int64_t n = xc.numel();
  if (n > 0) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t wanted = (n + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(std::min<int64_t>(wanted, int64_t{sms} * 8));
    health_kernel<F, Scalar, kShared><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const typename F::storage*>(xc.const_data_ptr()), n,
        reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()),
        reinterpret_cast<unsigned long long*>(hist.data_ptr<int64_t>()),
        reinterpret_cast<unsigned long long*>(extrema.data_ptr<double>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {counts, hist, extrema};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tensor_health_cuda(const at::Tensor& x) {
  return visit_health_dtype(x, [&]<typename F, typename Scalar>() { return health_of<F, Scalar>(x); });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchcast, CUDA, m) {
  m.impl("tensor_health", &tensor_health_cuda);
}

}  // namespace torchcast
