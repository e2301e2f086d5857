// Block-wide selection helpers shared by the selection kernels (select.cu, sparse_fused.cu): not
// a public interface. Keys are order-preserving uint32 (SortKey); ties at the threshold go to the
// lower index, as the CPU executor breaks them.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_common.cuh"

namespace pion::kernels::cuda {

// A 4-column slice of a block score: q·mean, and Quest's bound (sum of max(q·min, q·max)).
__device__ inline float Dot4(float4 a, float4 b) {
  return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
}
__device__ inline float Bound4(float4 q, float4 lo, float4 hi) {
  return fmaxf(q.x * lo.x, q.x * hi.x) + fmaxf(q.y * lo.y, q.y * hi.y) +
         fmaxf(q.z * lo.z, q.z * hi.z) + fmaxf(q.w * lo.w, q.w * hi.w);
}

template <typename Op>
__device__ inline float BlockReduce(float x, Op op, float identity) {
  __shared__ float part[32];
  __shared__ float result;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  if (lane == 0) part[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / 32) ? part[lane] : identity;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
    if (lane == 0) result = x;
  }
  __syncthreads();
  const float r = result;
  __syncthreads();
  return r;
}
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Where the top k of n keys end: a key is in the top k when its masked bits exceed `prefix`,
// or equal it and it is among the first `need` such (in index order).
struct Threshold {
  uint32_t prefix = 0, mask = 0;
  int need = 0;
};

// The threshold of the top k among key(0..n-1) (1 <= k <= n). One block of kThreads (>= 256)
// threads; per 8-bit digit a shared histogram, then a block scan over the bins from the top finds
// the digit of the k-th largest key. It stops early once every key of that digit's bin belongs to
// the top k (the masked prefix then separates them exactly: no later digit can matter).
template <int kThreads, typename KeyFn>
__device__ inline Threshold RadixSelect(const KeyFn& key, int n, int k) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ int s_k;
  __shared__ bool s_done;
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_k = k;
    s_done = false;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (threadIdx.x < 256) hist[threadIdx.x] = 0;
    __syncthreads();
    if (s_done) break;
    const uint32_t prefix = s_prefix, mask = s_mask;
    const int want = s_k;
    // Lanes with the same digit add once (block scores cluster in a few high digits: one
    // shared-memory atomic per digit and warp instead of one per key on one address).
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + static_cast<int>(threadIdx.x);
      const uint32_t u = i < n ? key(i) : 0u;
      const bool in = i < n && (u & mask) == prefix;
      const uint32_t bin = in ? (u >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && __ffs(peers) - 1 == static_cast<int>(threadIdx.x & 31u)) {
        atomicAdd(&hist[bin], __popc(peers));
      }
    }
    __syncthreads();
    // Thread t owns bin 255 − t: `above` counts the keys in higher bins.
    const int b = 255 - static_cast<int>(threadIdx.x);
    const int h = b >= 0 ? hist[b] : 0;
    int above;
    Scan(tmp).ExclusiveSum(h, above);
    if (above < want && want <= above + h) {
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      s_mask = mask | (255u << shift);
      s_k = want - above;
      s_done = want - above == h;  // the whole bin is in the top k
    }
    __syncthreads();
  }
  Threshold t;
  t.prefix = s_prefix;
  t.mask = s_mask;
  t.need = s_k;
  __syncthreads();
  return t;
}

// The exclusive prefix sum of x over the block's threads in thread order: a warp scan, the
// warps' totals in warp_total (kThreads / 32 shared ints) and one block barrier.
template <int kThreads>
__device__ inline int BlockExclusiveSum(int x, int* warp_total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int excl = incl - x;
  for (int w = 0; w < warp; ++w) excl += warp_total[w];
  return excl;
}

// The float a SortKey came from.
__device__ inline float FromSortKey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// Shared memory of RangeSelect: the histogram, the threshold bin's keys, the warps' sums.
template <int kBins>
struct RangeScratch {
  int hist[kBins];
  uint32_t list[32];
  int warp_sum[32];
  int count, bin, above, in_bin;
};

// Before the barrier that precedes RangeSelect: the histogram and the list emptied.
template <int kThreads, int kBins>
__device__ inline void RangeSelectClear(RangeScratch<kBins>& s) {
  for (int i = static_cast<int>(threadIdx.x); i < kBins; i += kThreads) s.hist[i] = 0;
  if (threadIdx.x == 0) s.count = 0;
}

// The threshold of the top k among n keys (1 <= k < n) in one histogram pass where it can,
// where RadixSelect takes a pass per 8-bit digit (three or four for block scores, whose keys
// share their high bits). Thread t holds `mine` of the keys in registers (u[0..mine), any
// partition of the n); lo and hi are the smallest and largest of all n. The keys' floats are
// binned linearly over [lo, hi] into kBins bins — bin(x) = ⌊(x − lo)·(kBins / (hi − lo))⌋ rounded
// the same way in every thread, so monotone in the key — a block scan from the top finds the bin
// holding the k-th largest, and where that bin holds at most 32 keys every warp ranks them for
// the exact key (ties then go to the lower index in CompactAscending, as with RadixSelect).
// Returns false, the same in every thread, where it cannot (the range empty or not finite, or
// more than 32 keys in the bin): the caller runs RadixSelect. Four block barriers; the caller's
// barrier after RangeSelectClear must also publish the keys.
template <int kThreads, int kPer, int kBins>
__device__ inline bool RangeSelect(RangeScratch<kBins>& s, const uint32_t (&u)[kPer], int mine,
                                   uint32_t lo, uint32_t hi, int k, Threshold* th) {
  static_assert(kBins % (4 * kThreads) == 0, "a thread scans whole int4s of bins");
  constexpr int kP = kBins / kThreads;
  const float xlo = FromSortKey(lo), width = __fsub_rn(FromSortKey(hi), xlo);
  const float inv = __fdiv_rn(static_cast<float>(kBins), width);
  if (!(width > 0.f) || !isfinite(width) || !isfinite(inv)) return false;
  auto bin_of = [&](uint32_t key) {
    return Min(kBins - 1, __float2int_rz(__fmul_rn(__fsub_rn(FromSortKey(key), xlo), inv)));
  };
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (j < mine) atomicAdd(&s.hist[bin_of(u[j])], 1);
  }
  __syncthreads();
  // Thread t owns the kP bins kBins − 1 − t·kP downwards; `above` counts the keys in higher bins.
  const int lane = threadIdx.x & 31;
  const int top = kBins - 1 - static_cast<int>(threadIdx.x) * kP;
  int h[kP];
