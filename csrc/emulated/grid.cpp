// The runtime of the emulated grid (grid.h): fibers, the scheduler, the block
// barrier, the warp collectives, and the memory-access hooks that the kernel
// files' -fsanitize=thread instrumentation calls (the names and signatures
// are the compiler's interface to a race detector; here they only give the
// scheduler a chance to switch threads). Built as a library of its own,
// without that instrumentation (tests/emulated.py).
#include "grid.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
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
enum class Collective { kShuffleDown, kShuffle, kMatchAny, kBallot, kSyncWarp };

const char* name_of(Collective c) {
  switch (c) {
    case Collective::kShuffleDown: return "__shfl_down_sync";
    case Collective::kShuffle: return "__shfl_sync";
    case Collective::kMatchAny: return "__match_any_sync";
    case Collective::kBallot: return "__ballot_sync";
    case Collective::kSyncWarp: return "__syncwarp";
  }
  return "?";
}

struct Fiber {
  Context context;
  char* stack_lo = nullptr;
  char* stack_hi = nullptr;
  uint3 thread{0, 0, 0};
  int lane = 0, warp = 0;
  size_t unit = 0;  // whose priority it runs at: its warp's or its own
  Waits waits = Waits::kNothing;
  uint64_t result = 0;  // of the last warp collective
};

// A warp collective that some lanes of its mask have reached.
struct WarpCall {
  bool open = false;
  Collective kind = Collective::kShuffleDown;
  unsigned mask = 0, arrived = 0;
  uint64_t bits[kWarpSize] = {};
  int arg[kWarpSize] = {};  // the delta or source lane
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

// The kernel's name, for errors: its symbol in the ELF symbol table of the
// library that holds it (the kernels have internal linkage, so dladdr does
// not know them), demangled.
std::string kernel_name(const void* kernel) {
  Dl_info info;
  if (dladdr(kernel, &info) == 0 || info.dli_fname == nullptr) return "an unknown kernel";
  const int fd = open(info.dli_fname, O_RDONLY);
  if (fd < 0) return "a kernel of " + std::string(info.dli_fname);
  struct stat st;
  std::string name;
  if (fstat(fd, &st) == 0) {
    void* map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (map != MAP_FAILED) {
      const auto* bytes = static_cast<const char*>(map);
      const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(bytes);
      const auto* sh = reinterpret_cast<const Elf64_Shdr*>(bytes + eh->e_shoff);
      const uintptr_t offset =
          reinterpret_cast<uintptr_t>(kernel) - reinterpret_cast<uintptr_t>(info.dli_fbase);
      for (int i = 0; i < eh->e_shnum && name.empty(); ++i) {
        if (sh[i].sh_type != SHT_SYMTAB) continue;
        const auto* syms = reinterpret_cast<const Elf64_Sym*>(bytes + sh[i].sh_offset);
        const char* strings = bytes + sh[sh[i].sh_link].sh_offset;
        for (size_t k = 0; k < sh[i].sh_size / sizeof(Elf64_Sym); ++k) {
          if (ELF64_ST_TYPE(syms[k].st_info) == STT_FUNC && syms[k].st_value == offset) {
            name = strings + syms[k].st_name;
            break;
          }
        }
      }
      munmap(map, static_cast<size_t>(st.st_size));
    }
  }
  close(fd);
  if (name.empty()) return "a kernel of " + std::string(info.dli_fname);
  int status = 0;
  char* plain = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  if (plain != nullptr) {
    name = plain;
    free(plain);
  }
  return name;
}

class Launch;

// One block in flight: its threads and the scheduler that runs them.
class Block {
 public:
  Block(Launch& launch, uint3 index, int slot);
  // Runs the block to its end; false if the launch stopped it (another
  // block failed). Throws what went wrong in it.
  bool run();

  uint3 index;
  dim3 grid_dim, block_dim;
  Fiber* current = nullptr;

