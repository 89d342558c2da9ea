// Device pieces shared by the CUDA kernels: the warp and block trees of the
// canonical reduction order (numerics.h), which the CPU kernels emulate, and
// a 16-byte load/store packet.
#pragma once

#include <cstdint>
#include <cstring>

#include "../numerics.h"
#include "launch.cuh"

namespace torchcast {

constexpr int kWarps = kBlockThreads / kWarp;

template <typename T, int N>
struct alignas(sizeof(T) * N) Packet {
  T v[N];
};

// Shuffles a trivially copyable struct down the warp, 32 bits at a time.
template <typename T>
__device__ __forceinline__ T shfl_down(const T& value, int offset) {
  static_assert(sizeof(T) % sizeof(uint32_t) == 0, "shuffle moves 32-bit words");
  constexpr int kWords = sizeof(T) / sizeof(uint32_t);
  uint32_t w[kWords];
  memcpy(w, &value, sizeof(T));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_down_sync(0xffffffffu, w[i], offset);
  T out;
  memcpy(&out, w, sizeof(T));
  return out;
}

// The in-warp stage of block_tree_reduce: lane i merges lane i + offset, for
// offsets 16, 8, ..., 1. The result is valid in lane 0; every lane must call.
template <typename T>
__device__ __forceinline__ T warp_reduce(T value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value.merge(shfl_down(value, offset));
  return value;
}

// The block tree of block_tree_reduce (numerics.h): warp_reduce inside each
// warp, then the warps' results by the same pattern. The result is valid in
// thread 0. smem holds kWarps values and may be reused once this returns.
template <typename T>
__device__ __forceinline__ T block_reduce(T value, T* smem) {
  value = warp_reduce(value);
  if (threadIdx.x % kWarp == 0) smem[threadIdx.x / kWarp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      for (int i = 0; i < offset; ++i) smem[i].merge(smem[i + offset]);
    }
    value = smem[0];
  }
  __syncthreads();
  return value;
}

// Uninitialized shared storage for kWarps values: __shared__ variables cannot
// have constructors, and the partials have default member initializers.
// (alignas first: the emulated grid's __shared__ is a storage class.)
template <typename T>
__device__ __forceinline__ T* shared_scratch() {
  alignas(T) __shared__ unsigned char raw[kWarps * sizeof(T)];
  return reinterpret_cast<T*>(raw);
}

}  // namespace torchcast
