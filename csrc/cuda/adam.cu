// adam_step_ on CUDA: one launch per dtype group steps every tensor of it
// (a multi-tensor kernel, as torch's fused Adam), with the per-element math
// of the CPU kernel (AdamElement, adam_common.h), so that params, moments,
// compensation and unscaled grads are bit-identical to the CPU op's.
//
// The tensors' addresses, sizes and step constants go to the device as one
// array (a pinned host buffer copied on the current stream, no host sync);
// block b steps chunk b of the concatenated tensors and finds its tensor by a
// binary search over the chunk offsets. A tensor lr and grad_scale are read
// on the device, and the constants that depend on them are computed there
// with the same float64 expressions as on the host.
#include <ATen/ATen.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "../adam_common.h"
#include "launch.cuh"

namespace torchcast {
namespace {

constexpr int kAdamThreads = 256;
// Elements per block: enough work to amortize the block's setup, small
// enough that a 50M-parameter group spreads over several waves of blocks.
constexpr int64_t kAdamChunk = int64_t{1} << 14;

// One non-empty tensor of the group, as the kernel sees it.
template <typename T>
struct DeviceTensor {
  void* p;
  void* g;
  void* m;
  void* v;
  void* vmax;
  void* c;
  int64_t* stats;  // update accounting (kTrack), else nullptr
  float* scales;   // 8-bit moments: (2, blocks), else nullptr
  int64_t blocks;  // 8-bit moments: the scales' blocks per row
  int64_t numel;
  int64_t first_chunk;  // chunks of the tensors before this one
  double bc1;           // 1 - beta1^step, for an lr known only on the device
  AdamTensorConsts<T> t;
};

// Scalars that may live on the device (nullptr where absent), and what the
// lr-dependent constants need besides lr.
struct DeviceScalars {
  const double* lr;
  const double* grad_scale;
  double weight_decay;
  bool decoupled;
};

// Adds one thread's tally to the tensor's stats: summed over each warp by
// shuffles, then one integer atomic per warp and field, so that the totals
// do not depend on the order the warps arrive in.
__device__ void add_tally(int64_t* stats, UpdateTally t) {
  for (int off = 16; off > 0; off /= 2) {
    UpdateTally o;
    o.updated = __shfl_down_sync(0xffffffffu, t.updated, off);
    o.lost = __shfl_down_sync(0xffffffffu, t.lost, off);
    o.shrunk = __shfl_down_sync(0xffffffffu, t.shrunk, off);
    o.comp_sum = __shfl_down_sync(0xffffffffu, t.comp_sum, off);
    o.comp_max_bits = __shfl_down_sync(0xffffffffu, t.comp_max_bits, off);
    t.merge(o);
  }
  for (int off = 16; off > 0; off /= 2) {
    UpdateTally o;
    o.m_lost = __shfl_down_sync(0xffffffffu, t.m_lost, off);
    o.m_off = __shfl_down_sync(0xffffffffu, t.m_off, off);
    o.v_lost = __shfl_down_sync(0xffffffffu, t.v_lost, off);
    o.v_off = __shfl_down_sync(0xffffffffu, t.v_off, off);
    t.m_lost += o.m_lost;
    t.m_off += o.m_off;
    t.v_lost += o.v_lost;
    t.v_off += o.v_off;
  }
  if ((threadIdx.x & 31u) != 0) return;
  auto* u = reinterpret_cast<unsigned long long*>(stats);
  atomicAdd(u + kStatExpAvgLost, static_cast<unsigned long long>(t.m_lost));
  atomicAdd(u + kStatExpAvgOff, static_cast<unsigned long long>(t.m_off));
  atomicAdd(u + kStatExpAvgSqLost, static_cast<unsigned long long>(t.v_lost));
  atomicAdd(u + kStatExpAvgSqOff, static_cast<unsigned long long>(t.v_off));
  atomicAdd(u + kStatUpdated, static_cast<unsigned long long>(t.updated));
  atomicAdd(u + kStatLost, static_cast<unsigned long long>(t.lost));
  atomicAdd(u + kStatShrunk, static_cast<unsigned long long>(t.shrunk));
  atomicAdd(u + kStatCompSum, static_cast<unsigned long long>(t.comp_sum));
  atomicMax(reinterpret_cast<long long*>(stats) + kStatCompMax,
            static_cast<long long>(t.comp_max()));
}

// The tensor chunk `chunk` belongs to: the last one starting at or before
// it (no tensor is empty).
template <typename T>
__device__ const DeviceTensor<T>& tensor_of_chunk(const DeviceTensor<T>* tensors, int ntensors,
                                                  int64_t chunk) {
  int lo = 0, hi = ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tensors[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return tensors[lo];
}

// The constants that depend on a device lr, and the grad's unscale: the
// CPU op's grad.mul_(1 / grad_scale), the reciprocal in float64, rounded to
// the compute type, one multiply rounded to the grad.
template <typename T>
__device__ void device_scalars(const DeviceScalars& ds, const DeviceTensor<T>& a,
                               AdamConsts<T>& k, AdamTensorConsts<T>& t, T& inv_scale) {
  if (ds.lr != nullptr) {
    const double lr = *ds.lr;
    set_lr_consts(k, lr, ds.weight_decay, ds.decoupled);
    t.neg_step_size = neg_step_size_of<T>(lr, a.bc1);
  }
  inv_scale = ds.grad_scale != nullptr ? static_cast<T>(1.0 / *ds.grad_scale) : T(1);
}

template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
__global__ void __launch_bounds__(kAdamThreads)
    adam_kernel(const DeviceTensor<typename AdamElement<PT, ST, M, kAmsgrad, kTrack>::T>*
                    __restrict__ tensors,
                int ntensors, AdamConsts<typename AdamElement<PT, ST, M, kAmsgrad, kTrack>::T> k,
                DeviceScalars ds) {
  using E = AdamElement<PT, ST, M, kAmsgrad, kTrack>;
  using T = typename E::T;
  using P = typename PT::storage;
  using S = typename ST::storage;
  using C = typename E::C;
  const int64_t chunk = blockIdx.x;
  const DeviceTensor<T>& a = tensor_of_chunk(tensors, ntensors, chunk);
  AdamTensorConsts<T> t = a.t;
  T inv_scale;
  device_scalars(ds, a, k, t, inv_scale);

  P* __restrict__ p = static_cast<P*>(a.p);
  P* __restrict__ g = static_cast<P*>(a.g);
  S* __restrict__ m = static_cast<S*>(a.m);
  S* __restrict__ v = static_cast<S*>(a.v);
  S* __restrict__ vmax = static_cast<S*>(a.vmax);
  C* __restrict__ c = static_cast<C*>(a.c);
  const int64_t begin = (chunk - a.first_chunk) * kAdamChunk;
  const int64_t rest = a.numel - begin;
  const int64_t end = begin + (rest < kAdamChunk ? rest : kAdamChunk);
  UpdateTally tally;
  for (int64_t j = begin + threadIdx.x; j < end; j += kAdamThreads) {
    P gj = g[j];
    if (ds.grad_scale != nullptr) {
      gj = PT::round(PT::widen(gj) * inv_scale);
      g[j] = gj;
    }
    ElementTally e;
    E::step_at(k, t, j, j, p, gj, m, v, vmax, c, e);
    if constexpr (kTrack) tally.add(e);
  }
  if constexpr (kTrack) {
    // Every thread of the block reaches this (no early return above).
    add_tally(a.stats, tally);
    if (threadIdx.x == 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(a.stats) + kStatElements,
                static_cast<unsigned long long>(end - begin));
    }
  }
}

// adam_kernel for 8-bit moments (adam_moments8.h): the block of threads
// steps its chunk one Moments8 block (kAdamThreads elements, one a thread)
// at a time: each thread its element's update and float32 moments, the
// block's largest magnitudes reduced across the threads (warp shuffles,
// then each warp's through shared memory), the codes against the new
// scales, the param. Every thread reads the old scales before the first
// barrier; thread 0 writes the new ones after it.
template <typename PT, Compensation M, bool kTrack>
__global__ void __launch_bounds__(kAdamThreads)
    adam_moments8_kernel(const DeviceTensor<float>* __restrict__ tensors, int ntensors,
                         AdamConsts<float> k, DeviceScalars ds) {
  static_assert(kAdamThreads == Moments8::kBlock, "a thread per element of a block");
  using E = AdamElement<PT, Moments8, M, false, kTrack>;
  using P = typename PT::storage;
  using C = typename E::C;
  constexpr int kWarps = kAdamThreads / 32;
  __shared__ int32_t largest[2][kWarps];
  const int64_t chunk = blockIdx.x;
  const DeviceTensor<float>& a = tensor_of_chunk(tensors, ntensors, chunk);
  AdamTensorConsts<float> t = a.t;
  float inv_scale;
  device_scalars(ds, a, k, t, inv_scale);

  P* __restrict__ p = static_cast<P*>(a.p);
  P* __restrict__ g = static_cast<P*>(a.g);
  int8_t* __restrict__ m = static_cast<int8_t*>(a.m);
  uint8_t* __restrict__ v = static_cast<uint8_t*>(a.v);
  C* __restrict__ c = static_cast<C*>(a.c);
  const int64_t begin = (chunk - a.first_chunk) * kAdamChunk;
  const int64_t rest = a.numel - begin;
  const int64_t end = begin + (rest < kAdamChunk ? rest : kAdamChunk);
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x / 32u;
  UpdateTally tally;
  for (int64_t first = begin; first < end; first += Moments8::kBlock) {
    const int64_t j = first + threadIdx.x;
    const bool in = j < end;
    const int64_t block = first / Moments8::kBlock;
    const float sm = a.scales[block], sr = a.scales[a.blocks + block];
    float u = 0.0f, mn = 0.0f, root = 0.0f, pv = 0.0f;
    P pj{};
    C cj{};
    if (in) {
      P gj = g[j];
      if (ds.grad_scale != nullptr) {
        gj = PT::round(PT::widen(gj) * inv_scale);
        g[j] = gj;
      }
      pj = p[j];
      if constexpr (E::kCarries) cj = c[j];
      pv = E::weight_of(pj, cj);
      const float ro = Moments8::root_of(v[j], sr);
      float vn, xn = 0.0f;
      u = E::update_of(k, t, pv, gj, Moments8::m_of(m[j], sm), ro * ro, 0.0f, mn, vn, xn, root);
    }
    int32_t mb = in ? Moments8::magnitude_bits(mn) : 0;
    int32_t rb = in ? Moments8::magnitude_bits(root) : 0;
    for (int off = 16; off > 0; off /= 2) {
      const int32_t om = __shfl_down_sync(0xffffffffu, mb, off);
      const int32_t orr = __shfl_down_sync(0xffffffffu, rb, off);
      mb = mb > om ? mb : om;
      rb = rb > orr ? rb : orr;
    }
    if (lane == 0) {
      largest[0][warp] = mb;
      largest[1][warp] = rb;
    }
    __syncthreads();
    mb = 0;
    rb = 0;
    for (int w = 0; w < kWarps; ++w) {
      mb = mb > largest[0][w] ? mb : largest[0][w];
      rb = rb > largest[1][w] ? rb : largest[1][w];
    }
    __syncthreads();  // the next block writes largest again
    const float new_sm = Moments8::scale_of(mb), new_sr = Moments8::scale_of(rb);
    if (threadIdx.x == 0) {
      a.scales[block] = new_sm;
      a.scales[a.blocks + block] = new_sr;
    }
    if (in) {
      const uint32_t bits = stochastic_bits(t.moment_key, j);
      const int8_t qm = Moments8::m_code(mn, Moments8::inverse(new_sm), Moments8::m_fraction(bits));
      const uint8_t qr =
          Moments8::root_code(root, Moments8::inverse(new_sr), Moments8::root_fraction(bits));
      m[j] = qm;
      v[j] = qr;
      ElementTally e;
      E::apply(k, E::bits_at(t, j), pv, u, pj, cj, e);
      p[j] = pj;
      if constexpr (E::kCarries) c[j] = cj;
      if constexpr (kTrack) {
        e.moments = MomentTally::of(mn, qm, new_sm, root, qr, new_sr);
        tally.add(e);
      }
    }
  }
  if constexpr (kTrack) {
    // Every thread of the block reaches this (no early return above).
    add_tally(a.stats, tally);
    if (threadIdx.x == 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(a.stats) + kStatElements,
                static_cast<unsigned long long>(end - begin));
    }
  }
}

template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
void adam_cuda_typed(const std::vector<TensorOperands>& ops, const AdamHyper& h,
                     const std::vector<double>& steps, const DeviceScalars& ds,
                     const Launcher& launch) {
  using T = typename AdamElement<PT, ST, M, kAmsgrad, kTrack>::T;
  std::vector<DeviceTensor<T>> tensors;
  tensors.reserve(ops.size());
  int64_t nchunks = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const TensorOperands& o = ops[i];
    const int64_t numel = o.p.numel();
    if (numel == 0) continue;
    tensors.push_back({o.p.data_ptr(), o.g.data_ptr(), o.m.data_ptr(), o.v.data_ptr(),
                       operand_ptr<void>(o.vmax), operand_ptr<void>(o.c),
                       kTrack ? o.stats.data_ptr<int64_t>() : nullptr,
                       operand_ptr<float>(o.scales), o.scales.defined() ? o.scales.size(1) : 0,
                       numel, nchunks, bias_correction1(h, steps[i]),
                       adam_tensor_consts<T>(h, steps[i], i)});
    nchunks += (numel + kAdamChunk - 1) / kAdamChunk;
  }
  if (tensors.empty()) return;
  TORCH_CHECK(nchunks <= std::numeric_limits<int32_t>::max(),
              "torchcast.adam_step_: ", nchunks, " chunks of ", kAdamChunk,
              " elements exceed one launch; step the params in several groups");

