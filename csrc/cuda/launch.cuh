// How the host drivers of csrc/cuda/ reach the device: a Launcher made for
// the tensors' device launches kernels, reports the device's multiprocessors
// and the kernels' residency, and copies host data there. The kernels and
// drivers are written against it once and compiled twice:
//  - by nvcc, for the GPU (ATen's CUDA API: the device guard, the current
//    stream, the device properties), registered for the CUDA key of the
//    torchcast ops;
//  - by the host compiler with TORCHCAST_EMULATED defined, on the emulated
//    grid (csrc/emulated/grid.h), registered for the CPU key of the same ops
//    in the torchcast_emulated namespace, which tests/emulated.py defines,
//    builds and loads: the CUDA kernels run on CPU tensors.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(TORCHCAST_EMULATED)
#include "../emulated/grid.h"
// The kernels of a file, for its ops' CPU key in torchcast_emulated.
#define TORCHCAST_CUDA_KERNELS(m) TORCH_LIBRARY_IMPL(torchcast_emulated, CPU, m)
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
// The kernels of a file, for its ops' CUDA key.
#define TORCHCAST_CUDA_KERNELS(m) TORCH_LIBRARY_IMPL(torchcast, CUDA, m)
#endif

namespace torchcast {

#if defined(TORCHCAST_EMULATED)

class Launcher {
 public:
  explicit Launcher(const at::Device& device) {
    TORCH_CHECK(device.is_cpu(), "torchcast: an emulated CUDA kernel got tensors on ", device);
  }

  int multiprocessors() const { return emulated::settings().multiprocessors; }

  // The grid sizes scale with the configured multiprocessors alone.
  template <typename... Params>
  static int blocks_per_sm(void (*)(Params...), int) {
    return 1;
  }

  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) const {
    emulated::launch(kernel, grid, block, std::forward<Args>(args)...);
  }

  at::Tensor upload(const void* data, int64_t bytes) const {
    at::Tensor copy = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(copy.data_ptr(), data, static_cast<size_t>(bytes));
    return copy;
  }
};

#else

class Launcher {
 public:
  explicit Launcher(const at::Device& device)
      : guard_(cuda(device)), device_(device), stream_(at::cuda::getCurrentCUDAStream()) {}

  int multiprocessors() const {
    return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  }

  // Blocks of `threads` threads of kernel that one multiprocessor holds at
  // once (at least one).
  template <typename... Params>
  static int blocks_per_sm(void (*kernel)(Params...), int threads) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
    return std::max(blocks, 1);
  }

  // kernel<<<grid, block>>>(args...) on the current stream.
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) const {
    kernel<<<grid, block, 0, stream_>>>(std::forward<Args>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // bytes of host data on the device: a pinned copy, copied asynchronously
  // on the current stream (the caching host allocator keeps the pinned
  // buffer until the copy has run).
  at::Tensor upload(const void* data, int64_t bytes) const {
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), data, static_cast<size_t>(bytes));
    return host.to(device_, /*non_blocking=*/true);
  }

 private:
  static const at::Device& cuda(const at::Device& device) {
    TORCH_CHECK(device.is_cuda(), "torchcast: a CUDA kernel got tensors on ", device);
    return device;
  }

  const c10::cuda::CUDAGuard guard_;
  const at::Device device_;
  const cudaStream_t stream_;
};

#endif

}  // namespace torchcast
