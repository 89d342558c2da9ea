// Kernels with the bugs the emulated grid exists to catch, as ops of
// torchcast_emulated, so that tests/test_cuda_emulated.py can check that it
// does: a shared counter added to without atomics loses counts, a block sum
// read without the barrier before it is wrong (and varies with the seed), a
// barrier in divergent code and a shuffle whose mask leaves its caller out
// are reported.
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "grid.h"

namespace torchcast {
namespace emulated {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__global__ void count_kernel(int64_t n, bool atomic, unsigned* out) {
  __shared__ unsigned counter;
  if (threadIdx.x == 0) counter = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (atomic) {
      atomicAdd(&counter, 1u);
    } else {
      counter += 1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *out = counter;
}

// The sum of x[0 .. blockDim.x): shuffles within each warp, then thread 0
// adds the warps' sums from shared memory, after a barrier or not.
__global__ void block_sum_kernel(const unsigned* x, bool barrier, unsigned* out) {
  __shared__ unsigned warp_sums[32];
  unsigned v = x[threadIdx.x];
  for (unsigned offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(kFull, v, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  if (barrier) __syncthreads();
  if (threadIdx.x == 0) {
    unsigned sum = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) sum += warp_sums[w];
    *out = sum;
  }
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x == 0) __syncthreads();
}

__global__ void outside_mask_kernel(unsigned* out) {
  out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, threadIdx.x, 1);
}

int64_t count(int64_t threads, int64_t n, bool atomic) {
  unsigned out = 0;
  launch(count_kernel, 1, static_cast<unsigned>(threads), n, atomic, &out);
  return out;
}

// The sum of salt, salt + 1, ...: a new salt per call, so that what an
// earlier call left in shared memory is not this call's sums.
int64_t block_sum(int64_t threads, int64_t salt, bool barrier) {
  std::vector<unsigned> x(static_cast<size_t>(threads));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<unsigned>(salt) + static_cast<unsigned>(i);
  }
  unsigned out = 0;
  launch(block_sum_kernel, 1, static_cast<unsigned>(threads), x.data(), barrier, &out);
  return out;
}

void divergent_barrier() { launch(divergent_barrier_kernel, 1, 64); }

void outside_mask() {
  std::vector<unsigned> out(32);
  launch(outside_mask_kernel, 1, 32, out.data());
}

}  // namespace
}  // namespace emulated
}  // namespace torchcast

TORCH_LIBRARY_FRAGMENT(torchcast_emulated, m) {
  namespace e = torchcast::emulated;
  m.def("selftest_count(int threads, int n, bool atomic) -> int", &e::count);
  m.def("selftest_block_sum(int threads, int salt, bool barrier) -> int", &e::block_sum);
  m.def("selftest_divergent_barrier() -> ()", &e::divergent_barrier);
  m.def("selftest_outside_mask() -> ()", &e::outside_mask);
}
