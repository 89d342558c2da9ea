// adam_step_ on the CPU: one pass over param, grad, moments and compensation
// for every tensor of a dtype group, parallel over fixed-size chunks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../adam_common.h"
#include "simd.h"

namespace torchcast {
namespace {

// Large enough to amortize a task, small enough to balance threads and keep
// one chunk's working set near the L2 cache.
constexpr int64_t kAdamChunk = int64_t{1} << 16;

template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
using Elem = AdamElement<PT, ST, M, kAmsgrad, kTrack>;

// The hot loop over elements [first, first + n) of a tensor (the operand
// pointers start at element first), returning its update tally (all zero
// without kTrack). Unused operands (vmax without amsgrad, c without
// compensation) are never touched. Each tile of kTallyBlock elements takes
// two passes: the moments and updates (into a buffer in L1), then the
// params; two short chains of dependent operations per element overlap
// across more elements than one long one.
template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
TC_CPU_CLONES UpdateTally adam_run(
    const AdamConsts<typename Elem<PT, ST, M, kAmsgrad, kTrack>::T>& consts,
    AdamTensorConsts<typename Elem<PT, ST, M, kAmsgrad, kTrack>::T> tconsts,
    typename PT::storage* __restrict__ p, const typename PT::storage* __restrict__ g,
    typename ST::storage* __restrict__ m, typename ST::storage* __restrict__ v,
    typename ST::storage* __restrict__ vmax,
    typename Elem<PT, ST, M, kAmsgrad, kTrack>::C* __restrict__ c, int64_t first, int64_t n) {
  using E = Elem<PT, ST, M, kAmsgrad, kTrack>;
  using T = typename E::T;
  const AdamConsts<T> k = consts;
  UpdateTally out;
  T u[kTallyBlock];
  for (int64_t b = 0; b < n; b += kTallyBlock) {
    const int64_t end = std::min(n - b, kTallyBlock);
    for (int64_t j = 0; j < end; ++j) {
      u[j] = E::moments_at(k, tconsts, b + j, p, g[b + j], m, v, vmax, c);
    }
    if constexpr (!kTrack) {
      ElementTally unused;
      for (int64_t j = 0; j < end; ++j) {
        E::apply_at(k, tconsts, b + j, first + b + j, u[j], p, c, unused);
      }
    } else {
      // Summed in plain int32 locals, which gcc keeps in vector registers of
      // full width (checked with -fopt-info-vec: every tracked loop
      // vectorizes for x86-64-v4 and v3).
      int32_t updated = 0, lost = 0, shrunk = 0, comp_units = 0;
      uint32_t comp_max_bits = 0;
      for (int64_t j = 0; j < end; ++j) {
        ElementTally e;
        E::apply_at(k, tconsts, b + j, first + b + j, u[j], p, c, e);
        updated += e.updated;
        lost += e.lost;
        shrunk += e.shrunk;
        comp_units += e.comp_units;
        comp_max_bits = comp_max_bits > e.comp_max_bits ? comp_max_bits : e.comp_max_bits;
      }
      ElementTally block;
      block.updated = updated;
      block.lost = lost;
      block.shrunk = shrunk;
      block.comp_units = comp_units;
      block.comp_max_bits = comp_max_bits;
      out.add(block);
    }
  }
  return out;
}

// Adds a tensor's tally (and its element count) to its stats tensor.
void add_tally(const at::Tensor& stats, int64_t numel, const UpdateTally& t) {
  int64_t* s = stats.data_ptr<int64_t>();
  s[kStatElements] += numel;
  s[kStatUpdated] += t.updated;
  s[kStatLost] += t.lost;
  s[kStatShrunk] += t.shrunk;
  s[kStatCompSum] += t.comp_sum;
  s[kStatCompMax] = std::max(s[kStatCompMax], t.comp_max());
}

template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
void adam_cpu_typed(std::vector<TensorOperands>& ops, const AdamHyper& h,
                    const std::vector<double>& steps) {
  using E = Elem<PT, ST, M, kAmsgrad, kTrack>;
  using T = typename E::T;
  using P = typename PT::storage;
  using S = typename ST::storage;
  using C = typename E::C;
  const AdamConsts<T> k = adam_consts<T>(h);
  std::vector<AdamTensorConsts<T>> tk;
  tk.reserve(ops.size());
  for (size_t i = 0; i < steps.size(); ++i) tk.push_back(adam_tensor_consts<T>(h, steps[i], i));

  struct Chunk {
    int64_t tensor, begin, len;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < ops.size(); ++i) {
    const int64_t numel = ops[i].p.numel();
    for (int64_t b = 0; b < numel; b += kAdamChunk) {
      chunks.push_back({static_cast<int64_t>(i), b, std::min(kAdamChunk, numel - b)});
    }
  }
  // One tally per chunk, merged per tensor in chunk order after the pass.
  std::vector<UpdateTally> tallies(kTrack ? chunks.size() : 0);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t ci = lo; ci < hi; ++ci) {
      const Chunk& ch = chunks[static_cast<size_t>(ci)];
      const TensorOperands& o = ops[static_cast<size_t>(ch.tensor)];
      const int64_t b = ch.begin;
      S* vmax = kAmsgrad ? operand_ptr<S>(o.vmax) + b : nullptr;
      C* c = E::kCarries ? operand_ptr<C>(o.c) + b : nullptr;
      const UpdateTally t = adam_run<PT, ST, M, kAmsgrad, kTrack>(
          k, tk[static_cast<size_t>(ch.tensor)], operand_ptr<P>(o.p) + b,
          operand_ptr<const P>(o.g) + b, operand_ptr<S>(o.m) + b, operand_ptr<S>(o.v) + b, vmax,
          c, b, ch.len);
      if constexpr (kTrack) tallies[static_cast<size_t>(ci)] = t;
    }
  });
  if constexpr (kTrack) {
    std::vector<UpdateTally> per_tensor(ops.size());
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      per_tensor[static_cast<size_t>(chunks[ci].tensor)].merge(tallies[ci]);
    }
    for (size_t i = 0; i < ops.size(); ++i) add_tally(ops[i].stats, ops[i].p.numel(), per_tensor[i]);
  }
}

// The backend of adam_step<> (adam_common.h): lr and grad_scale read on the
// host, the grads unscaled in place before the pass, as torch's fused Adam
// leaves them.
struct CpuAdam {
  static constexpr bool kUnscalesInKernel = false;

  explicit CpuAdam(const at::Device&) {}
  double lr_of(double lr) const { return lr; }
  double lr_of(const at::Tensor& lr) const { return lr.item<double>(); }
  void unscale(at::TensorList grads, const std::optional<at::Tensor>& grad_scale) const {
    if (!grad_scale.has_value()) return;
    const double inv = 1.0 / grad_scale->item<double>();
    for (const at::Tensor& g : grads) g.mul_(inv);
  }
  template <typename PT, typename ST, Compensation M, bool kAmsgrad, bool kTrack>
  void run(std::vector<TensorOperands>& ops, const AdamHyper& h,
           const std::vector<double>& steps) const {
    adam_cpu_typed<PT, ST, M, kAmsgrad, kTrack>(ops, h, steps);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchcast, CPU, m) {
  m.impl("adam_step_", &adam_step<CpuAdam, double>);
  m.impl("adam_step_.tensor_lr", &adam_step<CpuAdam, const at::Tensor&>);
}

}  // namespace torchcast
