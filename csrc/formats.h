// The one table of number formats on the C++ side: each element format's
// bits, range and special encodings as a traits type, read by numerics.h's
// rounding, the block-scaled casts (block_cast.h) and the CPU and CUDA
// kernels alike. torchcast/formats.py states the same table for Python;
// tests/test_formats.py checks that the two agree (through
// torchcast._C.format_traits, ops.cpp) and match torch.finfo and ml_dtypes.
//
// Fields of a Format:
//   kName                       the name torchcast/formats.py keys it by
//   kRank                       width order of the dtypes cast_with_stats
//                               measures (a cast to a higher rank is exact;
//                               0: not one of them)
//   kBits, kExpBits, kMant      storage bits, exponent bits, mantissa bits
//   kBias                       exponent bias
//   kEmax                       exponent of the largest power of two <= kMax
//   kMax, kMinNormal, kMinSubnormal   as float (double for float64)
//   kHasInf, kHasNaN
//   kSignBit, kMaxBits          the sign bit; the largest finite magnitude's bits
//   kOverflow                   the bits (sign cleared) a finite value rounding
//                               past kMax becomes without saturation: inf, NaN
//                               (float8_e4m3fn) or kMaxBits (float4_e2m1fn:
//                               no inf, no NaN)
//   kNaN                        the bits (sign cleared) a NaN becomes: c10's
//                               NaN; float4_e2m1fn has none and gives kMaxBits
//   kFirstOverflow              float32 bits of the smallest |f| that rounds
//                               past kMax (max + half an ulp when that tie
//                               rounds up, just above it when it rounds down)
//   special(em), special_bits(em)   for the narrow formats: whether the
//                               magnitude bits em are inf/NaN, and their float32
//                               bits
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TC_HD __host__ __device__ __forceinline__
#else
#define TC_HD inline __attribute__((always_inline))
#endif