  const at::Tensor dev = launch.upload(
      tensors.data(), static_cast<int64_t>(tensors.size() * sizeof(DeviceTensor<T>)));
  const auto* device_tensors = static_cast<const DeviceTensor<T>*>(dev.data_ptr());
  if constexpr (std::is_same_v<ST, Moments8>) {
    launch(adam_moments8_kernel<PT, M, kTrack>, static_cast<unsigned>(nchunks), kAdamThreads,
           device_tensors, static_cast<int>(tensors.size()), adam_consts<T>(h), ds);
  } else {
    launch(adam_kernel<PT, ST, M, kAmsgrad, kTrack>, static_cast<unsigned>(nchunks),
           kAdamThreads, device_tensors, static_cast<int>(tensors.size()), adam_consts<T>(h), ds);
  }
}

// A one-element scalar as float64 on the device: a device tensor is converted
// there, a host one written by a fill kernel; neither waits for the device.
at::Tensor device_double(const at::Tensor& t, const at::Device& device) {
  const auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
  if (t.is_cpu()) return at::full({1}, t.item<double>(), opts);
  return t.reshape({1}).to(opts);
}

// The backend of adam_step<> (adam_common.h): a tensor lr and grad_scale are
// read on the device, by the kernel, which also unscales the grads there.
class CudaAdam {
 public:
  static constexpr bool kUnscalesInKernel = true;

