// kahan_sum / kahan_mean on the CPU: float32 accumulation with Neumaier
// compensation in the canonical order of csrc/reduce_common.h, so that the
// result depends on the shape, strides and dtype only, never on the thread
// count. Work is split into units (a chunk, or an (output, segment) pair)
// whose partials are combined in a fixed order after the parallel loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../reduce_common.h"
#include "simd.h"

namespace torchcast {
namespace {

template <typename scalar_t>
using acc_of = typename ReduceSource<scalar_t>::Partial::acc_t;
template <typename scalar_t>
using storage_of = typename ReduceSource<scalar_t>::storage;

// The hot loops. Both add element (r, j) = x[r * rs + j * sx] to accumulator
// j, row after row: lanes of one output (schemes 1 and 2) or the one lane of
// neighbouring outputs (scheme 3). Each accumulator is an independent
// sequential sum, so the loops vectorize across j without reassociating.
//
// add_tile: kTile accumulators, copied into locals so that they stay in
// registers over the rows (the arrays themselves live in memory).
template <typename scalar_t, int kTile, bool kUnitStride>
TC_CPU_CLONES void add_tile(acc_of<scalar_t>* __restrict__ s, acc_of<scalar_t>* __restrict__ c,
                            const storage_of<scalar_t>* __restrict__ x, int64_t sx, int64_t rows,
                            int64_t rs) {
  using Src = ReduceSource<scalar_t>;
  if (kUnitStride) sx = 1;
  acc_of<scalar_t> ls[kTile], lc[kTile];
  for (int j = 0; j < kTile; ++j) {
    ls[j] = s[j];
    lc[j] = c[j];
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < kTile; ++j) {
      Src::Partial::add(ls[j], lc[j], Src::widen(x[r * rs + j * sx]));
    }
  }
  for (int j = 0; j < kTile; ++j) {
    s[j] = ls[j];
    c[j] = lc[j];
  }
}

// add_rows: any number n of accumulators, kept in memory.
template <typename scalar_t, bool kUnitStride>
TC_CPU_CLONES void add_rows(acc_of<scalar_t>* __restrict__ s, acc_of<scalar_t>* __restrict__ c,
                            const storage_of<scalar_t>* __restrict__ x, int64_t sx, int64_t n,
                            int64_t rows, int64_t rs) {
  using Src = ReduceSource<scalar_t>;
  if (kUnitStride) sx = 1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      Src::Partial::add(s[j], c[j], Src::widen(x[r * rs + j * sx]));
    }
  }
}

// Rows per pass over the register tiles of a wide block, and how far ahead
// of such a pass x is prefetched (one float32 chunk).
constexpr int64_t kRowBlock = 8;
constexpr int64_t kPrefetchBytes = kChunk * 4;
// The same for a block of a single tile, whose rows follow one another.
constexpr int64_t kSeqRowBlock = 32;
constexpr int64_t kSeqPrefetchBytes = 4096;

// rows x n block of elements (lane stride sx, row stride rs) into n
// accumulators: register tiles of kTile accumulators, a few rows at a time,
// then the leftover accumulators. When the rows are contiguous (sx == 1,
// rs == n), the data a fixed distance further on, up to pf_end, is requested
// into cache at the rate the tiles consume it: a wide block is read column
// by column, which the hardware prefetchers do not follow, and even a
// single sequential tile gains from the extra look-ahead.
template <typename scalar_t, int kTile, bool kUnitStride>
void add_block(acc_of<scalar_t>* s, acc_of<scalar_t>* c, const storage_of<scalar_t>* x, int64_t sx,
               int64_t n, int64_t rows, int64_t rs, const void* pf_end) {
  const int64_t tiled = n / kTile * kTile;
  const bool prefetch = kUnitStride && rs == n && tiled > 0;
  const bool single = n == kTile;
  const int64_t row_block = single ? kSeqRowBlock : kRowBlock;
  const int64_t distance = single ? kSeqPrefetchBytes : kPrefetchBytes;
  for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
    const int64_t nr = std::min(row_block, rows - r0);
    const auto* xr = x + r0 * rs;
    const char* ahead = reinterpret_cast<const char*>(xr) + distance;
    // The row block's cache lines, spread over its tiles.
    const int64_t lines_per_tile =
        prefetch ? (nr * n * static_cast<int64_t>(sizeof(*x)) + 63) / 64 / (tiled / kTile) : 0;
    for (int64_t j = 0; j < tiled; j += kTile) {
      for (int64_t q = 0; q < lines_per_tile && ahead < pf_end; ++q, ahead += 64) {
        __builtin_prefetch(ahead, 0, 2);
      }
      add_tile<scalar_t, kTile, kUnitStride>(s + j, c + j, xr + j * sx, sx, nr, rs);
    }
    if (tiled < n) {
      add_rows<scalar_t, kUnitStride>(s + tiled, c + tiled, xr + tiled * sx, sx, n - tiled, nr, rs);
    }
  }
}

