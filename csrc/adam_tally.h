// The update accounting of the Adam step (track_updates): the entries of a
// param's int64 counter, one element's tally and one thread's, host and
// device alike. What is counted: AdamElement::tally_element (adam_common.h)
// for the weights, MomentTally (adam_moments8.h) for 8-bit moments.
#pragma once

#include <cstdint>

#include "adam_moments8.h"
#include "numerics.h"

namespace torchcast {

// Per param, int64 entries that the step
// adds to (kStatCompMax: a running max). torchcast/_reference/adam.py
// UPDATE_STAT_FIELDS names them in this order.
enum UpdateStat : int {
  kStatElements,  // elements stepped
  kStatUpdated,   // of those, with a finite non-zero intended update
  kStatLost,      // of those, whose stored param did not change
  kStatShrunk,    // of those, whose stored param changed by less than half of it
  kStatCompSum,   // sum of |compensation| / ulp(param), in units of 2^-20
  kStatCompMax,   // max of the same
  // 8-bit moments (MomentTally): elements whose exp_avg, exp_avg_sq was
  // stored as code 0 though not zero, or off by more than half of itself
  kStatExpAvgLost,
  kStatExpAvgOff,
  kStatExpAvgSqLost,
  kStatExpAvgSqOff,
  kNumUpdateStats
};
// 2^20 units per ulp: integers add in any order to the same total, so the
// CPU and CUDA tallies agree bit for bit; 2^43 element-steps at a full ulp
// each before an int64 fills.
constexpr float kCompUnits = 1048576.0f;
// 2^22 units: a ratio past 4 ulp (a compensation is within an ulp of the
// param it was made beside; more only where the param has just fallen by
// binades) is clamped, so that a ratio converts to int32, which AVX2
// vectorizes, and kTallyBlock of them add up in an int32.
constexpr float kCompCap = 4194304.0f;
constexpr int64_t kTallyBlock = 256;

// One element's (or, summed in int32 lanes, one block's) update accounting.
// The max is kept as the bits of a non-negative float (whose order is its
// value's): an integer max beside the sums is what gcc vectorizes.
struct ElementTally {
  int32_t updated = 0, lost = 0, shrunk = 0, comp_units = 0;
  uint32_t comp_max_bits = 0;  // float units, clamped to [0, kCompCap]
  MomentTally moments;         // 8-bit moments only
};

// One thread's tally of the update accounting over the elements it stepped.
struct UpdateTally {
  int64_t updated = 0, lost = 0, shrunk = 0, comp_sum = 0;
  uint32_t comp_max_bits = 0;
  int64_t m_lost = 0, m_off = 0, v_lost = 0, v_off = 0;

  TC_HD void add(const ElementTally& e) {
    updated += e.updated;
    lost += e.lost;
    shrunk += e.shrunk;
    comp_sum += e.comp_units;
    comp_max_bits = comp_max_bits > e.comp_max_bits ? comp_max_bits : e.comp_max_bits;
    m_lost += e.moments.m_lost;
    m_off += e.moments.m_off;
    v_lost += e.moments.v_lost;
    v_off += e.moments.v_off;
  }
  TC_HD void merge(const UpdateTally& o) {
    updated += o.updated;
    lost += o.lost;
    shrunk += o.shrunk;
    comp_sum += o.comp_sum;
    comp_max_bits = comp_max_bits > o.comp_max_bits ? comp_max_bits : o.comp_max_bits;
    m_lost += o.m_lost;
    m_off += o.m_off;
    v_lost += o.v_lost;
    v_off += o.v_off;
  }
  // The kStatCompMax entry: the largest ratio in units, truncated.
  TC_HD int64_t comp_max() const { return static_cast<int64_t>(bit_cast<float>(comp_max_bits)); }
};

// p with its last significand bit flipped: one ulp away from p, whatever p's
// binade (subnormals and zero included).
TC_HD uint16_t flip_last_bit(uint16_t p) { return static_cast<uint16_t>(p ^ 1u); }
TC_HD float flip_last_bit(float p) { return bit_cast<float>(bit_cast<uint32_t>(p) ^ 1u); }

}  // namespace torchcast
