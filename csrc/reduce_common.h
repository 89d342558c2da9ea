// The canonical order of kahan_sum / kahan_mean, shared by the CPU kernel
// (csrc/cpu/reduce.cpp), the pure-PyTorch fallback (torchcast/_reference/reduce.py)
// and a CUDA kernel, which must all produce the same bits.
//
// Sequence. The elements that make up one output are visited in x's memory
// order: the reduced dims, size-1 dims dropped, sorted by decreasing stride
// (equal strides, e.g. 0 for an expanded dim: lower dim index first), the
// innermost dim running fastest. Outputs are the kept dims in row-major order.
// The "run" is the innermost axis of that sequence after merging neighbouring
// dims that are contiguous with each other (stride[a] == stride[b] * size[b]).
//
// Three schemes, chosen from the shape and strides only (never the thread
// count), so the bits depend on (shape, strides, dtype) alone:
//
// 1. Full: one output (every kept dim has size 1). The canonical order of
//    numerics.h: chunks of kChunk consecutive elements, element e of a chunk
//    to lane e % lanes_of<scalar_t>(), each lane a sequential Neumaier sum,
//    per CUDA thread its vec lanes folded in order into an empty sum, then
//    block_tree_reduce, and the chunk partials by reduce_partials. A CUDA
//    block per chunk, exactly like cast_with_stats.
// 2. Warp lanes: several outputs and a run of stride 1 and length >=
//    kWarpMinRun. Each output's sequence is cut into segments of kChunk
//    elements; element e of a segment goes to lane e % kWarp, each lane a
//    sequential Neumaier sum, and the 32 lanes are combined by the in-warp
//    shuffle-down tree (warp_tree_reduce). A CUDA warp per (output, segment).
// 3. One lane: several outputs, any other layout (typically the reduced dim
//    is outer and the kept dim contiguous). Each segment of kChunk elements
//    of an output is one sequential Neumaier sum. A CUDA thread per (output,
//    segment), neighbouring threads on neighbouring outputs (coalesced).
//
// In schemes 2 and 3 the segment partials of one output are combined by
// reduce_partials. With a single segment that step only renormalises the pair
// (s, c) into (s + c, error) exactly, so the value s + c is unchanged and a
// kernel may skip it: the CPU kernel does, the fallback does not (the tests
// compare both bit for bit).
//
// The result is the compensated pair's value(), rounded once to the output
// dtype (via round-to-odd for float16/bfloat16, numerics.h); a mean divides
// value() by the count in float64 first. float64 inputs accumulate in plain
// float64 (PlainDoubleSum) in the same order.
//
// Non-finite values: every partial is settled (numerics.h) as it is formed,
// so a partial whose sum s is not finite keeps c = 0 and is worth s alone.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <optional>

#include "numerics.h"

namespace torchcast {

// Scheme 2 needs runs this long (two elements per lane) to pay for its 32
// lanes and tree per output; shorter runs go to scheme 3.
constexpr int64_t kWarpMinRun = 2 * kWarp;

// A compensated float32 partial sum.
struct CompensatedSum {
  using acc_t = float;
  float s = 0.f, c = 0.f;

  TC_HD static void add(float& s, float& c, float v) { neumaier_add(s, c, v); }
  TC_HD static void merge(float& s, float& c, float s2, float c2) {
    neumaier_merge(s, c, s2, c2);
    c = settled(s, c);
  }
  TC_HD static CompensatedSum from_lane(float s, float c) { return {s, settled(s, c)}; }
  TC_HD void merge(const CompensatedSum& o) { merge(s, c, o.s, o.c); }
  // Exact unless the exponents of s and c are more than 29 apart, and then
  // rounded once, so rounding it to float32 equals rounding s + c directly.
  TC_HD double value() const { return static_cast<double>(s) + static_cast<double>(c); }
};

// float64 inputs: a plain float64 sum in the same order (c stays 0).
struct PlainDoubleSum {
  using acc_t = double;
  double s = 0.0, c = 0.0;

