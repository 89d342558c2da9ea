// Host-side argument checking, result layout and entry points shared by the
// CPU and CUDA cast_with_stats kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>

#include <optional>
#include <string>
#include <tuple>

#include "numerics.h"

namespace torchcast {

// "torch.float32" rather than c10's "Float", so errors read like Python.
std::string dtype_name(at::ScalarType t);

enum class CastKind { kNarrowing, kExact };

// Classifies x.dtype -> dtype, raising a clear error (naming both dtypes and
// listing the supported pairs) for anything else.
CastKind classify_cast(at::ScalarType from, at::ScalarType to);

// saturate as given, or (None) what x.to(dtype) does: torch saturates casts
// to float8_e4m3fn (+-inf included) and no others.
bool resolve_saturate(std::optional<bool> saturate, at::ScalarType to);

// Checks that a one-element float32 or float64 scale s is positive and finite: read
// here on the CPU (TORCH_CHECK_VALUE with message and the value), queued on
// the device elsewhere, so that no host synchronization is added and a bad
// scale fails at the next one. A zero, negative or non-finite scale loses
// every element while the measured errors read as zero.
void check_scale_value(const at::Tensor& s, const char* message);

// Checks a scaled cast's scale (a one-element float32 tensor on x's device,
// for a lossy cast, or float64 for a float64 x) and returns it as the
// kernels read it, ScaleOf the source: a float32 scale of a float64 x as a
// float64 copy (made on the device, without a synchronization). The value
// is read by the kernels (and by check_scale_value on the CPU).
std::optional<at::Tensor> kernel_scale(const at::Tensor& x, at::ScalarType dtype, CastKind kind,
                                       const std::optional<at::Tensor>& scale);

// Checks a preallocated output for cast_with_stats.out: dtype, shape, device,
// and that out overlaps neither itself nor x. (Autograd is refused by the
// Autograd kernel, autograd.cpp.)
void check_cast_out(const at::Tensor& x, at::ScalarType dtype, const at::Tensor& out);

// False when t's strides prove that no two elements share memory: each
// stride, in increasing order, exceeds the span of the smaller ones.
bool may_self_overlap(const at::Tensor& t);

// y = cast(x) over any strides, in the element order the canonical
// reduction follows on every backend.
at::TensorIterator cast_iterator(const at::Tensor& x, at::Tensor& y);

// The stats of a cast that cannot lose anything: numel, the NaN and +-inf
// counts and amax; the error sums and sum_sq stay zero (no error, so SQNR is
// inf regardless).
at::Tensor exact_cast_stats(const at::Tensor& x);

// Per-chunk result of the fused pass: exact counts and maxima, and the sums
// (SumsOf<From> on CUDA, PlainSums on the CPU).
// merge() and write() are TC_HD: the CUDA kernels reduce and write these on
// the device, in the same order as the CPU.
template <typename From, typename Sums = SumsOf<From>>
struct ChunkStats {
  CastCounts<int64_t> counts;
  From max_abs_err = 0, max_rel_err = 0, amax = 0;
  Sums sums;

  TC_HD void merge(const ChunkStats& o) {
    counts.add(o.counts);
    max_abs_err = o.max_abs_err > max_abs_err ? o.max_abs_err : max_abs_err;
    max_rel_err = o.max_rel_err > max_rel_err ? o.max_rel_err : max_rel_err;
    amax = o.amax > amax ? o.amax : amax;
    sums.merge(o.sums);
  }

