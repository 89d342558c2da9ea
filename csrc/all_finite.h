// Whether a CPU tensor holds only finite values: the per-op check of
// track(nonfinite=...), which must cost far less than the op it watches
// (all_finite.cpp).
#pragma once

#include <ATen/ATen.h>

namespace torchcast {

// True when every element of x (a CPU tensor of any dtype) is finite; integer
// and bool tensors are. Reads the bits, without allocating, for contiguous
// floating x; other layouts go through at::isfinite.
bool all_finite(const at::Tensor& x);

}  // namespace torchcast