  explicit CudaAdam(const at::Device& device) : launch_(device), device_(device) {}

  double lr_of(double lr) const { return lr; }
  // 0 is never read: the device computes the lr-dependent constants.
  double lr_of(const at::Tensor& lr) {
    lr_ = device_double(lr, device_);
    return 0.0;
  }
  void unscale(at::TensorList, const std::optional<at::Tensor>& grad_scale) {
    if (grad_scale.has_value()) scale_ = device_double(*grad_scale, device_);
  }
  template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
  void run(const std::vector<TensorOperands>& ops, const AdamHyper& h,
           const std::vector<double>& steps) const {
    const DeviceScalars ds{lr_.defined() ? lr_.data_ptr<double>() : nullptr,
                           scale_.defined() ? scale_.data_ptr<double>() : nullptr,
                           h.weight_decay, h.decoupled};
    adam_cuda_typed<PT, ST, M, kAmsgrad, kTrack>(ops, h, steps, ds, launch_);
  }

 private:
  const Launcher launch_;
  const at::Device device_;
  at::Tensor lr_, scale_;  // float64 on the device, where passed
};

}  // namespace

TORCHCAST_CUDA_KERNELS(m) {
  m.impl("adam_step_", &adam_step<CudaAdam, double>);
  m.impl("adam_step_.tensor_lr", &adam_step<CudaAdam, const at::Tensor&>);
}

}  // namespace torchcast
