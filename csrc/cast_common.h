// Host-side argument checking, result layout and entry points shared by the
// CPU and CUDA cast_with_stats kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>

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

// The stats of a cast that cannot lose anything: numel and the NaN count; the
// error sums and sum_sq stay zero (no error, so SQNR is inf regardless).
at::Tensor exact_cast_stats(const at::Tensor& x);

// The exact counts of a cast (Count: as wide as the caller needs).
template <typename Count>
struct CastCounts {
  Count nan = 0, inexact = 0, overflow = 0, underflow = 0, subnormal = 0;

  template <typename Other>
  TC_HD void merge(const CastCounts<Other>& o) {
    nan += o.nan;
    inexact += o.inexact;
    overflow += o.overflow;
    underflow += o.underflow;
    subnormal += o.subnormal;
  }
};

// Per-chunk result of the fused pass: exact counts and maxima, compensated sums.
// merge() and write() are TC_HD: the CUDA kernels reduce and write these on
// the device, in the same order as the CPU.
template <typename From>
struct ChunkStats {
  CastCounts<int64_t> counts;
  From max_abs_err = 0, max_rel_err = 0;
  ErrorSums sums;

  TC_HD void merge(const ChunkStats& o) {
    counts.merge(o.counts);
    max_abs_err = o.max_abs_err > max_abs_err ? o.max_abs_err : max_abs_err;
    max_rel_err = o.max_rel_err > max_rel_err ? o.max_rel_err : max_rel_err;
    sums.merge(o.sums);
  }

  TC_HD void write(double* out, int64_t numel) const {
    out[kNumel] = static_cast<double>(numel);
    out[kNan] = static_cast<double>(counts.nan);
    out[kInexact] = static_cast<double>(counts.inexact);
    out[kOverflow] = static_cast<double>(counts.overflow);
    out[kUnderflow] = static_cast<double>(counts.underflow);
    out[kSubnormal] = static_cast<double>(counts.subnormal);
    out[kMaxAbsErr] = static_cast<double>(max_abs_err);
    out[kMaxRelErr] = static_cast<double>(max_rel_err);
    out[kSumAbsErr] = neumaier_value(sums.abs_s, sums.abs_c);
    out[kSumSqErr] = neumaier_value(sums.sq_err_s, sums.sq_err_c);
    out[kSumSq] = neumaier_value(sums.sq_s, sums.sq_c);
  }
};

// ---------------------------------------------------------------------------
// The kernels of cast_with_stats and cast_with_stats.out for one backend,
// whose Backend::narrowing<From, Target>(x, y) writes y = cast(x) and returns
// the stats; each backend registers these with its own Backend.

// Only the five lossy pairs reach Backend::narrowing.
template <typename Backend>
at::Tensor cast_into(const at::Tensor& x, CastKind kind, at::ScalarType dtype, at::Tensor& y) {
  if (kind == CastKind::kExact) {
    y.copy_(x);
    return exact_cast_stats(x);
  }
  if (x.scalar_type() == at::kDouble) {
    switch (dtype) {
      case at::kFloat: return Backend::template narrowing<double, Float32Target>(x, y);
      case at::kHalf: return Backend::template narrowing<double, Float16Target>(x, y);
      default: return Backend::template narrowing<double, BFloat16Target>(x, y);
    }
  }
  if (dtype == at::kHalf) return Backend::template narrowing<float, Float16Target>(x, y);
  return Backend::template narrowing<float, BFloat16Target>(x, y);
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> cast_with_stats(const at::Tensor& x, at::ScalarType dtype) {
  const CastKind kind = classify_cast(x.scalar_type(), dtype);
  auto y = at::empty_like(x, x.options().dtype(dtype));
  auto stats = cast_into<Backend>(x, kind, dtype, y);
  return {y, stats};
}

template <typename Backend>
at::Tensor cast_with_stats_out(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out) {
  const CastKind kind = classify_cast(x.scalar_type(), dtype);
  check_cast_out(x, dtype, out);
  return cast_into<Backend>(x, kind, dtype, out);
}

}  // namespace torchcast
