// A kernel for aten::_to_copy at the ADInplaceOrView key, which every cast of
// a (non-inference) tensor passes in every thread, that hands the cast to a
// Python callback while one is set: torchcast.track(all_casts=True) records
// the casts of threads it has no dispatch mode in (threads started before or
// inside the block, the autograd engine's device threads) through it.
//
// Registered by the first torchcast.track() (install_thread_casts), never
// removed (see program_casts.cpp for why).
// With no callback set it costs one atomic load per cast. Threads that a
// track's dispatch mode already covers (marked with set_thread_tracked, or
// running under any dispatch mode) are left to the mode, and a cast the
// callback itself makes (measuring) is not reported again.
#include <ATen/ATen.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <memory>

#include "thread_casts.h"

namespace torchcast {
namespace {

std::atomic<PyObject*> cast_callback{nullptr};
thread_local bool thread_tracked = false;
thread_local bool in_callback = false;

void report_cast(const at::Tensor& src, const at::Tensor& out) {
  pybind11::gil_scoped_acquire gil;
  PyObject* callback = cast_callback.load(std::memory_order_acquire);
  if (callback == nullptr) return;  // unset while this thread waited for the GIL
  Py_INCREF(callback);
  in_callback = true;
  PyObject* py_src = THPVariable_Wrap(src);
  PyObject* py_out = THPVariable_Wrap(out);
  PyObject* result = (py_src && py_out)
                         ? PyObject_CallFunctionObjArgs(callback, py_src, py_out, nullptr)
                         : nullptr;
  in_callback = false;
  Py_XDECREF(py_src);
  Py_XDECREF(py_out);
  Py_DECREF(callback);
  if (result == nullptr) {
    // The callback's exception (a PrecisionLossError under policy "raise")
    // reaches the thread's Python caller as it was raised.
    python_error error;
    error.persist();
    throw error;
  }
  Py_DECREF(result);
}

at::Tensor reported_to_copy(c10::DispatchKeySet keys, const at::Tensor& self,
                            std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                            std::optional<at::Device> device, std::optional<bool> pin_memory,
                            bool non_blocking, std::optional<at::MemoryFormat> memory_format) {
  at::Tensor out = at::_ops::_to_copy::redispatch(keys & c10::after_ADInplaceOrView_keyset, self,
                                                  dtype, layout, device, pin_memory, non_blocking,
                                                  memory_format);
  if (cast_callback.load(std::memory_order_relaxed) != nullptr && !thread_tracked &&
      !in_callback && out.scalar_type() != self.scalar_type() &&
      c10::impl::TorchDispatchModeTLS::stack_len() == 0) {
    report_cast(self, out);
  }
  return out;
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

void install_thread_casts() {
  // Installed once, leaked on purpose (see install_program_casts).
  static const auto* library = [] {
    auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView,
                                   __FILE__, __LINE__);
    lib->impl("_to_copy", TORCH_FN(reported_to_copy));
    return lib;
  }();
  (void)library;
}

}  // namespace torchcast
