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
  using Op = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                 const std::optional<at::Tensor>&, std::optional<bool>);
  static const c10::TypedOperatorHandle<Op>& op() {
    static const auto handle =
        c10::Dispatcher::singleton().findSchemaOrThrow("torchcast::cast_with_stats", "").typed<Op>();
    return handle;
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::ScalarType dtype,
                               const std::optional<at::Tensor>& scale, std::optional<bool> saturate) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, stats] = op().call(x, dtype, scale, saturate);
    ctx->saved_data["src_dtype"] = static_cast<int64_t>(x.scalar_type());
    if (scale.has_value()) ctx->save_for_backward({*scale});
    ctx->mark_non_differentiable({stats});
    return {y, stats};
  }

  // y = x (or x * scale) rounded: the derivative is the identity (scale),
  // saturated elements included, as for x.to(dtype); the gradient comes back
  // in x's dtype. The scale gets none: it is a recipe's choice, not a
  // parameter of the cast.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto src = static_cast<at::ScalarType>(ctx->saved_data["src_dtype"].toInt());
    at::Tensor grad;
    if (grads[0].defined()) {
      const auto saved = ctx->get_saved_variables();
      grad = saved.empty() ? grads[0].to(src) : grads[0].to(src).mul(saved[0].reshape({}).to(src));
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> cast_with_stats_autograd(const at::Tensor& x, at::ScalarType dtype,
                                                            const std::optional<at::Tensor>& scale,
                                                            std::optional<bool> saturate) {
  // Without a graph to record, no node: Function::apply builds its context
  // (a hash map of saved data) on every call, about 0.8 us of a small cast's.
  if (!at::GradMode::is_enabled() || !x.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return CastWithStats::op().call(x, dtype, scale, saturate);
  }
  auto out = CastWithStats::apply(x, dtype, scale, saturate);
  return {out[0], out[1]};
}

// The out= variant refuses autograd as torch's out= ops do (same wording):
// out cannot carry a graph, and writing into a leaf that requires grad would
// cut it silently.
at::Tensor cast_with_stats_out_autograd(const at::Tensor& x, at::ScalarType dtype,
                                        const std::optional<at::Tensor>& scale,
                                        std::optional<bool> saturate, at::Tensor& out) {
  TORCH_CHECK(!at::GradMode::is_enabled() || !(x.requires_grad() || out.requires_grad()),
              "torchcast.cast_with_stats(): functions with out=... arguments don't support "
              "automatic differentiation, but one of the arguments requires grad. Call it "
              "without out= (y then carries the gradient) or under torch.no_grad()");
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torchcast::cast_with_stats", "out")
                             .typed<at::Tensor(const at::Tensor&, at::ScalarType,
                                               const std::optional<at::Tensor>&,
                                               std::optional<bool>, at::Tensor&)>();
  at::Tensor stats;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    stats = op.call(x, dtype, scale, saturate, out);
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

// block_cast's outputs (elements, scales, statistics) carry no graph either:
// its straight-through gradient is BlockCast.dequantize's (torchcast/block.py).
using BlockCastOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
BlockCastOutputs block_cast_autograd(const at::Tensor& x, c10::string_view format,
                                     int64_t block_size, c10::string_view scale_mode,
                                     const std::optional<at::Tensor>& tensor_scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torchcast::block_cast", "")
                             .typed<BlockCastOutputs(const at::Tensor&, c10::string_view, int64_t,
                                                     c10::string_view,
                                                     const std::optional<at::Tensor>&)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, format, block_size, scale_mode, tensor_scale);
}

}  // namespace

// For every backend: y's derivative is the identity, stats is not
// differentiable; tensor_health's and block_cast's outputs never carry a graph.
TORCH_LIBRARY_IMPL(torchcast, Autograd, m) {
  m.impl("cast_with_stats", &cast_with_stats_autograd);
  m.impl("cast_with_stats.out", &cast_with_stats_out_autograd);
  m.impl("tensor_health", &tensor_health_autograd);
  m.impl("block_cast", &block_cast_autograd);
}

}  // namespace torchcast
