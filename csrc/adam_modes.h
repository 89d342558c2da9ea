// The compensation modes of the Adam step: one table, from which the enum,
// the name parser, the argument checks (adam_common.cpp) and the list of
// compiled instantiations (dispatch_adam) are all made. torchcast/adam_modes.py
// states the same table for Python (the optimizer and the pure-PyTorch
// reference read it there); tests/test_adam_modes.py checks that the two
// agree, through torchcast._C.adam_compensations (ops.cpp) and by reading
// this file.
//
// X(enumerator, name, carried, param dtypes, instead, needs):
//   name          the op's `compensation` string
//   carried       what the mode keeps per param between steps, in the op's
//                 `compensations` list: kCarriesNothing, kCarriesParamDtype
//                 (a buffer of the param's dtype), kCarriesInt16 or kCarriesInt8
//   param dtypes  the param dtypes it steps, a mask of kParam* bits
//   instead       the mode an error message suggests for other params
//   needs         why other params are refused, as the messages say it
#pragma once

#include <cstdint>
#include <string_view>

namespace torchcast {

enum CarriedState : int {
  kCarriesNothing = 0,
  kCarriesParamDtype = 1,
  kCarriesInt16 = 2,
  kCarriesInt8 = 3
};

enum ParamDtypeBit : uint32_t {
  kParamFloat64 = 1u,
  kParamFloat32 = 2u,
  kParamBFloat16 = 4u,
  kParamFloat16 = 8u,
};

#define TORCHCAST_COMPENSATIONS(X)                                                        \
  X(kNone, "none", kCarriesNothing,                                                       \
    kParamFloat64 | kParamFloat32 | kParamBFloat16 | kParamFloat16, "", "")               \
  X(kKahan, "kahan", kCarriesParamDtype, kParamFloat32 | kParamBFloat16 | kParamFloat16,  \
    "none", "compensation is for float32, bfloat16 and float16 params")                   \
  X(kRemainder, "remainder", kCarriesInt16, kParamBFloat16, "kahan",                      \
    "compensation='remainder' stores float32 master weights as bfloat16 + int16 and "     \
    "needs bfloat16 params")                                                              \
  X(kStochastic, "stochastic", kCarriesNothing, kParamBFloat16 | kParamFloat16, "kahan",  \
    "compensation='stochastic' rounds updates into 16-bit params and needs bfloat16 or "  \
    "float16 params")                                                                     \
  X(kRemainder8, "remainder8", kCarriesInt8, kParamBFloat16, "kahan",                     \
    "compensation='remainder8' stores 24-bit master weights as bfloat16 + int8 and "      \
    "needs bfloat16 params")

// How a narrow parameter takes the part of its update that rounding would
// lose: not at all, carried in a buffer (Kahan, remainder), or rounded
// stochastically (unbiased, nothing stored).
#define TORCHCAST_COMPENSATION_ENUM(e, name, carried, params, instead, needs) e,
enum class Compensation : int { TORCHCAST_COMPENSATIONS(TORCHCAST_COMPENSATION_ENUM) };
#undef TORCHCAST_COMPENSATION_ENUM

// One row of the table.
struct CompensationInfo {
  Compensation mode;
  const char* name;
  CarriedState carried;
  uint32_t param_dtypes;
  const char* instead;
  const char* needs;
};

#define TORCHCAST_COMPENSATION_ROW(e, name, carried, params, instead, needs) \
  CompensationInfo{Compensation::e, name, carried, params, instead, needs},
inline constexpr CompensationInfo kCompensations[] = {
    TORCHCAST_COMPENSATIONS(TORCHCAST_COMPENSATION_ROW)};
#undef TORCHCAST_COMPENSATION_ROW
inline constexpr int kNumCompensations =
    static_cast<int>(sizeof(kCompensations) / sizeof(kCompensations[0]));

// The row of a mode (the rows are in enum order).
constexpr const CompensationInfo& compensation_info(Compensation m) {
  return kCompensations[static_cast<int>(m)];
}

// Whether the mode keeps a compensation tensor per param.
constexpr bool carries(Compensation m) {
  return compensation_info(m).carried != kCarriesNothing;
}

// Whether the mode steps params whose dtype has the bit `param`.
constexpr bool steps_param(Compensation m, uint32_t param) {
  return (compensation_info(m).param_dtypes & param) != 0;
}

// The row named s, or nullptr.
inline const CompensationInfo* find_compensation(std::string_view s) {
  for (const CompensationInfo& c : kCompensations) {
    if (s == c.name) return &c;
  }
  return nullptr;
}

}  // namespace torchcast
