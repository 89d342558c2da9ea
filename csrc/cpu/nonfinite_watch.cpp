// nonfinite_watch.h. A RecordFunction callback pair sees every op the
// dispatcher runs, nested ones included (linear and the addmm inside it):
// the start callback keeps the op's floating inputs (and reads them at once
// when the op writes to one of them, before it does), the end callback reads
// the outputs with all_finite and, only when one is non-finite, the inputs
// (on_end says which op of a chain of calls is the origin). Exceptions
// cannot leave a RecordFunction callback, so the Python callback's are
// printed as unraisable (the Python dispatch mode does "raise").
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <algorithm>
#include <vector>

#include "../all_finite.h"
#include "../nonfinite_watch.h"
#include "../op_info.h"

namespace torchcast {
namespace {

// An origin found, not yet reported: an op that called it may take its place.
struct Origin {
  const char* name;
  const char* overload;
  std::vector<c10::IValue> outputs, inputs;
  std::vector<c10::IValue> before;  // per input: what before_write read, else None
};

struct OpCall : at::ObserverContext {
  OpCall* parent = nullptr;
  bool inputs_bad = false;        // a float argument, or (written inputs) a tensor, was non-finite
  bool inputs_read = false;       // inputs_bad already covers the tensors
  bool callee_nonfinite = false;  // an op this one called made NaN/inf
  bool first_output = false;
  bool decomposes = false;        // CompositeImplicitAutograd: its callees are the ops that run
  bool skip = false;              // not checked, nor the ops it calls
  bool recording_paused = false;  // RecordFunction is off in this thread until it ends
  std::vector<at::Tensor> inputs;
  std::vector<c10::IValue> input_values;
  std::vector<c10::IValue> before;  // per input the op writes: its amax before the op
  std::unique_ptr<Origin> origin;  // found in a callee
};

PyObject* watch_callback = nullptr;  // set and read with the GIL held
std::atomic<int64_t> propagated{0};
thread_local at::CallbackHandle handle = 0;
thread_local OpCall* current = nullptr;
thread_local bool paused = false;

// A CPU tensor with values to read: not a tensor subclass (FakeTensor under
// torch.compile's tracing has no data), not a functional wrapper.
bool floating(const at::Tensor& t) {
  static const c10::DispatchKeySet wrappers =
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                           c10::DispatchKey::Functionalize});
  return t.defined() && (t.is_floating_point() || t.is_complex()) && t.numel() > 0 &&
         t.device().is_cpu() && !t.key_set().has_any(wrappers) && t.has_storage() &&
         t.const_data_ptr() != nullptr;
}

// Sets this thread's paused flag for a scope: the watch's own reads
// (at::isfinite of a strided tensor) dispatch ops too.
struct Paused {
  bool saved;
  Paused() : saved(paused) { paused = true; }
  ~Paused() { paused = saved; }
};

// An input an op is about to write to: its amax (a list of them for a
// tensor list, NaN for an element that is not floating), with bad set when
// it holds NaN/inf. One read, as all_finite's.
c10::IValue before_write(const c10::IValue& v, bool& bad) {
  const auto amax_of = [&bad](const at::Tensor& t) {
    double amax = std::nan("");
    if (floating(t)) bad |= !all_finite_amax(t, amax);
    return amax;
  };
  if (v.isTensor()) return amax_of(v.toTensor());
  if (v.isTensorList()) {
    c10::List<double> amaxes;
    for (const at::Tensor& t : v.toTensorList().vec()) amaxes.push_back(amax_of(t));
    return amaxes;
  }
  return c10::IValue();
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  // The ops an op that does not decompose calls are its implementation (the
  // copy_ inside _to_copy): its own output is what is checked.
  if (paused || (current != nullptr && !current->decomposes)) return nullptr;
  const OpInfo& info = info_of(fn);
  if (info.transparent) return nullptr;
  // Not checked, nor the ops it calls: views of an input, the ops named
  // unchecked, torchcast's own (but safe_to's cast result).
  const bool skip = info.view || info.unchecked || (info.own && !info.first_output);
  auto call = std::make_unique<OpCall>();
  call->parent = current;
  current = call.get();
  if ((skip || !info.decomposes) && sole_observer()) {
    // Nothing this op calls is looked at, and each call the dispatcher
    // records for an observer that needs inputs and outputs boxes them
    // (every int list a heap allocation): off until the op ends.
    at::enableRecordFunction(false);
    call->recording_paused = true;
  }
  if (skip) {
    call->skip = true;
    return call;
  }
  const Paused pause;
  call->first_output = info.first_output;
  call->decomposes = info.decomposes;
  const auto values = fn.inputs();
  if (info.writes) call->before.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const c10::IValue& v = values[i];
    if (i < info.out_args.size() && info.out_args[i]) continue;
    if (info.writes && i < info.written.size() && info.written[i]) {
      // Read now: the op is about to overwrite it, and an origin's
      // description needs it as the op received it.
      call->before[i] = before_write(v, call->inputs_bad);
    } else if (v.isTensor()) {
      if (floating(v.toTensor())) call->inputs.push_back(v.toTensor());
    } else if (v.isDouble()) {
      call->inputs_bad |= !std::isfinite(v.toDouble());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (floating(t)) call->inputs.push_back(t);
      }
    }
  }
  if (info.writes) {
    for (const at::Tensor& t : call->inputs) call->inputs_bad |= !all_finite(t);
    call->inputs_read = true;
  }
  call->input_values.assign(fn.inputs().begin(), fn.inputs().end());
  return call;
}

