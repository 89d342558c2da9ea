// A kernel for aten::_to_copy at the autocast dispatch keys that counts, per
// thread, the casts passing through it, then redispatches below autocast
// exactly as autocast's fallthrough would. Only the program's own casts pass
// these keys: autocast inserts its casts from inside its kernels, with its
// keys excluded. torchcast.track(all_casts=True) reads the count to tell the
// two apart (torch.is_autocast_enabled() is always False in a dispatch
// handler).
//
// Registered once, when torchcast._C is imported, and never removed:
// registering and destroying a kernel while other threads dispatch through
// it crashes them. With no tracker active it costs one thread-local
// increment per cast made under autocast.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "program_casts.h"

namespace torchcast {
namespace {

thread_local int program_cast_depth = 0;

at::Tensor program_to_copy(c10::DispatchKeySet keys, const at::Tensor& self,
                           std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                           std::optional<at::Device> device, std::optional<bool> pin_memory,
                           bool non_blocking, std::optional<at::MemoryFormat> memory_format) {
  struct Depth {
    Depth() { ++program_cast_depth; }
    ~Depth() { --program_cast_depth; }
  } depth;
  return at::_ops::_to_copy::redispatch(keys - c10::autocast_dispatch_keyset, self, dtype, layout,
                                        device, pin_memory, non_blocking, memory_format);
}

}  // namespace

bool in_program_cast() { return program_cast_depth != 0; }

TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) { m.impl("_to_copy", TORCH_FN(program_to_copy)); }
TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m) { m.impl("_to_copy", TORCH_FN(program_to_copy)); }
TORCH_LIBRARY_IMPL(aten, AutocastXPU, m) { m.impl("_to_copy", TORCH_FN(program_to_copy)); }
TORCH_LIBRARY_IMPL(aten, AutocastMPS, m) { m.impl("_to_copy", TORCH_FN(program_to_copy)); }

}  // namespace torchcast
