// track(all_casts=True) without a dispatch mode: what the mode found in ops
// that are not casts, found by a RecordFunction callback of the tracking
// thread instead (dtype_watch.cpp). The casts themselves reach the tracker
// through thread_casts.cpp's kernels.
#pragma once

#include <Python.h>

namespace torchcast {

// Starts watching this thread's ops (and those of the autograd threads it
// starts). callback is called, with the GIL, as
//   callback("promotion", op, inputs, output): an op returned a float64
//       tensor from floating inputs of several dtypes;
//   callback("failure", op, inputs, None): an op with floating inputs of
//       several dtypes raised (called while its exception propagates);
//   callback("cast", src, out, dtype): a dtype-changing _to_copy (out its
//       result) or copy_ (out None, already written) that thread_casts.cpp's
//       kernels did not see (torch.inference_mode skips their key).
// Ops that an op which does not decompose calls (its implementation) and
// torchcast's own ops are not looked at. An exception the callback raises
// is printed as unraisable. Call with the GIL held; one watch per thread.
void start_dtype_watch(PyObject* callback);

// Stops this thread's watch (nothing if none).
void stop_dtype_watch();

// Pauses (or resumes) the watch in this thread: the tracker's own ops.
// Returns whether it was paused.
bool pause_dtype_watch(bool paused);

}  // namespace torchcast
