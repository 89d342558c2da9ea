// The op schemas and the Python module that loading torchcast._C needs (the
// tracker's functions in it: tracker_module.cpp). Each backend registers its
// kernels at the end of its own file (csrc/cpu/*.cpp, csrc/cuda/*.cu),
// autograd in autograd.cpp.
#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <utility>

#include "adam_modes.h"
#include "all_finite.h"
#include "cast_common.h"
#include "formats.h"
#include "numerics.h"
#include "tracker_module.h"

namespace {

// ("numel", "nan", ...): the names of the stats tensor's entries, in order.
PyObject* stat_fields() {
  static constexpr const char* kNames[] = {
#define TORCHCAST_STAT_NAME(index, name) name,
      TORCHCAST_STATS(TORCHCAST_STAT_NAME)
#undef TORCHCAST_STAT_NAME
  };
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == torchcast::kNumStats, "one name a stat");
  PyObject* fields = PyTuple_New(torchcast::kNumStats);
  if (fields == nullptr) return nullptr;
  for (int i = 0; i < torchcast::kNumStats; ++i) {
    PyObject* name = PyUnicode_FromString(kNames[i]);
    if (name == nullptr) {
      Py_DECREF(fields);
      return nullptr;
    }
    PyTuple_SET_ITEM(fields, i, name);
  }
  return fields;
}

// {name: (bits, exponent bits, mantissa bits, bias, emax, max, smallest
// normal, smallest subnormal, has inf, has NaN, rank)}: formats.h's table, which
// tests/test_formats.py checks against torchcast/formats.py's.
PyObject* format_traits() {
  PyObject* table = PyDict_New();
  if (table == nullptr) return nullptr;
  bool ok = true;
  const auto add = [&](auto format) {
    using F = decltype(format);
    PyObject* row = Py_BuildValue("(iiiiidddOOi)", F::kBits, F::kExpBits, F::kMant, F::kBias,
                                  F::kEmax, static_cast<double>(F::kMax),
                                  static_cast<double>(F::kMinNormal),
                                  static_cast<double>(F::kMinSubnormal),
                                  F::kHasInf ? Py_True : Py_False, F::kHasNaN ? Py_True : Py_False,
                                  F::kRank);
    ok = ok && row != nullptr && PyDict_SetItemString(table, F::kName, row) == 0;
    Py_XDECREF(row);
  };
#define TORCHCAST_ADD_FORMAT(F) add(torchcast::F{});
  TORCHCAST_FORMATS(TORCHCAST_ADD_FORMAT)
#undef TORCHCAST_ADD_FORMAT
  if (!ok) {
    Py_DECREF(table);
    return nullptr;
  }
  return table;
}

// ((name, carried, param dtypes, instead, needs), ...): adam_modes.h's table
// of compensation modes, which tests/test_adam_modes.py checks against
// torchcast/adam_modes.py's. carried: "nothing", "param" (a buffer of the
// param's dtype), "int16" or "int8"; param dtypes: a tuple of dtype names.
PyObject* adam_compensations() {
  static constexpr const char* kCarried[] = {"nothing", "param", "int16", "int8"};
  static constexpr std::pair<uint32_t, const char*> kDtypes[] = {
      {torchcast::kParamFloat64, "float64"}, {torchcast::kParamFloat32, "float32"},
      {torchcast::kParamBFloat16, "bfloat16"}, {torchcast::kParamFloat16, "float16"}};
  PyObject* table = PyTuple_New(torchcast::kNumCompensations);
  if (table == nullptr) return nullptr;
  for (int i = 0; i < torchcast::kNumCompensations; ++i) {
    const torchcast::CompensationInfo& c = torchcast::kCompensations[i];
    PyObject* names = PyList_New(0);
    for (const auto& [bit, name] : kDtypes) {
      if (names == nullptr || (c.param_dtypes & bit) == 0) continue;
      PyObject* item = PyUnicode_FromString(name);
      if (item == nullptr || PyList_Append(names, item) < 0) Py_CLEAR(names);
      Py_XDECREF(item);
    }
    PyObject* dtypes = names == nullptr ? nullptr : PyList_AsTuple(names);
    Py_XDECREF(names);
    PyObject* row = dtypes == nullptr ? nullptr
                                      : Py_BuildValue("(ssNss)", c.name, kCarried[c.carried],
                                                      dtypes, c.instead, c.needs);
    if (row == nullptr) {
      Py_DECREF(table);
      return nullptr;
    }
    PyTuple_SET_ITEM(table, i, row);
  }
  return table;
}