  void yield();
  void barrier();
  uint64_t warp_call(Collective kind, unsigned mask, uint64_t bits, int arg, int width);
  void maybe_yield();
  [[noreturn]] void fail(const std::string& what);

 private:
  static void trampoline();
  void release(Fiber& f) {
    f.waits = Waits::kNothing;
    runnable_.push_back(&f);
  }
  void park() { switch_context(current->context, scheduler_); }
  Fiber* pick();
  void draw_priorities();
  std::string deadlock() const;

  Launch& launch_;
  Random& random_;
  int slot_;
  std::vector<Fiber> fibers_;
  std::vector<Fiber*> runnable_;
  std::vector<WarpCall> warps_;
  Context scheduler_;
  int at_barrier_ = 0, exited_ = 0;
  uint64_t countdown_ = 1, mean_gap_ = kMeanGap;
  Policy policy_ = Policy::kUniform;
  std::vector<uint64_t> priority_;  // by unit (warp or thread)
  uint64_t lowest_ = uint64_t{1} << 62;  // below every drawn priority, and falling
  uint64_t change_gap_ = 0;  // mean picks between change points
  std::string error_;
};

// The block the calling OS thread runs, if any.
thread_local Block* active = nullptr;

std::mutex launch_mutex;  // one launch at a time
Settings current_settings;
uint64_t launch_count = 0;
std::vector<LaunchRecord> launch_log;
Stacks slot_stacks[kMaxResident];  // a slot's blocks' fibers

// A launch: its blocks in a shuffled order, `resident` of them at once, each
// slot an OS thread; one thread runs at a time (it holds the turn) and hands
// it to another at random points (maybe_hand_over) or when its slot runs out
// of blocks.
class Launch {
 public:
  Launch(dim3 grid, dim3 block, const void* kernel, void (*thread_main)(void*), void* context,
         const Settings& s, uint64_t stream)
      : grid(grid), block(block), thread_main(thread_main), context(context),
        policy(s.policy), random{s.seed ^ (0x5851f42d4c957f2dull * stream)}, kernel_(kernel) {
    const unsigned n = grid.x * grid.y * grid.z;
    order_.resize(n);
    for (unsigned i = 0; i < n; ++i) order_[i] = i;
    for (unsigned i = n; i > 1; --i) std::swap(order_[i - 1], order_[random.below(i)]);
    slots_ = static_cast<int>(std::min<unsigned>(n, static_cast<unsigned>(s.resident)));
    slots_ = std::max(1, std::min(slots_, kMaxResident));
    live_ = slots_;
    done_.assign(slots_, false);
  }

  void run() {
    std::vector<std::thread> threads;
    for (int s = 1; s < slots_; ++s) threads.emplace_back([this, s] { serve(s); });
    serve(0);
    for (std::thread& t : threads) t.join();
    if (!error_.empty()) throw std::runtime_error(error_);
  }

  // At a pick of a block's scheduler: maybe hands the turn to another slot
  // (about one pick in kHandOverGap) and waits for it back. False if the
  // launch has stopped.
  bool maybe_hand_over(int slot) {
    if (live_ > 1 && random.below(kHandOverGap) == 0) hand_over(slot, true);
    return !stop_;
  }

  const dim3 grid, block;
  void (*const thread_main)(void*);
  void* const context;
  const Policy policy;
  Random random;

 private:
  // Mean picks of a block's scheduler between two hand-overs.
  static constexpr uint64_t kHandOverGap = 64;