// Positions [begin, end) of the row-major index space of axes, as maximal
// runs along the innermost axis: fn(x_offset, out_offset, length, position).
template <typename Fn>
void for_each_run(const Axes& axes, int64_t begin, int64_t end, Fn&& fn) {
  const int nd = static_cast<int>(axes.size());
  int64_t idx[kMaxAxes];  // all nd entries set below
  int64_t xoff = 0, ooff = 0, rem = begin;
  for (int d = nd - 1; d >= 0; --d) {
    idx[d] = rem % axes[d].size;
    rem /= axes[d].size;
    xoff += idx[d] * axes[d].xstride;
    ooff += idx[d] * axes[d].ostride;
  }
  const Axis& inner = axes[nd - 1];
  for (int64_t pos = begin; pos < end;) {
    const int64_t len = std::min(inner.size - idx[nd - 1], end - pos);
    fn(xoff, ooff, len, pos);
    pos += len;
    idx[nd - 1] += len;
    xoff += len * inner.xstride;
    ooff += len * inner.ostride;
    for (int d = nd - 1; d > 0 && idx[d] == axes[d].size; --d) {
      xoff += axes[d - 1].xstride - idx[d] * axes[d].xstride;
      ooff += axes[d - 1].ostride - idx[d] * axes[d].ostride;
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
}

// Element offset in x (and in the output) of position pos.
Axis offset_of(const Axes& axes, int64_t pos) {
  Axis off{0, 0, 0};
  for (int d = static_cast<int>(axes.size()) - 1; d >= 0; --d) {
    const int64_t i = pos % axes[d].size;
    pos /= axes[d].size;
    off.xstride += i * axes[d].xstride;
    off.ostride += i * axes[d].ostride;
  }
  return off;
}

// Feeds positions [begin, end) of an output's sequence (reduced axes, base
// offset in x) into lanes, the element at position p to lane p % kLanes: a
// run is a partial row of lanes, whole rows, and a partial row.
template <typename scalar_t, int kLanes, bool kUnitStride>
void feed_run(acc_of<scalar_t>* s, acc_of<scalar_t>* c, const storage_of<scalar_t>* x, int64_t sx,
              int64_t len, int64_t pos, const void* pf_end) {
  const int64_t lane = pos % kLanes;
  const int64_t head = std::min(len, (kLanes - lane) % kLanes);
  if (head > 0) add_rows<scalar_t, kUnitStride>(s + lane, c + lane, x, sx, head, 1, 0);
  const int64_t rows = (len - head) / kLanes;
  if (rows > 0) {
    add_block<scalar_t, std::min(kLanes, 64), kUnitStride>(s, c, x + head * sx, sx, kLanes, rows,
                                                           kLanes * sx, pf_end);
  }
  const int64_t done = head + rows * kLanes;
  if (done < len) add_rows<scalar_t, kUnitStride>(s, c, x + done * sx, sx, len - done, 1, 0);
}

template <typename scalar_t, int kLanes>
void feed_lanes(acc_of<scalar_t>* s, acc_of<scalar_t>* c, const storage_of<scalar_t>* x,
                const Axes& reduced, int64_t begin, int64_t end, const void* pf_end) {
  const int64_t sx = reduced.back().xstride;
  auto run = [&](int64_t xoff, int64_t, int64_t len, int64_t pos) {
    if (sx == 1) {
      feed_run<scalar_t, kLanes, true>(s, c, x + xoff, 1, len, pos, pf_end);
    } else {
      feed_run<scalar_t, kLanes, false>(s, c, x + xoff, sx, len, pos, pf_end);
    }
  };
  if (reduced.size() == 1) {
    run(begin * sx, 0, end - begin, begin);
  } else {
    for_each_run(reduced, begin, end, run);
  }
}

// Rounds n values (sums, or means once divided by count) once to the
// output dtype and stores them at output positions o0 + j * os.
template <typename Target>
TC_CPU_CLONES void store_rounded(typename Target::storage* __restrict__ out, int64_t os,
                                 const double* __restrict__ v, int64_t n, double count, bool mean) {
  if (mean) {
    for (int64_t j = 0; j < n; ++j) out[j * os] = Target::round(v[j] / count);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j * os] = Target::round(v[j]);
  }
}

// Where the results go: the output's data (contiguous), its dtype, and the
// count a mean divides by.
struct Writer {
  void* data;
  at::ScalarType dtype;
  double count;
  bool mean;

  void operator()(int64_t o0, int64_t os, const double* v, int64_t n) const {
    switch (dtype) {
      case at::kDouble: {
        auto* out = static_cast<double*>(data) + o0;
        for (int64_t j = 0; j < n; ++j) out[j * os] = mean ? v[j] / count : v[j];
        break;
      }
      case at::kFloat:
        store_rounded<Float32Target>(static_cast<float*>(data) + o0, os, v, n, count, mean);
        break;
      case at::kHalf:
        store_rounded<Float16Target>(static_cast<uint16_t*>(data) + o0, os, v, n, count, mean);
        break;
      default:
        store_rounded<BFloat16Target>(static_cast<uint16_t*>(data) + o0, os, v, n, count, mean);
        break;
    }
  }
  void operator()(int64_t o, double v) const { (*this)(o, 1, &v, 1); }
};

// The value of n lanes or outputs that each hold one sequential sum.
template <typename scalar_t>
TC_CPU_CLONES void lane_values(const acc_of<scalar_t>* __restrict__ s,
                               const acc_of<scalar_t>* __restrict__ c, double* __restrict__ v,
                               int64_t n) {
  using P = typename ReduceSource<scalar_t>::Partial;
  for (int64_t j = 0; j < n; ++j) v[j] = P::from_lane(s[j], c[j]).value();
}

// Scheme 2's partial of one segment from its kWarp lanes.
template <typename scalar_t>
TC_CPU_CLONES typename ReduceSource<scalar_t>::Partial warp_partial(acc_of<scalar_t>* __restrict__ s,
                                                              acc_of<scalar_t>* __restrict__ c) {
  using P = typename ReduceSource<scalar_t>::Partial;
  for (int l = 0; l < kWarp; ++l) c[l] = P::from_lane(s[l], c[l]).c;
  warp_tree_reduce<P>(s, c);
  return P{s[0], c[0]};
}

// Scheme 1: one output.
template <typename scalar_t>
void reduce_full(const typename ReduceSource<scalar_t>::storage* x, const Axes& reduced,
                 const void* x_end, const Writer& write) {
  using P = typename ReduceSource<scalar_t>::Partial;
  using Acc = typename P::acc_t;
  constexpr int kLanes = lanes_of<scalar_t>();
  constexpr int kVec = vec_of<scalar_t>();
  const int64_t m = numel_of(reduced);
  const int64_t nchunks = (m + kChunk - 1) / kChunk;
  std::vector<P> partials(static_cast<size_t>(nchunks));
  at::parallel_for(0, nchunks, 1, [&](int64_t first, int64_t last) {
    alignas(64) Acc s[kLanes];
    alignas(64) Acc c[kLanes];
    P threads[kBlockThreads];
    for (int64_t chunk = first; chunk < last; ++chunk) {
      std::fill(s, s + kLanes, Acc(0));
      std::fill(c, c + kLanes, Acc(0));
      feed_lanes<scalar_t, kLanes>(s, c, x, reduced, chunk * kChunk,
                                   std::min(m, (chunk + 1) * kChunk), x_end);
      for (int t = 0; t < kBlockThreads; ++t) {
        threads[t] = P();
        for (int v = 0; v < kVec; ++v) {
          threads[t].merge(P::from_lane(s[t * kVec + v], c[t * kVec + v]));
        }
      }
      block_tree_reduce(threads);
      partials[static_cast<size_t>(chunk)] = threads[0];
    }
  });
  write(0, reduce_partials(partials.data(), nchunks).value());
}

// Combines each output's segment partials (nseg per output, consecutive) and
// writes it; with one segment the partial is the result (reduce_common.h).
template <typename P>
void finish_segments(const std::vector<P>& partials, int64_t nseg, const Axes& kept,
                     const Writer& write) {
  const int64_t k = numel_of(kept);
  at::parallel_for(0, k, std::max<int64_t>(1, 4096 / nseg), [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o) {
      write(offset_of(kept, o).ostride,
            reduce_partials(partials.data() + o * nseg, nseg).value());
    }
  });
}

