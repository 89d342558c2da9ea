// The Adam/AdamW step shared by the CPU and CUDA kernels: the per-element
// math (host and device), the step constants, and the host-side argument
// checks. One element function for both backends keeps their results
// bit-identical (both are built without contraction or fast math).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "adam_modes.h"
#include "adam_moments8.h"
#include "adam_tally.h"
#include "numerics.h"

namespace torchcast {

// float64 parameters and states: computed in float64, never compensated.
struct Float64Storage {
  using storage = double;
  TC_HD static double round(double d) { return d; }
  TC_HD static double widen(double s) { return s; }
};

// The ParamDtypeBit (adam_modes.h) of a param storage format.
template <typename PT>
constexpr uint32_t param_bit() {
  if constexpr (std::is_same_v<PT, Float64Storage>) return kParamFloat64;
  if constexpr (std::is_same_v<PT, Float32Target>) return kParamFloat32;
  if constexpr (std::is_same_v<PT, BFloat16Target>) return kParamBFloat16;
  if constexpr (std::is_same_v<PT, Float16Target>) return kParamFloat16;
  return 0;
}

// The arithmetic type of a storage format: float32 for every narrow format.
template <typename Target>
struct ComputeOf {
  using type = float;
};
template <>
struct ComputeOf<Float64Storage> {
  using type = double;
};

TC_HD float tc_sqrt(float x) { return sqrtf(x); }
TC_HD double tc_sqrt(double x) { return sqrt(x); }
TC_HD float tc_abs(float x) { return fabsf(x); }
// a * b + c rounded once, where ATen's CPU kernels fuse them (lerp, add with
// alpha, addcmul on AVX2 and AVX-512): explicit, so that -ffp-contract=off
// and --fmad=false leave every other product and sum rounded on its own.
TC_HD float tc_fma(float a, float b, float c) { return fmaf(a, b, c); }
TC_HD double tc_fma(double a, double b, double c) { return fma(a, b, c); }

// An unsigned integer as wide as T, and a select by a mask of all ones or all
// zeros in it: gcc does not vectorize a ?: on a loop-invariant bool, but it
// does vectorize bit operations.
template <typename T>
using MaskOf = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;

template <typename T>
TC_HD T blend(MaskOf<T> mask, T a, T b) {
  return bit_cast<T>((bit_cast<MaskOf<T>>(a) & mask) | (bit_cast<MaskOf<T>>(b) & ~mask));
}

template <typename T>
MaskOf<T> mask_of(bool flag) {
  return flag ? ~MaskOf<T>(0) : MaskOf<T>(0);
}

// Constants of one step of one parameter group, rounded once to the compute
// type from the float64 hyperparameters (as torch rounds its Python-float
// scalars), so that the uncompensated float32 step is torch.optim.Adam's
// (foreach=False) operation for operation: docs/adam.md says where the bits
// can still differ (torch's square root).
// The flags are masks for blend(), uniform over the loop.
template <typename T>
struct AdamConsts {
  T grad_sign;        // -1 when maximizing (exact)
  T l2;               // Adam's weight decay, added to the gradient
  T lerp_w, lerp_wc;  // exp_avg.lerp_(grad, w): w = 1 - beta1, wc = 1 - w
  T beta2, one_minus_beta2;
  T eps;
  T decay;  // AdamW: 1 - lr * weight_decay, applied as torch does (param * decay)
  T lr_wd;  // AdamW compensated: lr * weight_decay, inside the compensated update
  MaskOf<T> use_l2, lerp_small, use_decay;
};

// Constants that depend on the parameter's own step count. The steps that
// give float32 Adam's bits (kDividesByBc2) divide by sqrt(1 - beta2^step) as
// torch does; Kahan and stochastic rounding, whose results are not float32
// Adam's anyway, multiply by its reciprocal rounded once: divisions and
// square roots are what their compute-bound loops spend their time on.
template <typename T>
struct AdamTensorConsts {
  T neg_step_size;     // -lr / (1 - beta1^step)
  T bc2_sqrt;          // (1 - beta2^step) ** 0.5, as Python computes it
  T inv_bc2_sqrt;      // 1 / sqrt(1 - beta2^step)
  StochasticKey key;   // the param's random bits (stochastic, remainder8): of (seed, tensor, step)
  StochasticKey moment_key;  // 8-bit moments' random bits: another stream of the same seed
};

struct AdamHyper {
  double lr, beta1, beta2, weight_decay, eps;
  bool amsgrad, maximize, decoupled;
  Compensation mode;
  uint64_t seed;  // compensation="stochastic"
};

// The constants that depend on lr, on the host or (for a tensor lr that
// lives on the GPU, read there without a host sync) on the device: the same
// float64 expressions, so the same bits.
template <typename T>
TC_HD void set_lr_consts(AdamConsts<T>& k, double lr, double weight_decay, bool decoupled) {
  k.decay = weight_decay != 0.0 && decoupled ? static_cast<T>(1.0 - lr * weight_decay) : T(1);
  k.lr_wd = static_cast<T>(lr * weight_decay);
}

template <typename T>
AdamConsts<T> adam_consts(const AdamHyper& h) {
  AdamConsts<T> k;
  const bool wd = h.weight_decay != 0.0;
  k.grad_sign = h.maximize ? T(-1) : T(1);
  k.use_l2 = mask_of<T>(wd && !h.decoupled);
  k.l2 = static_cast<T>(h.weight_decay);
  k.lerp_w = static_cast<T>(1.0 - h.beta1);
  k.lerp_wc = T(1) - k.lerp_w;  // in T, as ATen's lerp computes it
  k.lerp_small = mask_of<T>(std::abs(k.lerp_w) < T(0.5));
  k.beta2 = static_cast<T>(h.beta2);
  k.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  k.eps = static_cast<T>(h.eps);
  k.use_decay = mask_of<T>(wd && h.decoupled);
  set_lr_consts(k, h.lr, h.weight_decay, h.decoupled);
  return k;
}

template <typename T>
TC_HD T neg_step_size_of(double lr, double bc1) {
  return static_cast<T>(-(lr / bc1));
}

// 1 - beta1^step, the first-moment bias correction.
inline double bias_correction1(const AdamHyper& h, double step) {
  return 1.0 - std::pow(h.beta1, step);
}

// The step counts' top bit, never set in a count: the 8-bit moments' random
// bits are keyed by the count with it set, a stream apart from the param's.
constexpr uint64_t kMomentStream = uint64_t{1} << 63;

// The constants of tensor `tensor` (its position in the op's lists) at its
// step count `step` (after the increment).
template <typename T>
AdamTensorConsts<T> adam_tensor_consts(const AdamHyper& h, double step, size_t tensor) {
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  return {neg_step_size_of<T>(h.lr, bias_correction1(h, step)),
          static_cast<T>(std::pow(bc2, 0.5)), static_cast<T>(1.0 / std::sqrt(bc2)),
          stochastic_key(h.seed, tensor, static_cast<uint64_t>(step)),
          stochastic_key(h.seed, tensor, static_cast<uint64_t>(step) ^ kMomentStream)};
}

// torch.maximum: NaN in either operand gives NaN.
template <typename T>
TC_HD T max_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}


