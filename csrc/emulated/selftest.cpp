// Kernels with the bugs the emulated grid exists to catch, as ops of
// torchcast_emulated, so that tests/test_cuda_emulated.py can check that it
// does: a shared counter added to without atomics loses counts, and so does
// a global one that blocks add to; a block sum read without the barrier
// before it is wrong (and varies with the seed), and so is one whose shared
// memory the next turn rewrites before the last barrier; a barrier in
// divergent code, a shuffle whose mask leaves its caller out and a
// misaligned vector load are reported. And the warp intrinsics with partial
// masks, which tests/test_cuda_emulated.py checks against their definition.
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

// Thread 0 of each block adds 1 to *out n times, atomically or not: only
// blocks that run at once race.
__global__ void global_count_kernel(int64_t n, bool atomic, unsigned* out) {
  if (threadIdx.x != 0) return;
  for (int64_t i = 0; i < n; ++i) {
    if (atomic) {
      atomicAdd(out, 1u);
    } else {
      *out += 1;
    }
  }
}

// Turns of a grid-stride loop over the same shared memory: each warp writes
// its sum, thread 0 adds them after a barrier; the barrier at the end of the
// turn, before the next turn's writes, or not. out: the sum of all turns.
__global__ void late_barrier_kernel(const unsigned* x, int turns, bool late, unsigned* out) {
  __shared__ unsigned warp_sums[32];
  for (int turn = 0; turn < turns; ++turn) {
    unsigned v = x[turn * blockDim.x + threadIdx.x];
    for (unsigned offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(kFull, v, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (unsigned w = 0; w < blockDim.x / 32; ++w) *out += warp_sums[w];
    }
    if (late) __syncthreads();
  }
}

// The warp intrinsics on a warp of 32 with the lanes of mask taking part
// (the others return at once): out[lane] = [__shfl_sync from lane (lane *
// 7 + 3) % 32 within width, __ballot_sync of odd values, x[lane] after a
// __syncwarp-ordered exchange through shared memory with the next lane of
// the mask].
__global__ void warp_intrinsics_kernel(const unsigned* x, unsigned mask, int width,
                                       unsigned* out) {
  __shared__ unsigned exchange[32];
  const unsigned lane = threadIdx.x;
  if (((mask >> lane) & 1u) == 0) return;
  const unsigned v = x[lane];
  out[3 * lane] = __shfl_sync(mask, v, static_cast<int>((lane * 7 + 3) % 32), width);
  out[3 * lane + 1] = __ballot_sync(mask, v % 2);
  exchange[lane] = v;
  __syncwarp(mask);
  unsigned next = (lane + 1) % 32;
  while (((mask >> next) & 1u) == 0) next = (next + 1) % 32;
  out[3 * lane + 2] = exchange[next];
}

// A 16-byte packet loaded from x + offset bytes (aligned where offset is a
// multiple of 16).
struct alignas(16) Packet16 {
  unsigned v[4];
};
__global__ void vector_load_kernel(const unsigned char* x, int64_t offset, unsigned* out) {
  const Packet16 p = *reinterpret_cast<const Packet16*>(x + offset);
  out[threadIdx.x] = p.v[threadIdx.x % 4];
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

int64_t global_count(int64_t blocks, int64_t n, bool atomic) {
  unsigned out = 0;
  launch(global_count_kernel, static_cast<unsigned>(blocks), 32, n, atomic, &out);
  return out;
}

// The sum of salt, salt + 1, ... over turns * threads values.
int64_t late_barrier(int64_t threads, int64_t turns, int64_t salt, bool late) {
  std::vector<unsigned> x(static_cast<size_t>(threads * turns));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<unsigned>(salt) + static_cast<unsigned>(i);
  }
  unsigned out = 0;
  launch(late_barrier_kernel, 1, static_cast<unsigned>(threads), x.data(),
         static_cast<int>(turns), late, &out);
  return out;
}

std::vector<int64_t> warp_intrinsics(const std::vector<int64_t>& x, int64_t mask, int64_t width) {
  TORCH_CHECK(x.size() == 32, "selftest_warp_intrinsics: 32 values");
  std::vector<unsigned> in(x.begin(), x.end()), out(96, 0);
  launch(warp_intrinsics_kernel, 1, 32, in.data(), static_cast<unsigned>(mask),
         static_cast<int>(width), out.data());
  return std::vector<int64_t>(out.begin(), out.end());
}

void vector_load(int64_t offset) {
  alignas(16) unsigned char x[64] = {};
  unsigned out[32];
  launch(vector_load_kernel, 1, 32, x, offset, out);
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
  m.def("selftest_global_count(int blocks, int n, bool atomic) -> int", &e::global_count);
  m.def("selftest_late_barrier(int threads, int turns, int salt, bool late) -> int",
        &e::late_barrier);
  m.def("selftest_warp_intrinsics(int[] x, int mask, int width) -> int[]", &e::warp_intrinsics);
  m.def("selftest_vector_load(int offset) -> ()", &e::vector_load);
  m.def("selftest_divergent_barrier() -> ()", &e::divergent_barrier);
  m.def("selftest_outside_mask() -> ()", &e::outside_mask);
}
