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

// 16 bytes global → shared, asynchronously (cp.async, L1 bypassed), with a 256-byte L2
// prefetch hint: a streaming read keeps more DRAM requests in flight. Committed and awaited with
// __pipeline_commit / __pipeline_wait_prior like __pipeline_memcpy_async.
__device__ inline void CpAsync16(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src));
}

__device__ inline uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Hopper's bulk copies (the TMA unit): global → this block's shared memory, counted against an
// mbarrier's transaction count. The copy unit takes its requests one at a time (on the H200 about
// one every 10 cycles a multiprocessor), so a tile comes best as one tensor copy (TensorCopy2d),
// not as a bulk copy a row (BulkCopy: for rows that are not contiguous).
__device__ inline void MbarInit(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(arrivals)
               : "memory");
}
// After MbarInit, before the barrier's first use by the copy unit.
__device__ inline void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// A ring of copy barriers, one arrival each (the lane that issues the copies), fenced for the
// copy unit: one lane sets up its warp's ring, then the warp syncs before using it.
template <int S>
__device__ inline void MbarInitRing(uint64_t (&ring)[S]) {
#pragma unroll
  for (int b = 0; b < S; ++b) MbarInit(&ring[b], 1);
  FenceMbarInit();
}
// One arrival that also expects `bytes` more to land before the phase completes.
__device__ inline void MbarArriveExpect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
// Until the phase of the given parity (0, 1, 0, ... as the barrier is reused) has completed.
__device__ inline void MbarWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  }
}
// A 2-D tensor copy (TMA): the box at {c0, c1} of the tensor map at `map` (a __grid_constant__
// kernel parameter) into shared memory (128-byte aligned), counted on `bar`.
// PrefetchTensorMap: the map's descriptor on its way to the copy unit ahead of its first use.
__device__ inline void PrefetchTensorMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}
__device__ inline void TensorCopy2d(void* smem_dst, const void* map, int c0, int c1,
                                    uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];" ::"r"(SmemAddr(smem_dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(SmemAddr(bar))
      : "memory");
}
// The same for the 1-D and 3-D maps of EncodeTensorMap (a 3-D box at {c0, c1, c2}).
__device__ inline void TensorCopy1d(void* smem_dst, const void* map, int c0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2}], [%3];" ::"r"(SmemAddr(smem_dst)),
      "l"(map), "r"(c0), "r"(SmemAddr(bar))
      : "memory");
}
__device__ inline void TensorCopy3d(void* smem_dst, const void* map, int c0, int c1, int c2,
                                    uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];" ::"r"(SmemAddr(smem_dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar))
      : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from gmem_src.