// One element of the step. PT/ST: parameter and state storage formats
// (Float64Storage, Float32Target, BFloat16Target, Float16Target); M: how the
// parameter carries its rounding error; kTrack: whether the step also tallies
// what rounding did to the update (ElementTally). Everything is computed and
// selected without branches so that the loops vectorize.
template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack = false>
struct AdamElement {
  using T = typename ComputeOf<PT>::type;
  using P = typename PT::storage;
  using S = typename ST::storage;
  using C = std::conditional_t<M == Compensation::kRemainder, int16_t,
                               std::conditional_t<M == Compensation::kRemainder8, int8_t, P>>;
  // The update accounting's arithmetic (tally_element).
  using TallyT = std::conditional_t<sizeof(P) == 2, float, double>;
  static constexpr bool kCarries = carries(M);
  // The second moment's bias correction divides where the result is float32
  // Adam's (the plain step, and remainder's float32 master).
  static constexpr bool kDividesByBc2 = M == Compensation::kNone || M == Compensation::kRemainder;
  static_assert(steps_param(M, param_bit<PT>()), "adam_modes.h: the mode does not step PT");

  // The weight the step starts from: the stored param, or for remainder the
  // float32 master it and its remainder hold.
  TC_HD static T weight_of(P p, C c) {
    if constexpr (M == Compensation::kRemainder) {
      return join_bf16_remainder(p, c);
    } else if constexpr (M == Compensation::kRemainder8) {
      return join_bf16_remainder8(p, c);
    } else {
      return PT::widen(p);
    }
  }

