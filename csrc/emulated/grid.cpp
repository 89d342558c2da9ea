// The runtime of the emulated grid (grid.h): fibers, the scheduler, the block
// barrier, the warp collectives, and the memory-access hooks that the kernel
// files' -fsanitize=thread instrumentation calls (the names and signatures
// are the compiler's interface to a race detector; here they only give the
// scheduler a chance to switch threads). Built as a library of its own,
// without that instrumentation (tests/emulated.py).
#include "grid.h"

#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <atomic>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace torchcast {
namespace emulated {
namespace {

// A thread's stack; the kernels keep a few KiB of locals.
constexpr size_t kStackBytes = size_t{128} << 10;
// Mean number of loads and stores outside a thread's stack between two
// random switches (each one switches with probability about 1 / kMeanGap).
constexpr uint64_t kMeanGap = 16;

// splitmix64: a seed's stream of pseudo-random numbers.
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }
};

// A suspended thread of execution. On x86-64 a switch saves the
// callee-saved registers on the stack it leaves and restores them from the
// one it enters (about 10 ns); elsewhere ucontext's swapcontext, which also
// saves the signal mask with a system call (about 1 us).
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};

extern "C" void torchcast_emulated_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type torchcast_emulated_switch, @function
torchcast_emulated_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size torchcast_emulated_switch, .-torchcast_emulated_switch
)");

// A context that starts entry() on the stack [lo, lo + bytes): the six
// registers the switch pops, then entry as its return address, then a null
// return address for entry (which never returns), 16-byte aligned at entry.
void start_context(Context& c, char* lo, size_t bytes, void (*entry)()) {
  auto* top = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(lo + bytes) & ~uintptr_t{15});
  *--top = nullptr;
  *--top = reinterpret_cast<void*>(entry);
  for (int i = 0; i < 6; ++i) *--top = nullptr;
  c.sp = top;
}

