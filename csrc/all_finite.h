// Non-finite values in a CPU tensor, read from its bits (cpu/all_finite.cpp):
// whether there are any (the per-op check of track(nonfinite=...), which must
// cost far less than the op it watches), and how many, with the largest finite
// magnitude (the stats of an exact cast, which the tracker takes for every
// widening cast).
#pragma once

#include <ATen/ATen.h>

namespace torchcast {

// True when every element of x (a CPU tensor of any dtype) is finite; integer
// and bool tensors are. Reads the bits, without allocating, for contiguous
// floating x; other layouts go through at::isfinite.
bool all_finite(const at::Tensor& x);

// all_finite(x), and when it is true, x's largest |x| in amax (complex: the
// largest |real| or |imaginary| part). The non-finite watch reads the
// tensors an in-place op writes to this way, before the op overwrites them.
bool all_finite_amax(const at::Tensor& x, double& amax);

struct NonfiniteCounts {
  int64_t nan = 0, inf = 0;
  double amax = 0;  // the largest finite |x|; 0 when there is none
};

// The counts of a CPU tensor of a floating dtype of float_rank > 0 that is
// non-overlapping and dense (its numel elements read as one block).
NonfiniteCounts count_nonfinite(const at::Tensor& x);

}  // namespace torchcast
