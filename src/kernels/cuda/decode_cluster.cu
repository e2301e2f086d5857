// Dense M = 1 decode over a short visible range in one launch, fp32, fp16 or bf16 K/V (d 64 or
// 128), up to kG = 4 query heads a K/V head.
//
// Per K/V head one thread-block cluster of kCluster blocks of 8 warps: the visible keys split
// evenly over the cluster's warps in whole runs of 32/kG keys, rank-major, each warp a
// contiguous run. A warp's K tiles (16 or 32 keys) stream through its own ring of bulk copies (a
// tile's rows are contiguous in the slot: one copy), its V rows straight into registers while
// the tile's scores are computed. The math is fp32 on the CUDA cores, lane l owning columns
// l·D/32 ..:
//   scores   a run of 32/kG keys' dot products with the kG member heads' queries is one
//            ReduceScatter32Xor (31 shuffles and 31 adds for 32 sums; the values sit
//            lane-permuted — each lane's queries and K rows in its own order — so no selects),
//            leaving lane l key l / kG of head l % kG
//   softmax  online, in the log2 domain, per head over the lanes of that head
//   p·V      every lane's columns of every head; a key's weights by one broadcast read of the
//            warp's weights in shared memory
// Then the warps merge in shared memory, each rank sends its merged (m, l, o) where it is
// merged — its m and l to every rank, its output columns to the rank that owns them — as
// st.async stores into their shared memory, each counted on the receiver's mbarrier, so each
// rank waits for its own inputs (no cluster barrier after the start), writes its columns of the
// output, and rank h writes head h's LSE.
//
// Against the split-K launch and its combine (flash.cu, attend.cu) this leaves out the partials'
// round trip through global memory and the second launch, and runs 8 warps a
// multiprocessor where the fp32 decode runs four (whose hi/lo tf32 MMA chains then wait on each
// other) — on 64 multiprocessors for 8 K/V heads, so it pays only while a range is short
// (DecodeClusterMaxKeys).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_cluster.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"

namespace pion::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kCluster = kDecodeCluster;
constexpr int kBlockWarps = 8;  // warps a block (Dc::kWarps)

template <typename T, int D, int kG, int Tk>
struct Dc {
  // Warps a block: 8 (up to 255 registers a thread). 16-warp blocks (128 registers, 8-key fp32
  // tiles) measured slower once 8 warps had 16- and 32-key tiles — H200, fp32 MHA 8/8 2K 7.42
  // vs 7.02 µs, 16/8 2K 7.44 vs 7.04, 8/8 4K 11.26 vs 10.94, 16/8 1K 5.48 vs 5.33, fp16 8/8 2K
  // 6.73 vs 6.58 — so the kernel has 8.
  static constexpr int kWarps = kBlockWarps;
  static_assert(Tk == 16 || Tk == 32, "16- or 32-key tiles");
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCols = D / 32;  // columns a lane owns
  static_assert(kCols * 32 == D && (kCols == 2 || kCols == 4), "d 64 or 128");
  static constexpr int kRowBytes = D * int(sizeof(T));
  static constexpr int kRun = 32 / kG;  // keys one ReduceScatter32 scores
  // Keys a tile (at most Tk: their V rows are registers) and the K bytes of a ring stage:
  // 16-key tiles in 8 KB stages — at fp32 d = 128 two runs whose shuffle chains overlap, against
  // 8-key tiles (H200, GQA 32/8: 2K 7.87 -> 7.48 µs, 1K 5.58 -> 5.30, 4K 12.0 -> 11.4) — or
  // 32-key tiles in 16 KB stages, which take a warp's 32 keys at 2K in one tile, every V row's
  // load in flight at once, where 16-key tiles wait on the second tile's V loads: fp32 2K
  // 7.50 -> 7.05 µs, 4K 11.39 -> 10.98 (one ring stage a warp), fp16 2K 6.82 -> 6.58.
  static constexpr int kStageBytes = Tk == 32 ? 16384 : 8192;
  static constexpr int kFit = kStageBytes / kRowBytes < Tk ? kStageBytes / kRowBytes : Tk;
  static constexpr int kTk = kFit > kRun ? kFit : kRun;
  static_assert(kTk % kRun == 0, "a tile is whole runs");
  static constexpr int kRuns = kTk / kRun;
  static constexpr int kWords = kCols * int(sizeof(T)) / 4;  // 32-bit words of a lane's columns
  static_assert(kRuns >= 1 && kWords >= 1, "a tile is a run or more; a lane loads a word or more");
  static constexpr size_t kTile = size_t{kTk} * kRowBytes;  // K bytes of a tile
  // Tiles in each warp's ring: up to 3, within 192 KB of rings a block.
  static constexpr int kStages = kWarps * 3 * kTile <= (192u << 10)   ? 3
                                 : kWarps * 2 * kTile <= (192u << 10) ? 2
                                                                      : 1;
  static constexpr size_t kRing = kStages * kTile;
  // The warps' outputs [kWarps][kG][D] floats, in the rings once every warp is done with them.
  static constexpr size_t kOut = size_t{kWarps} * kG * D * 4;
  static constexpr size_t kBytes = kWarps * kRing > kOut ? kWarps* kRing : kOut;
  static constexpr int kShare = (kG * D / 4 + kCluster - 1) / kCluster;  // float4 columns a rank
  static_assert(kShare <= kThreads, "a rank merges its share in one pass");
};

