#include "cast_common.h"

#include <c10/util/Exception.h>

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
              " but x is on ", x.device());
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
  auto stats = at::zeros({kNumStats}, x.options().dtype(at::kDouble));
  stats.select(0, kNumel).fill_(static_cast<double>(x.numel()));
  return stats;
}

}  // namespace torchcast