#pragma unroll
  for (int j = 0; j < kP; j += 4) {
    const int4 x = *reinterpret_cast<const int4*>(&s.hist[top - j - 3]);
    h[j] = x.w, h[j + 1] = x.z, h[j + 2] = x.y, h[j + 3] = x.x;
  }
  int sum = 0;
#pragma unroll
  for (int j = 0; j < kP; ++j) sum += h[j];
  int above = BlockExclusiveSum<kThreads>(sum, s.warp_sum);
#pragma unroll
  for (int j = 0; j < kP; ++j) {
    if (above < k && k <= above + h[j]) s.bin = top - j, s.above = above, s.in_bin = h[j];
    above += h[j];
  }
  __syncthreads();
  const int b = s.bin, in_bin = s.in_bin, want = k - s.above;
  if (in_bin > 32) return false;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (j < mine && bin_of(u[j]) == b) s.list[atomicAdd(&s.count, 1)] = u[j];
  }
  __syncthreads();
  // Every warp ranks the bin's keys: the k-th largest is the key with fewer than `want` keys
  // above it and at least `want` at or above it.
  const uint32_t mk = lane < in_bin ? s.list[lane] : 0u;
  int gt = 0, eq = 0;
  for (int j = 0; j < in_bin; ++j) {
    const uint32_t x = __shfl_sync(0xffffffffu, mk, j);
    gt += x > mk;
    eq += x == mk;
  }
  const unsigned hit = __ballot_sync(0xffffffffu, lane < in_bin && gt < want && want <= gt + eq);
  const int src = __ffs(hit) - 1;
  th->prefix = __shfl_sync(0xffffffffu, mk, src);
  th->mask = 0xffffffffu;
  th->need = want - __shfl_sync(0xffffffffu, gt, src);
  return true;
}

// A run of kPer keys from index i0 (those at n or past it absent) against the threshold: the
// keys above it plus (<< 16) the keys at it.
template <int kPer>
__device__ inline int ThresholdCount(const uint32_t (&u)[kPer], int i0, int n,
                                     const Threshold& th) {
  int count = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const uint32_t x = u[j] & th.mask;
    count += i0 + j < n ? (x > th.prefix) | ((x == th.prefix) << 16) : 0;
  }
  return count;
}
// visit(i, taken, rank) for the run's keys, gts and eqs the keys above and at the threshold
// before it: a key at the threshold is taken while fewer than th.need came before (the lower
// index wins a tie).
template <int kPer, typename Visit>
__device__ inline void VisitRun(const uint32_t (&u)[kPer], int i0, int n, const Threshold& th,
                                int gts, int eqs, const Visit& visit) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (i0 + j >= n) break;
    const uint32_t x = u[j] & th.mask;
    const bool gt = x > th.prefix, eq = x == th.prefix;
    visit(i0 + j, gt || (eq && eqs < th.need), gts + Min(eqs, th.need));
    gts += gt;
    eqs += eq;
  }
}

// Visits i = 0..n-1 in index order: visit(i, taken, rank) with rank the position of i among
// the taken ones (ascending), taken as `th` says. One block scan per kThreads · kPer keys (a
// thread a run of kPer consecutive keys: keys in shared memory, where kPer > 1 saves scans): it
// counts the keys above the threshold and those at it together (16 bits each), and the ones at
// it are taken while fewer than th.need came before.
template <int kThreads, int kPer = 1, typename KeyFn, typename Visit>
__device__ inline void CompactAscending(const KeyFn& key, int n, const Threshold& th,
                                        const Visit& visit) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int gt_before = 0, eq_before = 0;
  for (int base = 0; base < n; base += kThreads * kPer) {
    const int i0 = base + static_cast<int>(threadIdx.x) * kPer;
    uint32_t u[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) u[j] = i0 + j < n ? key(i0 + j) : 0u;
    int excl, total;
    Scan(tmp).ExclusiveSum(ThresholdCount(u, i0, n, th), excl, total);
    __syncthreads();
    VisitRun(u, i0, n, th, gt_before + (excl & 0xffff), eq_before + (excl >> 16), visit);
    gt_before += total & 0xffff;
    eq_before += total >> 16;
  }
}

// CompactAscending for keys already in registers: thread t holds keys i0 = t·kPer ..
// i0 + kPer − 1 (those ≥ n absent). One block barrier.
template <int kThreads, int kPer, typename Visit>
__device__ inline void CompactRegisters(const uint32_t (&u)[kPer], int n, const Threshold& th,
                                        const Visit& visit) {
  __shared__ int warp_total[kThreads / 32];
  const int i0 = static_cast<int>(threadIdx.x) * kPer;
  const int excl = BlockExclusiveSum<kThreads>(ThresholdCount(u, i0, n, th), warp_total);
  VisitRun(u, i0, n, th, excl & 0xffff, excl >> 16, visit);
}

}  // namespace pion::kernels::cuda