void switch_context(Context& from, Context& to) { torchcast_emulated_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void start_context(Context& c, char* lo, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = lo;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

enum class Waits { kNothing, kBarrier, kWarp, kExited };
enum class Collective { kShuffleDown, kMatchAny };

const char* name_of(Collective c) {
  return c == Collective::kShuffleDown ? "__shfl_down_sync" : "__match_any_sync";
}

struct Fiber {
  Context context;
  char* stack_lo = nullptr;
  char* stack_hi = nullptr;
  uint3 thread{0, 0, 0};
  int lane = 0, warp = 0;
  Waits waits = Waits::kNothing;
  uint64_t result = 0;  // of the last warp collective
};

// A warp collective that some lanes of its mask have reached.
struct WarpCall {
  bool open = false;
  Collective kind = Collective::kShuffleDown;
  unsigned mask = 0, arrived = 0;
  uint64_t bits[kWarpSize] = {};
  unsigned delta[kWarpSize] = {};
  int width[kWarpSize] = {};
};

// Fiber stacks, kept from launch to launch, each above a guard page.
class Stacks {
 public:
  char* lo(size_t i) { return base_ + i * slot() + page(); }
  void reserve(size_t n) {
    if (n <= count_) return;
    if (base_ != nullptr) munmap(base_, count_ * slot());
    void* p = mmap(nullptr, n * slot(), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("torchcast emulated grid: no memory for stacks");
    base_ = static_cast<char*>(p);
    count_ = n;
    for (size_t i = 0; i < n; ++i) mprotect(base_ + i * slot(), page(), PROT_NONE);
  }

 private:
  static size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
  static size_t slot() { return kStackBytes + page(); }
  char* base_ = nullptr;
  size_t count_ = 0;
};

// One block in flight: its threads and the scheduler that runs them.
class Block {
 public:
  Block(dim3 grid, dim3 block, uint3 index, Random& random, Stacks& stacks,
        void (*thread_main)(void*), void* context);
  void run();

  uint3 index;
  dim3 grid_dim, block_dim;
  std::atomic<Fiber*> current{nullptr};

  void yield();
  void barrier();
  uint64_t warp_call(Collective kind, unsigned mask, uint64_t bits, unsigned delta, int width);
  void maybe_yield();

 private:
  static void trampoline();
  void release(Fiber& f) {
    f.waits = Waits::kNothing;
    runnable_.push_back(&f);
  }
  void park() {
    Fiber* f = current.load(std::memory_order_relaxed);
    switch_context(f->context, scheduler_);
  }
  [[noreturn]] void fail(const std::string& what);
  std::string deadlock() const;

  Random& random_;
  void (*thread_main_)(void*);
  void* context_;
  std::vector<Fiber> fibers_;
  std::vector<Fiber*> runnable_;
  std::vector<WarpCall> warps_;
  Context scheduler_;
  int at_barrier_ = 0, exited_ = 0;
  uint64_t countdown_ = 1;
  std::string error_;
};

std::mutex launch_mutex;           // one launch at a time, so one block in flight
std::atomic<Block*> active{nullptr};
Settings current_settings;
uint64_t launch_count = 0;
std::vector<LaunchRecord> launch_log;

Block::Block(dim3 grid, dim3 block, uint3 index_, Random& random, Stacks& stacks,
             void (*thread_main)(void*), void* context)
    : index(index_), grid_dim(grid), block_dim(block), random_(random),
      thread_main_(thread_main), context_(context) {
  const size_t n = static_cast<size_t>(block.x) * block.y * block.z;
  stacks.reserve(n);
  fibers_.resize(n);
  warps_.resize((n + kWarpSize - 1) / kWarpSize);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = fibers_[i];
    const unsigned t = static_cast<unsigned>(i);
    f.thread = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
    f.lane = static_cast<int>(i % kWarpSize);
    f.warp = static_cast<int>(i / kWarpSize);
    f.stack_lo = stacks.lo(i);
    f.stack_hi = f.stack_lo + kStackBytes;
    start_context(f.context, f.stack_lo, kStackBytes, &Block::trampoline);
    runnable_.push_back(&f);
  }
  countdown_ = 1 + random_.below(2 * kMeanGap);
}

void Block::trampoline() {
  Block* b = active.load(std::memory_order_relaxed);
  Fiber* f = b->current.load(std::memory_order_relaxed);
  try {
    b->thread_main_(b->context_);
  } catch (const std::exception& e) {
    b->error_ = std::string("a thread threw: ") + e.what();
  }
  f->waits = Waits::kExited;
  ++b->exited_;
  switch_context(f->context, b->scheduler_);  // never resumed
  __builtin_unreachable();
}

void Block::run() {
  while (!runnable_.empty() && error_.empty()) {
    const size_t k = random_.below(runnable_.size());
    Fiber* f = runnable_[k];
    runnable_[k] = runnable_.back();
    runnable_.pop_back();
    current.store(f, std::memory_order_relaxed);
    switch_context(scheduler_, f->context);
    current.store(nullptr, std::memory_order_relaxed);
  }
  if (error_.empty() && exited_ != static_cast<int>(fibers_.size())) error_ = deadlock();
  if (!error_.empty()) {
    auto str = [](unsigned x, unsigned y, unsigned z) {
      return "(" + std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) + ")";
    };
    throw std::runtime_error("torchcast emulated grid: block " + str(index.x, index.y, index.z) +
                             " of a launch of " + str(grid_dim.x, grid_dim.y, grid_dim.z) +
                             " blocks of " + str(block_dim.x, block_dim.y, block_dim.z) +
                             " threads: " + error_);
  }
}

std::string Block::deadlock() const {
  std::string s = "deadlock: " + std::to_string(at_barrier_) + " of " +
                  std::to_string(fibers_.size()) + " threads wait at __syncthreads, " +
                  std::to_string(exited_) + " have exited";
  for (size_t w = 0; w < warps_.size(); ++w) {
    const WarpCall& c = warps_[w];
    if (!c.open) continue;
    char buf[160];
    snprintf(buf, sizeof buf, "; warp %zu: lanes 0x%08x of mask 0x%08x wait at %s", w, c.arrived,
             c.mask, name_of(c.kind));
    s += buf;
  }
  return s;
}

void Block::fail(const std::string& what) {
  error_ = what;
  park();  // never resumed: the scheduler stops and throws
  __builtin_unreachable();
}

void Block::yield() {
  runnable_.push_back(current.load(std::memory_order_relaxed));
  park();
}

void Block::maybe_yield() {
  if (--countdown_ != 0) return;
  countdown_ = 1 + random_.below(2 * kMeanGap);
  yield();
}

void Block::barrier() {
  Fiber* f = current.load(std::memory_order_relaxed);
  f->waits = Waits::kBarrier;
  if (++at_barrier_ < static_cast<int>(fibers_.size())) {
    park();
    return;
  }
  at_barrier_ = 0;
  for (Fiber& g : fibers_) {
    if (g.waits == Waits::kBarrier) release(g);
  }
  park();
}

uint64_t Block::warp_call(Collective kind, unsigned mask, uint64_t bits, unsigned delta,
                          int width) {
  Fiber* f = current.load(std::memory_order_relaxed);
  const unsigned me = 1u << f->lane;
  if ((mask & me) == 0) {
    fail(std::string(name_of(kind)) + " called by lane " + std::to_string(f->lane) +
         " with a mask that leaves it out");
  }
  WarpCall& c = warps_[f->warp];
  if (!c.open) {
    c.open = true;
    c.kind = kind;
    c.mask = mask;
    c.arrived = 0;
  } else if (c.kind != kind || c.mask != mask) {
    fail("lanes of warp " + std::to_string(f->warp) + " are in different collectives: " +
         name_of(c.kind) + " and " + name_of(kind));
  }
  c.bits[f->lane] = bits;
  c.delta[f->lane] = delta;
  c.width[f->lane] = width;
  c.arrived |= me;
  f->waits = Waits::kWarp;
  if (c.arrived != c.mask) {
    park();
    return f->result;
  }
  c.open = false;
  Fiber* first = &fibers_[static_cast<size_t>(f->warp) * kWarpSize];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if (((c.mask >> lane) & 1u) == 0) continue;
    uint64_t r = 0;
    if (kind == Collective::kShuffleDown) {
      const int w = c.width[lane];
      const int src = lane + static_cast<int>(c.delta[lane]);
      if (lane % w + static_cast<int>(c.delta[lane]) >= w) {
        r = c.bits[lane];
      } else if (((c.mask >> src) & 1u) != 0) {
        r = c.bits[src];
      } else {
        r = random_.next();  // an inactive source lane: undefined
      }
    } else {
      for (int j = 0; j < kWarpSize; ++j) {
        if (((c.mask >> j) & 1u) != 0 && c.bits[j] == c.bits[lane]) r |= 1u << j;
      }
    }
    first[lane].result = r;
    release(first[lane]);
  }
  park();
  return f->result;
}

