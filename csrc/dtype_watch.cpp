// dtype_watch.h. The start callback notes whether an op's floating tensor
// inputs have several dtypes (the only ops either finding concerns), and
// keeps its inputs then, or for a cast; the end callback looks at the
// outputs of those ops only, or at the exception leaving them: an op whose
// inputs agree costs a scan of their dtypes.
#include "dtype_watch.h"

#include <ATen/record_function.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "op_info.h"
#include "thread_casts.h"

namespace torchcast {
namespace {

const c10::DispatchKeySet kPythonKeys({c10::DispatchKey::Python,
                                       c10::DispatchKey::PythonTLSSnapshot});

struct OpCall : at::ObserverContext {
  OpCall* parent = nullptr;
  const OpInfo* info = nullptr;
  bool mixed = false;           // floating tensor inputs of several dtypes
  bool callee_failed = false;   // a failure was reported inside this op
  bool recording_paused = false;
  int exceptions = 0;           // std::uncaught_exceptions() as the op began
  uint64_t kernel_entries = 0;  // cast_kernel_entries() as the op began (casts)
  std::vector<c10::IValue> inputs;  // kept for mixed ops and casts
};

PyObject* watch_callback = nullptr;  // set and read with the GIL held
thread_local at::CallbackHandle handle = 0;
thread_local OpCall* current = nullptr;
thread_local bool paused = false;

// Whether the floating tensors among values have more than one dtype.
bool mixed_dtypes(c10::ArrayRef<c10::IValue> values) {
  std::optional<at::ScalarType> seen;
  const auto differs = [&seen](const at::Tensor& t) {
    if (!t.defined() || !t.is_floating_point()) return false;
    if (!seen) seen = t.scalar_type();
    return *seen != t.scalar_type();
  };
  for (const c10::IValue& v : values) {
    if (v.isTensor()) {
      if (differs(v.toTensor())) return true;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (differs(t)) return true;
      }
    }
  }
  return false;
}

// callback(kind, a, b, c). Keeps the Python error indicator as it was (an
// op's failure may be a Python exception on its way out).
void call_back(const char* kind, const pybind11::object& a, const pybind11::object& b,
               const pybind11::object& c) {
  pybind11::gil_scoped_acquire gil;
  if (watch_callback == nullptr) return;
  // The tracker's own ops bypass the program's dispatch modes (as they do
  // the mode route's handler): a mode sees the program's ops only.
  const c10::impl::ExcludeDispatchKeyGuard no_modes(kPythonKeys);
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  const bool was_paused = paused;
  paused = true;  // the callback's own ops are not the program's
  PyObject* result =
      PyObject_CallFunction(watch_callback, "sOOO", kind, a.ptr(), b.ptr(), c.ptr());
  paused = was_paused;
  if (result == nullptr) {
    PyErr_WriteUnraisable(watch_callback);
  } else {
    Py_DECREF(result);
  }
  PyErr_Restore(type, value, traceback);
}

pybind11::object py_values(const std::vector<c10::IValue>& values) {
  pybind11::list list;
  for (const c10::IValue& v : values) list.append(torch::jit::toPyObject(v));
  return std::move(list);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  // The ops an op that does not decompose calls are its implementation.
  if (paused || (current != nullptr && !current->info->decomposes)) return nullptr;
  const OpInfo& info = info_of(fn);
  if (info.transparent) return nullptr;
  auto call = std::make_unique<OpCall>();
  call->parent = current;
  call->info = &info;
  current = call.get();
  if (!info.decomposes && sole_observer()) {
    // Nothing this op calls is looked at, and the dispatcher boxes the
    // arguments of every call it records for an observer: off until it ends.
    at::enableRecordFunction(false);
    call->recording_paused = true;
  }
  if (info.own) return call;
  call->exceptions = std::uncaught_exceptions();
  const auto values = fn.inputs();
  call->mixed = mixed_dtypes(values);
  if (info.cast) call->kernel_entries = cast_kernel_entries();
  if (call->mixed || info.cast) call->inputs.assign(values.begin(), values.end());
  return call;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  auto* call = static_cast<OpCall*>(ctx);
  if (call == nullptr) return;
  if (call->recording_paused) at::enableRecordFunction(true);
  current = call->parent;
  const OpInfo& info = *call->info;
  if (info.own) return;
  if (std::uncaught_exceptions() > call->exceptions) {
    const bool report = call->mixed && !call->callee_failed;
    if (report) {
      pybind11::gil_scoped_acquire gil;
      call_back("failure", pybind11::str(fn.name()), py_values(call->inputs), pybind11::none());
    }
    if (call->parent != nullptr && (report || call->callee_failed)) {
      call->parent->callee_failed = true;
    }
    return;
  }
  const auto outputs = fn.outputs();
  if (info.cast && cast_kernel_entries() == call->kernel_entries) {
    // _to_copy(self, ...) -> out; copy_(self, src): src into self.
    const bool copy = call->inputs.size() > 1 && call->inputs[1].isTensor();
    const c10::IValue& src = call->inputs[copy ? 1 : 0];
    const c10::IValue out =
        copy ? call->inputs[0] : (outputs.empty() ? c10::IValue() : outputs[0]);
    if (src.isTensor() && out.isTensor() &&
        src.toTensor().scalar_type() != out.toTensor().scalar_type()) {
      pybind11::gil_scoped_acquire gil;
      const auto dtype = out.toTensor().scalar_type();
      call_back("cast", torch::jit::toPyObject(src),
                copy ? pybind11::none() : torch::jit::toPyObject(out),
                pybind11::reinterpret_borrow<pybind11::object>(
                    reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype))));
    }
    return;
  }
  if (!call->mixed || info.decomposes) return;
  for (const c10::IValue& v : outputs) {
    if (v.isTensor() && v.toTensor().scalar_type() == at::kDouble) {
      pybind11::gil_scoped_acquire gil;
      call_back("promotion", pybind11::str(fn.name()), py_values(call->inputs),
                torch::jit::toPyObject(v));
      return;
    }
  }
}

}  // namespace

void start_dtype_watch(PyObject* callback) {
  TORCH_CHECK(handle == 0, "torchcast: this thread already has a dtype watch");
  Py_INCREF(callback);
  Py_XDECREF(watch_callback);
  watch_callback = callback;
  handle = add_observer(at::RecordFunctionCallback(on_start, on_end)
                            .needsInputs(true)
                            .needsOutputs(true)
                            .scopes({at::RecordScope::FUNCTION}));
}

void stop_dtype_watch() {
  remove_observer(handle);
  current = nullptr;
}

bool pause_dtype_watch(bool pause) {
  const bool previous = paused;
  paused = pause;
  return previous;
}

}  // namespace torchcast