PyObject* exact_cast_stats(PyObject*, PyObject* tensor) {
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "exact_cast_stats: expected a tensor");
    return nullptr;
  }
  HANDLE_TH_ERRORS  // c10 errors become the Python exceptions torch raises for them
  return THPVariable_Wrap(torchcast::exact_cast_stats(THPVariable_Unpack(tensor)));
  END_HANDLE_TH_ERRORS
}

// Whether torch.ops would leave obj's __torch_function__ alone: no torch
// function mode is on, and obj is a torch.Tensor or of a class that disables
// __torch_function__, as nn.Parameter does. Sets no Python error.
bool without_torch_function(PyObject* obj) {
  if (at::impl::torch_function_mode_enabled()) return false;
  if (THPVariable_CheckExact(obj)) return true;
  static PyObject* const disabled = [] {
    PyObject* c = PyImport_ImportModule("torch._C");
    PyObject* impl =
        c != nullptr ? PyObject_GetAttrString(c, "_disabled_torch_function_impl") : nullptr;
    Py_XDECREF(c);
    PyErr_Clear();
    return impl;  // kept for the life of the process
  }();
  PyObject* impl =
      PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(obj)), "__torch_function__");
  if (impl == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool is_disabled = disabled != nullptr && impl == disabled;
  Py_DECREF(impl);
  return is_disabled;
}

// plain_tensor(x): whether x needs none of torchcast._inputs.check_input's
// questions: a torch.Tensor or nn.Parameter (exactly), dense and strided,
// neither quantized nor nested, and outside every torch.func transform (no
// functorch or functionalization wrapper). False sends the caller to those
// questions; one call instead of five attribute reads, a tenth of a small
// safe_to.
PyObject* plain_tensor(PyObject*, PyObject* obj) {
  static PyTypeObject* const parameter = [] {
    PyObject* module = PyImport_ImportModule("torch.nn.parameter");
    PyObject* cls = module != nullptr ? PyObject_GetAttrString(module, "Parameter") : nullptr;
    Py_XDECREF(module);
    PyErr_Clear();
    return reinterpret_cast<PyTypeObject*>(cls);  // kept for the life of the process
  }();
  if (!THPVariable_CheckExact(obj) && !(parameter != nullptr && Py_TYPE(obj) == parameter)) {
    Py_RETURN_FALSE;
  }
  const at::Tensor& x = THPVariable_Unpack(obj);
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::BatchedNestedTensor});
  return PyBool_FromLong(x.layout() == at::kStrided && !x.is_quantized() && !x.is_nested() &&
                         !x.key_set().has_any(wrapped));
}

// An op's results as a Python tuple of tensors (nullptr, with the error set,
// if one cannot be made).
template <typename... Tensors>
PyObject* wrap_tensors(std::tuple<Tensors...>&& results) {
  PyObject* tuple = PyTuple_New(sizeof...(Tensors));
  if (tuple == nullptr) return nullptr;
  Py_ssize_t i = 0;
  bool wrapped = true;
  const auto add = [&](at::Tensor& t) {
    PyObject* item = wrapped ? THPVariable_Wrap(std::move(t)) : nullptr;
    wrapped = item != nullptr;
    if (wrapped) PyTuple_SET_ITEM(tuple, i++, item);
  };
  std::apply([&](auto&... t) { (add(t), ...); }, results);
  if (!wrapped) {
    Py_DECREF(tuple);  // its unset items are NULL, which tuple deallocation skips
    return nullptr;
  }
  return tuple;
}

