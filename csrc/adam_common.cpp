#include "adam_common.h"

#include <c10/util/Exception.h>

#include <string>

#include "cast_common.h"

namespace torchcast {
namespace {

// "'none', 'kahan', 'remainder' or 'stochastic'": the table's names.
std::string compensation_names() {
  std::string out;
  for (int i = 0; i < kNumCompensations; ++i) {
    if (i > 0) out += i + 1 == kNumCompensations ? " or " : ", ";
    out += std::string("'") + kCompensations[i].name + "'";
  }
  return out;
}

const CompensationInfo& parse_compensation(std::string_view s) {
  const CompensationInfo* info = find_compensation(s);
  TORCH_CHECK_VALUE(info != nullptr, "torchcast.adam_step_: compensation must be ",
                    compensation_names(), ", got '", std::string(s), "'");
  return *info;
}

uint32_t param_dtype_bit(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return kParamFloat64;
    case at::kFloat: return kParamFloat32;
    case at::kBFloat16: return kParamBFloat16;
    case at::kHalf: return kParamFloat16;
    default: return 0;
  }
}

bool is_narrow(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

void check_state_dtype(at::ScalarType param, at::ScalarType state, int64_t i) {
  const bool ok = is_narrow(param)
                      ? (state == at::kFloat || state == at::kBFloat16 || state == at::kChar)
                      : state == param;
  TORCH_CHECK_TYPE(ok, "torchcast.adam_step_: param ", i, " is ", dtype_name(param),
                   " but its optimizer states are ", dtype_name(state),
                   "; supported: float32, bfloat16 or 8-bit (int8) states for bfloat16/float16 "
                   "params, the param's own dtype for float32/float64 params");
}

void check_same_shape(const at::Tensor& p, const at::Tensor& t, const char* what, int64_t i) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "torchcast.adam_step_: ", what, " ", i,
                    " is not a dense tensor (layout ", t.layout(),
                    "); Adam does not support sparse gradients, use torch.optim.SparseAdam");
  TORCH_CHECK_VALUE(t.sizes() == p.sizes(), "torchcast.adam_step_: ", what, " ", i,
                    " has shape ", t.sizes(), " but its param has shape ", p.sizes());
  TORCH_CHECK(t.device() == p.device(), "torchcast.adam_step_: ", what, " ", i, " is on ",
              t.device(), " but its param is on ", p.device());
}

}  // namespace

