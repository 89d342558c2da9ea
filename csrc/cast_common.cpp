#include "cast_common.h"

#include "all_finite.h"

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

namespace torchcast {

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "torch.float64";
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: break;
  }
  // Every other dtype's Python name is c10's name in lower case
  // (BFloat16 -> bfloat16, Float8_e4m3fn -> float8_e4m3fn, UInt16 -> uint16,
  // QInt8 -> qint8, Bool -> bool), which also covers dtypes added later.
  std::string name = c10::toString(t);
  for (char& ch : name) {
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  }
  return "torch." + name;
}

static constexpr const char* kSupportedPairs =
    "supported lossy pairs: float64->float32; float64, float32->float16, bfloat16; "
    "float16<->bfloat16; float64, float32, float16, bfloat16->float8_e4m3fn, float8_e5m2. "
    "Widening and same-dtype casts between these dtypes are exact";

namespace {

// How wide a floating dtype is (formats.h's kRank; 0: not one torchcast
// measures). A cast to a
// higher rank is exact; to a lower one, or between the two 16-bit formats,
// lossy; between the two float8 formats, not supported.
int float_rank(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return FormatFloat64::kRank;
    case at::kFloat: return FormatFloat32::kRank;
    case at::kHalf: return FormatFloat16::kRank;
    case at::kBFloat16: return FormatBFloat16::kRank;
    case at::kFloat8_e4m3fn: return FormatE4M3FN::kRank;
    case at::kFloat8_e5m2: return FormatE5M2::kRank;
    default: return 0;
  }
}

}  // namespace

CastKind classify_cast(at::ScalarType from, at::ScalarType to) {
  const int rf = float_rank(from), rt = float_rank(to);
  TORCH_CHECK_TYPE(rf > 0 && rt > 0 && !(rf == 1 && rt == 1 && from != to),
                   "torchcast.cast_with_stats: cannot measure a cast of x from ", dtype_name(from),
                   " to ", dtype_name(to), "; ", kSupportedPairs,
                   ". For other casts use x.to(dtype).");
  return (rf > rt || (rf == rt && from != to)) ? CastKind::kNarrowing : CastKind::kExact;
}

bool resolve_saturate(std::optional<bool> saturate, at::ScalarType to) {
  return saturate.value_or(to == at::kFloat8_e4m3fn);
}

namespace {
constexpr const char* kBadScale =
    "torchcast.cast_with_stats: scale must be positive and finite (x * scale is cast, y / scale "
    "is read back); a zero or inf scale comes from an inf or zero amax (e.g. in a delayed-scaling "
    "history): recompute it with torchcast.scaling.amax_scale(x, dtype), or skip this cast";
}  // namespace

std::optional<at::Tensor> kernel_scale(const at::Tensor& x, at::ScalarType dtype, CastKind kind,
                                       const std::optional<at::Tensor>& scale) {
  if (!scale.has_value()) return std::nullopt;
  const at::Tensor& s = *scale;
  TORCH_CHECK(kind == CastKind::kNarrowing, "torchcast.cast_with_stats: a scale applies to lossy "
              "casts; the cast of x from ", dtype_name(x.scalar_type()), " to ", dtype_name(dtype),
              " is exact. Drop scale (and multiply x yourself if you meant to)");
  const bool source64 = x.scalar_type() == at::kDouble;
  TORCH_CHECK(s.numel() == 1 && (s.scalar_type() == at::kFloat ||
                                 (source64 && s.scalar_type() == at::kDouble)),
              "torchcast.cast_with_stats: scale must be a one-element float32 tensor (float64 "
              "also for a float64 x), got ", dtype_name(s.scalar_type()), " of shape ", s.sizes(),
              " for x of ", dtype_name(x.scalar_type()), "; pass torch.tensor(value, "
              "dtype=torch.float32, device=x.device)");
  TORCH_CHECK(s.device() == x.device(), "torchcast.cast_with_stats: scale is on ", s.device(),
              " but x is on ", x.device(), "; move scale to x's device (it is read there, never "
              "on the host)");
  // y / 0 is not x's error; a zero scale is what delayed scaling makes from
  // an inf in its amax history.
  check_scale_value(s, kBadScale);
  return source64 ? s.to(at::kDouble) : s;
}