// Scheme 2: several outputs, each reduced over a contiguous run by 32 lanes.
template <typename scalar_t>
void reduce_warp_lanes(const typename ReduceSource<scalar_t>::storage* x, const Axes& kept,
                       const Axes& reduced, const void* x_end, const Writer& write) {
  using P = typename ReduceSource<scalar_t>::Partial;
  using Acc = typename P::acc_t;
  const int64_t k = numel_of(kept), m = numel_of(reduced);
  const int64_t nseg = (m + kChunk - 1) / kChunk;
  // The partial of segment seg of the output whose sequence starts at xo.
  auto segment = [&](const storage_of<scalar_t>* xo, int64_t seg) {
    alignas(64) Acc s[kWarp];
    alignas(64) Acc c[kWarp];
    std::fill(s, s + kWarp, Acc(0));
    std::fill(c, c + kWarp, Acc(0));
    feed_lanes<scalar_t, kWarp>(s, c, xo, reduced, seg * kChunk, std::min(m, (seg + 1) * kChunk),
                                x_end);
    return warp_partial<scalar_t>(s, c);
  };
  if (nseg == 1) {
    const Axis& inner = kept.back();
    at::parallel_for(0, k, std::max<int64_t>(1, kChunk / m), [&](int64_t first, int64_t last) {
      for_each_run(kept, first, last, [&](int64_t xoff, int64_t ooff, int64_t len, int64_t) {
        for (int64_t i = 0; i < len; ++i) {
          write(ooff + i * inner.ostride, segment(x + xoff + i * inner.xstride, 0).value());
        }
      });
    });
    return;
  }
  std::vector<P> partials(static_cast<size_t>(k * nseg));
  at::parallel_for(0, k * nseg, 1, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      partials[static_cast<size_t>(u)] = segment(x + offset_of(kept, u / nseg).xstride, u % nseg);
    }
  });
  finish_segments(partials, nseg, kept, write);
}

