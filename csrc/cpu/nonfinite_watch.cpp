// nonfinite_watch.h. A RecordFunction callback pair sees every op the
// dispatcher runs, nested ones included (linear and the addmm inside it):
// the start callback keeps the op's floating inputs (and reads them at once
// when the op writes to one of them, before it does), the end callback reads
// the outputs with all_finite and, only when one is non-finite, the inputs
// (on_end says which op of a chain of calls is the origin). Exceptions
// cannot leave a RecordFunction callback, so the Python callback's are
// printed as unraisable (the Python dispatch mode does "raise").
//
// NaN/inf that no watched op made (the program's data, a checkpoint, a
// literal, a tensor made before the track) are found where they enter: the
// storages the watched ops wrote NaN/inf into are known (a set of weak
// references, empty on a healthy run); an op whose non-finite input is not
// in it, or a non-finite Python number, is where they entered. Ops that
// are not checked (views, clone, cat, ...) pass the mark on from their
// inputs to their outputs without reading them.
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
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
  std::vector<int64_t> entered;     // an entry: the inputs that brought NaN/inf in
  int64_t batch = -1;               // a deferred write's: the optimizer step it ran in
};

// A set of storages. A weak reference keeps a
// StorageImpl's memory (not its data) allocated, so that its address is
// not reused while it is a key here.
class KnownNonfinite {
 public:
  bool empty() const { return size_.load(std::memory_order_relaxed) == 0; }

  void mark(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const c10::Storage& storage = t.storage();
    const std::lock_guard<std::mutex> lock(mutex_);
    known_.try_emplace(storage.unsafeGetStorageImpl(), storage.getWeakStorageImpl());
    if (known_.size() >= 2 * swept_) sweep();
    size_.store(known_.size(), std::memory_order_relaxed);
  }

  bool contains(const at::Tensor& t) {
    if (empty() || !t.defined() || !t.has_storage()) return false;
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = known_.find(t.storage().unsafeGetStorageImpl());
    return found != known_.end() && !found->second.expired();
  }

  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    known_.clear();
    swept_ = kFirstSweep;
    size_.store(0, std::memory_order_relaxed);
  }

 private:
  static constexpr size_t kFirstSweep = 64;

  void sweep() {  // the storages that died since: forgotten
    for (auto it = known_.begin(); it != known_.end();) {
      it = it->second.expired() ? known_.erase(it) : std::next(it);
    }
    swept_ = std::max(kFirstSweep, known_.size());
  }

  std::mutex mutex_;
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> known_;
  size_t swept_ = kFirstSweep;
  std::atomic<size_t> size_{0};
};

// known: the storages watched ops wrote NaN/inf into (empty on a healthy
// run, so that the ops not checked pay one atomic load); accounted: those
// whose NaN/inf, if any, are accounted for elsewhere (a collective's output,
// what an optimizer's step wrote), read only where an op made NaN/inf.
KnownNonfinite known, accounted;

// The tensors an op wrote to that were read finite after it, at the version
// they had then. An in-place op about to write one again (an optimizer's
// step, on the parameters and states of the step before) reads it before
// only if something wrote it since: the read would find it finite. Weak
// references keep the TensorImpls' memory, so that an address is not
// reused while it is a key.
class FiniteAt {
 public:
  bool holds(const at::Tensor& t) {
    if (!t.defined()) return false;
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = seen_.find(t.unsafeGetTensorImpl());
    return found != seen_.end() && !found->second.first.expired() &&
           found->second.second == t._version();
  }

  void note(const at::Tensor& t) {
    if (!t.defined()) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    auto [it, added] = seen_.try_emplace(
        t.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()),
        t._version());
    if (!added) {
      it->second = {c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), t._version()};
    }
    if (seen_.size() >= 2 * swept_) {
      for (auto e = seen_.begin(); e != seen_.end();) {
        e = e->second.first.expired() ? seen_.erase(e) : std::next(e);
      }
      swept_ = std::max<size_t>(1024, seen_.size());
    }
  }

  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    seen_.clear();
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*,
                     std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, uint32_t>>
      seen_;
  size_t swept_ = 1024;
};