  TC_HD static void add(double& s, double&, double v) { s += v; }
  TC_HD static void merge(double& s, double&, double s2, double) { s += s2; }
  TC_HD static PlainDoubleSum from_lane(double s, double) { return {s, 0.0}; }
  TC_HD void merge(const PlainDoubleSum& o) { s += o.s; }
  TC_HD double value() const { return s; }
};

// What x holds (storage), how it widens to the accumulator, and the partial
// that accumulates it.
template <typename scalar_t>
struct ReduceSource;

template <>
struct ReduceSource<float> {
  using storage = float;
  using Partial = CompensatedSum;
  TC_HD static float widen(float v) { return v; }
};

template <>
struct ReduceSource<at::Half> {
  using storage = uint16_t;
  using Partial = CompensatedSum;
  TC_HD static float widen(uint16_t v) { return Float16Target::widen(v); }
};

template <>
struct ReduceSource<at::BFloat16> {
  using storage = uint16_t;
  using Partial = CompensatedSum;
  TC_HD static float widen(uint16_t v) { return BFloat16Target::widen(v); }
};

template <>
struct ReduceSource<double> {
  using storage = double;
  using Partial = PlainDoubleSum;
  TC_HD static double widen(double v) { return v; }
};

// Scheme 2's tree over kWarp lanes held as arrays (lane i in s[i], c[i]):
// the shuffle-down order of one warp, i.e. block_tree_reduce's first stage.
// The result is in s[0], c[0]. Lanes must come from from_lane(). The levels
// are unrolled at compile time so that each one vectorizes on the CPU.
template <typename P, int kOff, typename Acc>
TC_HD void warp_tree_level(Acc* s, Acc* c) {
  for (int i = 0; i < kOff; ++i) P::merge(s[i], c[i], s[i + kOff], c[i + kOff]);
  if constexpr (kOff > 1) warp_tree_level<P, kOff / 2>(s, c);
}

template <typename P, typename Acc>
TC_HD void warp_tree_reduce(Acc* s, Acc* c) {
  warp_tree_level<P, kWarp / 2>(s, c);
}

// ---------------------------------------------------------------------------
// The host-side plan both kernels start from (reduce_common.cpp).

// One axis of an index space: its size, and its strides (in elements) in x
// and in the output.
struct Axis {
  int64_t size, xstride, ostride;
};
using Axes = c10::SmallVector<Axis, 8>;  // outermost first
// Dims left after merging (coalesce) that the CPU kernel indexes with a
// fixed array; more is an error that says to make x contiguous.
constexpr size_t kMaxAxes = 64;

int64_t numel_of(const Axes& axes);

// Drops size-1 axes and merges neighbours that are contiguous in x and in
// the output; neither changes the order of the index space. Never empty.
Axes coalesce(const Axes& in);

enum class Scheme { kFull, kWarpLanes, kOneLane };

// What a kahan_sum / kahan_mean call does: its output (allocated, contiguous,
// already final when `done`), and otherwise the kept axes (outputs, row-major)
// and reduced axes (each output's sequence), both coalesced, and the scheme.
struct ReducePlan {
  at::Tensor out;
  bool done = false;
  bool mean = false;
  Axes kept, reduced;
  int64_t k = 0, m = 0;  // outputs, elements per output
  Scheme scheme = Scheme::kFull;
};

// plan_reduce for the tensor a kernel reduces, which replaces x: x itself, or
// x.to(torch.float64) when the result is float64, so that dtype=torch.float64
// accumulates in float64 (as torch.sum's does) and never overflows where
// torch's does not. Every argument is checked before x is copied.
ReducePlan plan_accumulation(const char* op, at::Tensor& x, at::OptionalIntArrayRef dim,
                             bool keepdim, std::optional<at::ScalarType> dtype, bool mean);

// Checks the arguments the way torch.sum / torch.mean do (same exception
// types, dim errors from torch itself) and plans the reduction.
ReducePlan plan_reduce(const char* op, const at::Tensor& x, at::OptionalIntArrayRef dim,
                       bool keepdim, std::optional<at::ScalarType> dtype, bool mean);

// The kernel of kahan_sum (kMean false) or kahan_mean for one backend, whose
// Backend::reduce(op, x, plan) fills plan.out: checks and plan are the same
// everywhere. Each backend registers these with its own Backend.
template <typename Backend, bool kMean>
at::Tensor kahan_reduce(const at::Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                        std::optional<at::ScalarType> dtype) {
  const char* op = kMean ? "kahan_mean" : "kahan_sum";
  at::Tensor source = x;  // what the kernel reads: x or its float64 copy
  const ReducePlan plan = plan_accumulation(op, source, dim, keepdim, dtype, kMean);
  if (!plan.done) Backend::reduce(op, source, plan);
  return plan.out;
}

}  // namespace torchcast
