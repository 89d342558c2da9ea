// Host-side argument checking and result layout shared by the CPU and CUDA
// cast_with_stats kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>

#include <string>

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
// Autograd kernel, cast_autograd.cpp.)
void check_cast_out(const at::Tensor& x, at::ScalarType dtype, const at::Tensor& out);

// False when t's strides prove that no two elements share memory: each
// stride, in increasing order, exceeds the span of the smaller ones.
bool may_self_overlap(const at::Tensor& t);

// y = cast(x) over any strides, in the element order the canonical
// reduction follows on every backend.
at::TensorIterator cast_iterator(const at::Tensor& x, at::Tensor& y);

// The stats of a cast that cannot lose anything: numel only, no pass over x.
at::Tensor exact_cast_stats(const at::Tensor& x);

// Per-chunk result of the fused pass: exact counts and maxima, compensated sums.
// merge() and write() are TC_HD: the CUDA kernels reduce and write these on
// the device, in the same order as the CPU.
template <typename From>
struct ChunkStats {
  int64_t nan = 0, inexact = 0, overflow = 0, underflow = 0, subnormal = 0;
  From max_abs_err = 0, max_rel_err = 0;
  ErrorSums sums;

  TC_HD void merge(const ChunkStats& o) {
    nan += o.nan;
    inexact += o.inexact;
    overflow += o.overflow;
    underflow += o.underflow;
    subnormal += o.subnormal;
    max_abs_err = o.max_abs_err > max_abs_err ? o.max_abs_err : max_abs_err;
    max_rel_err = o.max_rel_err > max_rel_err ? o.max_rel_err : max_rel_err;
    sums.merge(o.sums);
  }

  TC_HD void write(double* out, int64_t numel) const {
    out[kNumel] = static_cast<double>(numel);
    out[kNan] = static_cast<double>(nan);
    out[kInexact] = static_cast<double>(inexact);
    out[kOverflow] = static_cast<double>(overflow);
    out[kUnderflow] = static_cast<double>(underflow);
    out[kSubnormal] = static_cast<double>(subnormal);
    out[kMaxAbsErr] = static_cast<double>(max_abs_err);
    out[kMaxRelErr] = static_cast<double>(max_rel_err);
    out[kSumAbsErr] = neumaier_value(sums.abs_s, sums.abs_c);
    out[kSumSqErr] = neumaier_value(sums.sq_err_s, sums.sq_err_c);
    out[kSumSq] = neumaier_value(sums.sq_s, sums.sq_c);
  }
};

}  // namespace torchcast
