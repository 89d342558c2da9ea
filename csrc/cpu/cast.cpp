// cast_with_stats on the CPU: one pass over x that writes the correctly
// rounded y and reduces the error statistics, parallel over fixed-size chunks
// so that the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>

#include <memory>
#include <type_traits>

#include "../cast_common.h"
#include "../ops.h"
#include "simd.h"

namespace torchcast {
namespace {

// Per-lane accumulators of one chunk, structure-of-arrays so that the
// contiguous loop vectorizes across lanes (each lane is an independent
// sequential Neumaier sum, so no reassociation is needed).
template <typename From>
struct LaneState {
  static constexpr int kLanes = lanes_of<From>();

  alignas(64) float abs_s[kLanes];
  alignas(64) float abs_c[kLanes];
  alignas(64) float sq_err_s[kLanes];
  alignas(64) float sq_err_c[kLanes];
  alignas(64) float sq_s[kLanes];
  alignas(64) float sq_c[kLanes];
  alignas(64) From max_abs[kLanes];
  alignas(64) From max_rel[kLanes];
  int64_t nan, inexact, overflow, underflow, subnormal;

  void reset() {
    for (int l = 0; l < kLanes; ++l) {
      abs_s[l] = abs_c[l] = sq_err_s[l] = sq_err_c[l] = sq_s[l] = sq_c[l] = 0.f;
      max_abs[l] = max_rel[l] = From(0);
    }
    nan = inexact = overflow = underflow = subnormal = 0;
  }