// The block the calling code runs in, or nullptr when it runs outside a
// fiber (host code, or another thread than the launching one).
Block* on_fiber() {
  Block* b = active.load(std::memory_order_relaxed);
  if (b == nullptr) return nullptr;
  const Fiber* f = b->current.load(std::memory_order_relaxed);
  char probe;
  if (f == nullptr || &probe < f->stack_lo || &probe >= f->stack_hi) return nullptr;
  return b;
}

Block& block() {
  Block* b = on_fiber();
  if (b == nullptr) throw std::logic_error("torchcast emulated grid: device code outside a launch");
  return *b;
}

// A load or store of the kernel code: maybe a switch, unless it is to the
// thread's own stack (its locals and arguments).
inline void touched(const void* address) {
  Block* b = on_fiber();
  if (b == nullptr) return;
  const Fiber* f = b->current.load(std::memory_order_relaxed);
  const char* a = static_cast<const char*>(address);
  if (a >= f->stack_lo && a < f->stack_hi) return;
  b->maybe_yield();
}

}  // namespace

uint3 thread_index() { return block().current.load(std::memory_order_relaxed)->thread; }
uint3 block_index() { return block().index; }
dim3 block_dim() { return block().block_dim; }
dim3 grid_dim() { return block().grid_dim; }

void sync_block() { block().barrier(); }

uint64_t shuffle_down(unsigned mask, uint64_t bits, unsigned delta, int width) {
  return block().warp_call(Collective::kShuffleDown, mask, bits, delta, width);
}