// A lane's columns of a row as loaded (W 32-bit words), and as floats.
template <int W>
__device__ inline void LoadWords(const void* p, uint32_t (&w)[W]) {
  if constexpr (W == 4) {
    const uint4 u = __ldg(static_cast<const uint4*>(p));
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
  } else if constexpr (W == 2) {
    const uint2 u = __ldg(static_cast<const uint2*>(p));
    w[0] = u.x, w[1] = u.y;
  } else {
    w[0] = __ldg(static_cast<const unsigned int*>(p));
  }
}
template <typename T, int N, int W>
__device__ inline void ToFloats(const uint32_t (&w)[W], float (&x)[N]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __uint_as_float(w[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // the high halves of fp32: exact
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      x[2 * i] = f.x, x[2 * i + 1] = f.y;
    }
  }
}
// A lane's kCols columns of a row as floats.
template <int N>
__device__ inline void LoadCols(const float* p, float (&x)[N]) {
  if constexpr (N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x, x[1] = v.y;
  }
}
template <int N>
__device__ inline void LoadCols(const __half* p, float (&x)[N]) {
  if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
  } else {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(p));
    x[0] = a.x, x[1] = a.y;
  }
}

template <int N>
__device__ inline void LoadCols(const __nv_bfloat16* p, float (&x)[N]) {
  uint32_t w[N / 2];
  if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x, w[1] = u.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
  ToFloats<__nv_bfloat16>(w, x);
}