__device__ inline void BulkCopy(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SmemAddr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// Orders this thread's earlier plain shared-memory accesses before later bulk copies' writes.
__device__ inline void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif

// Order-preserving uint32 of a float: larger float → larger key (−inf lowest but NaN).
__device__ inline uint32_t SortKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The first visible key of a query at position p (window W > 0), relative to keys at pos0.
__host__ __device__ inline int64_t FirstVisible(int64_t p, int64_t window, int64_t pos0) {
  return window > 0 ? p - window + 1 - pos0 : 0;
}

// The keys [lo, lo + len) that queries at positions pmin..pmax see together: from pmin's first
// visible key (a.window, a.begin) to pmax's last (a.end); len = 0 where there is none.
struct KeySpan {
  uint32_t lo, len;
};
__host__ __device__ inline KeySpan VisibleSpan(const AttendArgs& a, int64_t pmin, int64_t pmax) {
  const int64_t b = Max<int64_t>(FirstVisible(pmin, a.window, a.k_pos0), a.begin);
  const int64_t e = Min<int64_t>(pmax - a.k_pos0 + 1, a.end);
  const uint32_t lo = static_cast<uint32_t>(b < e ? b : 0),
                 hi = static_cast<uint32_t>(b < e ? e : 0);
  return {lo, hi - lo};
}

// The end of a split-K attention block when the launch finishes itself (a.counters set): every
// block counts itself done; the last of its blockIdx.x merges the splits of its rows (`rows`,
// −1 = none) into a.out / a.lse, exactly as LaunchCombine would, and resets the counter.
__device__ inline void FinishSplits(const AttendArgs& a, const int32_t* rows, int nrows_block) {
  if (a.counters == nullptr) return;
  __shared__ bool last;
  __threadfence();  // this block's partials are visible device-wide before it counts itself
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&a.counters[blockIdx.x], 1u) == a.splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const uint32_t groups = a.d / 4, parts = a.splits;
  for (int e = threadIdx.x; e < nrows_block * static_cast<int>(groups); e += blockDim.x) {
    const int32_t row = rows[e / groups];
    const uint32_t g = e % groups;
    if (row < 0) continue;
    float mx = -INFINITY;
    for (uint32_t p = 0; p < parts; ++p)
      mx = fmaxf(mx, __ldcg(a.part_m + size_t{p} * a.nrows + row));
    float4* o = reinterpret_cast<float4*>(a.out + size_t(row) * a.d) + g;
    if (mx == -INFINITY) {
      *o = make_float4(0.f, 0.f, 0.f, 0.f);
      if (g == 0 && a.lse != nullptr) a.lse[row] = -INFINITY;
      continue;
    }
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (uint32_t p = 0; p < parts; ++p) {
      const size_t pr = size_t{p} * a.nrows + row;
      const float m = __ldcg(a.part_m + pr);
      if (m == -INFINITY) continue;
      const float w = expf(m - mx);
      l += w * __ldcg(a.part_l + pr);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(a.part_o + pr * a.d) + g);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    *o = make_float4(acc.x / l, acc.y / l, acc.z / l, acc.w / l);
    if (g == 0 && a.lse != nullptr) a.lse[row] = mx + logf(l);
  }
  if (threadIdx.x == 0) a.counters[blockIdx.x] = 0;
}

// Programmatic dependent launch (sm_90): a kernel launched after this one by LaunchDependent may
// start once every block of this grid has called LaunchDependents (or exited); it waits for this
// grid's results in WaitForPrimary. Both are no-ops where unsupported or when the kernels are
// launched plainly.
__device__ inline void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ inline void WaitForPrimary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

inline Status KernelStatus(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : gpu::CudaError(e, what);
}

// Launches `kernel` on sm_90 as a programmatic dependent launch: its blocks may begin while the
// kernel before it in the stream drains, so the launch latency between the two is hidden. The
// kernel must call WaitForPrimary before it reads that kernel's results (or writes what that
// kernel reads). Elsewhere a plain launch.
template <typename... Params, typename... Args>
Status LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, const char* what, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = gpu::Info().cc_major >= 9 ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  return e == cudaSuccess ? KernelStatus(what) : gpu::CudaError(e, what);
}

// The launch of `blocks` blocks of `threads` in thread-block clusters of `cluster` blocks (a
// 1-D grid); `attr` holds the cluster attribute the config points at.
inline cudaLaunchConfig_t ClusterLaunch(uint32_t blocks, uint32_t threads, size_t smem,
                                        uint32_t cluster, cudaStream_t stream,
                                        cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// The tensor-core kernels (flash.cu; eight row groups a block: flash_batched.cu) and the
// resident blocks per multiprocessor of the one LaunchFlash takes for `a`.
Status LaunchFlash(const AttendArgs& a, cudaStream_t stream);
int FlashBlocksPerSm(const AttendArgs& a);
Status LaunchBatched(const AttendArgs& a, cudaStream_t stream);
int BatchedBlocksPerSm(const AttendArgs& a);  // resident blocks of it per multiprocessor
// The streaming decode (decode_stream.cu): its launch (encoding a's tensor maps) and the blocks
// a multiprocessor its splits are planned for over `keys` keys (StreamDecodeFits:
// cuda_attention.h).
Status LaunchStreamDecode(const AttendArgs& a, cudaStream_t stream);
int StreamDecodeBlocksPerSm(const AttendArgs& a, uint64_t keys);

}  // namespace pion::kernels::cuda