FiniteAt finite_at;

// What the ops an optimizer's step ran wrote, not read as they wrote it: the
// step's writes (parameters, states: most of a step's memory traffic) are
// checked where they are next read by an op whose output holds NaN/inf, or
// when the watch ends (check_deferred). Each entry: the tensor (weakly), its
// version after the write, the op that wrote it and the step (batch).
// Keyed by storage: a later op may read a view of what was written (the
// transposed weight of a Linear), which shares its version counter.
struct DeferredWrite {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  uint32_t version;
  const char* name;
  const char* overload;
  int64_t batch;
};
std::mutex deferred_mutex;
std::unordered_map<const c10::StorageImpl*, DeferredWrite> deferred;
std::atomic<int64_t> batches{0};
thread_local int64_t deferring = -1;  // the batch of the optimizer step running, -1: none

void defer_write(const at::Tensor& t, const char* name, const char* overload) {
  if (!t.defined() || !t.has_storage()) return;
  const std::lock_guard<std::mutex> lock(deferred_mutex);
  DeferredWrite write{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()),
                      static_cast<uint32_t>(t._version()), name, overload, deferring};
  const auto [it, added] = deferred.try_emplace(t.storage().unsafeGetStorageImpl(), write);
  if (!added) it->second = std::move(write);
}

// The deferred write of t, if t is as that write left it; forgotten either way.
std::optional<DeferredWrite> take_deferred(const at::Tensor& t) {
  if (!t.has_storage()) return std::nullopt;
  const std::lock_guard<std::mutex> lock(deferred_mutex);
  const auto found = deferred.find(t.storage().unsafeGetStorageImpl());
  if (found == deferred.end()) return std::nullopt;
  DeferredWrite write = found->second;
  deferred.erase(found);
  if (write.impl.expired() || write.version != static_cast<uint32_t>(t._version())) {
    return std::nullopt;
  }
  return write;
}

// What before_write gives a written input that was finite when last read
// and not written since: finite, its amax not read again.
constexpr double kFiniteUnread = -1.0;

struct OpCall : at::ObserverContext {
  OpCall* parent = nullptr;
  bool inputs_bad = false;        // a float argument, or (written inputs) a tensor, was non-finite
  bool inputs_read = false;       // inputs_bad already covers the tensors
  bool callee_nonfinite = false;  // an op this one called made NaN/inf
  bool first_output = false;
  bool decomposes = false;        // CompositeImplicitAutograd: its callees are the ops that run
  bool skip = false;              // not checked, nor the ops it calls
  bool recording_paused = false;  // RecordFunction is off in this thread until it ends
  bool passes_mark = false;       // skipped, but its outputs hold known NaN/inf (an input's, or
                                  // a non-finite number's)
  bool deferred = false;          // writes in an optimizer's step: noted, not read
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
  // The wrappers and symbolic sizes first: numel() throws for a tensor
  // with symbolic sizes (torch.compile's tracing with dynamic shapes).
  return t.defined() && !t.key_set().has_any(wrappers) &&
         !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && t.device().is_cpu() &&
         (t.is_floating_point() || t.is_complex()) && t.numel() > 0 && t.has_storage() &&
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
    if (floating(t)) {
      if (finite_at.holds(t)) return kFiniteUnread;
      bad |= !all_finite_amax(t, amax);
    }
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

// Calls f on each tensor an IValue holds (a tensor, or a tensor list).
template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) f(t);
  }
}

// A Python number that is not finite: NaN/inf the program passes on purpose
// (masked_fill(mask, -inf), torch.full(..., -inf)), not an entry.
bool nonfinite_number(const c10::IValue& v) { return v.isDouble() && !std::isfinite(v.toDouble()); }

// A Python number the dispatcher carries as a tensor (x * inf: mul.Tensor's
// other): the program's own number, as a double argument is.
bool wrapped_number(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number();
}

// A 0-d tensor holding NaN/inf that no watched op made: a Python number
// turned into a tensor (scores[0] = -inf fills with one, torch.tensor(inf)).
bool nonfinite_scalar_tensor(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().dim() == 0 && !wrapped_number(v.toTensor()) &&
         floating(v.toTensor()) &&
         !known.contains(v.toTensor()) && !accounted.contains(v.toTensor()) &&
         !all_finite(v.toTensor());
}

