// Runtime ISA dispatch for the CPU kernels' hot loops. The loops are written
// as plain, branch-free C++ that gcc vectorizes; target_clones compiles each
// for AVX-512 and AVX2 as well as the baseline and picks one at load time, so
// the extension stays portable (no -march=native) yet uses the wide units.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TC_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TC_CPU_CLONES
#endif

namespace torchcast {
namespace cpu {

// Whether to take the AVX-512 loops (cast_avx512.h, block_cast_avx512.h): the
// CPU has AVX-512 and ATen uses it too, so ATEN_CPU_CAPABILITY=avx2 or
// =default selects the portable loops (which is how the tests reach them on
// an AVX-512 machine). Defined in cast.cpp.
bool use_avx512();

}  // namespace cpu
}  // namespace torchcast