  // This step's moments of one element from the old ones (mo, vo and, under
  // amsgrad, the old max xo): mn, vn and the new max xn. Returns the update
  // of the weight pv: -lr * m_hat / (sqrt(v_hat) + eps), and in the
  // compensated modes minus lr * wd * pv under decoupled decay (the plain
  // step scales the weight by a rounded 1 - lr * wd instead, in apply);
  // root: the square root of the second moment the denominator used.
  TC_HD static T update_of(const AdamConsts<T>& k, const AdamTensorConsts<T>& t, T pv, P g, T mo,
                           T vo, T xo, T& mn, T& vn, T& xn, T& root) {
    // torch.optim.Adam's operations, fused where ATen fuses them:
    // grad.add(param, alpha=wd), exp_avg.lerp_(grad, 1 - beta1),
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2).
    T gr = PT::widen(g) * k.grad_sign;
    gr = blend(k.use_l2, tc_fma(pv, k.l2, gr), gr);
    mn = blend(k.lerp_small, tc_fma(k.lerp_w, gr - mo, mo), tc_fma(-k.lerp_wc, gr - mo, gr));
    vn = tc_fma(k.one_minus_beta2 * gr, gr, vo * k.beta2);
    // This step's moments drive its update as computed; the stored ones are
    // rounded to the state's format by the caller, for the next step (which
    // reads them back, so a run resumed from a state dict steps alike).
    // Rounding for the store only keeps it off the update's chain of
    // dependent operations, the chain whose length bounds the loop's speed.
    T vv = vn;
    if constexpr (kAmsgrad) {
      xn = max_nan(xo, vn);
      vv = xn;
    }
    root = tc_sqrt(vv);
    const T denom = (kDividesByBc2 ? root / t.bc2_sqrt : root * t.inv_bc2_sqrt) + k.eps;
    const T upd = (t.neg_step_size * mn) / denom;
    if constexpr (M == Compensation::kNone) {
      return upd;
    } else {
      // Compensated, decoupled decay joins the update rather than scaling
      // the weight by a rounded 1 - lr * wd (a bias of up to 2^-25 a step).
      return blend(k.use_decay, upd - k.lr_wd * pv, upd);
    }
  }

  // Whether apply rounds with random bits (stochastic, remainder8).
  static constexpr bool kDrawsBits = M == Compensation::kStochastic || M == Compensation::kRemainder8;

  // The param's random bits at element `index` of its tensor (0 where the
  // mode draws none): stochastic_bits of the tensor's key.
  TC_HD static uint32_t bits_at(const AdamTensorConsts<T>& t, int64_t index) {
    if constexpr (kDrawsBits) {
      return stochastic_bits(t.key, index);
    } else {
      return 0;
    }
  }

  // The param (and its compensation) stepped from the weight pv by the
  // update u of update_of; bits: its random bits (bits_at).
  TC_HD static void apply(const AdamConsts<T>& k, uint32_t bits, T pv, T u, P& p, C& c,
                          ElementTally& tally) {
    const T p_old = PT::widen(p);  // the stored param (for remainder: the bfloat16 half)
    // The intended update: u minus lr * wd * w under decoupled decay, in
    // float64 (the product exact: 24 + 24 bits), then in the tally's type.
    // The plain step scales the weight by a rounded 1 - lr * wd instead,
    // whose rounding is then part of what the accounting sees; the
    // compensated modes compute the same float32 u.
    TallyT intended = 0;
    if constexpr (M == Compensation::kNone) {
      p = PT::round(pv * k.decay + u);
      if constexpr (kTrack) {
        const double lr_wd = static_cast<double>(blend(k.use_decay, k.lr_wd, T(0)));
        intended = static_cast<TallyT>(static_cast<double>(u) - lr_wd * static_cast<double>(pv));
      }
    } else {
      if constexpr (M == Compensation::kKahan) {
        kahan_update<PT>(pv, p, c, u);
      } else if constexpr (M == Compensation::kRemainder) {
        split_bf16_remainder(pv + u, p, c);
      } else if constexpr (M == Compensation::kRemainder8) {
        split_bf16_remainder8(pv + u, bits, p, c);
      } else {
        if constexpr (std::is_same_v<PT, BFloat16Target>) {
          p = bfloat16_bits_stochastic(pv + u, bits);
        } else {
          p = half_bits_stochastic(pv + u, bits);
        }
      }
      if constexpr (kTrack) intended = static_cast<TallyT>(u);
    }
    if constexpr (kTrack) tally_element(p, p_old, intended, c, tally);
  }

  // One whole element step: update_of, the moments rounded to ST, apply.
  TC_HD static void step(const AdamConsts<T>& k, const AdamTensorConsts<T>& t, int64_t index,
                         P& p, P g, S& m, S& v, S& vmax, C& c, ElementTally& tally) {
    const T pv = weight_of(p, c);
    T mn, vn, xn{}, root;
    const T u = update_of(k, t, pv, g, ST::widen(m), ST::widen(v),
                          kAmsgrad ? ST::widen(vmax) : T(0), mn, vn, xn, root);
    m = ST::round(mn);
    v = ST::round(vn);
    if constexpr (kAmsgrad) vmax = ST::round(xn);
    apply(k, bits_at(t, index), pv, u, p, c, tally);
  }

  // The update accounting of one element: p and c after the step, p_old the
  // stored param before it. Counted in TallyT: float32 for a 16-bit param,
  // whose change is exact there wherever the comparison with half the
  // intended update is close (that needs an update of a few ulp, so p_old
  // and p are within a binade or two); float64 for wider params.
  TC_HD static void tally_element(P p, T p_old, TallyT intended, C c, ElementTally& tally) {
    const T p_new = PT::widen(p);
    const TallyT change = static_cast<TallyT>(p_new) - static_cast<TallyT>(p_old);
    const TallyT a = intended < TallyT(0) ? -intended : intended;
    const TallyT d = change < TallyT(0) ? -change : change;
    const int32_t updated = (intended != TallyT(0)) & (intended - intended == TallyT(0));
    tally.updated = updated;
    tally.lost = updated & (change == TallyT(0));
    tally.shrunk = updated & (TallyT(2) * d < a);
    if constexpr (kCarries) {
      T carried;
      if constexpr (M == Compensation::kKahan) {
        carried = PT::widen(c);
      } else {
        carried = weight_of(p, c) - p_new;  // exact: within an ulp of p_new
      }
      const T ulp = tc_abs(PT::widen(flip_last_bit(p)) - p_new);
      // ulp is a power of two: the ratio and its scaling are exact. A
      // non-finite param (ratio NaN, of either sign) counts 0. Clamped on
      // the bits (units >= 0: bit order is value order), as integer ops.
      const float units = (tc_abs(carried) / ulp) * kCompUnits;
      const uint32_t bits = bit_cast<uint32_t>(units);
      const uint32_t nan =
          static_cast<uint32_t>(static_cast<int32_t>(0x7f800000u - (bits & 0x7fffffffu)) >> 31);
      const uint32_t cap = bit_cast<uint32_t>(kCompCap);
      const uint32_t clamped = (bits < cap ? bits : cap) & ~nan;
      tally.comp_units = static_cast<int32_t>(bit_cast<float>(clamped));
      tally.comp_max_bits = clamped;
    }
  }

  // The CPU loop's two passes over a tile, on element j of the operand
  // arrays: moments_at updates the moments and returns the update (update_of),
  // apply_at applies it with the element's random bits. Two short loops keep
  // more elements in flight than one long chain per element.
  TC_HD static T moments_at(const AdamConsts<T>& k, const AdamTensorConsts<T>& t, int64_t j,
                            const P* p, P g, S* m, S* v, S* vmax, const C* c) {
    C cj{};
    if constexpr (kCarries) cj = c[j];
    T mn, vn, xn{}, root;
    const T u = update_of(k, t, weight_of(p[j], cj), g, ST::widen(m[j]), ST::widen(v[j]),
                          kAmsgrad ? ST::widen(vmax[j]) : T(0), mn, vn, xn, root);
    m[j] = ST::round(mn);
    v[j] = ST::round(vn);
    if constexpr (kAmsgrad) vmax[j] = ST::round(xn);
    return u;
  }
  TC_HD static void apply_at(const AdamConsts<T>& k, int64_t j, uint32_t bits, T u, P* p, C* c,
                             ElementTally& tally) {
    P pj = p[j];
    C cj{};
    if constexpr (kCarries) cj = c[j];
    apply(k, bits, weight_of(pj, cj), u, pj, cj, tally);
    p[j] = pj;
    if constexpr (kCarries) c[j] = cj;
  }

  // step() on element j of the operand arrays (element `index` of the
  // tensor), with its gradient g. vmax and c are read and written only where
  // the step uses them.
  TC_HD static void step_at(const AdamConsts<T>& k, const AdamTensorConsts<T>& t, int64_t j,
                            int64_t index, P* p, P g, S* m, S* v, S* vmax, C* c,
                            ElementTally& tally) {
    P pj = p[j];
    S mj = m[j], vj = v[j], xj{};
    C cj{};
    if constexpr (kAmsgrad) xj = vmax[j];
    if constexpr (kCarries) cj = c[j];
    step(k, t, index, pj, g, mj, vj, xj, cj, tally);
    p[j] = pj;
    m[j] = mj;
    v[j] = vj;
    if constexpr (kAmsgrad) vmax[j] = xj;
    if constexpr (kCarries) c[j] = cj;
  }
};

