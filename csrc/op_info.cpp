// op_info.h.
#include "op_info.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace torchcast {
namespace {

std::unordered_set<std::string> unchecked_ops;  // set with the GIL
std::atomic<int> unchecked_generation{0};       // how many times it was set

// An op's name and overload ("aten::addmm", "out"): the overloads of a name
// differ in what they write (addmm.out writes its out= argument, addmm
// nothing), so both are the key.
using OpKey = std::pair<std::string, std::string>;
using OpKeyView = std::pair<std::string_view, std::string_view>;

struct OpKeyHash {
  using is_transparent = void;
  size_t operator()(const OpKeyView& k) const {
    const std::hash<std::string_view> h;
    return h(k.first) * 31 + h(k.second);
  }
  size_t operator()(const OpKey& k) const { return (*this)(OpKeyView(k.first, k.second)); }
};

struct OpKeyEqual {
  using is_transparent = void;
  template <typename A, typename B>
  bool operator()(const A& a, const B& b) const {
    return std::string_view(a.first) == std::string_view(b.first) &&
           std::string_view(a.second) == std::string_view(b.second);
  }
};

OpInfo describe(const at::RecordFunction& fn, const std::string& full) {
  OpInfo info;
  const auto schema = fn.operator_schema();
  if (!schema.has_value()) {
    info.transparent = true;
    return info;
  }
  if (full.rfind("torchcast", 0) == 0) {
    info.own = true;
    info.first_output = full == "torchcast::cast_with_stats";
    return info;
  }
  info.cast =
      full == "aten::_to_copy" || (full == "aten::copy_" && fn.overload_name()[0] == '\0');
  const auto op = c10::Dispatcher::singleton().findOp(fn.operator_name().value());
  info.decomposes =
      op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
  const auto& returns = schema->returns();
  const auto* alias = returns.empty() ? nullptr : returns[0].alias_info();
  info.writes = schema->is_mutable();
  // A view of an input; one that decomposes (to, reshape) may copy instead:
  // the ops it calls say.
  info.view = alias != nullptr && !alias->isWrite() && !info.decomposes;
  bool stats = false;
  for (const auto& argument : schema->arguments()) {
    info.out_args.push_back(argument.is_out());
    const auto* written = argument.alias_info();
    info.written.push_back(written != nullptr && written->isWrite() && !argument.is_out());
    const bool stat = !info.written.back() &&
                      (argument.name() == "running_mean" || argument.name() == "running_var");
    info.stats_written.push_back(stat);
    stats = stats || stat;
    if (argument.name() == "training" && argument.type()->kind() == c10::TypeKind::BoolType) {
      info.training_arg = static_cast<int>(info.stats_written.size()) - 1;
    }
  }
  if (!stats) info.stats_written.clear();
  return info;
}

struct Known {
  OpInfo info;
  int generation = -1;  // of unchecked_ops when info.unchecked was looked up
};

}  // namespace

// Keyed by the name's text: a record that is not an op owns its name string,
// so its address says nothing. Entries stay where they are (the observers
// keep pointers to them); only the unchecked flag is looked up again after
// set_unchecked_ops.
const OpInfo& info_of(const at::RecordFunction& fn) {
  thread_local std::unordered_map<OpKey, Known, OpKeyHash, OpKeyEqual> known;
  const std::string_view name(fn.name());
  const OpKeyView key(name, fn.overload_name());
  auto it = known.find(key);
  if (it == known.end()) {
    const std::string full(name);
    it = known.emplace(OpKey(full, std::string(key.second)), Known{describe(fn, full)}).first;
  }
  const int generation = unchecked_generation.load(std::memory_order_acquire);
  if (it->second.generation != generation) {
    it->second.info.unchecked = unchecked_ops.count(it->first.first) > 0;
    it->second.generation = generation;
  }
  return it->second.info;
}

const std::vector<bool>& written_now(const OpInfo& info, const c10::ArrayRef<c10::IValue>& inputs,
                                     std::vector<bool>& scratch) {
  if (info.stats_written.empty()) return info.written;
  if (info.training_arg >= 0) {
    const size_t at = static_cast<size_t>(info.training_arg);
    if (at >= inputs.size() || !inputs[at].isBool() || !inputs[at].toBool()) return info.written;
  }
  scratch = info.written;
  for (size_t i = 0; i < scratch.size(); ++i) scratch[i] = scratch[i] || info.stats_written[i];
  return scratch;
}

void set_unchecked_ops(const std::vector<std::string>& names) {
  std::unordered_set<std::string> given(names.begin(), names.end());
  // Other threads' observers read the set: it changes only when it differs
  // (the tracker passes the same list every time).
  if (given == unchecked_ops) return;
  unchecked_ops = std::move(given);
  unchecked_generation.fetch_add(1, std::memory_order_release);
}

namespace {

// The start callbacks of torchcast's observers: a thread runs only ours when
// every callback it has starts with one of them (the autograd threads
// inherit the callbacks, not a count of them).
using StartCallback = at::RecordFunctionCallback::StartCallback;
constexpr int kMaxObservers = 4;
std::atomic<StartCallback> own_starts[kMaxObservers] = {};

bool is_own(StartCallback start) {
  for (const auto& own : own_starts) {
    if (own.load(std::memory_order_relaxed) == start) return true;
  }
  return false;
}

}  // namespace

at::CallbackHandle add_observer(at::RecordFunctionCallback callback) {
  const StartCallback start = callback.start();
  for (auto& own : own_starts) {
    StartCallback expected = nullptr;
    if (own.load() == start || own.compare_exchange_strong(expected, start)) break;
  }
  return at::addThreadLocalCallback(std::move(callback));
}

void remove_observer(at::CallbackHandle& handle) {
  if (handle == 0) return;
  at::removeCallback(handle);
  handle = 0;
}

bool sole_observer() {
  if (at::hasGlobalCallbacks()) return false;
  for (const auto& entry : at::get_record_function_tls_().sorted_tls_callbacks_) {
    if (!is_own(entry.callback_.start())) return false;
  }
  return true;
}
}  // namespace torchcast