Compensation check_adam_args(const AdamTensors& args, bool amsgrad, std::string_view compensation,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf,
                             const std::optional<at::TensorList>& update_stats) {
  const at::TensorList &params = args.params, &grads = args.grads, &exp_avgs = args.exp_avgs,
                       &exp_avg_sqs = args.exp_avg_sqs, &max_exp_avg_sqs = args.max_exp_avg_sqs,
                       &compensations = args.compensations, &state_steps = args.state_steps;
  const CompensationInfo& info = parse_compensation(compensation);
  const Compensation mode = info.mode;
  const auto n = static_cast<int64_t>(params.size());
  const auto count = [&](at::TensorList l, int64_t want, const char* what) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(l.size()) == want, "torchcast.adam_step_: ",
                      want, " ", what, " expected (one per param", want == 0 ? ", none here" : "",
                      "), got ", l.size());
  };
  count(grads, n, "grads");
  count(exp_avgs, n, "exp_avgs");
  count(exp_avg_sqs, n, "exp_avg_sqs");
  count(max_exp_avg_sqs, amsgrad ? n : 0, "max_exp_avg_sqs");
  count(compensations, carries(mode) ? n : 0, "compensations");
  count(state_steps, n, "state_steps");
  if (update_stats.has_value()) count(*update_stats, n, "update_stats");
  if (n == 0) return mode;

  const at::ScalarType pt = params[0].scalar_type();
  const at::ScalarType st = exp_avgs[0].scalar_type();
  TORCH_CHECK_TYPE(param_dtype_bit(pt) != 0,
                   "torchcast.adam_step_: params must be float64, float32, bfloat16 or float16, "
                   "got ", dtype_name(pt));
  TORCH_CHECK_TYPE(steps_param(mode, param_dtype_bit(pt)), "torchcast.adam_step_: ", info.needs,
                   ", got ", dtype_name(pt), "; use compensation='", info.instead, "'");
  check_state_dtype(pt, st, 0);
  const bool eight_bit = st == at::kChar;
  const at::ScalarType sqt = eight_bit ? at::kByte : st;
  TORCH_CHECK_VALUE(eight_bit == args.moment_scales.has_value(), "torchcast.adam_step_: ",
                    eight_bit ? "8-bit moments (int8 exp_avgs) need moment_scales"
                              : "moment_scales are for 8-bit moments (int8 exp_avgs), but "
                                "exp_avg 0 is ",
                    eight_bit ? "" : dtype_name(st));
  TORCH_CHECK_VALUE(!(eight_bit && amsgrad), "torchcast.adam_step_: amsgrad is not supported "
                    "with 8-bit moments; use float32 or bfloat16 states");
  if (eight_bit) count(*args.moment_scales, n, "moment_scales");
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.layout() == at::kStrided, "torchcast.adam_step_: param ", i,
                      " is not a dense tensor");
    TORCH_CHECK(p.device() == params[0].device(), "torchcast.adam_step_: param ", i, " is on ",
                p.device(), " but param 0 is on ", params[0].device(),
                "; one call steps one device");
    TORCH_CHECK_TYPE(p.scalar_type() == pt, "torchcast.adam_step_: param ", i, " is ",
                     dtype_name(p.scalar_type()), " but param 0 is ", dtype_name(pt),
                     "; one call steps one dtype group");
    TORCH_CHECK_TYPE(grads[i].scalar_type() == pt, "torchcast.adam_step_: grad ", i, " is ",
                     dtype_name(grads[i].scalar_type()), " but its param is ", dtype_name(pt),
                     "; cast the gradient to the param's dtype");
    check_same_shape(p, grads[i], "grad", i);
    const auto check_state = [&](const at::Tensor& s, const char* what, at::ScalarType want) {
      TORCH_CHECK_TYPE(s.scalar_type() == want, "torchcast.adam_step_: ", what, " ", i, " is ",
                       dtype_name(s.scalar_type()), " but exp_avg 0 is ", dtype_name(st),
                       eight_bit ? " (8-bit moments: exp_avg_sq is uint8)" : "");
      check_same_shape(p, s, what, i);
    };
    check_state(exp_avgs[i], "exp_avg", st);
    check_state(exp_avg_sqs[i], "exp_avg_sq", sqt);
    if (amsgrad) check_state(max_exp_avg_sqs[i], "max_exp_avg_sq", st);
    if (eight_bit) {
      const at::Tensor& sc = (*args.moment_scales)[i];
      const int64_t blocks = (p.numel() + Moments8::kBlock - 1) / Moments8::kBlock;
      TORCH_CHECK_VALUE(sc.scalar_type() == at::kFloat && sc.layout() == at::kStrided &&
                            sc.dim() == 2 && sc.size(0) == 2 && sc.size(1) == blocks &&
                            sc.is_contiguous(),
                        "torchcast.adam_step_: moment_scales ", i, " must be a contiguous "
                        "float32 tensor of shape (2, ", blocks, ") (one scale per moment and "
                        "block of ", Moments8::kBlock, " elements), got ",
                        dtype_name(sc.scalar_type()), " of shape ", sc.sizes());
      TORCH_CHECK(sc.device() == p.device(), "torchcast.adam_step_: moment_scales ", i,
                  " is on ", sc.device(), " but its param is on ", p.device());
    }
    if (carries(mode)) {
      const at::ScalarType ct = info.carried == kCarriesInt16 ? at::kShort
                                 : info.carried == kCarriesInt8 ? at::kChar
                                                                : pt;
      TORCH_CHECK_TYPE(compensations[i].scalar_type() == ct, "torchcast.adam_step_: ",
                       "compensation ", i, " is ", dtype_name(compensations[i].scalar_type()),
                       " but must be ", dtype_name(ct));
      check_same_shape(p, compensations[i], "compensation", i);
    }
    if (update_stats.has_value()) {
      const at::Tensor& u = (*update_stats)[i];
      TORCH_CHECK_TYPE(u.scalar_type() == at::kLong, "torchcast.adam_step_: update_stats ", i,
                       " is ", dtype_name(u.scalar_type()), " but must be torch.int64");
      TORCH_CHECK_VALUE(u.layout() == at::kStrided && u.dim() == 1 &&
                            u.size(0) == kNumUpdateStats && u.is_contiguous(),
                        "torchcast.adam_step_: update_stats ", i, " must be a contiguous "
                        "int64 tensor of ", static_cast<int>(kNumUpdateStats),
                        " elements, got shape ", u.sizes());
      TORCH_CHECK(u.device() == p.device(), "torchcast.adam_step_: update_stats ", i,
                  " is on ", u.device(), " but its param is on ", p.device());
    }
    const at::Tensor& s = state_steps[i];
    TORCH_CHECK_VALUE(s.numel() == 1 && (s.scalar_type() == at::kFloat ||
                                         s.scalar_type() == at::kDouble),
                      "torchcast.adam_step_: state_step ", i,
                      " must be a one-element float32 or float64 tensor, got ",
                      dtype_name(s.scalar_type()), " with ", s.numel(), " elements");
    // Read and written on the host, also for CUDA params (as torch's fused
    // Adam keeps them); checked here, before any grad is unscaled or any
    // count incremented.
    TORCH_CHECK(s.device().is_cpu(), "torchcast.adam_step_: state_step ", i, " is on ",
                s.device(), " but state steps must be on the CPU");
  }
  const auto check_scalar = [&](const std::optional<at::Tensor>& t, const char* what) {
    TORCH_CHECK_VALUE(!t.has_value() || (t->numel() == 1 && t->is_floating_point()),
                      "torchcast.adam_step_: ", what, " must be a one-element floating tensor");
    if (t.has_value() && n > 0) check_scalar_device(*t, what, params[0].device());
  };
  check_scalar(grad_scale, "grad_scale");
  check_scalar(found_inf, "found_inf");
  return mode;
}

