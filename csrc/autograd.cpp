// Autograd for torchcast's ops, as C++ kernels: a Python one
// (torch.library.register_autograd) costs microseconds on every call, with or
// without gradients, several times what the cast itself takes on small
// tensors.
#include <torch/autograd.h>
#include <torch/library.h>

namespace torchcast {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class CastWithStats : public torch::autograd::Function<CastWithStats> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::ScalarType dtype,
                               std::optional<bool> saturate) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torchcast::cast_with_stats", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                      std::optional<bool>)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, stats] = op.call(x, dtype, saturate);
    ctx->saved_data["src_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->mark_non_differentiable({stats});
    return {y, stats};
  }

  // The cast's derivative is the identity (saturated elements included, as
  // for x.to(dtype)); the gradient comes back in x's dtype.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto src = static_cast<at::ScalarType>(ctx->saved_data["src_dtype"].toInt());
    return {grads[0].defined() ? grads[0].to(src) : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> cast_with_stats_autograd(const at::Tensor& x, at::ScalarType dtype,
                                                            std::optional<bool> saturate) {
  auto out = CastWithStats::apply(x, dtype, saturate);
  return {out[0], out[1]};
}

// The out= variant refuses autograd as torch's out= ops do (same wording):
// out cannot carry a graph, and writing into a leaf that requires grad would
// cut it silently.
at::Tensor cast_with_stats_out_autograd(const at::Tensor& x, at::ScalarType dtype,
                                        std::optional<bool> saturate, at::Tensor& out) {
  TORCH_CHECK(!at::GradMode::is_enabled() || !(x.requires_grad() || out.requires_grad()),
              "torchcast.cast_with_stats(): functions with out=... arguments don't support "
              "automatic differentiation, but one of the arguments requires grad. Call it "
              "without out= (y then carries the gradient) or under torch.no_grad()");
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torchcast::cast_with_stats", "out")
                             .typed<at::Tensor(const at::Tensor&, at::ScalarType,
                                               std::optional<bool>, at::Tensor&)>();
  at::Tensor stats;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    stats = op.call(x, dtype, saturate, out);
  }
  torch::autograd::impl::bump_version(out);  // out was written in place
  return stats;
}

// tensor_health measures x: its outputs are statistics, never differentiable,
// for any x (one that requires grad included).
std::tuple<at::Tensor, at::Tensor, at::Tensor> tensor_health_autograd(const at::Tensor& x) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torchcast::tensor_health", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x);
}

}  // namespace

// For every backend: y's derivative is the identity, stats is not
// differentiable; tensor_health's outputs never carry a graph.
TORCH_LIBRARY_IMPL(torchcast, Autograd, m) {
  m.impl("cast_with_stats", &cast_with_stats_autograd);
  m.impl("cast_with_stats.out", &cast_with_stats_out_autograd);
  m.impl("tensor_health", &tensor_health_autograd);
}

}  // namespace torchcast
