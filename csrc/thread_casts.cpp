// Kernels for aten::_to_copy and aten::copy_ at the ADInplaceOrView key,
// which every cast of a (non-inference) tensor passes in every thread, that
// hand the cast to a Python callback while one is set:
// torchcast.track(all_casts=True) records every thread's casts through them,
// its own thread's included unless its dispatch mode sees them (only
// nonfinite="raise" or a build without the extension enters one).
//
// Registered by the first torchcast.track() (install_thread_casts), never
// removed (see program_casts.cpp for why). copy_'s replaces PyTorch's own
// kernel at that key, and does what it does (the copy below the key, then
// the version bump) after reporting the cast, so that a PrecisionLossError
// leaves the destination unwritten.
// With no callback set a cast costs one atomic load. Threads whose casts a
// track's dispatch mode sees (marked with set_thread_tracked; other threads
// under any dispatch mode) are left to it, and a cast the callback itself
// makes (measuring) is not reported again.
#include <ATen/ATen.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/ScopeExit.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <optional>

#include "thread_casts.h"

namespace torchcast {
namespace {

const c10::DispatchKeySet kPythonKeys({c10::DispatchKey::Python,
                                       c10::DispatchKey::PythonTLSSnapshot});

std::atomic<PyObject*> cast_callback{nullptr};
thread_local bool thread_tracked = false;
thread_local bool thread_direct = false;
thread_local bool in_callback = false;
thread_local uint64_t entries = 0;
thread_local bool in_to_copy = false;  // the copy_ _to_copy makes is not a cast of its own

// Whether a cast of src to dtype in this thread is the callback's to report.
bool to_report(const at::Tensor& src, at::ScalarType dtype) {
  if (cast_callback.load(std::memory_order_relaxed) == nullptr || in_callback || in_to_copy ||
      dtype == src.scalar_type()) {
    return false;
  }
  // A tracking thread reports under the program's own dispatch modes too:
  // this key runs before theirs.
  return thread_direct || (!thread_tracked && c10::impl::TorchDispatchModeTLS::stack_len() == 0);
}

// callback(src, out, dtype, when): see thread_casts.h. Returns what it
// returned when that is a tensor.
std::optional<at::Tensor> report_cast(const at::Tensor& src, const at::Tensor* out,
                                      at::ScalarType dtype, const char* when) {
  pybind11::gil_scoped_acquire gil;
  PyObject* callback = cast_callback.load(std::memory_order_acquire);
  // The tracker's own ops bypass the program's dispatch modes (as they do
  // the mode route's handler): a mode sees the program's ops only.
  const c10::impl::ExcludeDispatchKeyGuard no_modes(kPythonKeys);
  if (callback == nullptr) return std::nullopt;  // unset while this thread waited for the GIL
  Py_INCREF(callback);
  const bool outer = in_callback;
  in_callback = true;
  PyObject* py_src = THPVariable_Wrap(src);
  PyObject* py_out = out != nullptr ? THPVariable_Wrap(*out) : (Py_INCREF(Py_None), Py_None);
  PyObject* py_dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype));
  PyObject* py_when = PyUnicode_InternFromString(when);
  PyObject* result =
      (py_src && py_out && py_when)
          ? PyObject_CallFunctionObjArgs(callback, py_src, py_out, py_dtype, py_when, nullptr)
          : nullptr;
  in_callback = outer;
  Py_XDECREF(py_src);
  Py_XDECREF(py_out);
  Py_XDECREF(py_when);
  Py_DECREF(callback);
  if (result == nullptr) {
    // The callback's exception (a PrecisionLossError under policy "raise")
    // reaches the thread's Python caller as it was raised.
    python_error error;
    error.persist();
    throw error;
  }
  std::optional<at::Tensor> given;
  if (THPVariable_Check(result)) given = THPVariable_Unpack(result);
  Py_DECREF(result);
  return given;
}

// Whether _to_copy's result is a contiguous tensor of self's device,
// layout and shape, as the tracker's measuring op makes it, and no dispatch
// mode is to see the cast: then the callback may give that one instead of a
// second cast.
bool measured_result_fits(const at::Tensor& self, std::optional<at::Layout> layout,
                          std::optional<at::Device> device, std::optional<bool> pin_memory,
                          std::optional<at::MemoryFormat> memory_format) {
  const auto format = memory_format.value_or(at::MemoryFormat::Preserve);
  return self.layout() == at::kStrided && layout.value_or(at::kStrided) == at::kStrided &&
         (!device.has_value() || *device == self.device()) && !pin_memory.value_or(false) &&
         (format == at::MemoryFormat::Preserve || format == at::MemoryFormat::Contiguous) &&
         self.is_contiguous() && c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

at::Tensor reported_to_copy(c10::DispatchKeySet keys, const at::Tensor& self,
                            std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                            std::optional<at::Device> device, std::optional<bool> pin_memory,
                            bool non_blocking, std::optional<at::MemoryFormat> memory_format) {
  ++entries;
  const at::ScalarType target = dtype.value_or(self.scalar_type());
  const bool reported = to_report(self, target);
  if (reported && measured_result_fits(self, layout, device, pin_memory, memory_format)) {
    if (auto y = report_cast(self, nullptr, target, "to_copy")) return *std::move(y);
  }
  at::Tensor out;
  {
    // Under torch.inference_mode no autograd kernel excludes this key for
    // the ops _to_copy calls, so its copy_ would come here too.
    const bool outer = in_to_copy;
    in_to_copy = true;
    const auto restore = c10::make_scope_exit([outer] { in_to_copy = outer; });
    out = at::_ops::_to_copy::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, dtype,
                                         layout, device, pin_memory, non_blocking, memory_format);
  }
  if (reported) report_cast(self, &out, target, "to_copy_done");
  return out;
}

at::Tensor& reported_copy_(c10::DispatchKeySet keys, at::Tensor& self, const at::Tensor& src,
                           bool non_blocking) {
  ++entries;
  if (to_report(src, self.scalar_type())) report_cast(src, nullptr, self.scalar_type(), "copy_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::_ops::copy_::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, src,
                                non_blocking);
  }
  torch::autograd::impl::bump_version(self);
  return self;
}

}  // namespace

void set_cast_callback(PyObject* callback) {
  PyObject* previous = cast_callback.exchange(callback == Py_None ? nullptr : callback);
  if (callback != Py_None) Py_INCREF(callback);
  // Threads that loaded the previous callback hold the GIL while they use
  // it, and so does the caller: it can be released now.
  Py_XDECREF(previous);
}

void set_thread_tracked(bool tracked) { thread_tracked = tracked; }

void set_thread_direct(bool direct) { thread_direct = direct; }

bool pause_thread_casts(bool paused) {
  const bool previous = in_callback;
  in_callback = paused;
  return previous;
}

uint64_t cast_kernel_entries() { return entries; }

namespace {
struct QuietHandler : c10::WarningHandler {
  void process(const c10::Warning&) override {}
} quiet;
}  // namespace

void install_thread_casts() {
  // Installed once, leaked on purpose (see install_program_casts).
  static const auto* library = [] {
    auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView,
                                   __FILE__, __LINE__);
    lib->impl("_to_copy", TORCH_FN(reported_to_copy));
    // Replacing PyTorch's kernel makes the dispatcher warn; this one does
    // what that one does (see the top of this file).
    c10::WarningUtils::WarningHandlerGuard silent(&quiet);
    lib->impl("copy_", TORCH_FN(reported_copy_));
    return lib;
  }();
  (void)library;
}

}  // namespace torchcast