// Calls f(PT{}, ST{}, mode, amsgrad, track) (mode and the flags as
// integral_constants) with the storage formats and flags of one dtype group:
// the one list of instantiations both backends compile. check_adam_args has
// rejected the combinations not instantiated here.
template <typename F>
void dispatch_adam(at::ScalarType param_dtype, at::ScalarType state_dtype, Compensation mode,
                   bool amsgrad, bool track, F&& f) {
  const auto tracked = [&](auto pt, auto st, auto m, auto ams) {
    if (track) {
      f(pt, st, m, ams, std::true_type{});
    } else {
      f(pt, st, m, ams, std::false_type{});
    }
  };
  const auto flags = [&](auto pt, auto st, auto m) {
    if constexpr (std::is_same_v<decltype(st), Moments8>) {
      tracked(pt, st, m, std::false_type{});  // check_adam_args refuses amsgrad there
    } else if (amsgrad) {
      tracked(pt, st, m, std::true_type{});
    } else {
      tracked(pt, st, m, std::false_type{});
    }
  };
  // Every mode of the table, for the param formats its row allows.
  const auto modes = [&](auto pt, auto st) {
    constexpr uint32_t kParam = param_bit<decltype(pt)>();
#define TORCHCAST_COMPENSATION_CASE(e, ...)                                        \
  if constexpr (steps_param(Compensation::e, kParam)) {                            \
    if (mode == Compensation::e) {                                                 \
      flags(pt, st, std::integral_constant<Compensation, Compensation::e>{});       \
    }                                                                              \
  }
    TORCHCAST_COMPENSATIONS(TORCHCAST_COMPENSATION_CASE)
#undef TORCHCAST_COMPENSATION_CASE
  };
  const auto states = [&](auto pt) {
    if (state_dtype == at::kBFloat16) {
      modes(pt, BFloat16Target{});
    } else if (state_dtype == at::kChar) {
      modes(pt, Moments8{});
    } else {
      modes(pt, Float32Target{});
    }
  };
  switch (param_dtype) {
    case at::kDouble: modes(Float64Storage{}, Float64Storage{}); break;
    case at::kFloat: modes(Float32Target{}, Float32Target{}); break;
    case at::kBFloat16: states(BFloat16Target{}); break;
    default: states(Float16Target{}); break;
  }
}