void check_scale_value(const at::Tensor& s, const char* message) {
  if (s.is_cpu()) {
    const double v = s.scalar_type() == at::kDouble ? *s.const_data_ptr<double>()
                                                    : *s.const_data_ptr<float>();
    TORCH_CHECK_VALUE(v > 0.0 && std::isfinite(v), message, "; got ", v);
  } else {
    at::_assert_async(at::isfinite(s).logical_and_(s.gt(0)), message);
  }
}

void check_cast_out(const at::Tensor& x, at::ScalarType dtype, const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == dtype, "torchcast.cast_with_stats: out has dtype ",
              dtype_name(out.scalar_type()), " but the cast is to ", dtype_name(dtype),
              "; allocate out with dtype=", dtype_name(dtype));
  TORCH_CHECK(out.sizes() == x.sizes(), "torchcast.cast_with_stats: out has shape ", out.sizes(),
              " but x has shape ", x.sizes(), "; out must have x's shape");
  TORCH_CHECK(out.device() == x.device(), "torchcast.cast_with_stats: out is on ", out.device(),
              " but x is on ", x.device(), "; out must be on x's device");
  if (out.numel() == 0) return;
  // ATen's has_internal_overlap and get_overlap_status answer "too hard" for
  // any non-dense tensor, which is how an aliasing out usually looks
  // (x.view(torch.float16)[::2]), so both checks are made here from strides.
  TORCH_CHECK(!may_self_overlap(out), "torchcast.cast_with_stats: out's strides let elements "
              "share memory (e.g. an expanded tensor), so the result would depend on the write "
              "order; allocate out with torch.empty_like(x, dtype=...)");
  const auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto* begin = static_cast<const char*>(t.const_data_ptr());
    return std::make_pair(begin, begin + (last + 1) * t.element_size());
  };
  const auto [x0, x1] = range(x);
  const auto [o0, o1] = range(out);
  TORCH_CHECK(!(o0 < x1 && x0 < o1), "torchcast.cast_with_stats: out shares memory with x, so "
              "writing out would overwrite x while it is read; pass an out that does not overlap "
              "x (or x.clone())");
}

bool may_self_overlap(const at::Tensor& t) {
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // the largest offset reachable with the smaller strides
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += stride * (size - 1);
  }
  return false;
}

at::TensorIterator cast_iterator(const at::Tensor& x, at::Tensor& y) {
  return at::TensorIteratorConfig()
      .add_output(y)
      .add_const_input(x)
      .check_all_same_dtype(false)
      .resize_outputs(false)
      .build();
}

at::Tensor exact_cast_stats(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(float_rank(dtype) > 0,
                   "exact_cast_stats: x must be float64, float32, float16, bfloat16, "
                   "float8_e4m3fn or float8_e5m2, got ", dtype_name(dtype));
  auto stats = at::zeros({kNumStats}, x.options().dtype(at::kDouble));
  // NaN and inf pass an exact cast unchanged, and are still news (a NaN
  // gradient widened for the optimizer): counted on the device, without a sync.
  if (x.is_cpu()) {
    // A strided x is copied: a copy costs a few times less than at::isnan
    // and friends below, and dense x is read as one block of numel elements.
    const NonfiniteCounts c =
        count_nonfinite(x.is_non_overlapping_and_dense() ? x : x.contiguous());
    auto* values = stats.data_ptr<double>();
    values[kNumel] = static_cast<double>(x.numel());
    values[kNan] = static_cast<double>(c.nan);
    values[kInf] = static_cast<double>(c.inf);
    values[kAmax] = c.amax;
    return stats;
  }
  // float8 has few kernels in torch; widened to float32, every value is kept.
  const auto xw = float_rank(dtype) == 1 ? x.to(at::kFloat) : x;
  const auto finite = at::isfinite(xw);
  stats.select(0, kNumel).fill_(static_cast<double>(x.numel()));
  stats.select(0, kNan).copy_(at::isnan(xw).sum());
  stats.select(0, kInf).copy_(at::isinf(xw).sum());
  if (x.numel() > 0) {
    stats.select(0, kAmax).copy_(at::where(finite, xw.abs(), at::zeros({}, xw.options())).amax());
  }
  return stats;
}

}  // namespace torchcast