namespace torchcast {

struct FormatFloat64 {
  static constexpr const char* kName = "float64";
  static constexpr int kRank = 4;
  static constexpr int kBits = 64, kExpBits = 11, kMant = 52, kBias = 1023, kEmax = 1023;
  static constexpr double kMax = 1.7976931348623157e308, kMinNormal = 0x1p-1022,
                          kMinSubnormal = 0x1p-1074;
  static constexpr bool kHasInf = true, kHasNaN = true;
};

struct FormatFloat32 {
  static constexpr const char* kName = "float32";
  static constexpr int kRank = 3;
  static constexpr int kBits = 32, kExpBits = 8, kMant = 23, kBias = 127, kEmax = 127;
  static constexpr float kMax = 3.40282346638528859812e+38f, kMinNormal = 0x1p-126f,
                         kMinSubnormal = 0x1p-149f;
  static constexpr bool kHasInf = true, kHasNaN = true;
};

struct FormatFloat16 {
  static constexpr const char* kName = "float16";
  static constexpr int kRank = 2;
  static constexpr int kBits = 16, kExpBits = 5, kMant = 10, kBias = 15, kEmax = 15;
  static constexpr float kMax = 65504.f, kMinNormal = 0x1p-14f, kMinSubnormal = 0x1p-24f;
  static constexpr bool kHasInf = true, kHasNaN = true;
  static constexpr uint32_t kSignBit = 0x8000u, kMaxBits = 0x7bffu;
};

struct FormatBFloat16 {
  static constexpr const char* kName = "bfloat16";
  static constexpr int kRank = 2;
  static constexpr int kBits = 16, kExpBits = 8, kMant = 7, kBias = 127, kEmax = 127;
  static constexpr float kMax = 0x1.fep127f, kMinNormal = 0x1p-126f, kMinSubnormal = 0x1p-133f;
  static constexpr bool kHasInf = true, kHasNaN = true;
  static constexpr uint32_t kSignBit = 0x8000u, kMaxBits = 0x7f7fu;
};

struct FormatE4M3FN {
  static constexpr const char* kName = "float8_e4m3fn";
  static constexpr int kRank = 1;
  static constexpr int kBits = 8, kExpBits = 4, kMant = 3, kBias = 7, kEmax = 8;
  static constexpr float kMax = 448.f, kMinNormal = 0x1p-6f, kMinSubnormal = 0x1p-9f;
  static constexpr bool kHasInf = false, kHasNaN = true;
  static constexpr uint32_t kSignBit = 0x80u, kMaxBits = 0x7eu;  // 448
  static constexpr uint32_t kOverflow = 0x7fu, kNaN = 0x7fu;    // no inf: NaN
  // Just above 464: the tie 448|480 goes to 448, the even one.
  static constexpr uint32_t kFirstOverflow = 0x43e80001u;
  TC_HD static bool special(uint32_t em) { return em == 0x7fu; }
  TC_HD static uint32_t special_bits(uint32_t) { return 0x7fc00000u; }
};

struct FormatE5M2 {
  static constexpr const char* kName = "float8_e5m2";
  static constexpr int kRank = 1;
  static constexpr int kBits = 8, kExpBits = 5, kMant = 2, kBias = 15, kEmax = 15;
  static constexpr float kMax = 57344.f, kMinNormal = 0x1p-14f, kMinSubnormal = 0x1p-16f;
  static constexpr bool kHasInf = true, kHasNaN = true;
  static constexpr uint32_t kSignBit = 0x80u, kMaxBits = 0x7bu;  // 57344
  static constexpr uint32_t kOverflow = 0x7cu, kNaN = 0x7fu;    // inf, and c10's NaN
  // 61440: the tie 57344|inf goes to inf, the even one.
  static constexpr uint32_t kFirstOverflow = 0x47700000u;
  TC_HD static bool special(uint32_t em) { return em >= 0x7cu; }
  TC_HD static uint32_t special_bits(uint32_t em) { return 0x7f800000u | ((em & 3u) << 21); }
};

// OCP MX's FP4 element: no inf, no NaN; every cast to it saturates.
struct FormatE2M1 {
  static constexpr const char* kName = "float4_e2m1fn";
  static constexpr int kRank = 0;
  static constexpr int kBits = 4, kExpBits = 2, kMant = 1, kBias = 1, kEmax = 2;
  static constexpr float kMax = 6.f, kMinNormal = 1.f, kMinSubnormal = 0.5f;
  static constexpr bool kHasInf = false, kHasNaN = false;
  static constexpr uint32_t kSignBit = 0x8u, kMaxBits = 0x7u;  // 6
  static constexpr uint32_t kOverflow = 0x7u, kNaN = 0x7u;
  // 7: the tie 6|8 goes to 8, the even one, past the largest.
  static constexpr uint32_t kFirstOverflow = 0x40e00000u;
  TC_HD static bool special(uint32_t) { return false; }
  TC_HD static uint32_t special_bits(uint32_t) { return 0u; }
};

// OCP MX's scale: an unsigned power of two 2^(bits - 127); bits 0xff is NaN.
// There is no zero: bits 0 is 2^-127, a float32 subnormal.
struct FormatE8M0 {
  static constexpr const char* kName = "float8_e8m0fnu";
  static constexpr int kRank = 0;
  static constexpr int kBits = 8, kExpBits = 8, kMant = 0, kBias = 127, kEmax = 127;
  static constexpr float kMax = 0x1p127f, kMinNormal = 0x1p-127f, kMinSubnormal = 0x1p-127f;
  static constexpr bool kHasInf = false, kHasNaN = true;
  static constexpr uint32_t kMaxBits = 0xfeu, kNaN = 0xffu;
};

// The formats above in the order torchcast._C.format_traits lists them.
#define TORCHCAST_FORMATS(X) \
  X(FormatFloat64)           \
  X(FormatFloat32)           \
  X(FormatFloat16)           \
  X(FormatBFloat16)          \
  X(FormatE4M3FN)            \
  X(FormatE5M2)              \
  X(FormatE2M1)              \
  X(FormatE8M0)

// Block-scaled formats: Element values, one scale per block of elements
// (kDefaultBlock unless block_cast is told otherwise).
// MX (OCP MX v1.0): an e8m0 scale; NVFP4: an e4m3 scale per 16 elements and
// a float32 scale per tensor.
enum class BlockKind : int { kMx = 0, kNvfp4 = 1 };

template <typename Element, BlockKind Kind, int DefaultBlock>
struct BlockFormatT {
  using element = Element;
  static constexpr BlockKind kKind = Kind;
  static constexpr int kDefaultBlock = DefaultBlock;
};
using Mxfp8E4M3 = BlockFormatT<FormatE4M3FN, BlockKind::kMx, 32>;
using Mxfp8E5M2 = BlockFormatT<FormatE5M2, BlockKind::kMx, 32>;
using Mxfp4 = BlockFormatT<FormatE2M1, BlockKind::kMx, 32>;
using Nvfp4 = BlockFormatT<FormatE2M1, BlockKind::kNvfp4, 16>;

}  // namespace torchcast
