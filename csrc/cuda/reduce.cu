// kahan_sum / kahan_mean on CUDA: the three schemes of csrc/reduce_common.h,
// each a kernel whose threads, warps and blocks are the ones the canonical
// order is written in, so the results are bit-identical to the CPU kernel's
// and run to run. Partials of several chunks or segments go through a second
// kernel (reduce_partials' order), never float atomics, and nothing here
// synchronizes with the host.
//  - Full (one output): a block per chunk, 16-byte loads where x is one
//    aligned stride-1 run, one partial per chunk.
//  - Warp lanes (a stride-1 run of >= kWarpMinRun elements): a warp per
//    (output, segment); neighbouring lanes read neighbouring elements.
//  - One lane (anything else, typically the reduced dim outer): a thread per
//    (output, segment), neighbouring threads on the outputs that are
//    neighbours in x, so their loads coalesce. Each thread walks up to kChunk
//    elements in sequence: correct for any shape, slow when there are few
//    outputs and long reductions (few threads).
// Strided x is read in place through the plan's axes (no copy).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstdint>

#include "../reduce_common.h"
#include "block_reduce.cuh"
#include "launch.cuh"

namespace torchcast {
namespace {

template <typename scalar_t>
using storage_of = typename ReduceSource<scalar_t>::storage;
template <typename scalar_t>
using partial_of = typename ReduceSource<scalar_t>::Partial;
template <typename scalar_t>
using acc_of = typename partial_of<scalar_t>::acc_t;

// Axes a kernel indexes on the device (torch's own limit for CUDA iterators).
constexpr int kMaxDeviceAxes = 25;

struct Offsets {
  int64_t x, out;
};

// An index space of the plan (kept or reduced axes) on the device.
struct DeviceAxes {
  int nd;
  int64_t size[kMaxDeviceAxes], xstride[kMaxDeviceAxes], ostride[kMaxDeviceAxes];

  // Offsets of row-major position pos (nd == 0: the single position 0).
  __device__ __forceinline__ Offsets at(int64_t pos) const {
    if (nd == 1) return {pos * xstride[0], pos * ostride[0]};
    Offsets o{0, 0};
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t i = pos % size[d];
      pos /= size[d];
      o.x += i * xstride[d];
      o.out += i * ostride[d];
    }
    return o;
  }
};

DeviceAxes device_axes(const char* op, const Axes& axes) {
  TORCH_CHECK(axes.size() <= static_cast<size_t>(kMaxDeviceAxes), "torchcast.", op,
              ": on CUDA x may have at most ", kMaxDeviceAxes,
              " dims that cannot be merged, got ", axes.size(), "; make it contiguous");
  DeviceAxes d{};
  d.nd = static_cast<int>(axes.size());
  for (int i = 0; i < d.nd; ++i) {
    d.size[i] = axes[i].size;
    d.xstride[i] = axes[i].xstride;
    d.ostride[i] = axes[i].ostride;
  }
  return d;
}

enum class OutKind : int { kF64, kF32, kF16, kBF16 };

// Rounds a result (a mean divided first, in float64) once to the output dtype,
// as the CPU kernel's Writer does.
struct OutputWriter {
  void* data;
  OutKind kind;
  double count;
  bool mean;