template <typename T, int D, int kG, int Tk>
__global__ void __launch_bounds__(Dc<T, D, kG, Tk>::kThreads, 1)
    DecodeCluster(const __grid_constant__ DecodeClusterArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // clusters; the launch checks the device
  using F = Dc<T, D, kG, Tk>;
  constexpr int kCols = F::kCols, kRun = F::kRun, kTk = F::kTk, kRuns = F::kRuns;
  constexpr int kShare = F::kShare, kWarps = F::kWarps, kThreads = F::kThreads;
  constexpr int kWords = F::kWords, kStages = F::kStages;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[kWarps][kStages];
  __shared__ float warp_m[kWarps][kG], warp_l[kWarps][kG];
  __shared__ int32_t heads[kG];
  __shared__ __align__(
      16) float pw[kWarps][kRuns * 32];  // each warp's tile weights, as lanes hold them
  // What the other ranks send this one: their (m, l) of every member head and their output
  // columns of this rank's share.
  __shared__ float4 recv_o[kCluster][kShare];
  __shared__ float recv_m[kCluster][kG], recv_l[kCluster][kG];
  __shared__ __align__(8) uint64_t recv_bar;  // counts the other ranks' stores into recv_*

  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  const uint32_t kv = blockIdx.x / kCluster;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) MbarInit(&recv_bar, 1);
  if (lane == 0) MbarInitRing(bars[warp]);
  __syncwarp();

  // This warp's keys: [lo, hi) split evenly over the cluster's warps (rank-major) in whole runs
  // of kRun keys, so only the range's last run is partial (a warp's tiles past its full ones
  // skip the runs they lack).
  const uint32_t total = a.hi - a.lo, runs = (total + kRun - 1) / kRun;
  const uint32_t gw = static_cast<uint32_t>(rank * kWarps + warp);
  const uint32_t w0 = a.lo + Min(total, SplitPoint(runs, gw, kCluster * kWarps) * kRun);
  const uint32_t w1 = a.lo + Min(total, SplitPoint(runs, gw + 1, kCluster * kWarps) * kRun);
  const int ntiles = static_cast<int>((w1 - w0 + kTk - 1) / kTk);
  const size_t head_off = size_t{kv} * a.rows * F::kRowBytes;
  const uint8_t* kbase = static_cast<const uint8_t*>(a.k) + head_off;
  const uint8_t* vbase = static_cast<const uint8_t*>(a.v) + head_off;
  uint8_t* ring = smem + warp * F::kRing;
  auto tile_k = [&](int buf) { return reinterpret_cast<const T*>(ring + buf * F::kTile); };
  // Tile t's K into buffer t % kStages: its valid rows, one bulk copy, counted on the buffer's
  // mbarrier (its k-th fill completes phase k, parity k & 1). Lane 0 issues.
  auto prefetch = [&](int t) {
    if (t >= ntiles || lane != 0) return;
    const int buf = t % kStages;
    const uint32_t first = w0 + static_cast<uint32_t>(t * kTk);
    const uint32_t bytes = Min<uint32_t>(kTk, w1 - first) * F::kRowBytes;
    MbarArriveExpect(&bars[warp][buf], bytes);
    BulkCopy(ring + buf * F::kTile, kbase + size_t{first} * F::kRowBytes, bytes, &bars[warp][buf]);
  };
#pragma unroll
  for (int t = 0; t < kStages; ++t) prefetch(t);

  // The member heads' queries, this lane's columns of each (zero past the group), lane-permuted
  // for ReduceScatter32Xor: the scores' value j = key·kG + head sits at v[j ^ lane], so lane l's
  // q[g] is head g ^ (l mod kG)'s and its key r row r ^ (l / kG) (the same banks either way).
  float q[kG][kCols];
  int G = 0;
  const int xg = lane % kG, xr = lane / kG;
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    G += a.members[kv * kMaxSharedGroup + g] >= 0;
    if (tid == g) heads[g] = a.members[kv * kMaxSharedGroup + g];
    const int32_t h = a.members[kv * kMaxSharedGroup + (g ^ xg)];
    if (h >= 0) {
      LoadCols(a.q + size_t(h) * D + lane * kCols, q[g]);
    } else {
#pragma unroll
      for (int c = 0; c < kCols; ++c) q[g][c] = 0.f;
    }
  }
  // What this rank receives, expected before its arrival on the cluster barrier (every send
  // follows that barrier's wait). The expectation is the barrier's one arrival, so its phase
  // cannot complete before it, whatever lands first.
  if (tid == 0) MbarArriveExpect(&recv_bar, RecvBytes<kCluster>(G, G * (D / 4), rank));
  ClusterArriveRelaxed();
  const float sl2 = a.scale * kLog2e;
  // Head (lane % kG)'s running max (log2 domain, alike in its lanes) and this lane's share of
  // its running sum; every head's output over this lane's columns.
  float m_h = -INFINITY, l_part = 0.f;
  float o[kG][kCols];