// The operands of one tensor as buffers in one common memory order (the
// param's when it is dense). An operand in another order, or every operand of
// a non-dense param, is staged through a copy that is written back after the
// pass; the usual case (states created like the param) copies nothing. The
// copies run on the tensors' device (on the current stream for CUDA).
struct TensorOperands {
  at::Tensor p, g, m, v, vmax, c;
  at::Tensor stats;  // int64[kNumUpdateStats], added to in place (never staged), or undefined
  at::Tensor scales;  // 8-bit moments: float32 (2, blocks), in place (never staged), or undefined
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (original, staged)

  // grad_mutated: the pass writes the gradient too (the CUDA kernel unscales
  // it in place).
  TensorOperands(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor* max_sq, const at::Tensor* comp,
                 bool grad_mutated = false);
  at::Tensor stage(const at::Tensor& t, bool mutated);
  void finish();
};

template <typename T>
T* operand_ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

// The tensor lists of one adam_step_ call, one entry per param
// (max_exp_avg_sqs only with amsgrad, compensations only in a mode that
// carries() them).
struct AdamTensors {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations,
      state_steps;
  std::optional<at::TensorList> moment_scales;  // 8-bit moments
};

// Host-side checks shared by the backends; everything is checked before
// anything is written. Returns the parsed compensation mode.
Compensation check_adam_args(const AdamTensors& args, bool amsgrad, std::string_view compensation,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf,
                             const std::optional<at::TensorList>& update_stats);