  void serve(int slot) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      turn_changed_.wait(lock, [&] { return turn_ == slot; });
    }
    while (!stop_ && next_ < order_.size()) {
      const unsigned i = order_[next_++];
      const uint3 index{i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y)};
      try {
        Block b(*this, index, slot);
        active = &b;
        b.run();
        active = nullptr;
      } catch (const std::exception& e) {
        active = nullptr;
        error_ = "torchcast emulated grid: kernel " + kernel_name(kernel_) + ": " + e.what();
        stop_ = true;
      }
    }
    done_[slot] = true;
    --live_;
    if (live_ > 0) hand_over(slot, false);
  }

  // Gives the turn to another live slot, drawn; waits for it back if asked.
  void hand_over(int slot, bool wait) {
    int k = static_cast<int>(random.below(static_cast<uint64_t>(live_ - (done_[slot] ? 0 : 1))));
    int to = 0;
    for (;; ++to) {
      if (to == slot || done_[to]) continue;
      if (k-- == 0) break;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    turn_ = to;
    turn_changed_.notify_all();
    if (wait) turn_changed_.wait(lock, [&] { return turn_ == slot; });
  }

  const void* kernel_;
  std::vector<unsigned> order_;
  size_t next_ = 0;
  int slots_ = 1, live_ = 1;
  std::vector<bool> done_;
  bool stop_ = false;
  std::string error_;
  std::mutex mutex_;
  std::condition_variable turn_changed_;
  int turn_ = 0;
};

Block::Block(Launch& launch, uint3 index_, int slot)
    : index(index_), grid_dim(launch.grid), block_dim(launch.block), launch_(launch),
      random_(launch.random), slot_(slot) {
  const dim3 block = launch.block;
  const size_t n = static_cast<size_t>(block.x) * block.y * block.z;
  slot_stacks[slot].reserve(n);
  fibers_.resize(n);
  warps_.resize((n + kWarpSize - 1) / kWarpSize);
  policy_ = launch.policy;
  if (policy_ == Policy::kMixed) policy_ = static_cast<Policy>(1 + random_.below(3));
  if (policy_ != Policy::kUniform) {
    priority_.resize(policy_ == Policy::kWarps ? warps_.size() : n);
    draw_priorities();
    // Change points: none, or rare enough that the one ahead mostly reaches
    // its barrier, sometimes overtaken on the way.
    const uint64_t gaps[] = {0, 8192, 1024};
    change_gap_ = gaps[random_.below(3)];
  }
  mean_gap_ = random_.below(4) == 0 ? 2 : kMeanGap;  // sometimes a switch at almost every access
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = fibers_[i];
    const unsigned t = static_cast<unsigned>(i);
    f.thread = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
    f.lane = static_cast<int>(i % kWarpSize);
    f.warp = static_cast<int>(i / kWarpSize);
    f.unit = policy_ == Policy::kWarps ? static_cast<size_t>(f.warp) : i;
    f.stack_lo = slot_stacks[slot].lo(i);
    f.stack_hi = f.stack_lo + kStackBytes;
    start_context(f.context, f.stack_lo, kStackBytes, &Block::trampoline);
    runnable_.push_back(&f);
  }
  countdown_ = 1 + random_.below(2 * mean_gap_);
}

void Block::trampoline() {
  Block* b = active;
  Fiber* f = b->current;
  try {
    b->launch_.thread_main(b->launch_.context);
  } catch (const std::exception& e) {
    b->error_ = std::string("a thread threw: ") + e.what();
  }
  f->waits = Waits::kExited;
  ++b->exited_;
  switch_context(f->context, b->scheduler_);  // never resumed
  __builtin_unreachable();
}

// The next thread to run, taken out of runnable_: uniformly drawn, or the
// one of the highest priority (ties: the first).
Fiber* Block::pick() {
  size_t k = 0;
  if (policy_ == Policy::kUniform) {
    k = random_.below(runnable_.size());
  } else {
    for (size_t i = 1; i < runnable_.size(); ++i) {
      if (priority_[runnable_[i]->unit] > priority_[runnable_[k]->unit]) k = i;
    }
  }
  Fiber* f = runnable_[k];
  runnable_[k] = runnable_.back();
  runnable_.pop_back();
  return f;
}

