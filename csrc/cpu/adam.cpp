// adam_step_ on the CPU: one pass over param, grad, moments and compensation
// for every tensor of a dtype group, parallel over fixed-size chunks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "../adam_common.h"
#include "../ops.h"
#include "simd.h"

namespace torchcast {
namespace {

// Large enough to amortize a task, small enough to balance threads and keep
// one chunk's working set near the L2 cache.
constexpr int64_t kAdamChunk = int64_t{1} << 16;

template <typename PT, typename ST, Compensation M, bool kAmsgrad>
using Elem = AdamElement<PT, ST, M, kAmsgrad>;

// The hot loop. Unused operands (vmax without amsgrad, c without
// compensation) are never touched.
template <typename PT, typename ST, Compensation M, bool kAmsgrad>
TC_CPU_CLONES void adam_run(const AdamConsts<typename Elem<PT, ST, M, kAmsgrad>::T>& consts,
                            AdamTensorConsts<typename Elem<PT, ST, M, kAmsgrad>::T> tconsts,
                            typename PT::storage* __restrict__ p,
                            const typename PT::storage* __restrict__ g,
                            typename ST::storage* __restrict__ m,
                            typename ST::storage* __restrict__ v,
                            typename ST::storage* __restrict__ vmax,
                            typename Elem<PT, ST, M, kAmsgrad>::C* __restrict__ c, int64_t n) {
  using E = Elem<PT, ST, M, kAmsgrad>;
  const AdamConsts<typename E::T> k = consts;
  for (int64_t j = 0; j < n; ++j) {
    typename PT::storage pj = p[j];
    typename ST::storage mj = m[j], vj = v[j], xj{};
    typename E::C cj{};
    if constexpr (kAmsgrad) xj = vmax[j];
    if constexpr (M != Compensation::kNone) cj = c[j];
    E::step(k, tconsts, pj, g[j], mj, vj, xj, cj);
    p[j] = pj;
    m[j] = mj;
    v[j] = vj;
    if constexpr (kAmsgrad) vmax[j] = xj;
    if constexpr (M != Compensation::kNone) c[j] = cj;
  }
}

template <typename PT, typename ST, Compensation M, bool kAmsgrad>
void adam_cpu_typed(std::vector<TensorOperands>& ops, const AdamHyper& h,
                    const std::vector<double>& steps) {
  using E = Elem<PT, ST, M, kAmsgrad>;
  using T = typename E::T;
  using P = typename PT::storage;
  using S = typename ST::storage;
  using C = typename E::C;
  const AdamConsts<T> k = adam_consts<T>(h);
  std::vector<AdamTensorConsts<T>> tk;
  tk.reserve(ops.size());
  for (double s : steps) tk.push_back(adam_tensor_consts<T>(h, s));

  struct Chunk {
    int64_t tensor, begin, len;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < ops.size(); ++i) {
    const int64_t numel = ops[i].p.numel();
    for (int64_t b = 0; b < numel; b += kAdamChunk) {
      chunks.push_back({static_cast<int64_t>(i), b, std::min(kAdamChunk, numel - b)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t ci = lo; ci < hi; ++ci) {
      const Chunk& ch = chunks[static_cast<size_t>(ci)];
      const TensorOperands& o = ops[static_cast<size_t>(ch.tensor)];
      const int64_t b = ch.begin;
      S* vmax = kAmsgrad ? operand_ptr<S>(o.vmax) + b : nullptr;
      C* c = M != Compensation::kNone ? operand_ptr<C>(o.c) + b : nullptr;
      adam_run<PT, ST, M, kAmsgrad>(k, tk[static_cast<size_t>(ch.tensor)],
                                    operand_ptr<P>(o.p) + b, operand_ptr<const P>(o.g) + b,
                                    operand_ptr<S>(o.m) + b, operand_ptr<S>(o.v) + b, vmax, c,
                                    ch.len);
    }
  });
}

}  // namespace

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                   at::TensorList compensations, at::TensorList state_steps, double lr,
                   double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                   bool maximize, bool decoupled_weight_decay, std::string_view compensation,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
  const Compensation mode =
      check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                      state_steps, amsgrad, compensation, grad_scale, found_inf);
  if (params.empty()) return;
  // A GradScaler step with infs in the gradients changes nothing, step
  // counts included.
  if (found_inf.has_value() && found_inf->item<double>() != 0.0) return;
  if (grad_scale.has_value()) {
    // Unscaled in place, as torch's fused Adam leaves them.
    const double inv = 1.0 / grad_scale->item<double>();
    for (const at::Tensor& g : grads) g.mul_(inv);
  }

  const AdamHyper h{lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
                    decoupled_weight_decay, mode};
  std::vector<double> steps;
  std::vector<TensorOperands> ops;
  steps.reserve(params.size());
  ops.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    steps.push_back(increment_step(state_steps[i]));
    ops.emplace_back(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                     amsgrad ? &max_exp_avg_sqs[i] : nullptr,
                     mode != Compensation::kNone ? &compensations[i] : nullptr);
  }

  dispatch_adam(params[0].scalar_type(), exp_avgs[0].scalar_type(), mode, amsgrad,
                [&](auto pt, auto st, auto m, auto ams) {
                  adam_cpu_typed<decltype(pt), decltype(st), decltype(m)::value,
                                 decltype(ams)::value>(ops, h, steps);
                });
  for (TensorOperands& o : ops) o.finish();
}

void adam_step_tensor_lr_cpu(at::TensorList params, at::TensorList grads,
                             at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                             at::TensorList max_exp_avg_sqs, at::TensorList compensations,
                             at::TensorList state_steps, const at::Tensor& lr, double beta1,
                             double beta2, double weight_decay, double eps, bool amsgrad,
                             bool maximize, bool decoupled_weight_decay,
                             std::string_view compensation,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK_VALUE(lr.numel() == 1, "torchcast.adam_step_: Tensor lr must be 1-element");
  if (!params.empty()) check_scalar_device(lr, "lr", params[0].device());
  adam_step_cpu(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
                state_steps, lr.item<double>(), beta1, beta2, weight_decay, eps, amsgrad, maximize,
                decoupled_weight_decay, compensation, grad_scale, found_inf);
}

}  // namespace torchcast
