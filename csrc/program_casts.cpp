// A kernel for aten::_to_copy at the autocast dispatch keys that counts, per
// thread, the casts passing through it, then redispatches below autocast
// exactly as autocast's fallthrough would. Only the program's own casts pass
// these keys: autocast inserts its casts from inside its kernels, with its
// keys excluded. torchcast.track(all_casts=True) reads the count to tell the
// two apart (torch.is_autocast_enabled() is always False in a dispatch
// handler).
//
// Registered by the first torchcast.track() (install_program_casts), not at
// import: importing torchcast leaves aten's dispatch as it was. Never
// removed: destroying a kernel while other threads dispatch through it
// crashes them. Once installed, with no tracker active, it costs one
// thread-local increment per cast made under autocast.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>
#include <vector>

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
  // Excluded in the thread too, not only in the keyset passed on: under the
  // Python dispatcher (torch.compile's tracing) the redispatch recomputes
  // the keys from the tensor and the thread, and would come back here.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::_ops::_to_copy::redispatch(keys - c10::autocast_dispatch_keyset, self, dtype, layout,
                                        device, pin_memory, non_blocking, memory_format);
}

}  // namespace

bool in_program_cast() { return program_cast_depth != 0; }

void install_program_casts() {
  // A function-local static: installed once, whichever thread comes first,
  // and leaked on purpose (a Library's destructor deregisters its kernels).
  static const auto* libraries = [] {
    auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
    for (const auto key : {c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA,
                           c10::DispatchKey::AutocastXPU, c10::DispatchKey::AutocastMPS}) {
      libs->push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key,
                                                       __FILE__, __LINE__));
      libs->back()->impl("_to_copy", TORCH_FN(program_to_copy));
    }
    return libs;
  }();
  (void)libraries;
}

}  // namespace torchcast