// lr (tensor overload), grad_scale and found_inf: on the CPU or the params'
// device.
void check_scalar_device(const at::Tensor& t, const char* what, const at::Device& params);

// The value of a one-element step counter after adding one to it in place.
double increment_step(const at::Tensor& step);

// The kernels of adam_step_ (Lr = double) and adam_step_.tensor_lr (Lr =
// const at::Tensor&) for one backend: the checks, found_inf, the step counts
// and the staging of operands are the same everywhere. A Backend object,
// made for the params' device, decides where lr and grad_scale are read:
//  - lr_of(lr): the lr the host computes the constants with;
//  - unscale(grads, grad_scale): divides the grads by grad_scale now, or
//    keeps it for the kernel (then kUnscalesInKernel: the pass writes the
//    grads, so staged ones are written back);
//  - run<PT, ST, M, kAmsgrad, kTrack>(ops, h, steps): the step over staged
//    operands (kTrack: adding each param's UpdateTally to its ops[i].stats).
template <typename Backend, typename Lr>
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
               at::TensorList compensations, at::TensorList state_steps, Lr lr, double beta1,
               double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
               bool decoupled_weight_decay, std::string_view compensation,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, int64_t seed,
               std::optional<at::TensorList> update_stats,
               std::optional<at::TensorList> moment_scales) {
  if constexpr (!std::is_same_v<Lr, double>) {
    TORCH_CHECK_VALUE(lr.numel() == 1, "torchcast.adam_step_: Tensor lr must be 1-element");
    if (!params.empty()) check_scalar_device(lr, "lr", params[0].device());
  }
  const Compensation mode = check_adam_args(
      {params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, compensations, state_steps,
       moment_scales},
      amsgrad, compensation, grad_scale, found_inf, update_stats);
  if (params.empty()) return;
  Backend backend(params[0].device());
  // A GradScaler step with infs in the gradients changes nothing, step
  // counts included. The counts live on the host, so a device found_inf is
  // read here: the one synchronization of the op, only when found_inf is
  // passed.
  if (found_inf.has_value() && found_inf->item<double>() != 0.0) return;
  const AdamHyper h{backend.lr_of(lr), beta1, beta2, weight_decay, eps, amsgrad, maximize,
                    decoupled_weight_decay, mode, static_cast<uint64_t>(seed)};
  backend.unscale(grads, grad_scale);

  std::vector<double> steps;
  std::vector<TensorOperands> ops;
  steps.reserve(params.size());
  ops.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    steps.push_back(increment_step(state_steps[i]));
    ops.emplace_back(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                     amsgrad ? &max_exp_avg_sqs[i] : nullptr,
                     carries(mode) ? &compensations[i] : nullptr,
                     /*grad_mutated=*/Backend::kUnscalesInKernel && grad_scale.has_value());
    if (update_stats.has_value()) ops.back().stats = (*update_stats)[i];
    if (moment_scales.has_value()) ops.back().scales = (*moment_scales)[i];
  }
  dispatch_adam(params[0].scalar_type(), exp_avgs[0].scalar_type(), mode, amsgrad,
                update_stats.has_value(), [&](auto pt, auto st, auto m, auto ams, auto track) {
                  backend.template run<decltype(pt), decltype(st), decltype(m)::value,
                                       decltype(ams)::value, decltype(track)::value>(ops, h,
                                                                                     steps);
                });
  for (TensorOperands& o : ops) o.finish();
}

}  // namespace torchcast
