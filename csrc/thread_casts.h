// Casts in threads without a track's dispatch mode, reported to Python
// (thread_casts.cpp).
#pragma once

#include <Python.h>

#include <cstdint>

namespace torchcast {

// Sets the callable called at every dtype-changing aten::_to_copy and
// aten::copy_ in threads whose casts no track's dispatch mode sees, as
// callback(src, out, dtype, when):
//   when "to_copy": before a _to_copy whose result the tracker's measuring
//       op can make (a contiguous src cast on its device); out None. A
//       tensor returned is the cast's result; None: PyTorch casts, and
//       the callback is not called again;
//   when "to_copy_done": after any other _to_copy, out its result;
//   when "copy_": before a copy_ of src into a tensor of dtype writes; out
//       None.
// An exception it raises leaves the cast with it (the destination of a copy_
// unwritten). None unsets it. Call with the GIL held.
void set_cast_callback(PyObject* callback);

// Marks this thread as covered by a track's dispatch mode (its casts are the
// mode's to record).
void set_thread_tracked(bool tracked);

// Marks this thread as a tracking one whose casts are the callback's, under
// the program's dispatch modes too (no track's mode is in it).
void set_thread_direct(bool direct);

// Pauses (or resumes) the reports of this thread's casts: the tracker's own
// work. Returns whether they were paused.
bool pause_thread_casts(bool paused);

// How many times this thread entered the kernels: a cast that changed the
// count passed them (dtype_watch.cpp reports those that did not).
uint64_t cast_kernel_entries();

// Registers the kernel at aten::_to_copy's ADInplaceOrView key, once per
// process; later calls do nothing.
void install_thread_casts();

}  // namespace torchcast
