// The tracker's switches in torchcast._C (torchcast/tracker/native.py reads
// them): its kernels on aten (program_casts.cpp, thread_casts.cpp), the
// non-finite watch (cpu/nonfinite_watch.cpp) and the dtype watch
// (dtype_watch.cpp). ops.cpp's module adds them beside the ops' functions.
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "dtype_watch.h"
#include "nonfinite_watch.h"
#include "program_casts.h"
#include "thread_casts.h"
#include "tracker_module.h"

namespace {

PyObject* in_program_cast(PyObject*, PyObject*) {
  return PyBool_FromLong(torchcast::in_program_cast());
}

PyObject* set_cast_callback(PyObject*, PyObject* callback) {
  if (callback != Py_None && !PyCallable_Check(callback)) {
    PyErr_SetString(PyExc_TypeError, "set_cast_callback: expected a callable or None");
    return nullptr;
  }
  torchcast::set_cast_callback(callback);
  Py_RETURN_NONE;
}

PyObject* start_nonfinite_watch(PyObject*, PyObject* args) {
  PyObject* callback = nullptr;
  PyObject* skip = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &callback, &skip)) return nullptr;
  if (!PyCallable_Check(callback)) {
    PyErr_SetString(PyExc_TypeError, "start_nonfinite_watch: expected a callable");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  std::vector<std::string> names;
  for (const auto& name : pybind11::reinterpret_borrow<pybind11::iterable>(skip)) {
    names.push_back(name.cast<std::string>());
  }
  torchcast::start_nonfinite_watch(callback, names);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* stop_nonfinite_watch(PyObject*, PyObject*) {
  torchcast::stop_nonfinite_watch();
  Py_RETURN_NONE;
}

PyObject* take_propagated(PyObject*, PyObject*) {
  return PyLong_FromLongLong(torchcast::take_propagated());
}

PyObject* account_for_nonfinite(PyObject*, PyObject* tensor) {
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "account_for_nonfinite: expected a tensor");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  torchcast::account_for_nonfinite(THPVariable_Unpack(tensor));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* defer_writes(PyObject*, PyObject* flag) {
  const int defer = PyObject_IsTrue(flag);
  if (defer < 0) return nullptr;
  return PyLong_FromLongLong(torchcast::defer_writes(defer != 0));
}

PyObject* nonfinite_seen(PyObject*, PyObject*) {
  return PyBool_FromLong(torchcast::nonfinite_seen());
}

PyObject* check_deferred(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  torchcast::check_deferred();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* pause_nonfinite_watch(PyObject*, PyObject* flag) {
  const int pause = PyObject_IsTrue(flag);
  if (pause < 0) return nullptr;
  return PyBool_FromLong(torchcast::pause_nonfinite_watch(pause != 0));
}

PyObject* set_thread_tracked(PyObject*, PyObject* flag) {
  const int tracked = PyObject_IsTrue(flag);
  if (tracked < 0) return nullptr;
  torchcast::set_thread_tracked(tracked != 0);
  Py_RETURN_NONE;
}

PyObject* set_thread_direct(PyObject*, PyObject* flag) {
  const int direct = PyObject_IsTrue(flag);
  if (direct < 0) return nullptr;
  torchcast::set_thread_direct(direct != 0);
  Py_RETURN_NONE;
}

PyObject* pause_thread_casts(PyObject*, PyObject* flag) {
  const int pause = PyObject_IsTrue(flag);
  if (pause < 0) return nullptr;
  return PyBool_FromLong(torchcast::pause_thread_casts(pause != 0));
}

PyObject* start_dtype_watch(PyObject*, PyObject* callback) {
  if (!PyCallable_Check(callback)) {
    PyErr_SetString(PyExc_TypeError, "start_dtype_watch: expected a callable");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  torchcast::start_dtype_watch(callback);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* stop_dtype_watch(PyObject*, PyObject*) {
  torchcast::stop_dtype_watch();
  Py_RETURN_NONE;
}

PyObject* pause_dtype_watch(PyObject*, PyObject* flag) {
  const int pause = PyObject_IsTrue(flag);
  if (pause < 0) return nullptr;
  return PyBool_FromLong(torchcast::pause_dtype_watch(pause != 0));
}

PyObject* install_tracker_kernels(PyObject*, PyObject*) {
  torchcast::install_program_casts();
  torchcast::install_thread_casts();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"install_tracker_kernels", install_tracker_kernels, METH_NOARGS,
     "Registers the tracker's kernels on aten::_to_copy and aten::copy_ (csrc/program_casts.cpp, "
     "csrc/thread_casts.cpp), once per process; importing torchcast registers none."},
    {"in_program_cast", in_program_cast, METH_NOARGS,
     "Whether this thread is inside a cast the program asked for under autocast "
     "(csrc/program_casts.cpp)."},
    {"set_cast_callback", set_cast_callback, METH_O,
     "Sets callback(src, out, dtype), called at every cast in threads whose casts no track's "
     "dispatch mode sees; None unsets it (csrc/thread_casts.cpp)."},
    {"start_nonfinite_watch", start_nonfinite_watch, METH_VARARGS,
     "Checks this thread's CPU ops for NaN/inf made from finite inputs, calling "
     "callback(op, overload, outputs, inputs, before, entered, batch) at each "
     "(csrc/cpu/nonfinite_watch.cpp)."},
    {"stop_nonfinite_watch", stop_nonfinite_watch, METH_NOARGS,
     "Stops this thread's non-finite watch."},
    {"account_for_nonfinite", account_for_nonfinite, METH_O,
     "Has the non-finite watch take a tensor's NaN/inf as accounted for (a collective's "
     "output), not as entering."},
    {"take_propagated", take_propagated, METH_NOARGS,
     "Op calls that made NaN/inf only from non-finite inputs, since the last call."},
    {"defer_writes", defer_writes, METH_O,
     "Defers (True) the check of what this thread's ops write, as an optimizer's step "
     "runs, to where it is next read; returns the batch number (-1 when stopping)."},
    {"nonfinite_seen", nonfinite_seen, METH_NOARGS,
     "Whether a watched op has written NaN/inf since the watch started."},
    {"check_deferred", check_deferred, METH_NOARGS,
     "Reads every deferred write not checked yet, reporting its origins."},
    {"pause_nonfinite_watch", pause_nonfinite_watch, METH_O,
     "Pauses (True) or resumes the non-finite watch in this thread; returns whether it was "
     "paused."},
    {"set_thread_tracked", set_thread_tracked, METH_O,
     "Marks this thread as covered by a track's dispatch mode (csrc/thread_casts.cpp)."},
    {"set_thread_direct", set_thread_direct, METH_O,
     "Marks this thread as a tracking one whose casts the cast callback reports "
     "(csrc/thread_casts.cpp)."},
    {"pause_thread_casts", pause_thread_casts, METH_O,
     "Pauses (True) or resumes the reports of this thread's casts; returns whether they were "
     "paused (csrc/thread_casts.cpp)."},
    {"start_dtype_watch", start_dtype_watch, METH_O,
     "Watches this thread's ops for float64 promotions, failures with mixed dtypes and casts "
     "the cast kernels miss, calling callback(kind, a, b, c) (csrc/dtype_watch.cpp)."},
    {"stop_dtype_watch", stop_dtype_watch, METH_NOARGS, "Stops this thread's dtype watch."},
    {"pause_dtype_watch", pause_dtype_watch, METH_O,
     "Pauses (True) or resumes the dtype watch in this thread; returns whether it was paused."},
    
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

namespace torchcast {

PyMethodDef* tracker_methods() { return methods; }

}  // namespace torchcast