  ChunkStats<From> finish() const {
    ChunkStats<From> out;
    out.nan = nan;
    out.inexact = inexact;
    out.overflow = overflow;
    out.underflow = underflow;
    out.subnormal = subnormal;
    constexpr int vec = vec_of<From>();
    ErrorSums per_thread[kBlockThreads];
    for (int t = 0; t < kBlockThreads; ++t) {
      ErrorSums acc;
      for (int v = 0; v < vec; ++v) {
        const int l = t * vec + v;
        acc.merge(ErrorSums{abs_s[l], abs_c[l], sq_err_s[l], sq_err_c[l], sq_s[l], sq_c[l]});
      }
      per_thread[t] = acc;
    }
    block_tree_reduce(per_thread);
    out.sums = per_thread[0];
    for (int l = 0; l < kLanes; ++l) {
      out.max_abs_err = max_abs[l] > out.max_abs_err ? max_abs[l] : out.max_abs_err;
      out.max_rel_err = max_rel[l] > out.max_rel_err ? max_rel[l] : out.max_rel_err;
    }
    return out;
  }
};

// Casts n elements (strides in elements) into lanes [lane, lane + n) of st.
// Counters are local and as wide as From so the loop vectorizes.
template <typename From, typename Target, bool kUnitStride>
TC_CPU_CLONES void cast_run(LaneState<From>* __restrict__ st, const From* __restrict__ x,
                            int64_t sx, typename Target::storage* __restrict__ y, int64_t sy,
                            int lane, int n) {
  using Count = std::conditional_t<sizeof(From) == 8, int64_t, int32_t>;
  if (kUnitStride) sx = sy = 1;
  float* __restrict__ abs_s = st->abs_s + lane;
  float* __restrict__ abs_c = st->abs_c + lane;
  float* __restrict__ sq_err_s = st->sq_err_s + lane;
  float* __restrict__ sq_err_c = st->sq_err_c + lane;
  float* __restrict__ sq_s = st->sq_s + lane;
  float* __restrict__ sq_c = st->sq_c + lane;
  From* __restrict__ max_abs = st->max_abs + lane;
  From* __restrict__ max_rel = st->max_rel + lane;
  Count c_nan = 0, c_inexact = 0, c_overflow = 0, c_underflow = 0, c_subnormal = 0;
  for (int j = 0; j < n; ++j) {
    const ElementMeasure<Target, From> m(x[j * sx]);
    y[j * sy] = m.y;
    c_nan += m.nan;
    c_inexact += m.inexact;
    c_overflow += m.overflow;
    c_underflow += m.underflow;
    c_subnormal += m.subnormal;
    neumaier_add(abs_s[j], abs_c[j], m.abs_err_f);
    neumaier_add(sq_err_s[j], sq_err_c[j], m.sq_err_f);
    neumaier_add(sq_s[j], sq_c[j], m.sq_f);
    max_abs[j] = m.abs_err > max_abs[j] ? m.abs_err : max_abs[j];
    max_rel[j] = m.rel_err > max_rel[j] ? m.rel_err : max_rel[j];
  }
  st->nan += c_nan;
  st->inexact += c_inexact;
  st->overflow += c_overflow;
  st->underflow += c_underflow;
  st->subnormal += c_subnormal;
}

template <typename From, typename Target>
at::Tensor narrowing_cast_cpu(const at::Tensor& x, at::Tensor& y) {
  using State = LaneState<From>;
  using Storage = typename Target::storage;
  constexpr int kLanes = State::kLanes;

  auto iter = at::TensorIteratorConfig()
                  .add_output(y)
                  .add_const_input(x)
                  .check_all_same_dtype(false)
                  .resize_outputs(false)
                  .build();
  const int64_t numel = iter.numel();
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  std::vector<ChunkStats<From>> partials(static_cast<size_t>(nchunks));

  at::parallel_for(0, nchunks, 1, [&](int64_t first, int64_t last) {
    auto state = std::make_unique<State>();
    for (int64_t c = first; c < last; ++c) {
      state->reset();
      int64_t pos = 0;  // position inside the chunk: decides the lane
      auto loop = [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
        const int64_t sy = strides[0] / static_cast<int64_t>(sizeof(Storage));
        const int64_t sx = strides[1] / static_cast<int64_t>(sizeof(From));
        for (int64_t r = 0; r < size1; ++r) {
          auto* yp = reinterpret_cast<Storage*>(data[0] + r * strides[2]);
          auto* xp = reinterpret_cast<const From*>(data[1] + r * strides[3]);
          for (int64_t done = 0; done < size0;) {
            const int lane = static_cast<int>(pos % kLanes);
            const int n = static_cast<int>(std::min<int64_t>(size0 - done, kLanes - lane));
            if (sx == 1 && sy == 1) {
              cast_run<From, Target, true>(state.get(), xp + done, 1, yp + done, 1, lane, n);
            } else {
              cast_run<From, Target, false>(state.get(), xp + done * sx, sx, yp + done * sy,
                                            sy, lane, n);
            }
            done += n;
            pos += n;
          }
        }
      };
      iter.serial_for_each(loop, {c * kChunk, std::min(numel, (c + 1) * kChunk)});
      partials[static_cast<size_t>(c)] = state->finish();
    }
  });

  auto stats = at::empty({kNumStats}, x.options().dtype(at::kDouble));
  reduce_partials(partials.data(), nchunks).write(stats.data_ptr<double>(), numel);
  return stats;
}

template <typename Target>
at::Tensor narrowing_from(const at::Tensor& x, at::Tensor& y) {
  if (x.scalar_type() == at::kDouble) return narrowing_cast_cpu<double, Target>(x, y);
  return narrowing_cast_cpu<float, Target>(x, y);
}

at::Tensor cast_into_cpu(const at::Tensor& x, at::ScalarType dtype, at::Tensor& y) {
  if (classify_cast(x.scalar_type(), dtype) == CastKind::kExact) {
    y.copy_(x);
    return exact_cast_stats(x);
  }
  switch (dtype) {
    case at::kFloat: return narrowing_from<Float32Target>(x, y);
    case at::kHalf: return narrowing_from<Float16Target>(x, y);
    default: return narrowing_from<BFloat16Target>(x, y);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cast_with_stats_cpu(const at::Tensor& x, at::ScalarType dtype) {
  classify_cast(x.scalar_type(), dtype);
  auto y = at::empty_like(x, x.options().dtype(dtype));
  auto stats = cast_into_cpu(x, dtype, y);
  return {y, stats};
}

at::Tensor cast_with_stats_out_cpu(const at::Tensor& x, at::ScalarType dtype, at::Tensor& out) {
  classify_cast(x.scalar_type(), dtype);
  check_cast_out(x, dtype, out);
  return cast_into_cpu(x, dtype, out);
}

}  // namespace torchcast