void report_deferred(const DeferredWrite& write, const at::Tensor& t);

// Where the NaN/inf an op received through one input came from.
enum class Source {
  kNone,      // finite
  kKnown,     // a watched op wrote them, or the program passed a number: passed on
  kEntering,  // a tensor no watched op wrote: they enter here
  kReturned,  // such a tensor, returned as it is (a no-op .to()): not here yet
};

// The source of one input. An input the op writes to is kKnown: what it
// held may be stale or uninitialized memory the op overwrites (copy_'s
// self, a reused buffer; before: its amax read before the op). One the op
// returns is kReturned: it may return it unchanged (.to() of the dtype it
// has), or write to it undeclared (FSDP's all_gather_copy_in).
Source source_of(const c10::IValue& v, const c10::IValue& before,
                 const std::vector<const c10::StorageImpl*>& returned) {
  if (v.isDouble()) return std::isfinite(v.toDouble()) ? Source::kNone : Source::kKnown;
  if (!before.isNone()) {
    bool bad = false;
    if (before.isDouble()) bad = !std::isfinite(before.toDouble());
    if (before.isDoubleList()) {
      for (const double amax : before.toDoubleList().vec()) bad |= !std::isfinite(amax);
    }
    return bad ? Source::kKnown : Source::kNone;
  }
  bool entering = false, passed = false, as_returned = false;  // a tensor list: any of them
  each_tensor(v, [&](const at::Tensor& t) {
    if (!floating(t) || all_finite(t)) return;
    if (const auto write = take_deferred(t)) {
      report_deferred(*write, t);  // an optimizer step's op wrote them
      known.mark(t);
      passed = true;
    } else if (wrapped_number(t) || known.contains(t) || accounted.contains(t)) {
      passed = true;
    } else if (std::find(returned.begin(), returned.end(), t.storage().unsafeGetStorageImpl()) !=
               returned.end()) {
      as_returned = true;
    } else {
      entering = true;
    }
  });
  if (entering) return Source::kEntering;
  if (passed) return Source::kKnown;
  return as_returned ? Source::kReturned : Source::kNone;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  // The ops an op that does not decompose calls are its implementation (the
  // copy_ inside _to_copy): its own output is what is checked.
  if (paused || (current != nullptr && !current->decomposes)) return nullptr;
  const OpInfo& info = info_of(fn);
  if (info.transparent) return nullptr;
  // Not checked, nor the ops it calls: views of an input, the ops named
  // unchecked, torchcast's own (but safe_to's cast result). An unchecked op
  // given a 0-d tensor of NaN/inf no watched op made (scores[0] = -inf) is
  // where they enter: it is checked.
  bool skip = info.view || (info.own && !info.first_output);
  bool number = false;  // given a non-finite number: its outputs hold what the program placed
  if (!skip && info.unchecked) {
    // (detach_ of a literal is no fill: only an input it does not write counts)
    const auto values = fn.inputs();
    skip = true;
    for (size_t i = 0; i < values.size(); ++i) {
      const bool written = i < info.written.size() && info.written[i];
      if (!written && nonfinite_scalar_tensor(values[i])) skip = false;
    }
    number = std::any_of(values.begin(), values.end(), nonfinite_number);
  }
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
  if (!skip && deferring >= 0 && info.writes) {
    // The step's writes: read where they are next read, or at the end.
    call->deferred = true;
    call->input_values.assign(fn.inputs().begin(), fn.inputs().end());
    return call;
  }
  if (skip) {
    call->skip = true;
    call->passes_mark = number;
    if (!number && !known.empty() && !info.own) {
      for (const c10::IValue& v : fn.inputs()) {
        each_tensor(v, [&call](const at::Tensor& t) {
          if (known.contains(t)) call->passes_mark = true;
        });
      }
    }
    return call;
  }
  const Paused pause;
  call->first_output = info.first_output;
  call->decomposes = info.decomposes;
  const auto values = fn.inputs();
  // A training batch norm writes its running statistics undeclared: read
  // before, as an in-place op's self, so that what it leaves in them is
  // not taken for NaN/inf entering.
  std::vector<bool> scratch;
  const std::vector<bool>& written = written_now(info, values, scratch);
  const bool writes = info.writes || &written == &scratch;
  if (writes) call->before.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const c10::IValue& v = values[i];
    if (i < info.out_args.size() && info.out_args[i]) continue;
    if (writes && i < written.size() && written[i]) {
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
  if (info.writes) {  // (a batch norm's other inputs: read after it, only if its output is not finite)
    for (const at::Tensor& t : call->inputs) {
      call->inputs_bad |= !finite_at.holds(t) && !all_finite(t);
    }
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
    pybind11::object entered = pybind11::none();
    if (!origin.entered.empty()) entered = pybind11::cast(origin.entered);
    // (paused: the callback's own ops, a rerun in a wider dtype, are not the program's)
    pybind11::object batch = pybind11::none();
    if (origin.batch >= 0) batch = pybind11::int_(origin.batch);
    PyObject* result = PyObject_CallFunction(watch_callback, "ssOOOOO", origin.name,
                                             origin.overload, outputs.ptr(), inputs.ptr(),
                                             before.ptr(), entered.ptr(), batch.ptr());
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

// An op of an optimizer's step found to have written NaN/inf into t (an
// origin, reported as the step's: its inputs were not read).
void report_deferred(const DeferredWrite& write, const at::Tensor& t) {
  Origin origin{write.name, write.overload, {c10::IValue(t)}, {}, {}, {}, write.batch};
  report(origin);
}

// The origin of a chain of calls is the outermost op that made NaN/inf from
// finite inputs and that does not decompose (so .half() reports
// aten::_to_copy, not the copy_ inside it, and nn.Linear aten::addmm, not
// aten::linear): as the dispatch mode sees ops. An origin passes up to the
// caller, which may take its place, and is reported at the outermost call.
// So does an entry: the first op whose non-finite output came from a
// non-finite input that no watched op made.
void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  auto* call = static_cast<OpCall*>(ctx);
  if (call == nullptr) return;
  if (call->recording_paused) at::enableRecordFunction(true);
  current = call->parent;
  if (call->deferred) {
    const OpInfo& info = info_of(fn);
    const auto& values = call->input_values;  // (the end callback has no inputs)
    for (size_t i = 0; i < values.size(); ++i) {
      const bool out = i < info.out_args.size() && info.out_args[i];
      const bool written = i < info.written.size() && info.written[i];
      if (out || written) each_tensor(values[i], [&fn](const at::Tensor& t) {
        if (floating(t)) defer_write(t, fn.name(), fn.overload_name());
      });
    }
    for (const c10::IValue& v : fn.outputs()) each_tensor(v, [&fn](const at::Tensor& t) {
      if (floating(t)) defer_write(t, fn.name(), fn.overload_name());
    });
    return;
  }
  if (call->skip) {
    if (call->passes_mark) {
      for (const c10::IValue& v : fn.outputs()) each_tensor(v, [](const at::Tensor& t) {
        known.mark(t);
      });
    }
    return;
  }
  const Paused pause;
  bool out_bad = false;
  std::vector<c10::IValue> outputs(fn.outputs().begin(), fn.outputs().end());
  if (outputs.empty()) {
    // An op that returns nothing (_foreach_mul_, an out= op such as FSDP's
    // split_with_sizes_copy): what it wrote to is its output.
    const OpInfo& info = info_of(fn);
    for (size_t i = 0; i < call->input_values.size(); ++i) {
      const bool out = i < info.out_args.size() && info.out_args[i];
      const bool written = i < call->before.size() && !call->before[i].isNone();
      if (out || written) outputs.push_back(call->input_values[i]);
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
  if (!out_bad && !call->before.empty()) {
    // Read finite just now, as the op left them: what it wrote to.
    for (size_t i = 0; i < call->before.size(); ++i) {
      if (!call->before[i].isNone()) each_tensor(call->input_values[i], [](const at::Tensor& t) {
        if (floating(t)) finite_at.note(t);
      });
    }
  }
  if (out_bad) {
    if (!call->inputs_read) {
      for (const at::Tensor& t : call->inputs) call->inputs_bad |= !all_finite(t);
    }
    // What it wrote into its inputs (a batch norm's running statistics) is
    // its own, as its outputs are.
    for (size_t i = 0; i < call->before.size(); ++i) {
      if (!call->before[i].isNone()) each_tensor(call->input_values[i], [](const at::Tensor& t) {
        if (floating(t) && !all_finite(t)) known.mark(t);
      });
    }
    std::vector<int64_t> entered;
    bool passed_on = call->callee_nonfinite;  // NaN/inf that came with a known input
    bool returned_only = false;  // only NaN/inf of an input it returned as it is
    if (call->inputs_bad && !call->callee_nonfinite) {
      std::vector<const c10::StorageImpl*> returned;
      for (size_t i = 0; i < checked; ++i) each_tensor(outputs[i], [&returned](const at::Tensor& t) {
        if (t.has_storage()) returned.push_back(t.storage().unsafeGetStorageImpl());
      });
      for (size_t i = 0; i < call->input_values.size(); ++i) {
        const c10::IValue none;
        const c10::IValue& before = i < call->before.size() ? call->before[i] : none;
        switch (source_of(call->input_values[i], before, returned)) {
          case Source::kEntering: entered.push_back(i); break;
          case Source::kKnown: passed_on = true; break;
          case Source::kReturned: returned_only = true; break;
          case Source::kNone: break;
        }
      }
      returned_only = returned_only && entered.empty() && !passed_on;
      // Written into storage whose NaN/inf are accounted for: a collective's
      // own copy into its output (gloo's reduce-scatter, as work.wait()
      // runs), what arrives there.
      bool into_accounted = false;
      for (size_t i = 0; i < checked; ++i) each_tensor(outputs[i], [&](const at::Tensor& t) {
        into_accounted |= accounted.contains(t);
      });
      if (into_accounted && !entered.empty()) {
        entered.clear();
        passed_on = true;
        returned_only = false;
      }
    }
    if (returned_only) return;  // nothing made, nothing passed on: as a view is
    // Found where they entered: their next readers only pass them on.
    for (const int64_t i : entered) each_tensor(call->input_values[i], [](const at::Tensor& t) {
      known.mark(t);
    });
    if (call->inputs_bad && entered.empty()) {
      if (!call->callee_nonfinite) propagated.fetch_add(1, std::memory_order_relaxed);
    } else if (!call->decomposes) {
      call->origin = std::make_unique<Origin>(
          Origin{fn.name(), fn.overload_name(),
                 std::vector<c10::IValue>(outputs.begin(), outputs.begin() + checked),
                 std::move(call->input_values), std::move(call->before), std::move(entered)});
    }
    for (size_t i = 0; i < checked; ++i) each_tensor(outputs[i], [](const at::Tensor& t) {
      known.mark(t);
    });
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
  known.clear();
  accounted.clear();
  finite_at.clear();
  {
    const std::lock_guard<std::mutex> lock(deferred_mutex);
    deferred.clear();
  }
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

void account_for_nonfinite(const at::Tensor& t) { accounted.mark(t); }

bool nonfinite_seen() { return !known.empty(); }

int64_t defer_writes(bool defer) {
  deferring = defer ? batches.fetch_add(1) : -1;
  return deferring;
}

void check_deferred() {
  std::vector<DeferredWrite> writes;
  {
    const std::lock_guard<std::mutex> lock(deferred_mutex);
    for (auto& entry : deferred) writes.push_back(std::move(entry.second));
    deferred.clear();
  }
  const Paused pause;
  for (const DeferredWrite& write : writes) {
    auto impl = write.impl.lock();
    if (!impl) continue;
    const at::Tensor t(std::move(impl));
    if (static_cast<uint32_t>(t._version()) != write.version || all_finite(t)) continue;
    report_deferred(write, t);
    known.mark(t);
  }
}

bool pause_nonfinite_watch(bool pause) {
  const bool previous = paused;
  paused = pause;
  return previous;
}

}  // namespace torchcast
