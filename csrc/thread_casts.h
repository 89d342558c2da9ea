// Casts in threads without a track's dispatch mode, reported to Python
// (thread_casts.cpp).
#pragma once

#include <Python.h>

namespace torchcast {

// Sets the callable called as callback(src, out) after every dtype-changing
// aten::_to_copy in a thread no track's dispatch mode covers; None unsets it.
// Call with the GIL held.
void set_cast_callback(PyObject* callback);

// Marks this thread as covered by a track's dispatch mode (its casts are the
// mode's to record).
void set_thread_tracked(bool tracked);

// Registers the kernel at aten::_to_copy's ADInplaceOrView key, once per
// process; later calls do nothing.
void install_thread_casts();

}  // namespace torchcast
