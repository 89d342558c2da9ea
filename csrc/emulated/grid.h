// The emulated grid: what the kernels of csrc/cuda/ ask of a GPU, for the
// host compiler, so that the same kernel source runs on the CPU with CUDA's
// semantics (docs/cuda.md, "The emulated grid"). csrc/cuda/launch.cuh
// includes it instead of the CUDA runtime when TORCHCAST_EMULATED is defined;
// the runtime behind it is grid.cpp.
//
// A launch keeps a few blocks resident at once, as a multiprocessor does,
// each on an OS thread of its own, and interleaves them: one OS thread runs
// at a time, handing over at random points, so that a run is a function of
// the seed. A block's threads are fibers (one stack each) switched by a
// seeded scheduler at every barrier, warp collective and atomic, and at
// random loads and stores outside the thread's own stack: the kernel files
// are compiled with -fsanitize=thread, whose memory-access hooks are
// grid.cpp's. The scheduler picks uniformly among the runnable threads, or
// by random priorities of warps or of threads with random change points
// (PCT), drawn anew at half the barriers: one warp or thread runs far
// ahead, to its next barrier and past it. So a read that a missing
// __syncthreads leaves unordered, a read-modify-write of a counter that is
// not atomic, within a block or across blocks, interleaves as it may on a
// GPU, and the result is wrong or varies with the seed instead of passing
// by luck. An aligned load or store (a vector packet) at a misaligned
// address is reported, naming the kernel.
//
// What is emulated: threadIdx/blockIdx/blockDim/gridDim; __syncthreads (all
// of the block's threads must arrive: a thread that exited, or a barrier in
// divergent code, is reported as a deadlock); __syncwarp, __shfl_sync,
// __shfl_down_sync, __ballot_sync and __match_any_sync within a warp of 32
// lanes (every lane of the mask must call, and only they; a lane outside
// the mask reads as garbage); atomicAdd/Max/Min on integers; __shared__
// arrays, one per resident block.
#pragma once

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// A function-local static of the block's OS thread is its shared memory:
// each resident block runs on a thread of its own. (Shared memory is not
// cleared between the blocks a thread runs, as on a GPU.)
#define __shared__ static thread_local
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
uint64_t shuffle(unsigned mask, uint64_t bits, int src_lane, int width);
unsigned match_any(unsigned mask, uint64_t bits);
unsigned ballot(unsigned mask, bool predicate);
void sync_warp(unsigned mask);
// A point where the scheduler may switch threads (before each atomic).
void interleave();

// Runs thread_main(context) as every thread of a grid x block launch of
// kernel (named by its errors).
void run_grid(dim3 grid, dim3 block, const void* kernel, void (*thread_main)(void*),
              void* context);

// How a block's scheduler picks the next thread: uniformly among the
// runnable ones; or the runnable one of the highest priority, priorities
// drawn per warp or per thread, the running one's dropped below all others
// at random change points (PCT); or one of these drawn per block.
enum class Policy : int { kMixed = 0, kUniform = 1, kWarps = 2, kThreads = 3 };

// What the host drivers read as the device's properties, the schedule (its
// seed, policy and how many blocks are resident at once), and the launches
// made since the last reset (grid and block sizes), which the tests read to
// see that a case wraps a grid-stride loop.
struct Settings {
  int multiprocessors = 2;
  uint64_t seed = 0;
  Policy policy = Policy::kMixed;
  int resident = 1;  // blocks interleaved at once, at most kMaxResident
};
constexpr int kMaxResident = 8;
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
  run_grid(grid, block, reinterpret_cast<const void*>(kernel), [](void* c) {
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
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::torchcast::emulated::sync_warp(mask); }

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::torchcast::emulated::ballot(mask, predicate != 0);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = ::torchcast::emulated::kWarpSize) {
  namespace e = ::torchcast::emulated;
  return e::from_bits<T>(e::shuffle(mask, e::to_bits(v), src_lane, width));
}

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