void report(const Origin& origin) {
  pybind11::gil_scoped_acquire gil;
  if (watch_callback == nullptr) return;
  try {
    pybind11::list outputs, inputs, before;
    for (const c10::IValue& v : origin.outputs) outputs.append(torch::jit::toPyObject(v));
    for (const c10::IValue& v : origin.inputs) inputs.append(torch::jit::toPyObject(v));
    for (const c10::IValue& v : origin.before) before.append(torch::jit::toPyObject(v));
    // (paused: the callback's own ops, a rerun in a wider dtype, are not the program's)
    PyObject* result = PyObject_CallFunction(watch_callback, "ssOOO", origin.name,
                                             origin.overload, outputs.ptr(), inputs.ptr(),
                                             before.ptr());
    if (result == nullptr) {
      PyErr_WriteUnraisable(watch_callback);
    } else {
      Py_DECREF(result);
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    PyErr_WriteUnraisable(watch_callback);
  }
}

// The origin of a chain of calls is the outermost op that made NaN/inf from
// finite inputs and that does not decompose (so .half() reports
// aten::_to_copy, not the copy_ inside it, and nn.Linear aten::addmm, not
// aten::linear): as the dispatch mode sees ops. An origin passes up to the
// caller, which may take its place, and is reported at the outermost call.
void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  auto* call = static_cast<OpCall*>(ctx);
  if (call == nullptr) return;
  if (call->recording_paused) at::enableRecordFunction(true);
  current = call->parent;
  if (call->skip) return;
  const Paused pause;
  bool out_bad = false;
  std::vector<c10::IValue> outputs(fn.outputs().begin(), fn.outputs().end());
  if (outputs.empty()) {
    // An in-place op that returns nothing (_foreach_mul_): what it wrote to
    // is its output.
    for (size_t i = 0; i < call->before.size(); ++i) {
      if (!call->before[i].isNone()) outputs.push_back(call->input_values[i]);
    }
  }
  const size_t checked = call->first_output ? std::min<size_t>(1, outputs.size()) : outputs.size();
  const auto check = [&out_bad](const at::Tensor& t) {
    if (floating(t) && !all_finite(t)) out_bad = true;
  };
  for (size_t i = 0; i < checked; ++i) {
    const c10::IValue& v = outputs[i];
    if (v.isTensor()) {
      check(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) check(t);
    }
  }
  if (out_bad) {
    if (!call->inputs_read) {
      for (const at::Tensor& t : call->inputs) call->inputs_bad |= !all_finite(t);
    }
    if (call->inputs_bad) {
      if (!call->callee_nonfinite) propagated.fetch_add(1, std::memory_order_relaxed);
    } else if (!call->decomposes) {
      call->origin = std::make_unique<Origin>(
          Origin{fn.name(), fn.overload_name(),
                 std::vector<c10::IValue>(outputs.begin(), outputs.begin() + checked),
                 std::move(call->input_values), std::move(call->before)});
    }
    if (call->parent != nullptr) call->parent->callee_nonfinite = true;
  }
  if (call->origin == nullptr) return;
  if (call->parent != nullptr) {
    if (call->parent->origin == nullptr) call->parent->origin = std::move(call->origin);
  } else {
    report(*call->origin);
  }
}

}  // namespace

void start_nonfinite_watch(PyObject* callback, const std::vector<std::string>& skip) {
  TORCH_CHECK(handle == 0, "torchcast: this thread already has a non-finite watch");
  set_unchecked_ops(skip);
  Py_XINCREF(callback);
  Py_XDECREF(watch_callback);
  watch_callback = callback;
  propagated.store(0);
  handle = add_observer(at::RecordFunctionCallback(on_start, on_end)
                            .needsInputs(true)
                            .needsOutputs(true)
                            .scopes({at::RecordScope::FUNCTION}));
}

void stop_nonfinite_watch() {
  remove_observer(handle);
  current = nullptr;
}

int64_t take_propagated() { return propagated.exchange(0); }

bool pause_nonfinite_watch(bool pause) {
  const bool previous = paused;
  paused = pause;
  return previous;
}

}  // namespace torchcast
