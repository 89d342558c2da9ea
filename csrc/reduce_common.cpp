#include "reduce_common.h"

#include <ATen/native/ReduceOpsUtils.h>

#include <algorithm>
#include <limits>

#include "cast_common.h"

namespace torchcast {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// Same exception type as torch.mean / torch.nansum for the same mistake.
void check_dtypes(const char* op, const at::Tensor& x, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(is_supported_float(x.scalar_type()), "torchcast.", op,
              ": x must be float32, float16, bfloat16 or float64, got ",
              dtype_name(x.scalar_type()), "; convert it first, e.g. x.float()");
  TORCH_CHECK(!dtype || is_supported_float(*dtype), "torchcast.", op,
              ": dtype must be torch.float32, torch.float16, torch.bfloat16 or torch.float64, "
              "got ", dtype_name(*dtype), " (x is ", dtype_name(x.scalar_type()), ")");
}

}  // namespace

ReducePlan plan_accumulation(const char* op, at::Tensor& x, at::OptionalIntArrayRef dim,
                             bool keepdim, std::optional<at::ScalarType> dtype, bool mean) {
  ReducePlan plan = plan_reduce(op, x, dim, keepdim, dtype, mean);  // every argument checked
  // A float32 accumulator overflows past 3.4e38 even when the float64 result
  // would hold the sum; the float64 copy takes the plain float64 path that
  // float64 inputs take, in its own canonical order. Copied only once the
  // arguments are known to be good.
  if (!plan.done && dtype == at::kDouble && x.scalar_type() != at::kDouble) {
    x = x.to(at::kDouble);
    plan = plan_reduce(op, x, dim, keepdim, dtype, mean);
  }
  return plan;
}

Axes coalesce(const Axes& in) {
  Axes out;
  for (const Axis& a : in) {
    if (a.size == 1) continue;
    if (!out.empty() && out.back().xstride == a.xstride * a.size &&
        out.back().ostride == a.ostride * a.size) {
      out.back() = {out.back().size * a.size, a.xstride, a.ostride};
    } else {
      out.push_back(a);
    }
  }
  if (out.empty()) out.push_back({1, 1, 1});
  return out;
}

int64_t numel_of(const Axes& axes) {
  int64_t n = 1;
  for (const Axis& a : axes) n *= a.size;
  return n;
}

ReducePlan plan_reduce(const char* op, const at::Tensor& x, at::OptionalIntArrayRef dim,
                       bool keepdim, std::optional<at::ScalarType> dtype, bool mean) {
  check_dtypes(op, x, dtype);
  // torch's own dim handling: IndexError out of range, RuntimeError when
  // repeated, and dim=None or () reduces everything (any number of dims).
  const bool all = !dim.has_value() || dim->empty();
  const auto mask = all ? at::native::DimMask() : at::native::make_dim_mask(dim, x.dim());
  const auto reduces = [&](int64_t d) { return all || mask[d]; };
  // Kept axes in row-major output order; reduced axes by decreasing stride.
  Axes kept, reduced;
  at::DimVector shape;
  int64_t ostride = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    if (reduces(d)) {
      reduced.push_back({x.size(d), x.stride(d), 0});
      if (keepdim) shape.insert(shape.begin(), 1);
    } else {
      kept.insert(kept.begin(), {x.size(d), x.stride(d), ostride});
      shape.insert(shape.begin(), x.size(d));
      ostride *= x.size(d);
    }
  }
  ReducePlan plan;
  plan.mean = mean;
  plan.out = at::empty(shape, x.options().dtype(dtype.value_or(x.scalar_type())));
  std::reverse(reduced.begin(), reduced.end());
  reduced.erase(std::remove_if(reduced.begin(), reduced.end(),
                               [](const Axis& a) { return a.size == 1; }),
                reduced.end());
  std::stable_sort(reduced.begin(), reduced.end(),
                   [](const Axis& a, const Axis& b) { return a.xstride > b.xstride; });
  plan.k = numel_of(kept);
  plan.m = numel_of(reduced);
  if (plan.k == 0 || plan.m == 0) {  // torch's empty sum and mean: 0 and NaN
    plan.out.fill_(mean ? std::numeric_limits<double>::quiet_NaN() : 0.0);
    plan.done = true;
    return plan;
  }
  plan.kept = coalesce(kept);
  plan.reduced = coalesce(reduced);
  TORCH_CHECK(plan.kept.size() <= kMaxAxes && plan.reduced.size() <= kMaxAxes, "torchcast.", op,
              ": x has more than ", kMaxAxes, " dims that cannot be merged; make it contiguous");
  const Axis& run = plan.reduced.back();
  if (plan.k == 1) {
    plan.scheme = Scheme::kFull;
  } else if (run.xstride == 1 && run.size >= kWarpMinRun) {
    plan.scheme = Scheme::kWarpLanes;
  } else {
    plan.scheme = Scheme::kOneLane;
  }
  return plan;
}

}  // namespace torchcast