#pragma unroll
  for (int g = 0; g < kG; ++g)
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[g][c] = 0.f;

  // One tile: its V rows (this lane's columns) straight into registers, in flight while the
  // scores are computed; scores (−inf past the valid rows, whose bytes are a previous tile's or
  // never written); online softmax; p·V. kFull: every row valid (no per-row bounds).
  auto tile = [&](int t, auto full_c) {
    constexpr bool kFull = decltype(full_c)::value;
    const int buf = t % kStages;
    const uint32_t first = w0 + static_cast<uint32_t>(t * kTk);
    const int valid = kFull ? kTk : static_cast<int>(Min<uint32_t>(kTk, w1 - first));
    const uint8_t* vt = vbase + size_t{first} * F::kRowBytes + lane * kCols * sizeof(T);
    uint32_t vw[kTk][kWords];
#pragma unroll
    for (int j = 0; j < kTk; ++j) {
      if (kFull || j < valid) LoadWords(vt + j * F::kRowBytes, vw[j]);
    }
    MbarWait(&bars[warp][buf], static_cast<uint32_t>(t / kStages) & 1u);
    const T* kt = tile_k(buf);
    // Lane l ends with key run·kRun + l / kG of head l % kG; a partial tile's runs past its
    // valid rows are skipped (warp-uniform).
    float s[kRuns];
#pragma unroll
    for (int run = 0; run < kRuns; ++run) {
      if (!kFull && run * kRun >= valid) {
        s[run] = -INFINITY;
        continue;
      }
      float v[32];
#pragma unroll
      for (int r = 0; r < kRun; ++r) {
        float k[kCols];
        LoadCols(kt + (run * kRun + (r ^ xr)) * D + lane * kCols, k);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          float dot = 0.f;
#pragma unroll
          for (int c = 0; c < kCols; ++c) dot = fmaf(q[g][c], k[c], dot);
          v[r * kG + g] = dot;
        }
      }
      const float dot = ReduceScatter32Xor(v);
      s[run] = kFull || run * kRun + lane / kG < valid ? dot * sl2 : -INFINITY;
    }
    // Online softmax per head: the tile's max over the head's lanes (lanes ≡ head mod kG).
    float mx = s[0];
#pragma unroll
    for (int run = 1; run < kRuns; ++run) mx = fmaxf(mx, s[run]);
#pragma unroll
    for (int x = kG; x < 32; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
    const float m_new = fmaxf(m_h, mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m_h - m_use);
    m_h = m_new;
    float ps = 0.f;
#pragma unroll
    for (int run = 0; run < kRuns; ++run) {
      const float p = exp2f(s[run] - m_use);
      ps += p;
      pw[warp][run * 32 + lane] = p;
    }
    l_part = l_part * alpha + ps;
    __syncwarp();
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float ag = __shfl_sync(0xffffffffu, alpha, g);
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[g][c] *= ag;
    }
#pragma unroll
    for (int j = 0; j < kTk; ++j) {
      if (!kFull && j % kRun == 0 && j >= valid) break;  // warp-uniform: the runs past the rows
      if (kFull || j < valid) {
        float x[kCols];
        ToFloats<T>(vw[j], x);
        float pg[kG];  // key j's weights, every head (a broadcast read)
#pragma unroll
        for (int g4 = 0; g4 < kG; g4 += 4) {
          const float4 w4 = *reinterpret_cast<const float4*>(&pw[warp][j * kG + g4]);
          pg[g4] = w4.x, pg[g4 + 1] = w4.y, pg[g4 + 2] = w4.z, pg[g4 + 3] = w4.w;
        }
#pragma unroll
        for (int g = 0; g < kG; ++g) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) o[g][c] = fmaf(pg[g], x[c], o[g][c]);
        }
      }
    }
    // Every lane is done with the buffer (and the weights) before they refill: its reads are
    // ordered before the bulk copy's writes.
    FenceProxyAsync();
    __syncwarp();
    prefetch(t + kStages);
  };
  for (int t = 0; t < ntiles; ++t) {
    if (w1 - w0 - static_cast<uint32_t>(t * kTk) >= static_cast<uint32_t>(kTk)) {
      tile(t, std::true_type{});
    } else {
      tile(t, std::false_type{});
    }
  }
  // Head g's sum over its lanes; lane g (< kG) then holds head g's (m, l).