unsigned match_any(unsigned mask, uint64_t bits) {
  return static_cast<unsigned>(block().warp_call(Collective::kMatchAny, mask, bits, 0, kWarpSize));
}

void interleave() {
  if (Block* b = on_fiber()) b->maybe_yield();
}

void run_grid(dim3 grid, dim3 block_dims, void (*thread_main)(void*), void* context) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  static Stacks stacks;
  launch_log.push_back({grid, block_dims});
  Random random{current_settings.seed ^ (0x5851f42d4c957f2dull * ++launch_count)};
  const unsigned n = grid.x * grid.y * grid.z;
  std::vector<unsigned> order(n);
  for (unsigned i = 0; i < n; ++i) order[i] = i;
  for (unsigned i = n; i > 1; --i) std::swap(order[i - 1], order[random.below(i)]);
  for (unsigned i : order) {
    const uint3 index{i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y)};
    Block b(grid, block_dims, index, random, stacks, thread_main, context);
    active.store(&b, std::memory_order_relaxed);
    try {
      b.run();
    } catch (...) {
      active.store(nullptr, std::memory_order_relaxed);
      throw;
    }
    active.store(nullptr, std::memory_order_relaxed);
  }
}

Settings settings() {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  return current_settings;
}

void configure(const Settings& s) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  current_settings = s;
  launch_count = 0;
}

std::vector<LaunchRecord> take_launches() {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  std::vector<LaunchRecord> out;
  out.swap(launch_log);
  return out;
}

}  // namespace emulated
}  // namespace torchcast

// ---------------------------------------------------------------------------
// The hooks -fsanitize=thread makes the kernel files call: before every load
// and store (touched), around atomics (done here, as real atomics), and at
// function entry and exit (nothing).
using torchcast::emulated::touched;

extern "C" {
#define TORCHCAST_ACCESS_HOOKS(N)                                      \
  void __tsan_read##N(void* a) { touched(a); }                       \
  void __tsan_write##N(void* a) { touched(a); }                      \
  void __tsan_unaligned_read##N(void* a) { touched(a); }             \
  void __tsan_unaligned_write##N(void* a) { touched(a); }            \
  void __tsan_volatile_read##N(void* a) { touched(a); }              \
  void __tsan_volatile_write##N(void* a) { touched(a); }
TORCHCAST_ACCESS_HOOKS(1)
TORCHCAST_ACCESS_HOOKS(2)
TORCHCAST_ACCESS_HOOKS(4)
TORCHCAST_ACCESS_HOOKS(8)
TORCHCAST_ACCESS_HOOKS(16)
#undef TORCHCAST_ACCESS_HOOKS
void __tsan_read_range(void* a, unsigned long) { touched(a); }
void __tsan_write_range(void* a, unsigned long) { touched(a); }
void __tsan_vptr_read(void** a) { touched(a); }
void __tsan_vptr_update(void** a, void*) { touched(a); }
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_init() {}

// The atomics, sequentially consistent whatever order is asked for.
#define TORCHCAST_ATOMIC_HOOKS(N, T)                                                         \
  T __tsan_atomic##N##_load(const volatile T* a, int) {                                    \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                           \
  }                                                                                        \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) {                                 \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                              \
  }                                                                                        \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                 \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                    \
  }                                                                                        \
  T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) {                                \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                     \
  }                                                                                        \
  T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) {                                \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                     \
  }                                                                                        \
  T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) {                                \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                     \
  }                                                                                        \
  T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) {                                 \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                      \
  }                                                                                        \
  T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) {                                \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                     \
  }                                                                                        \
  T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) {                               \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                    \
  }                                                                                        \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {     \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                        \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {       \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);  \
  }                                                                                        \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {           \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);      \
    return c;                                                                              \
  }
TORCHCAST_ATOMIC_HOOKS(8, char)
TORCHCAST_ATOMIC_HOOKS(16, short)
TORCHCAST_ATOMIC_HOOKS(32, int)
TORCHCAST_ATOMIC_HOOKS(64, long)
#undef TORCHCAST_ATOMIC_HOOKS
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}