  TC_HD void write(double* out, int64_t numel) const {
    out[kNumel] = static_cast<double>(numel);
    out[kNan] = static_cast<double>(counts.nan);
    out[kInf] = static_cast<double>(counts.inf);
    out[kInexact] = static_cast<double>(counts.inexact);
    out[kOverflow] = static_cast<double>(counts.overflow);
    out[kSaturated] = static_cast<double>(counts.saturated);
    out[kUnderflow] = static_cast<double>(counts.underflow);
    out[kSubnormal] = static_cast<double>(counts.subnormal);
    // The maxima are over the measured elements (finite x, finite y). When
    // every finite x overflowed none is left, and 0 would read as "no
    // error": an overflow's error is infinite.
    const bool all_overflowed =
        counts.overflow > 0 && counts.overflow == numel - counts.nan - counts.inf;
    const double inf = bit_cast<double>(uint64_t{0x7ff0000000000000});
    out[kMaxAbsErr] = all_overflowed ? inf : static_cast<double>(max_abs_err);
    out[kMaxRelErr] = all_overflowed ? inf : static_cast<double>(max_rel_err);
    out[kAmax] = static_cast<double>(amax);
    sums.write(out + kSumAbsErr, out + kSumSqErr, out + kSumSq);
  }
};

// ---------------------------------------------------------------------------
// The kernels of cast_with_stats and cast_with_stats.out for one backend,
// whose Backend::narrowing<Src, Target>(x, y, options) writes y = cast(x) and
// returns the stats; each backend registers these with its own Backend.

// What a lossy cast does beyond rounding: saturate (resolved), and the
// scale's device address (nullptr: unscaled), a ScaleOf the source's wide
// type (kernel_scale).
struct CastOptions {
  bool saturate;
  const void* scale;

  template <typename Wide>
  TC_HD const ScaleOf<Wide>* scale_as() const {
    return static_cast<const ScaleOf<Wide>*>(scale);
  }
};

// Only lossy pairs reach Backend::narrowing<Src, Target>(x, y, options):
// Src is the source's element type, or the Target naming a 16-bit source.
template <typename Backend, typename Src>
at::Tensor narrowing_to(const at::Tensor& x, at::ScalarType dtype, at::Tensor& y,
                        const CastOptions& o) {
  switch (dtype) {
    case at::kFloat: return Backend::template narrowing<Src, Float32Target>(x, y, o);
    case at::kHalf: return Backend::template narrowing<Src, Float16Target>(x, y, o);
    case at::kBFloat16: return Backend::template narrowing<Src, BFloat16Target>(x, y, o);
    case at::kFloat8_e4m3fn: return Backend::template narrowing<Src, Float8E4M3FNTarget>(x, y, o);
    default: return Backend::template narrowing<Src, Float8E5M2Target>(x, y, o);  // e5m2
  }
}

template <typename Backend>
at::Tensor cast_into(const at::Tensor& x, CastKind kind, at::ScalarType dtype,
                     const std::optional<at::Tensor>& scale, std::optional<bool> saturate,
                     at::Tensor& y) {
  if (kind == CastKind::kExact) {
    y.copy_(x);
    // y holds every value of x (widened exactly): the same NaN, inf and amax.
    // A strided x is read through y when y is dense, not copied once more.
    const bool through_y = !x.is_non_overlapping_and_dense() && y.is_non_overlapping_and_dense();
    return exact_cast_stats(through_y ? y : x);
  }
  const CastOptions o{resolve_saturate(saturate, dtype),
                      scale.has_value() ? scale->const_data_ptr() : nullptr};
  switch (x.scalar_type()) {
    case at::kDouble: return narrowing_to<Backend, double>(x, dtype, y, o);
    case at::kFloat: return narrowing_to<Backend, float>(x, dtype, y, o);
    case at::kHalf: return narrowing_to<Backend, Float16Target>(x, dtype, y, o);
    default: return narrowing_to<Backend, BFloat16Target>(x, dtype, y, o);  // bfloat16
  }
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> cast_with_stats(const at::Tensor& x, at::ScalarType dtype,
                                                   const std::optional<at::Tensor>& scale,
                                                   std::optional<bool> saturate) {
  const CastKind kind = classify_cast(x.scalar_type(), dtype);
  const auto s = kernel_scale(x, dtype, kind, scale);
  auto y = at::empty_like(x, x.options().dtype(dtype));
  auto stats = cast_into<Backend>(x, kind, dtype, s, saturate, y);
  return {y, stats};
}

template <typename Backend>
at::Tensor cast_with_stats_out(const at::Tensor& x, at::ScalarType dtype,
                               const std::optional<at::Tensor>& scale,
                               std::optional<bool> saturate, at::Tensor& out) {
  const CastKind kind = classify_cast(x.scalar_type(), dtype);
  const auto s = kernel_scale(x, dtype, kind, scale);
  check_cast_out(x, dtype, out);
  return cast_into<Backend>(x, kind, dtype, s, saturate, out);
}

}  // namespace torchcast