#pragma unroll
  for (int x = kG; x < 32; x <<= 1) l_part += __shfl_xor_sync(0xffffffffu, l_part, x);

  __syncthreads();  // every warp is done with the rings: they hold the warps' outputs now
  float* wo = reinterpret_cast<float*>(smem);  // [kWarps][kG][D]
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    if (g < G) {
      float* dst = wo + (warp * kG + g) * D + lane * kCols;
      if constexpr (kCols == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(o[g][0], o[g][1], o[g][2], o[g][3]);
      } else {
        *reinterpret_cast<float2*>(dst) = make_float2(o[g][0], o[g][1]);
      }
    }
  }
  if (lane < G) warp_m[warp][lane] = m_h, warp_l[warp][lane] = l_part;
  __syncthreads();

  // Merge the warps into this rank's state and send it where it is merged: per head its m and
  // l to every rank (warp_m becomes the warps' weights), then a float4 column a thread to the
  // rank whose share holds it; each store completes its bytes on the receiver's recv_bar (a
  // rank exits only once all of its own inputs have arrived, so no store targets a gone rank).
  // H200, against stores and a cluster barrier: fp32 GQA 32/8 2K 7.10 -> 7.02 µs, 4K 11.04 ->
  // 10.93, MHA 8/8 2K 6.98 -> 6.89, fp16 2K 6.64 -> 6.58; 512 keys 4.71 -> 4.75.
  ClusterWait();  // every rank runs: its memory may be written
  if (tid < G) {
    SendHeadStateAsync(rank, tid, MergeWarpStates(warp_m, warp_l, tid), recv_m, recv_l, &recv_bar);
  }
  __syncthreads();
  const int ncol = G * (D / 4);  // the member heads' float4 output columns
  SendColumnsAsync<kCluster, kWarps, kG, kShare, D>(rank, wo, warp_m, recv_o, ncol, D, tid,
                                                    kThreads, &recv_bar);
  MbarWait(&recv_bar, 0);  // every rank's state has arrived here

  // Rank r merges its share of the float4 output columns; rank h (< G) writes head h's LSE.
  MergeShare(recv_m, recv_l, recv_o, heads, ncol, D, rank, tid, a.out);
  if (rank < G && warp == kWarps - 1) {
    const float lse = ClusterLse(recv_m, recv_l, rank, lane);
    if (lane == 0) a.lse[heads[rank]] = lse;
  }
#else
  __trap();  // built without clusters: never launched (Active checks the loaded code)
#endif
}

template <typename T, int D, int kG, int Tk>
cudaLaunchConfig_t Config(uint32_t blocks, cudaStream_t stream, cudaLaunchAttribute* attr) {
  using F = Dc<T, D, kG, Tk>;
  return ClusterLaunch(blocks, F::kThreads, F::kBytes, kCluster, stream, attr);
}

// How many clusters of the kernel the device runs at once (0: none, or the loaded code is not
// the sm_90 build — a newer GPU JIT-compiling the portable PTX gets a body that only traps).
// Sets the kernel's shared-memory attribute first (once).
template <typename T, int D, int kG, int Tk>
int ActiveClusters() {
  static const int n = [] {
    if (cudaFuncSetAttribute(DecodeCluster<T, D, kG, Tk>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(Dc<T, D, kG, Tk>::kBytes)) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, DecodeCluster<T, D, kG, Tk>) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    if (fa.ptxVersion < 90) return 0;
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = Config<T, D, kG, Tk>(kCluster, nullptr, &attr);
    int clusters = 0;
    const cudaError_t e =
        cudaOccupancyMaxActiveClusters(&clusters, DecodeCluster<T, D, kG, Tk>, &cfg);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess ? clusters : 0;
  }();
  return n;
}

// Calls f with (T, D, kG, Tk) as a type and constants for a supported shape (groups of up to
// 4 heads: kG = 4; `tile` 16 or 32 keys); false otherwise.
template <typename Fn>
bool WithShape(DType dtype, uint32_t d, uint32_t group, uint32_t tile, Fn&& f) {
  using I4 = std::integral_constant<int, 4>;
  auto by_tile = [&](auto t, auto dc) {
    if (tile == 32) {
      f(t, dc, I4{}, std::integral_constant<int, 32>{});
    } else {
      f(t, dc, I4{}, std::integral_constant<int, 16>{});
    }
    return true;
  };
  auto by_d = [&](auto t) {
    if (d == 64) return by_tile(t, std::integral_constant<int, 64>{});
    if (d == 128) return by_tile(t, std::integral_constant<int, 128>{});
    return false;
  };
  if (group < 1 || group > 4 || (tile != 16 && tile != 32)) return false;
  if (dtype == DType::kF32) return by_d(float{});
  if (dtype == DType::kF16) return by_d(__half{});
  if (dtype == DType::kBF16) return by_d(__nv_bfloat16{});
  return false;
}

}  // namespace

