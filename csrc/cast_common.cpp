#include "cast_common.h"

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <ATen/Parallel.h>

#include <algorithm>
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
    "supported lossy pairs: float64->float32, float64->float16, float64->bfloat16, "
    "float32->float16, float32->bfloat16; widening and same-dtype casts between "
    "float16/bfloat16/float32/float64 are exact";

CastKind classify_cast(at::ScalarType from, at::ScalarType to) {
  const auto rank = [](at::ScalarType t) {
    switch (t) {
      case at::kDouble: return 3;
      case at::kFloat: return 2;
      case at::kHalf:
      case at::kBFloat16: return 1;
      default: return 0;
    }
  };
  const int rf = rank(from), rt = rank(to);
  TORCH_CHECK_TYPE(rf > 0 && rt > 0 && !(rf == 1 && rt == 1 && from != to),
                   "torchcast.cast_with_stats: cannot measure a cast of x from ", dtype_name(from),
                   " to ", dtype_name(to), "; ", kSupportedPairs,
                   ". For other casts use x.to(dtype).");
  return rf > rt ? CastKind::kNarrowing : CastKind::kExact;
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

namespace {

// NaN has every exponent bit set and a nonzero mantissa: its bits without
// the sign exceed infinity's. Integer compares that gcc vectorizes, several
// times faster on the CPU than at::isnan(x).sum() on small tensors.
template <typename Bits>
int64_t count_nan_bits(const Bits* bits, int64_t begin, int64_t end, Bits abs_mask, Bits inf) {
  int64_t count = 0;
  for (int64_t i = begin; i < end; ++i) count += (bits[i] & abs_mask) > inf;
  return count;
}

template <typename Bits>
int64_t count_nan_dense(const at::Tensor& x, Bits abs_mask, Bits inf) {
  const auto* bits = static_cast<const Bits*>(x.const_data_ptr());
  return at::parallel_reduce(
      0, x.numel(), int64_t{1} << 16, int64_t{0},
      [&](int64_t begin, int64_t end, int64_t count) {
        return count + count_nan_bits(bits, begin, end, abs_mask, inf);
      },
      std::plus<int64_t>());
}

}  // namespace

at::Tensor exact_cast_stats(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kDouble || dtype == at::kFloat || dtype == at::kHalf ||
                       dtype == at::kBFloat16,
                   "exact_cast_stats: x must be float64, float32, float16 or bfloat16, got ",
                   dtype_name(dtype));
  auto stats = at::zeros({kNumStats}, x.options().dtype(at::kDouble));
  // NaN passes an exact cast unchanged, and is still news (a NaN gradient
  // widened for the optimizer): counted on the device, without a sync.
  if (x.is_cpu() && x.is_non_overlapping_and_dense()) {  // one block of numel elements
    int64_t nan = 0;
    switch (dtype) {
      case at::kDouble:
        nan = count_nan_dense<uint64_t>(x, 0x7fffffffffffffffULL, 0x7ff0000000000000ULL);
        break;
      case at::kFloat: nan = count_nan_dense<uint32_t>(x, 0x7fffffffU, 0x7f800000U); break;
      case at::kHalf: nan = count_nan_dense<uint16_t>(x, 0x7fff, 0x7c00); break;
      default: nan = count_nan_dense<uint16_t>(x, 0x7fff, 0x7f80); break;  // kBFloat16
    }
    auto* values = stats.data_ptr<double>();
    values[kNumel] = static_cast<double>(x.numel());
    values[kNan] = static_cast<double>(nan);
    return stats;
  }
  stats.select(0, kNumel).fill_(static_cast<double>(x.numel()));
  stats.select(0, kNan).copy_(at::isnan(x).sum());
  return stats;
}

}  // namespace torchcast