  __device__ __forceinline__ void operator()(int64_t off, double v) const {
    if (mean) v = v / count;
    switch (kind) {
      case OutKind::kF64: static_cast<double*>(data)[off] = v; break;
      case OutKind::kF32: static_cast<float*>(data)[off] = Float32Target::round(v); break;
      case OutKind::kF16: static_cast<uint16_t*>(data)[off] = Float16Target::round(v); break;
      default: static_cast<uint16_t*>(data)[off] = BFloat16Target::round(v); break;
    }
  }
};

OutputWriter output_writer(const ReducePlan& plan) {
  OutKind kind = OutKind::kBF16;
  switch (plan.out.scalar_type()) {
    case at::kDouble: kind = OutKind::kF64; break;
    case at::kFloat: kind = OutKind::kF32; break;
    case at::kHalf: kind = OutKind::kF16; break;
    default: break;
  }
  return {plan.out.data_ptr(), kind, static_cast<double>(plan.m), plan.mean};
}

// Scheme 1: block c handles chunk c (grid-stride); element e of the chunk goes
// to lane e % lanes, thread t owning lanes [t*vec, t*vec+vec). kVector: x is
// one stride-1 run starting 16-byte aligned, so the full lanes-wide steps are
// one 16-byte load per thread.
template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kBlockThreads)
    full_kernel(const storage_of<scalar_t>* __restrict__ x, DeviceAxes reduced, int64_t m,
                partial_of<scalar_t>* __restrict__ partials) {
  using Src = ReduceSource<scalar_t>;
  using P = partial_of<scalar_t>;
  using Storage = storage_of<scalar_t>;
  constexpr int kVec = vec_of<scalar_t>();
  constexpr int kLanes = lanes_of<scalar_t>();
  P* smem = shared_scratch<P>();
  const int64_t nchunks = (m + kChunk - 1) / kChunk;
  for (int64_t chunk = blockIdx.x; chunk < nchunks; chunk += gridDim.x) {
    const int64_t base = chunk * kChunk;
    const int64_t rest = m - base;
    const int n = static_cast<int>(rest < kChunk ? rest : kChunk);
    acc_of<scalar_t> s[kVec], c[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) s[v] = c[v] = 0;
    int first = 0;
    if constexpr (kVector) {
      const int steps = n / kLanes;
      const Storage* xt = x + base + threadIdx.x * kVec;
#pragma unroll 4
      for (int step = 0; step < steps; ++step) {
        const auto in = *reinterpret_cast<const Packet<Storage, kVec>*>(xt + step * kLanes);
#pragma unroll
        for (int v = 0; v < kVec; ++v) P::add(s[v], c[v], Src::widen(in.v[v]));
      }
      first = steps * kLanes;
    }
    for (int step = first; step < n; step += kLanes) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const int e = step + static_cast<int>(threadIdx.x) * kVec + v;
        if (e < n) P::add(s[v], c[v], Src::widen(x[reduced.at(base + e).x]));
      }
    }
    P thread;
#pragma unroll
    for (int v = 0; v < kVec; ++v) thread.merge(P::from_lane(s[v], c[v]));
    thread = block_reduce(thread, smem);
    if (threadIdx.x == 0) partials[chunk] = thread;
  }
}

// One lane of segment seg of an output whose sequence starts at x + xbase:
// positions seg * kChunk + first, + step, ... of the segment, summed in order.
template <typename scalar_t>
__device__ __forceinline__ partial_of<scalar_t> segment_lane(
    const storage_of<scalar_t>* __restrict__ x, int64_t xbase, const DeviceAxes& reduced,
    int64_t m, int64_t seg, int first, int step) {
  using Src = ReduceSource<scalar_t>;
  using P = partial_of<scalar_t>;
  const int64_t end = min(m, (seg + 1) * kChunk);
  acc_of<scalar_t> s = 0, c = 0;
#pragma unroll 4
  for (int64_t p = seg * kChunk + first; p < end; p += step) {
    P::add(s, c, Src::widen(x[xbase + reduced.at(p).x]));
  }
  return P::from_lane(s, c);
}

// A segment's partial: the output itself when it is the output's only segment
// (reduce_common.h), otherwise stored by (output o, segment) for finish_kernel.
template <typename P>
__device__ __forceinline__ void settle_segment(const P& sum, int64_t out_offset, int64_t o,
                                               int64_t seg, int64_t nseg, P* __restrict__ partials,
                                               const OutputWriter& write) {
  if (nseg == 1) {
    write(out_offset, sum.value());
  } else {
    partials[o * nseg + seg] = sum;
  }
}

// Scheme 2: warp w of the grid handles unit u = (output o, segment seg),
// lane l the positions seg * kChunk + l + 32 j of o's sequence.
template <typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads)
    warp_lanes_kernel(const storage_of<scalar_t>* __restrict__ x, DeviceAxes kept,
                      DeviceAxes reduced, int64_t k, int64_t m, int64_t nseg,
                      partial_of<scalar_t>* __restrict__ partials, OutputWriter write) {
  using P = partial_of<scalar_t>;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  // u is the same for the whole warp: every lane takes part in the shuffles.
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp; u < k * nseg;
       u += stride) {
    const int64_t o = u / nseg, seg = u % nseg;
    const Offsets out = kept.at(o);
    const P sum = warp_reduce(segment_lane<scalar_t>(x, out.x, reduced, m, seg, lane, kWarp));
    if (lane == 0) settle_segment(sum, out.out, o, seg, nseg, partials, write);
  }
}

// Scheme 3: thread u handles output o = u % k (in the order of `outputs`,
// whose last axis has the smallest stride in x) and segment seg = u / k.
// Partials are stored by (o, seg).
template <typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads)
    one_lane_kernel(const storage_of<scalar_t>* __restrict__ x, DeviceAxes outputs,
                    DeviceAxes reduced, int64_t k, int64_t m, int64_t nseg,
                    partial_of<scalar_t>* __restrict__ partials, OutputWriter write) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < k * nseg;
       u += stride) {
    const int64_t o = u % k, seg = u / k;
    const Offsets out = outputs.at(o);
    settle_segment(segment_lane<scalar_t>(x, out.x, reduced, m, seg, 0, 1), out.out, o, seg, nseg,
                   partials, write);
  }
}

