// The one registration point: op schemas, their per-backend kernels, and the
// Python module that loading torchcast._C needs.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

extern "C" {
// An empty module: importing torchcast._C runs the static registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
#ifdef TORCHCAST_WITH_CUDA
  PyModule_AddIntConstant(module, "with_cuda", 1);
#else
  PyModule_AddIntConstant(module, "with_cuda", 0);
#endif
  return module;
}
}

TORCH_LIBRARY(torchcast, m) {
  m.def("cast_with_stats(Tensor x, ScalarType dtype) -> (Tensor y, Tensor stats)");
  m.def("cast_with_stats.out(Tensor x, ScalarType dtype, *, Tensor(a!) out) -> Tensor stats");

  // adam_step_ (torchcast.optim): steps every tensor of one dtype group in
  // place, state counts included.
#define TORCHCAST_ADAM_ARGS(LR)                                                                 \
  "(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, " \
  "Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] compensations, Tensor(g!)[] state_steps, *, "    \
  LR ", float beta1, float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, " \
  "bool decoupled_weight_decay, str compensation, Tensor? grad_scale=None, "                   \
  "Tensor? found_inf=None) -> ()"
  m.def("adam_step_" TORCHCAST_ADAM_ARGS("float lr"));
  m.def("adam_step_.tensor_lr" TORCHCAST_ADAM_ARGS("Tensor lr"));
#undef TORCHCAST_ADAM_ARGS
  // kahan_sum / kahan_mean: arguments as torch.sum / torch.mean.
  m.def("kahan_sum(Tensor x, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor");
  m.def("kahan_mean(Tensor x, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("cast_with_stats", &torchcast::cast_with_stats_cpu);
  m.impl("cast_with_stats.out", &torchcast::cast_with_stats_out_cpu);
  m.impl("adam_step_", &torchcast::adam_step_cpu);
  m.impl("adam_step_.tensor_lr", &torchcast::adam_step_tensor_lr_cpu);
  m.impl("kahan_sum", &torchcast::kahan_sum_cpu);
  m.impl("kahan_mean", &torchcast::kahan_mean_cpu);
}

#ifdef TORCHCAST_WITH_CUDA
TORCH_LIBRARY_IMPL(torchcast, CUDA, m) {
  m.impl("cast_with_stats", &torchcast::cast_with_stats_cuda);
  m.impl("cast_with_stats.out", &torchcast::cast_with_stats_out_cuda);
  m.impl("adam_step_", &torchcast::adam_step_cuda);
  m.impl("adam_step_.tensor_lr", &torchcast::adam_step_tensor_lr_cuda);
  m.impl("kahan_sum", &torchcast::kahan_sum_cuda);
  m.impl("kahan_mean", &torchcast::kahan_mean_cuda);
}
#endif

// Autograd in C++ (see csrc/cast_autograd.cpp): y's derivative is the
// identity, stats is not differentiable.
TORCH_LIBRARY_IMPL(torchcast, Autograd, m) {
  m.impl("cast_with_stats", &torchcast::cast_with_stats_autograd);
  m.impl("cast_with_stats.out", &torchcast::cast_with_stats_out_autograd);
}

// Autocast passes the cast through untouched: re-casting x before the op
// would hide the very error being measured, and y must keep the dtype asked
// for. An explicit fallthrough states this instead of relying on the default.
TORCH_LIBRARY_IMPL(torchcast, AutocastCPU, m) {
  m.impl("cast_with_stats", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(torchcast, AutocastCUDA, m) {
  m.impl("cast_with_stats", torch::CppFunction::makeFallthrough());
}
