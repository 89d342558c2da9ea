// The emulated grid's settings and launch log, as ops of torchcast_emulated
// (tests/emulated.py): what the host drivers read as the device's
// multiprocessors, the schedule (seed, policy, resident blocks), and the grid
// and block sizes of the launches since the last call.
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "grid.h"

namespace torchcast {
namespace emulated {
namespace {

void configure_op(int64_t multiprocessors, int64_t seed, int64_t policy, int64_t resident) {
  TORCH_CHECK_VALUE(multiprocessors >= 1, "torchcast_emulated.configure: multiprocessors is ",
                    multiprocessors, "; expected at least 1");
  TORCH_CHECK_VALUE(policy >= 0 && policy <= static_cast<int>(Policy::kThreads),
                    "torchcast_emulated.configure: policy is ", policy,
                    "; expected 0 (mixed), 1 (uniform), 2 (warps) or 3 (threads)");
  TORCH_CHECK_VALUE(resident >= 1 && resident <= kMaxResident,
                    "torchcast_emulated.configure: resident is ", resident, "; expected 1 to ",
                    kMaxResident);
  configure({static_cast<int>(multiprocessors), static_cast<uint64_t>(seed),
             static_cast<Policy>(policy), static_cast<int>(resident)});
}

// [grid.x, block.x] per launch, flattened: the kernels launch 1-D grids.
std::vector<int64_t> launches_op() {
  std::vector<int64_t> out;
  for (const LaunchRecord& r : take_launches()) {
    out.push_back(r.grid.x);
    out.push_back(r.block.x);
  }
  return out;
}

}  // namespace
}  // namespace emulated
}  // namespace torchcast

TORCH_LIBRARY_FRAGMENT(torchcast_emulated, m) {
  m.def("configure(int multiprocessors, int seed, int policy=0, int resident=1) -> ()", &torchcast::emulated::configure_op);
  m.def("launches() -> int[]", &torchcast::emulated::launches_op);
}
