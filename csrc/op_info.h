// What the tracker's RecordFunction observers (cpu/nonfinite_watch.cpp,
// dtype_watch.cpp) need to know of an op, decided once per op name and
// overload and cached per thread.
#pragma once

#include <ATen/record_function.h>

#include <string>
#include <vector>

namespace torchcast {

struct OpInfo {
  bool transparent = false;   // not an op (the autograd engine's record of a node): ignored
  bool own = false;           // one of torchcast's ops
  bool first_output = false;  // safe_to's cast: its result, not its stats
  bool view = false;          // returns a view of an input (and does not decompose)
  bool unchecked = false;     // named in set_unchecked_ops
  bool decomposes = false;    // CompositeImplicitAutograd (linear, matmul): its callees run
  bool writes = false;        // writes to an input
  bool cast = false;          // aten::_to_copy or aten::copy_: may change the dtype
  std::vector<bool> out_args;  // out= arguments: outputs, not inputs (their bits are garbage)
  std::vector<bool> written;   // inputs the op writes to (self of an in-place op), not out=
  // The running statistics a batch norm writes without saying so in its
  // schema (native_batch_norm's running_mean and running_var: no (a!)), and
  // the index of its bool `training` argument: written when it is true (-1:
  // always, batch_norm_update_stats). Empty for other ops.
  std::vector<bool> stats_written;
  int training_arg = -1;
};

// The inputs the op recorded by fn writes to this call: info.written, with
// a batch norm's running statistics when it trains. Returns &info.written,
// or `scratch` filled.
const std::vector<bool>& written_now(const OpInfo& info, const c10::ArrayRef<c10::IValue>& inputs,
                                     std::vector<bool>& scratch);

// The facts of the op fn records (transparent for a record that is not an op).
const OpInfo& info_of(const at::RecordFunction& fn);

// The ops ("aten::empty", ...) whose OpInfo says unchecked. Call with the GIL
// held, before the observers of any thread look ops up.
void set_unchecked_ops(const std::vector<std::string>& names);

// Adds one of torchcast's RecordFunction callbacks to this thread (and to
// the autograd threads it starts); remove_observer undoes it and zeroes
// handle (nothing for a zero handle).
at::CallbackHandle add_observer(at::RecordFunctionCallback callback);
void remove_observer(at::CallbackHandle& handle);

// Whether this thread runs torchcast's observers only (no profiler, no other
// tool): then they may switch RecordFunction off for the ops an op calls,
// which none of them looks at.
bool sole_observer();

}  // namespace torchcast
