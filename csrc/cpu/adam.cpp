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

// The second pass over a tile of `end` elements at offset b of the chunk:
// the params stepped by the updates u (element first + b + j of the tensor),
// with the tile's update tally (all zero without kTrack).
template <typename E, bool kTrack>
inline ElementTally apply_tile(const AdamConsts<typename E::T>& k,
                               const AdamTensorConsts<typename E::T>& t,
                               const typename E::T* __restrict__ u, typename E::P* __restrict__ p,
                               typename E::C* __restrict__ c, int64_t first, int64_t b,
                               int64_t end) {
  // A tile never straddles 2^32 elements: its random bits from one high half.
  const uint32_t high = stochastic_high(t.key, first + b);
  const auto low = static_cast<uint32_t>(first + b);
  const auto bits = [&](int64_t j) -> uint32_t {
    if constexpr (E::kDrawsBits) {
      return stochastic_bits_low(t.key, high, low + static_cast<uint32_t>(j));
    } else {
      return 0;
    }
  };
  ElementTally tile;
  if constexpr (!kTrack) {
    for (int64_t j = 0; j < end; ++j) E::apply_at(k, b + j, bits(j), u[j], p, c, tile);
  } else {
    // Summed in plain int32 locals, which gcc keeps in vector registers of
    // full width (checked with -fopt-info-vec: every tracked loop
    // vectorizes for x86-64-v4 and v3).
    int32_t updated = 0, lost = 0, shrunk = 0, comp_units = 0;
    uint32_t comp_max_bits = 0;
    for (int64_t j = 0; j < end; ++j) {
      ElementTally e;
      E::apply_at(k, b + j, bits(j), u[j], p, c, e);
      updated += e.updated;
      lost += e.lost;
      shrunk += e.shrunk;
      comp_units += e.comp_units;
      comp_max_bits = comp_max_bits > e.comp_max_bits ? comp_max_bits : e.comp_max_bits;
    }
    tile.updated = updated;
    tile.lost = lost;
    tile.shrunk = shrunk;
    tile.comp_units = comp_units;
    tile.comp_max_bits = comp_max_bits;
  }
  return tile;
}

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
    out.add(apply_tile<E, kTrack>(k, tconsts, u, p, c, first, b, end));
  }
  return out;
}

