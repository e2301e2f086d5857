// Device helpers shared by the CUDA kernel files (not a public interface).
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/gpu.h"

namespace pion::kernels::cuda {

template <typename T>
__host__ __device__ inline T Min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
__host__ __device__ inline T Max(T a, T b) {
  return a < b ? b : a;
}

__device__ inline float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ inline float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Order-preserving uint32 of a float: larger float → larger key (−inf lowest but NaN).
__device__ inline uint32_t SortKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The first visible key of a query at position p (window W > 0), relative to keys at pos0.
__device__ inline int64_t FirstVisible(int64_t p, int64_t window, int64_t pos0) {
  return window > 0 ? p - window + 1 - pos0 : 0;
}

inline Status KernelStatus(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : gpu::CudaError(e, what);
}

// The tensor-core kernel (flash.cu) and its shared-memory bytes per block.
Status LaunchFlash(const AttendArgs& a, cudaStream_t stream);
size_t FlashBytes(const AttendArgs& a);

}  // namespace pion::kernels::cuda