// cast_with_stats(x, dtype, scale=None, saturate=None, out=None) -> (y, stats)
// or None: torch.ops.torchcast.cast_with_stats (its .out overload with out,
// y being out) through the dispatcher (autograd, dispatch modes, every
// backend as there), without torch.ops' conversion of the arguments to a
// boxed stack and back, which costs about 2 us a call, more than a small cast
// itself. None, and nothing done, where torch.ops is to answer instead:
// arguments of other types (torch.ops' own errors), or __torch_function__
// applies (a mode is on, or an argument's class overrides it), or x is on a
// device without compiled kernels.
PyObject* cast_with_stats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 5 || !THPVariable_Check(args[0]) || !THPDtype_Check(args[1]) ||
      (nargs > 2 && args[2] != Py_None && !THPVariable_Check(args[2])) ||
      (nargs > 3 && args[3] != Py_None && !PyBool_Check(args[3])) ||
      (nargs > 4 && args[4] != Py_None && !THPVariable_Check(args[4]))) {
    Py_RETURN_NONE;
  }
  const bool scaled = nargs > 2 && args[2] != Py_None;
  const bool into_out = nargs > 4 && args[4] != Py_None;
  if (!without_torch_function(args[0]) || (scaled && !without_torch_function(args[2])) ||
      (into_out && !without_torch_function(args[4]))) {
    Py_RETURN_NONE;
  }
  HANDLE_TH_ERRORS
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchcast::cast_with_stats", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                    const std::optional<at::Tensor>&,
                                                    std::optional<bool>)>();
  static const auto out_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchcast::cast_with_stats", "out")
          .typed<at::Tensor(const at::Tensor&, at::ScalarType, const std::optional<at::Tensor>&,
                            std::optional<bool>, at::Tensor&)>();
  static const bool cuda_kernels = op.hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  const at::Tensor& x = THPVariable_Unpack(args[0]);
  // Devices with compiled kernels only: elsewhere the caller runs the
  // pure-PyTorch fallback, saying so.
  if (!(x.is_cpu() || (x.is_cuda() && cuda_kernels))) Py_RETURN_NONE;
  const auto dtype = reinterpret_cast<THPDtype*>(args[1])->scalar_type;
  const std::optional<at::Tensor> scale =
      scaled ? std::optional<at::Tensor>(THPVariable_Unpack(args[2])) : std::nullopt;
  std::optional<bool> saturate;
  if (nargs > 3 && args[3] != Py_None) saturate = args[3] == Py_True;
  std::tuple<at::Tensor, at::Tensor> result;
  {
    // As torch.ops: other Python threads run while the kernel does (a
    // Python kernel or dispatch mode takes the GIL back itself).
    pybind11::gil_scoped_release no_gil;
    if (into_out) {
      at::Tensor out = THPVariable_Unpack(args[4]);
      at::Tensor stats = out_op.call(x, dtype, scale, saturate, out);
      result = {std::move(out), std::move(stats)};
    } else {
      result = op.call(x, dtype, scale, saturate);
    }
  }
  return wrap_tensors(std::move(result));
  END_HANDLE_TH_ERRORS
}

// tensor_health(x) -> (counts, hist, extrema) or None: as cast_with_stats,
// torch.ops.torchcast.tensor_health without torch.ops' argument conversion
// (track(health=True) measures every module output and gradient with it).
PyObject* tensor_health(PyObject*, PyObject* obj) {
  if (!THPVariable_Check(obj) || !without_torch_function(obj)) Py_RETURN_NONE;
  HANDLE_TH_ERRORS
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchcast::tensor_health", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&)>();
  static const bool cuda_kernels = op.hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  const at::Tensor& x = THPVariable_Unpack(obj);
  if (!(x.is_cpu() || (x.is_cuda() && cuda_kernels))) Py_RETURN_NONE;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result;
  {
    pybind11::gil_scoped_release no_gil;
    result = op.call(x);
  }
  return wrap_tensors(std::move(result));
  END_HANDLE_TH_ERRORS
}

PyObject* all_finite(PyObject*, PyObject* tensor) {
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "all_finite: expected a tensor");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  return PyBool_FromLong(torchcast::all_finite(THPVariable_Unpack(tensor)));
  END_HANDLE_TH_ERRORS
}

