// The Python functions of the tracker's C++ parts (tracker_module.cpp), which
// torchcast._C's module init adds beside the ops' own.
#pragma once

#include <Python.h>

namespace torchcast {

// A method table ending in a {nullptr} entry, for PyModule_AddFunctions.
PyMethodDef* tracker_methods();

}  // namespace torchcast
