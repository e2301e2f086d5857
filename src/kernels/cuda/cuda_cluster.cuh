// The merge both one-launch kernels end with (sparse_fused.cu, decode_cluster.cu): per K/V head
// a thread-block cluster of C blocks, each holding its warps' (m, l, o) of the head's G member
// query heads. Each block merges its warps and sends its state where it is merged — (m, l) of
// every head to every rank, float4 output column e to the rank whose share holds it — as
// st.async stores into the receivers' shared memory, each counted on the receiver's mbarrier;
// once its own barrier completes, rank r merges columns [ncol·r/C, ncol·(r+1)/C) (ncol = G·D/4)
// from every rank's state. Stores, not loads, cross the cluster, and no rank waits on a cluster
// barrier at the end: each waits only for what it receives.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"

namespace pion::kernels::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Head h's state over a block's warps (m_w in the log2 domain): m_w[w][h] becomes warp w's
// weight; returns (m in the natural-log domain, l).
template <int kWarps, int kG>
__device__ inline float2 MergeWarpStates(float (&m_w)[kWarps][kG], const float (&l_w)[kWarps][kG],
                                         int h) {
  float m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, m_w[w][h]);
  float l = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    const float f = m == -INFINITY ? 0.f : exp2f(m_w[w][h] - m);
    m_w[w][h] = f;
    l += f * l_w[w][h];
  }
  return make_float2(m == -INFINITY ? -INFINITY : m * kLn2, l);
}

// The start's cluster barrier, split: every thread arrives early and waits before its first
// store to another rank, so every rank runs by then. The arrival is relaxed: it publishes
// nothing — each rank's mbarrier inits are published by their fence.mbarrier_init, and all that
// crosses the cluster afterwards is counted st.async — and a release arrival would first wait
// for the thread's memory operations in flight (its loads, its bulk copies).
__device__ inline void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ inline void ClusterWait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// The stores that cross the cluster are st.async: each completes its bytes on the receiving
// rank's mbarrier `bar` (the same offset in every rank), so the receiver waits on its own
// barrier instead of a cluster barrier. RecvBytes: what a rank receives of the merge —
// SendHeadStateAsync's (m, l) of every head, SendColumnsAsync's columns of its share.
__device__ inline uint32_t MapaShared(const void* p, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(SmemAddr(p)), "r"(rank));
  return r;
}
__device__ inline void StAsync(const void* dst, float v, const uint64_t* bar, int rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   MapaShared(dst, rank)),
               "r"(__float_as_uint(v)), "r"(MapaShared(bar, rank))
               : "memory");
}
__device__ inline void StAsync(const void* dst, uint32_t v, const uint64_t* bar, int rank) {
  StAsync(dst, __uint_as_float(v), bar, rank);
}
__device__ inline void StAsync(const void* dst, float4 v, const uint64_t* bar, int rank) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(MapaShared(dst, rank)),
      "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
      "r"(__float_as_uint(v.w)), "r"(MapaShared(bar, rank))
      : "memory");
}
template <int C>
__device__ inline uint32_t RecvBytes(int g, int ncol, int rank) {
  const int share = ncol * (rank + 1) / C - ncol * rank / C;
  return static_cast<uint32_t>(C * (g * 8 + share * 16));
}
template <int C, int kG>
__device__ inline void SendHeadStateAsync(int rank, int h, float2 ml, float (&recv_m)[C][kG],
                                          float (&recv_l)[C][kG], const uint64_t* bar) {
#pragma unroll
  for (int r = 0; r < C; ++r) {
    StAsync(&recv_m[rank][h], ml.x, bar, r);
    StAsync(&recv_l[rank][h], ml.y, bar, r);
  }
}
// The block's output columns, its warps' outputs `wo` (row w·kG + h, kStride floats apart)
// weighted by `weight[w][h]`, each into recv_o of the rank whose share holds it.
template <int C, int kWarps, int kG, int kShare, int kStride>
__device__ inline void SendColumnsAsync(int rank, const float* wo,
                                        const float (&weight)[kWarps][kG],
                                        float4 (&recv_o)[C][kShare], int ncol, int d, int tid,
                                        int threads, const uint64_t* bar) {
  for (int e = tid; e < ncol; e += threads) {
    const int h = e / (d / 4), c = (e % (d / 4)) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = weight[w][h];
      const float4 x = *reinterpret_cast<const float4*>(wo + (w * kG + h) * kStride + c);
      acc.x += f * x.x;
      acc.y += f * x.y;
      acc.z += f * x.z;
      acc.w += f * x.w;
    }
    const int owner = ((e + 1) * C - 1) / ncol;  // the last rank whose share starts at or before e
    StAsync(&recv_o[rank][e - ncol * owner / C], acc, bar, owner);
  }
}

// Once every rank's state has landed: this rank's share of the output columns (≤ kShare: one
// pass), merged from every rank's state, into out (head h's row heads[h], d floats).
template <int C, int kG, int kShare>
__device__ inline void MergeShare(const float (&recv_m)[C][kG], const float (&recv_l)[C][kG],
                                  const float4 (&recv_o)[C][kShare], const int32_t* heads, int ncol,
                                  int d, int rank, int tid, float* out) {
  const int e = ncol * rank / C + tid;
  if (e >= ncol * (rank + 1) / C) return;
  const int h = e / (d / 4), c = (e % (d / 4)) * 4;
  float mx = -INFINITY;
#pragma unroll
  for (int r = 0; r < C; ++r) mx = fmaxf(mx, recv_m[r][h]);
  float l = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 0; r < C; ++r) {
    const float f = mx == -INFINITY ? 0.f : expf(recv_m[r][h] - mx);
    const float4 x = recv_o[r][tid];
    l += f * recv_l[r][h];
    acc.x += f * x.x;
    acc.y += f * x.y;
    acc.z += f * x.z;
    acc.w += f * x.w;
  }
  // One division, four products (H200: fp32 2K decode 7.50 -> 7.42 µs against four divisions).
  const float inv = mx == -INFINITY ? 0.f : 1.f / l;
  *reinterpret_cast<float4*>(out + size_t(heads[h]) * d + c) =
      make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
}

// Once every rank's state has landed, on one warp: head h's LSE from every rank's (m, l)
// (lane r < C takes rank r's); every lane gets it.
template <int C, int kG>
__device__ inline float ClusterLse(const float (&recv_m)[C][kG], const float (&recv_l)[C][kG],
                                   int h, int lane) {
  const bool in = lane < C;
  const float m = in ? recv_m[lane][h] : -INFINITY;
  const float l = in ? recv_l[lane][h] : 0.f;
  const float mx = WarpMax(m);
  const float sl = WarpSum(mx == -INFINITY || !in ? 0.f : expf(m - mx) * l);
  return mx == -INFINITY ? -INFINITY : mx + logf(sl);
}
#endif

}  // namespace pion::kernels::cuda