void check_scalar_device(const at::Tensor& t, const char* what, const at::Device& params) {
  TORCH_CHECK(t.device().is_cpu() || t.device() == params, "torchcast.adam_step_: ", what,
              " is on ", t.device(), " but the params are on ", params,
              "; put it on the CPU or the params' device");
}

TensorOperands::TensorOperands(const at::Tensor& param, const at::Tensor& grad,
                               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                               const at::Tensor* max_sq, const at::Tensor* comp,
                               bool grad_mutated) {
  p = param;
  if (!param.is_non_overlapping_and_dense()) {
    p = param.contiguous();
    write_back.emplace_back(param, p);
  }
  g = stage(grad, grad_mutated);
  m = stage(exp_avg, true);
  v = stage(exp_avg_sq, true);
  if (max_sq) vmax = stage(*max_sq, true);
  if (comp) c = stage(*comp, true);
}

at::Tensor TensorOperands::stage(const at::Tensor& t, bool mutated) {
  if (t.strides() == p.strides()) return t;
  at::Tensor s = at::empty_like(p, t.options());
  s.copy_(t);
  if (mutated) write_back.emplace_back(t, s);
  return s;
}

void TensorOperands::finish() {
  for (auto& [orig, staged] : write_back) orig.copy_(staged);
}

double increment_step(const at::Tensor& step) {
  TORCH_CHECK(step.device().is_cpu(), "torchcast.adam_step_: state steps must be on the CPU, "
              "got one on ", step.device());
  if (step.scalar_type() == at::kDouble) {
    double* s = step.data_ptr<double>();
    return *s += 1.0;
  }
  float* s = step.data_ptr<float>();
  return *s += 1.0f;
}

}  // namespace torchcast
