// The emulated grid: what the kernels of csrc/cuda/ ask of a GPU, for the
// host compiler, so that the same kernel source runs on the CPU with CUDA's
// semantics (docs/cuda.md, "The emulated grid"). csrc/cuda/launch.cuh
// includes it instead of the CUDA runtime when TORCHCAST_EMULATED is defined;
// the runtime behind it is grid.cpp.
//
// A launch runs its blocks one at a time, in a shuffled order; a block's
// threads are fibers (one stack each) on the launching thread, switched by a
// seeded random scheduler at every barrier, warp collective and atomic, and
// at random loads and stores outside the thread's own stack: the kernel
// files are compiled with -fsanitize=thread, whose memory-access hooks are
// grid.cpp's. So a read that a missing __syncthreads leaves unordered, or a
// read-modify-write of a shared counter that is not atomic, interleaves with
// the other threads as it may on a GPU, and the result is wrong or varies
// with the seed instead of passing by luck.
//
// What is emulated: threadIdx/blockIdx/blockDim/gridDim; __syncthreads (all
// of the block's threads must arrive: a thread that exited, or a barrier in
// divergent code, is reported as a deadlock); __shfl_down_sync and
// __match_any_sync within a warp of 32 lanes (every lane of the mask must
// call, and only they; a lane outside the mask reads as garbage);
// atomicAdd/Max/Min on integers; __shared__ arrays, one per block.
#pragma once

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// A function-local static is the block's shared memory: blocks run one at a
// time. (Shared memory is not cleared between blocks, as on a GPU.)
#define __shared__ static
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace torchcast {
namespace emulated {

constexpr int kWarpSize = 32;

// The calling thread's coordinates. Constant for the life of a thread, so
// declared const: the compiler may keep them in registers across switches.
uint3 thread_index() __attribute__((const));
uint3 block_index() __attribute__((const));
dim3 block_dim() __attribute__((const));
dim3 grid_dim() __attribute__((const));

// The block barrier and the warp collectives; each switches to other threads.
void sync_block();
uint64_t shuffle_down(unsigned mask, uint64_t bits, unsigned delta, int width);
unsigned match_any(unsigned mask, uint64_t bits);
// A point where the scheduler may switch threads (before each atomic).
void interleave();

// Runs thread_main(context) as every thread of a grid x block launch.
void run_grid(dim3 grid, dim3 block, void (*thread_main)(void*), void* context);

// What the host drivers read as the device's properties, the schedule's seed,
// and the launches made since the last reset (grid and block sizes), which the
// tests read to see that a case wraps a grid-stride loop.
struct Settings {
  int multiprocessors = 2;
  uint64_t seed = 0;
};
Settings settings();
void configure(const Settings& s);
struct LaunchRecord {
  dim3 grid, block;
};
// The records of the launches since the last call, and forgets them.
std::vector<LaunchRecord> take_launches();

// kernel<<<grid, block>>>(args...): the arguments converted to the kernel's
// parameter types once, as a launch copies them; each thread gets its own copy.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) {
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  } call{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  run_grid(grid, block, [](void* c) {
    const Call& call = *static_cast<const Call*>(c);
    std::apply(call.kernel, call.params);
  }, &call);
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) == 4 || sizeof(T) == 8),
                "warp collectives move 32- or 64-bit values");
  std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t> u;
  memcpy(&u, &v, sizeof(T));
  return u;
}

template <typename T>
T from_bits(uint64_t bits) {
  std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t> u =
      static_cast<decltype(u)>(bits);
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

}  // namespace emulated
}  // namespace torchcast

#define threadIdx (::torchcast::emulated::thread_index())
#define blockIdx (::torchcast::emulated::block_index())
#define blockDim (::torchcast::emulated::block_dim())
#define gridDim (::torchcast::emulated::grid_dim())

inline void __syncthreads() { ::torchcast::emulated::sync_block(); }

template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta,
                   int width = ::torchcast::emulated::kWarpSize) {
  namespace e = ::torchcast::emulated;
  return e::from_bits<T>(e::shuffle_down(mask, e::to_bits(v), delta, width));
}

template <typename T>
unsigned __match_any_sync(unsigned mask, T v) {
  namespace e = ::torchcast::emulated;
  return e::match_any(mask, e::to_bits(v));
}

inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline long long __double_as_longlong(double d) {
  long long u;
  memcpy(&u, &d, sizeof(u));
  return u;
}

// CUDA's integer atomics, as real atomics. (No floating-point ones: no result
// that promises determinism may use them; .ci/cuda_stage.sh checks the SASS.)
#define TORCHCAST_EMULATED_ATOMICS(T)                                          \
  inline T atomicAdd(T* address, T v) {                                       \
    ::torchcast::emulated::interleave();                                      \
    return __atomic_fetch_add(address, v, __ATOMIC_RELAXED);                  \
  }                                                                           \
  inline T atomicMax(T* address, T v) {                                       \
    ::torchcast::emulated::interleave();                                      \
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);                       \
    while (old < v && !__atomic_compare_exchange_n(address, &old, v, true,    \
                                                   __ATOMIC_RELAXED,          \
                                                   __ATOMIC_RELAXED)) {       \
    }                                                                         \
    return old;                                                               \
  }                                                                           \
  inline T atomicMin(T* address, T v) {                                       \
    ::torchcast::emulated::interleave();                                      \
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);                       \
    while (old > v && !__atomic_compare_exchange_n(address, &old, v, true,    \
                                                   __ATOMIC_RELAXED,          \
                                                   __ATOMIC_RELAXED)) {       \
    }                                                                         \
    return old;                                                               \
  }
TORCHCAST_EMULATED_ATOMICS(int)
TORCHCAST_EMULATED_ATOMICS(unsigned)
TORCHCAST_EMULATED_ATOMICS(long long)
TORCHCAST_EMULATED_ATOMICS(unsigned long long)
#undef TORCHCAST_EMULATED_ATOMICS

// The device's integer min and max (CUDA declares them for every integer type).
#define TORCHCAST_EMULATED_MINMAX(T)                      \
  inline T min(T a, T b) { return a < b ? a : b; }       \
  inline T max(T a, T b) { return a > b ? a : b; }
TORCHCAST_EMULATED_MINMAX(int)
TORCHCAST_EMULATED_MINMAX(unsigned)
TORCHCAST_EMULATED_MINMAX(long)
TORCHCAST_EMULATED_MINMAX(unsigned long)
TORCHCAST_EMULATED_MINMAX(long long)
TORCHCAST_EMULATED_MINMAX(unsigned long long)
#undef TORCHCAST_EMULATED_MINMAX
