// The ceilings for pion-gpu-attn-bench: plain streaming reads of n bytes — the bandwidth ceiling,
// in several forms, of which a bench reports the best (a ceiling must be the best plain read
// one can write, not one slow form of it) — and an empty kernel, the launch floor.
//   kind 0: 16-byte evict-first loads (__ldcs), grid-stride, 8 blocks of 256 an SM;
//   kind 1: four independent 16-byte non-coherent loads in flight a thread (L1 not allocated),
//           4 blocks of 512 an SM;
//   kind 2: eight in flight, 2 blocks of 1024 an SM.
// Each folds what it read into one word per block so the loads are not optimized away.
#include "gpu_stream.h"

namespace {

__global__ void StreamRead(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // practically never: keeps the loads live
}

__device__ __forceinline__ uint4 LoadNoAllocate(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// U loads in flight a thread: each iteration issues U independent loads, U grid strides apart.
template <int U>
__global__ void StreamReadUnrolled(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = LoadNoAllocate(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = LoadNoAllocate(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}

__global__ void Empty() {}

}  // namespace

// The launch floor: a kernel that does nothing, on `blocks` blocks of 128 threads.
void LaunchEmpty(int blocks, cudaStream_t s) { Empty<<<blocks, 128, 0, s>>>(); }

void LaunchStreamRead(const void* p, size_t bytes, uint32_t* sink, int sms, cudaStream_t s,
                      int kind) {
  const auto* q = static_cast<const uint4*>(p);
  switch (kind) {
    case 1:
      StreamReadUnrolled<4><<<sms * 4, 512, 0, s>>>(q, bytes / 16, sink);
      break;
    case 2:
      StreamReadUnrolled<8><<<sms * 2, 1024, 0, s>>>(q, bytes / 16, sink);
      break;
    default:
      StreamRead<<<sms * 8, 256, 0, s>>>(q, bytes / 16, sink);
  }
}