// reduce_partials per output: block b handles output o (grid-stride), thread
// t folding its partials t, t + kBlockThreads, ... in order, then the block tree.
template <typename P>
__global__ void __launch_bounds__(kBlockThreads)
    finish_kernel(const P* __restrict__ partials, DeviceAxes outputs, int64_t k, int64_t nseg,
                  OutputWriter write) {
  P* smem = shared_scratch<P>();
  for (int64_t o = blockIdx.x; o < k; o += gridDim.x) {
    P acc;
    for (int64_t i = threadIdx.x; i < nseg; i += kBlockThreads) acc.merge(partials[o * nseg + i]);
    acc = block_reduce(acc, smem);
    if (threadIdx.x == 0) write(outputs.at(o).out, acc.value());
  }
}

// Blocks for `work` units of `per_block` each, at most a few waves of the
// device (the loops are grid-stride; the order never depends on the grid).
unsigned grid_for(const Launcher& launch, int64_t work, int64_t per_block) {
  const int64_t waves = static_cast<int64_t>(launch.multiprocessors()) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min((work + per_block - 1) / per_block, waves)));
}

template <typename scalar_t>
void launch_reduce(const Launcher& launch, const char* op, const at::Tensor& x,
                   const ReducePlan& plan) {
  using P = partial_of<scalar_t>;
  using Storage = storage_of<scalar_t>;
  const auto* xp = static_cast<const Storage*>(x.const_data_ptr());
  const OutputWriter write = output_writer(plan);
  const DeviceAxes reduced = device_axes(op, plan.reduced);
  const int64_t k = plan.k, m = plan.m;
  const int64_t nseg = (m + kChunk - 1) / kChunk;
  // The per-chunk or per-segment partials; unused (one element) where every
  // output is a single segment and written directly.
  const bool direct = plan.scheme != Scheme::kFull && nseg == 1;
  auto partial_bytes = at::empty({(direct ? 1 : k * nseg) * static_cast<int64_t>(sizeof(P))},
                                 x.options().dtype(at::kByte));
  auto* partials = static_cast<P*>(partial_bytes.data_ptr());

  DeviceAxes outputs{};  // the order partials are stored in, by output
  switch (plan.scheme) {
    case Scheme::kFull: {
      outputs.nd = 0;
      const bool vector = plan.reduced.size() == 1 && plan.reduced[0].xstride == 1 &&
                          reinterpret_cast<uintptr_t>(xp) % 16 == 0;
      const unsigned grid = grid_for(launch, nseg, 1);
      if (vector) {
        launch(full_kernel<scalar_t, true>, grid, kBlockThreads, xp, reduced, m, partials);
      } else {
        launch(full_kernel<scalar_t, false>, grid, kBlockThreads, xp, reduced, m, partials);
      }
      break;
    }
    case Scheme::kWarpLanes:
      outputs = device_axes(op, plan.kept);
      launch(warp_lanes_kernel<scalar_t>, grid_for(launch, k * nseg, kWarps), kBlockThreads, xp,
             outputs, reduced, k, m, nseg, partials, write);
      break;
    case Scheme::kOneLane: {
      // The kept axis with the smallest stride in x last, so that
      // neighbouring threads read neighbouring addresses.
      Axes order = plan.kept;
      const auto inner = std::min_element(order.begin(), order.end(), [](const Axis& a, const Axis& b) {
        return a.xstride < b.xstride;
      });
      const Axis vec = *inner;
      order.erase(inner);
      order.push_back(vec);
      outputs = device_axes(op, order);
      launch(one_lane_kernel<scalar_t>, grid_for(launch, k * nseg, kBlockThreads), kBlockThreads,
             xp, outputs, reduced, k, m, nseg, partials, write);
      break;
    }
  }
  if (!direct) {
    launch(finish_kernel<P>, grid_for(launch, k, 1), kBlockThreads, partials, outputs, k, nseg,
           write);
  }
}

// The backend of kahan_reduce<> (reduce_common.h).
struct CudaReduce {
  static void reduce(const char* op, const at::Tensor& x, const ReducePlan& plan) {
    const Launcher launch(x.device());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "kahan_reduce_cuda",
                                    [&] { launch_reduce<scalar_t>(launch, op, x, plan); });
  }
};

}  // namespace

TORCHCAST_CUDA_KERNELS(m) {
  m.impl("kahan_sum", &kahan_reduce<CudaReduce, /*kMean=*/false>);
  m.impl("kahan_mean", &kahan_reduce<CudaReduce, /*kMean=*/true>);
}

}  // namespace torchcast