// Scheme 3: several outputs, one sequential sum each, computed for a block of
// outputs at a time along the kept axis with the smallest stride in x, so
// that the loop vectorizes across outputs (contiguous when that stride is 1).
// The block width only schedules work: each output's arithmetic is its own.
constexpr int kOneLaneTile = 64;

template <typename scalar_t>
void reduce_one_lane(const typename ReduceSource<scalar_t>::storage* x, const Axes& kept,
                     const Axes& reduced, const void* x_end, const Writer& write) {
  using P = typename ReduceSource<scalar_t>::Partial;
  using Acc = typename P::acc_t;
  const int64_t m = numel_of(reduced);
  const int64_t nseg = (m + kChunk - 1) / kChunk;
  // The vector axis; the other kept axes, row-major, index the blocks' rows.
  size_t vi = kept.size() - 1;
  for (size_t d = 0; d < kept.size(); ++d) {
    if (kept[d].xstride < kept[vi].xstride) vi = d;
  }
  const Axis vec = kept[vi];
  Axes rows;
  for (size_t d = 0; d < kept.size(); ++d) {
    if (d != vi) rows.push_back(kept[d]);
  }
  if (rows.empty()) rows.push_back({1, 0, 0});
  const int64_t nrows = numel_of(rows);
  // Wide blocks stream long contiguous pieces of each x row; narrower ones
  // when that is needed to give every thread work.
  constexpr int64_t kMaxBlock = 512;
  const int64_t want_units = 4 * at::get_num_threads();
  int64_t block = std::min(vec.size, kMaxBlock);
  const int64_t per_block = nrows * nseg;
  if (per_block * ((vec.size + block - 1) / block) < want_units) {
    const int64_t blocks = (want_units + per_block - 1) / per_block;
    block = std::max<int64_t>(16, (vec.size + blocks - 1) / blocks);
  }
  const int64_t nblocks = (vec.size + block - 1) / block;
  const int64_t k = nrows * vec.size;
  std::vector<P> partials(static_cast<size_t>(nseg > 1 ? k * nseg : 0));
  const int64_t grain = std::max<int64_t>(1, kChunk / (block * std::min(m, kChunk)));
  at::parallel_for(0, nrows * nblocks * nseg, grain, [&](int64_t first, int64_t last) {
    std::vector<Acc> s(static_cast<size_t>(block)), c(static_cast<size_t>(block));
    std::vector<double> values(static_cast<size_t>(block));
    for (int64_t u = first; u < last; ++u) {
      const int64_t seg = u % nseg, b = (u / nseg) % nblocks, r = u / (nseg * nblocks);
      const Axis row = offset_of(rows, r);
      const int64_t j0 = b * block, n = std::min(block, vec.size - j0);
      const auto* xb = x + row.xstride + j0 * vec.xstride;
      std::fill(s.begin(), s.end(), Acc(0));
      std::fill(c.begin(), c.end(), Acc(0));
      const int64_t rs = reduced.back().xstride;
      for_each_run(reduced, seg * kChunk, std::min(m, (seg + 1) * kChunk),
                   [&](int64_t xoff, int64_t, int64_t len, int64_t) {
                     if (vec.xstride == 1) {
                       add_block<scalar_t, kOneLaneTile, true>(s.data(), c.data(), xb + xoff, 1,
                                                               n, len, rs, x_end);
                     } else {
                       add_block<scalar_t, kOneLaneTile, false>(s.data(), c.data(), xb + xoff,
                                                                vec.xstride, n, len, rs, x_end);
                     }
                   });
      if (nseg == 1) {
        lane_values<scalar_t>(s.data(), c.data(), values.data(), n);
        write(row.ostride + j0 * vec.ostride, vec.ostride, values.data(), n);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          partials[static_cast<size_t>((r * vec.size + j0 + j) * nseg + seg)] =
              P::from_lane(s[j], c[j]);
        }
      }
    }
  });
  if (nseg > 1) {
    // Partials are stored by (row, position along vec); re-order the kept
    // axes the same way so that finish_segments finds each output's offset.
    Axes order = rows;
    order.push_back(vec);
    finish_segments(partials, nseg, order, write);
  }
}

// The backend of kahan_reduce<> (reduce_common.h).
struct CpuReduce {
  static void reduce(const char* /*op*/, const at::Tensor& x, const ReducePlan& plan) {
    const Writer write{plan.out.data_ptr(), plan.out.scalar_type(), static_cast<double>(plan.m),
                       plan.mean};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "kahan_reduce", [&] {
      const auto* xp = reinterpret_cast<const storage_of<scalar_t>*>(x.const_data_ptr());
      // One past x's last element: prefetching stops there.
      int64_t last = 0;
      for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
      const void* x_end = xp + last + 1;
      switch (plan.scheme) {
        case Scheme::kFull:
          reduce_full<scalar_t>(xp, plan.reduced, x_end, write);
          break;
        case Scheme::kWarpLanes:
          reduce_warp_lanes<scalar_t>(xp, plan.kept, plan.reduced, x_end, write);
          break;
        case Scheme::kOneLane:
          reduce_one_lane<scalar_t>(xp, plan.kept, plan.reduced, x_end, write);
          break;
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("kahan_sum", &kahan_reduce<CpuReduce, /*kMean=*/false>);
  m.impl("kahan_mean", &kahan_reduce<CpuReduce, /*kMean=*/true>);
}

}  // namespace torchcast