// Measured on the H200 (GQA 32/8, d = 128; bench/results/attention-gpu-2026-12-02.md), µs, one
// launch against the split-K launch and its combine: fp32 512 4.5 vs 9.1, 2K 7.6 vs 11.4, 4K
// 11.6 vs 14.9; fp16 1K 5.2 vs 6.4, 2K 6.8 vs 7.3 (at 4K the split-K launch's more
// multiprocessors win: 10.9 vs 8.9). Groups of up to 4 query heads a K/V head: with 8, twice
// the per-key work (32/4 at 2K: 10.9 vs 9.9), so the kernel is built for up to 4.
uint64_t DecodeClusterMaxKeys(DType dtype) {
  // bf16 streams fp16's bytes through the same fp32 math: fp16's limit.
  return dtype == DType::kF32 ? 4096 : dtype == DType::kF16 || dtype == DType::kBF16 ? 2048 : 0;
}

namespace {
// Keys a tile: 32 where each of a block's 8 warps has 32 keys or more (a whole 32-key tile;
// fewer would wait on V loads for rows a partial tile lacks), else 16.
uint32_t Tile(const DecodeClusterArgs& a) {
  if (a.tile == 16 || a.tile == 32) return a.tile;
  return a.hi - a.lo >= 32u * kCluster * kBlockWarps ? 32 : 16;
}
}  // namespace

bool DecodeClusterFits(DType dtype, uint32_t d, uint32_t group, uint32_t heads, uint64_t keys) {
  if (heads == 0 || heads > static_cast<uint32_t>(kMaxFusedHeads) || group < 1 || group > 4 ||
      keys == 0 || keys > DecodeClusterMaxKeys(dtype) || gpu::Info().cc_major < 9) {
    return false;
  }
  // Every K/V head's cluster at once, for either tile.
  int active = 1 << 30;
  for (uint32_t tile : {16u, 32u}) {
    const bool ok = WithShape(dtype, d, group, tile, [&](auto t, auto dc, auto gc, auto tc) {
      active = std::min(active, ActiveClusters<decltype(t), decltype(dc)::value,
                                               decltype(gc)::value, decltype(tc)::value>());
    });
    if (!ok) return false;
  }
  return active >= static_cast<int>(heads);
}

Status LaunchDecodeCluster(const DecodeClusterArgs& a, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (a.heads == 0 || a.hi <= a.lo) return Status::Ok();
  if (a.heads > static_cast<uint32_t>(kMaxFusedHeads) || a.hi > a.rows) {
    return Status(ErrorKind::kErr, "cluster decode: bad heads or visible range");
  }
  Status st = Status::Ok();
  const bool shape =
      WithShape(a.dtype, a.d, a.group, Tile(a), [&](auto t, auto dc, auto gc, auto tc) {
        using T = decltype(t);
        constexpr int D = decltype(dc)::value, G = decltype(gc)::value;
        constexpr int Tk = decltype(tc)::value;
        if (gpu::Info().cc_major < 9 || ActiveClusters<T, D, G, Tk>() == 0) {
          (void)(st = Status(
                     ErrorKind::kErr,
                     "cluster decode needs thread-block clusters and this binary's sm_90 code"));
          return;
        }
        cudaLaunchAttribute cluster;
        const cudaLaunchConfig_t cfg = Config<T, D, G, Tk>(a.heads * kCluster, s, &cluster);
        const cudaError_t e = cudaLaunchKernelEx(&cfg, DecodeCluster<T, D, G, Tk>, a);
        (void)(st = e == cudaSuccess ? KernelStatus("cluster decode kernel")
                                     : gpu::CudaError(e, "cluster decode kernel"));
      });
  if (!shape) {
    return Status(ErrorKind::kErr, "cluster decode has no kernel for this dtype, head dim (" +
                                       std::to_string(a.d) + ") or group (" +
                                       std::to_string(a.group) + ")");
  }
  return st;
}

}  // namespace pion::kernels::cuda