PyObject* all_finite_amax(PyObject*, PyObject* tensor) {
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "all_finite_amax: expected a tensor");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  double amax = 0;
  if (!torchcast::all_finite_amax(THPVariable_Unpack(tensor), amax)) Py_RETURN_NONE;
  return PyFloat_FromDouble(amax);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"exact_cast_stats", exact_cast_stats, METH_O,
     "The stats tensor cast_with_stats gives an exact cast of a floating tensor (numel and "
     "its NaN count), without casting it (csrc/cast_common.cpp)."},
    {"cast_with_stats",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(cast_with_stats)), METH_FASTCALL,
     "torch.ops.torchcast.cast_with_stats(x, dtype, scale, saturate=saturate), or its .out "
     "overload given out, without torch.ops' argument conversion; None where torch.ops is to "
     "answer instead."},
    {"tensor_health", tensor_health, METH_O,
     "torch.ops.torchcast.tensor_health(x) without torch.ops' argument conversion; None where "
     "torch.ops is to answer instead."},
    {"plain_tensor", plain_tensor, METH_O,
     "Whether x is a dense strided torch.Tensor or nn.Parameter outside every torch.func "
     "transform."},
    {"all_finite", all_finite, METH_O,
     "Whether every element of a CPU tensor is finite (csrc/cpu/all_finite.cpp)."},
    {"all_finite_amax", all_finite_amax, METH_O,
     "A CPU tensor's largest |x|, read in one pass, or None when an element is NaN/inf "
     "(csrc/cpu/all_finite.cpp)."},{nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
// Importing torchcast._C runs the static registrations of every file (on
// torchcast's own ops only; the tracker's kernels on aten wait for
// install_tracker_kernels); the module itself holds constants, the ops'
// entries without torch.ops' boxing, and the tracker's switches
// (tracker_module.cpp).
// with_cuda: whether the CUDA kernels were built (and so registered).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (PyModule_AddFunctions(module, torchcast::tracker_methods()) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  const auto op = c10::Dispatcher::singleton().findSchema({"torchcast::cast_with_stats", ""});
  const bool with_cuda = op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  PyObject* fields = stat_fields();
  if (PyModule_AddIntConstant(module, "with_cuda", with_cuda ? 1 : 0) < 0 || fields == nullptr ||
      PyModule_AddObject(module, "stat_fields", fields) < 0) {
    Py_XDECREF(fields);
    Py_DECREF(module);
    return nullptr;
  }
  PyObject* formats = format_traits();
  if (formats == nullptr || PyModule_AddObject(module, "format_traits", formats) < 0) {
    Py_XDECREF(formats);
    Py_DECREF(module);
    return nullptr;
  }
  PyObject* compensations = adam_compensations();
  if (compensations == nullptr ||
      PyModule_AddObject(module, "adam_compensations", compensations) < 0) {
    Py_XDECREF(compensations);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(torchcast, m) {
  // scale: y = round(x * scale); saturate: None does what x.to(dtype) does
  // (kernel_scale, resolve_saturate: cast_common.h).
  m.def("cast_with_stats(Tensor x, ScalarType dtype, Tensor? scale=None, *, bool? saturate=None) "
        "-> (Tensor y, Tensor stats)");
  m.def("cast_with_stats.out(Tensor x, ScalarType dtype, Tensor? scale=None, *, "
        "bool? saturate=None, Tensor(a!) out) -> Tensor stats");

  // adam_step_ (torchcast.optim): steps every tensor of one dtype group in
  // place, state counts included.
#define TORCHCAST_ADAM_ARGS(LR)                                                                 \
  "(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, " \
  "Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] compensations, Tensor(g!)[] state_steps, *, "    \
  LR ", float beta1, float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, " \
  "bool decoupled_weight_decay, str compensation, Tensor? grad_scale=None, "                   \
  "Tensor? found_inf=None, int seed=0, Tensor(h!)[]? update_stats=None, "                      \
  "Tensor(i!)[]? moment_scales=None) -> ()"
  m.def("adam_step_" TORCHCAST_ADAM_ARGS("float lr"));
  m.def("adam_step_.tensor_lr" TORCHCAST_ADAM_ARGS("Tensor lr"));
#undef TORCHCAST_ADAM_ARGS
  // kahan_sum / kahan_mean: arguments as torch.sum / torch.mean.
  m.def("kahan_sum(Tensor x, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor");
  m.def("kahan_mean(Tensor x, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor");
  // tensor_health: counts, exponent histogram and extrema of x (layout: health.h).
  m.def("tensor_health(Tensor x) -> (Tensor counts, Tensor hist, Tensor extrema)");
  // block_cast: x cast to a block-scaled format along its last dimension,
  // with what it lost (block_cast.h; the Python face is torchcast/block.py).
  m.def("block_cast(Tensor x, str format, int block_size, str scale_mode, "
        "Tensor? tensor_scale=None) -> (Tensor data, Tensor scales, Tensor stats, "
        "Tensor scale_hist, Tensor block_counts)");
}

// Autocast passes the cast through untouched: re-casting x before the op
// would hide the very error being measured, and y must keep the dtype asked
// for. An explicit fallthrough states this instead of relying on the default.
TORCH_LIBRARY_IMPL(torchcast, AutocastCPU, m) {
  m.impl("cast_with_stats", torch::CppFunction::makeFallthrough());
  m.impl("block_cast", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(torchcast, AutocastCUDA, m) {
  m.impl("cast_with_stats", torch::CppFunction::makeFallthrough());
  m.impl("block_cast", torch::CppFunction::makeFallthrough());
}