bool Block::run() {
  while (!runnable_.empty() && error_.empty()) {
    if (!launch_.maybe_hand_over(slot_)) return false;
    active = this;
    current = pick();
    switch_context(scheduler_, current->context);
    if (change_gap_ != 0 && random_.below(change_gap_) == 0) {
      priority_[current->unit] = --lowest_;  // a change point: it falls behind all others
    }
    current = nullptr;
  }
  if (error_.empty() && exited_ != static_cast<int>(fibers_.size())) error_ = deadlock();
  if (!error_.empty()) {
    auto str = [](unsigned x, unsigned y, unsigned z) {
      return "(" + std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) + ")";
    };
    throw std::runtime_error("block " + str(index.x, index.y, index.z) + " of a launch of " +
                             str(grid_dim.x, grid_dim.y, grid_dim.z) + " blocks of " +
                             str(block_dim.x, block_dim.y, block_dim.z) + " threads: " + error_);
  }
  return true;
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
  runnable_.push_back(current);
  park();
}

void Block::maybe_yield() {
  if (--countdown_ != 0) return;
  countdown_ = 1 + random_.below(2 * mean_gap_);
  yield();
}

void Block::barrier() {
  Fiber* f = current;
  f->waits = Waits::kBarrier;
  if (++at_barrier_ < static_cast<int>(fibers_.size())) {
    park();
    return;
  }
  at_barrier_ = 0;
  for (Fiber& g : fibers_) {
    if (g.waits == Waits::kBarrier) release(g);
  }
  // Half the barriers draw the priorities anew: which warp leaves first,
  // to run ahead into the next turn, changes from turn to turn.
  if (policy_ != Policy::kUniform && random_.below(2) == 0) draw_priorities();
  park();
}

void Block::draw_priorities() {
  for (uint64_t& p : priority_) p = random_.next() | (uint64_t{1} << 63);
}

uint64_t Block::warp_call(Collective kind, unsigned mask, uint64_t bits, int arg, int width) {
  Fiber* f = current;
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
  c.arg[f->lane] = arg;
  c.width[f->lane] = width;
  c.arrived |= me;
  f->waits = Waits::kWarp;
  if (c.arrived != c.mask) {
    park();
    return f->result;
  }
  c.open = false;
  Fiber* first = &fibers_[static_cast<size_t>(f->warp) * kWarpSize];
  // A lane of the mask, or garbage for one outside it (undefined on a GPU).
  auto lane_value = [&](int src) {
    return ((c.mask >> src) & 1u) != 0 ? c.bits[src] : random_.next();
  };
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if (((c.mask >> lane) & 1u) == 0) continue;
    uint64_t r = 0;
    const int w = c.width[lane];
    switch (kind) {
      case Collective::kShuffleDown:
        r = lane % w + c.arg[lane] >= w ? c.bits[lane] : lane_value(lane + c.arg[lane]);
        break;
      case Collective::kShuffle:  // within the lane's segment of width lanes
        r = lane_value(lane / w * w + ((c.arg[lane] % w) + w) % w);
        break;
      case Collective::kMatchAny:
        for (int j = 0; j < kWarpSize; ++j) {
          if (((c.mask >> j) & 1u) != 0 && c.bits[j] == c.bits[lane]) r |= 1u << j;
        }
        break;
      case Collective::kBallot:
        for (int j = 0; j < kWarpSize; ++j) {
          if (((c.mask >> j) & 1u) != 0 && c.bits[j] != 0) r |= 1u << j;
        }
        break;
      case Collective::kSyncWarp:
        break;
    }
    first[lane].result = r;
    release(first[lane]);
  }
  park();
  return f->result;
}