// adam_run for 8-bit moments (adam_moments8.h): each tile is a block of
// Moments8::kBlock elements with one scale per moment (the pointers
// m_scales and root_scales at the chunk's first block). Four passes: the
// moments from the old codes and the updates (keeping this step's float32
// exp_avg and sqrt(exp_avg_sq)), their largest magnitudes, the codes
// against the block's new scales, the params.
template <typename PT, Compensation M, bool kTrack>
TC_CPU_CLONES UpdateTally adam_run_moments8(
    const AdamConsts<float>& consts, AdamTensorConsts<float> tconsts,
    typename PT::storage* __restrict__ p, const typename PT::storage* __restrict__ g,
    int8_t* __restrict__ m, uint8_t* __restrict__ v, float* __restrict__ m_scales,
    float* __restrict__ root_scales, typename Elem<PT, Moments8, M, false, kTrack>::C* __restrict__ c,
    int64_t first, int64_t n) {
  using E = Elem<PT, Moments8, M, false, kTrack>;
  using C = typename E::C;
  static_assert(Moments8::kBlock == kTallyBlock, "a block is a tile");
  const AdamConsts<float> k = consts;
  UpdateTally out;
  float u[Moments8::kBlock], mn[Moments8::kBlock], root[Moments8::kBlock];
  for (int64_t b = 0, block = 0; b < n; b += Moments8::kBlock, ++block) {
    const int64_t end = std::min(n - b, Moments8::kBlock);
    const float sm = m_scales[block], sr = root_scales[block];
    for (int64_t j = 0; j < end; ++j) {
      C cj{};
      if constexpr (E::kCarries) cj = c[b + j];
      const float ro = Moments8::root_of(v[b + j], sr);
      float vn, xn = 0.0f;
      u[j] = E::update_of(k, tconsts, E::weight_of(p[b + j], cj), g[b + j],
                          Moments8::m_of(m[b + j], sm), ro * ro, 0.0f, mn[j], vn, xn, root[j]);
    }
    // The maxima in a loop of their own, which gcc vectorizes (checked with
    // -fopt-info-vec).
    int32_t m_largest = 0, root_largest = 0;
    for (int64_t j = 0; j < end; ++j) {
      const int32_t mb = Moments8::magnitude_bits(mn[j]);
      const int32_t rb = Moments8::magnitude_bits(root[j]);
      m_largest = m_largest > mb ? m_largest : mb;
      root_largest = root_largest > rb ? root_largest : rb;
    }
    const float new_sm = Moments8::scale_of(m_largest), new_sr = Moments8::scale_of(root_largest);
    const float inv_m = Moments8::inverse(new_sm), inv_r = Moments8::inverse(new_sr);
    m_scales[block] = new_sm;
    root_scales[block] = new_sr;
    int32_t m_lost = 0, m_off = 0, v_lost = 0, v_off = 0;
    // A block never straddles 2^32 elements: one high half for its indices.
    const uint32_t high = stochastic_high(tconsts.moment_key, first + b);
    const auto low = static_cast<uint32_t>(first + b);
    for (int64_t j = 0; j < end; ++j) {
      const uint32_t bits =
          stochastic_bits_low(tconsts.moment_key, high, low + static_cast<uint32_t>(j));
      const int8_t qm = Moments8::m_code(mn[j], inv_m, Moments8::m_fraction(bits));
      const uint8_t qr = Moments8::root_code(root[j], inv_r, Moments8::root_fraction(bits));
      m[b + j] = qm;
      v[b + j] = qr;
      if constexpr (kTrack) {
        const MomentTally e = MomentTally::of(mn[j], qm, new_sm, root[j], qr, new_sr);
        m_lost += e.m_lost;
        m_off += e.m_off;
        v_lost += e.v_lost;
        v_off += e.v_off;
      }
    }
    ElementTally tile = apply_tile<E, kTrack>(k, tconsts, u, p, c, first, b, end);
    tile.moments.m_lost = m_lost;
    tile.moments.m_off = m_off;
    tile.moments.v_lost = v_lost;
    tile.moments.v_off = v_off;
    out.add(tile);
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
  s[kStatExpAvgLost] += t.m_lost;
  s[kStatExpAvgOff] += t.m_off;
  s[kStatExpAvgSqLost] += t.v_lost;
  s[kStatExpAvgSqOff] += t.v_off;
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
      C* c = E::kCarries ? operand_ptr<C>(o.c) + b : nullptr;
      UpdateTally t;
      if constexpr (std::is_same_v<ST, Moments8>) {
        // Chunks start on a block: row 0 of the scales is exp_avg's, row 1 exp_avg_sq's.
        float* scales = operand_ptr<float>(o.scales);
        const int64_t blocks = o.scales.size(1), first_block = b / Moments8::kBlock;
        t = adam_run_moments8<PT, M, kTrack>(
            k, tk[static_cast<size_t>(ch.tensor)], operand_ptr<P>(o.p) + b,
            operand_ptr<const P>(o.g) + b, operand_ptr<int8_t>(o.m) + b,
            operand_ptr<uint8_t>(o.v) + b, scales + first_block, scales + blocks + first_block, c,
            b, ch.len);
      } else {
        S* vmax = kAmsgrad ? operand_ptr<S>(o.vmax) + b : nullptr;
        t = adam_run<PT, ST, M, kAmsgrad, kTrack>(
            k, tk[static_cast<size_t>(ch.tensor)], operand_ptr<P>(o.p) + b,
            operand_ptr<const P>(o.g) + b, operand_ptr<S>(o.m) + b, operand_ptr<S>(o.v) + b,
            vmax, c, b, ch.len);
      }
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