// The block the calling code runs in, or nullptr when it runs outside a
// fiber (host code, or an OS thread that runs no block).
Block* on_fiber() {
  Block* b = active;
  if (b == nullptr) return nullptr;
  const Fiber* f = b->current;
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
// thread's own stack (its locals and arguments). `aligned`: the compiler
// took the address as aligned to the access's size (an aligned vector load
// at a misaligned address faults on a GPU, and on the CPU).
inline void touched(const void* address, size_t bytes, bool aligned, const char* what) {
  Block* b = on_fiber();
  if (b == nullptr) return;
  const Fiber* f = b->current;
  const char* a = static_cast<const char*>(address);
  if (aligned && reinterpret_cast<uintptr_t>(a) % bytes != 0) {
    char buf[160];
    snprintf(buf, sizeof buf, "thread %u: a %zu-byte %s at %p, which is not %zu-byte aligned",
             f->thread.x, bytes, what, address, bytes);
    b->fail(buf);
  }
  if (a >= f->stack_lo && a < f->stack_hi) return;
  b->maybe_yield();
}

}  // namespace

uint3 thread_index() { return block().current->thread; }
uint3 block_index() { return block().index; }
dim3 block_dim() { return block().block_dim; }
dim3 grid_dim() { return block().grid_dim; }

void sync_block() { block().barrier(); }

uint64_t shuffle_down(unsigned mask, uint64_t bits, unsigned delta, int width) {
  return block().warp_call(Collective::kShuffleDown, mask, bits, static_cast<int>(delta), width);
}

uint64_t shuffle(unsigned mask, uint64_t bits, int src_lane, int width) {
  return block().warp_call(Collective::kShuffle, mask, bits, src_lane, width);
}

unsigned match_any(unsigned mask, uint64_t bits) {
  return static_cast<unsigned>(block().warp_call(Collective::kMatchAny, mask, bits, 0, kWarpSize));
}

unsigned ballot(unsigned mask, bool predicate) {
  return static_cast<unsigned>(
      block().warp_call(Collective::kBallot, mask, predicate ? 1 : 0, 0, kWarpSize));
}

void sync_warp(unsigned mask) { block().warp_call(Collective::kSyncWarp, mask, 0, 0, kWarpSize); }

void interleave() {
  if (Block* b = on_fiber()) b->maybe_yield();
}

void run_grid(dim3 grid, dim3 block_dims, const void* kernel, void (*thread_main)(void*),
              void* context) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  launch_log.push_back({grid, block_dims});
  Launch(grid, block_dims, kernel, thread_main, context, current_settings, ++launch_count).run();
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
// and store (touched: a switch, maybe, and the alignment the compiler
// assumed checked), around atomics (done here, as real atomics), and at
// function entry and exit (nothing).
using torchcast::emulated::touched;

extern "C" {
#define TORCHCAST_ACCESS_HOOKS(N)                                                     \
  void __tsan_read##N(void* a) { touched(a, N, true, "load"); }                     \
  void __tsan_write##N(void* a) { touched(a, N, true, "store"); }                   \
  void __tsan_unaligned_read##N(void* a) { touched(a, N, false, "load"); }          \
  void __tsan_unaligned_write##N(void* a) { touched(a, N, false, "store"); }        \
  void __tsan_volatile_read##N(void* a) { touched(a, N, true, "load"); }            \
  void __tsan_volatile_write##N(void* a) { touched(a, N, true, "store"); }
TORCHCAST_ACCESS_HOOKS(1)
TORCHCAST_ACCESS_HOOKS(2)
TORCHCAST_ACCESS_HOOKS(4)
TORCHCAST_ACCESS_HOOKS(8)
TORCHCAST_ACCESS_HOOKS(16)
#undef TORCHCAST_ACCESS_HOOKS
void __tsan_read_range(void* a, unsigned long n) { touched(a, n, false, "load"); }
void __tsan_write_range(void* a, unsigned long n) { touched(a, n, false, "store"); }
void __tsan_vptr_read(void** a) { touched(a, sizeof(void*), false, "load"); }
void __tsan_vptr_update(void** a, void*) { touched(a, sizeof(void*), false, "store"); }
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
