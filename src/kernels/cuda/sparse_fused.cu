// SHARED sparse-auto in one launch: the thread-block clusters of a K/V head score the head's
// blocks, select the top K_top, attend the chosen rows and merge, where the separate path takes
// four launches (block scores, block select, sparse partials, combine) and their gaps.
//
// A K/V head gets one cluster of C blocks (C = 16 where every head's cluster runs at once, else
// 8; 256 threads each: SparseAutoSharedCluster). Per cluster, for K/V head kv and its query heads
// (≤ 8, M = 1):
//   1. rank r scores its slice of the visible blocks b_lo..b_hi for every member head (q·mean,
//      and Quest's bound when asked: the same arithmetic as ScoreBlocks); a candidate's key is
//      the highest selection score of the members (SHARED);
//   2. every rank sends its slice's keys (and the heads' top mean scores, the keys' range) to
//      every rank's shared memory as st.async stores, counted on the receiver's mbarrier; once
//      its own barrier completes, every rank runs the same selection over the keys (one histogram
//      pass over the keys' range, RangeSelect, or the radix select where that cannot decide), so
//      every rank knows the chosen blocks without another exchange;
//   3. rank r attends its share of the chosen rows (first block, chosen middle blocks,
//      last block, ascending). Each warp streams its own run of 16-row tiles through its own
//      ring (TMA: a 2-D tensor copy each for K and V where the tile's rows are contiguous, else
//      a bulk copy a row, on an mbarrier per stage) to the tensor cores: the member heads'
//      queries are the MMA's rows 0..7 (fp16 high parts) and 8..15 (their low parts), so one
//      m16n8k16 computes both parts of every head's scores and weights (fp32-level accuracy, as
//      flash.cu's packed decode); while the first tiles land, the rank sums the omitted-mass
//      weights of its own slice; the eight warps' states merge in shared memory;
//   4. every rank sends its state where it is merged: (m, l) of every head to every rank, its
//      output columns to the rank whose share holds them, its omitted sums of head h to rank h;
//      st.async again; once its barrier completes, rank r merges its share of the output
//      columns, rank h writes the LSE, omitted fraction and receipts of member head h, and each
//      exits. The one cluster barrier is at the start: its wait, before the first store to
//      another rank, means every rank runs, and each rank expects its bytes before arriving
//      there; every access to another rank's shared memory is such a counted store, so no rank
//      exits before everything sent to it has landed.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_cluster.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"
#include "kernels/cuda/cuda_select.cuh"

namespace pion::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCand = 2048;  // candidate blocks (visible blocks − 2) a cluster can select from
constexpr int kTk = 16;         // rows per warp tile
constexpr int kG = kMaxSharedGroup;
constexpr int kBins = 2048;  // the selection's histogram (RangeSelect)

template <int D, int C>
struct Fused {
  static constexpr int kSlice = (kMaxCand + 2 + C - 1) / C;  // visible blocks a rank scores
  static constexpr int kSlice4 = (kSlice + 3) / 4 * 4;
  static constexpr int kStr = D + 8;  // padded tile row (halves): ldmatrix rows hit distinct banks
  static constexpr int kStages = D > 64 ? 3 : 4;  // tiles in each warp's ring
  static constexpr size_t kRing = size_t{kStages} * 2 * kTk * kStr * 2;  // a warp's K and V tiles
  // Dynamic shared memory (bytes; every piece a multiple of 16). Kept throughout: the fp16 hi/lo
  // queries (MMA rows), the chosen blocks, this rank's candidate keys (the other ranks read them)
  // and the warps' rings.
  static constexpr size_t kQh = size_t{16} * kStr * 2;
  static constexpr size_t kChosen = size_t{kMaxCand} * 2;  // uint16: block − b_lo
  static constexpr size_t kSliceKey = size_t{kSlice4} * 4;
  static constexpr size_t kOffChosen = kQh;
  static constexpr size_t kOffSliceKey = kOffChosen + kChosen;
  static constexpr size_t kOffRings = (kOffSliceKey + kSliceKey + 127) / 128 * 128;
  static constexpr size_t kBytes = kOffRings + kWarps * kRing;
  // Scoring and selection happen before the first tile is loaded, so their buffers share the
  // rings: every candidate's key at the start (stored there by the rank that scored it; dead
  // once the blocks are chosen) and the selection's histogram in warp 1's first stages; head h's
  // scaled q·mean over this rank's slice in warp h's last stage, and the slice's taken flags
  // after head 0's — read while the warps' first tiles (the other stages) are already in flight.
  static constexpr size_t kStage = size_t{2} * kTk * kStr * 2;  // a stage's K and V tiles
  static constexpr size_t kLast = (kStages - 1) * kStage;       // the last stage in a ring
  static_assert(size_t{kMaxCand} * 4 <= kLast, "keys > a ring's first stages");
  static_assert(size_t{kSlice4} * 5 <= kStage, "a head's slice scores and flags > a stage");
  static_assert(kWarps >= kG, "a warp's last stage a member head");
  static_assert(sizeof(RangeScratch<kBins>) <= kLast,
                "the selection's histogram > a ring's first stages");
  // ...and so do the warps' final outputs [kWarps][kG][kWo] (rows padded by 8 floats: a quad's
  // float2 stores of 8 rows hit distinct banks).
  static constexpr int kWo = D + 8;
  static_assert(size_t{kWarps} * kG * kWo * 4 <= kWarps * kRing, "outputs > rings");
};

template <int D, int C>
__global__ void __launch_bounds__(kThreads, 1)
    SparseAutoShared(const __grid_constant__ FusedSparseArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // clusters; the launch checks the device
  using F = Fused<D, C>;
  constexpr int kStr = F::kStr, kS = F::kStages;
  constexpr int kMarks = kFusedTraceMarks;
  extern __shared__ __align__(128) uint8_t smem[];
  __half* qh = reinterpret_cast<__half*>(smem);                               // [16][kStr]
  uint16_t* chosen = reinterpret_cast<uint16_t*>(smem + F::kOffChosen);       // [keep] ascending
  uint32_t* slice_key = reinterpret_cast<uint32_t*>(smem + F::kOffSliceKey);  // [kSlice]
  uint8_t* rings = smem + F::kOffRings;
  uint32_t* keys = reinterpret_cast<uint32_t*>(rings);  // [ncand], from every rank
  // Head h's scale·q·mean over the slice, and the slice's taken flags.
  auto slice_ms = [rings](int h) {
    return reinterpret_cast<float*>(rings + h * F::kRing + F::kLast);
  };
  uint8_t* taken = rings + F::kLast + F::kSlice4 * 4;  // [kSlice]
  __shared__ float part_all[kG], part_left[kG];
  __shared__ float warp_a[kWarps][kG], warp_b[kWarps][kG];
  __shared__ float s_top[kG];
  __shared__ int32_t heads[kG];

  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  const uint32_t kv = blockIdx.x / C, me = static_cast<uint32_t>(rank);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  auto mark = [&](int i) {
    if (a.trace != nullptr && tid == 0) a.trace[size_t{blockIdx.x} * kMarks + i] = clock64();
  };
  if (a.tensor_tiles && threadIdx.x == 0) {  // the descriptors on their way to the copy unit
    PrefetchTensorMap(&a.map_k);
    PrefetchTensorMap(&a.map_v);
  }
  // Each warp's ring barriers, initialized now so the cluster-scope init fence runs while the
  // scores load instead of after the selection, and the barriers that count what the other
  // ranks send this one (the exchange's and the merge's).
  __shared__ __align__(8) uint64_t bars[kWarps][kS];
  __shared__ __align__(8) uint64_t recv_bar;  // counts the other ranks' stores into recv_*
  __shared__ __align__(8) uint64_t xbar;      // ... and into keys, all_top, all_lo, all_hi
  if (tid == 0) MbarInit(&recv_bar, 1), MbarInit(&xbar, 1);
  if (lane == 0) MbarInitRing(bars[warp]);
  __syncwarp();
  WaitForPrimary();
  mark(0);

  // The member heads (packed, −1 past the last) in every thread's registers, from the launch's
  // parameters (no load before the queries' loads); heads[] keeps them for the merge and the
  // receipts.
  int32_t hd[kG];
  int G = 0;
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    hd[g] = a.members[kv * kG + g];
    G += hd[g] >= 0;
    if (tid == g) heads[g] = hd[g];
  }
  // What this rank receives in the merge (every send follows the wait of the cluster barrier
  // this rank arrives at below): the heads' states, its share of the columns and, for rank
  // h < G, head h's omitted sums.
  if (tid == 0) {
    MbarArriveExpect(&recv_bar, RecvBytes<C>(G, G * (D / 4), rank) + (rank < G ? C * 8 : 0));
  }
  const uint32_t B = a.block, lo = a.lo, hi = a.hi;
  const uint32_t b_lo = lo / B, b_hi = (hi - 1) / B;
  const int nvis = static_cast<int>(b_hi - b_lo + 1);
  const int ncand = nvis > 2 ? nvis - 2 : 0;
  // What this rank receives in the exchange: every rank's top mean scores and key range, and
  // every candidate's key. Expected (as the merge's) before this rank's arrival on the cluster
  // barrier whose wait, before the first store to another rank's shared memory, means every
  // rank runs.
  if (tid == 0) MbarArriveExpect(&xbar, static_cast<uint32_t>(C * (4 * G + 8) + 4 * ncand));
  ClusterArriveRelaxed();
  const int s0 = nvis * rank / C, s1 = nvis * (rank + 1) / C;  // this rank's visible blocks
  // Each lane's 4-column slice of every member's query (zero past the group), in registers: its
  // loads are in flight with the first block summaries'. Warp 0 also stages them as the MMA's
  // rows: fp16 high parts in rows g, low parts in rows g + 8.
  const int x4 = lane < D / 4 ? lane : 0;
  float4 q4[kG];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    q4[g] = g < G ? __ldg(reinterpret_cast<const float4*>(a.q + size_t(hd[g]) * D) + x4)
                  : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  mark(1);

  // 1. Scores of this rank's slice (the same sums in the same order as ScoreBlocks, so the same
  // choices): a warp scores a run of blocks at a time — kGs member heads (8, or 4 where the group
  // has at most 4: no work on zero queries) × 32 / kGs blocks, lanes over 4-column slices, and
  // ReduceScatter32 leaves lane l the sum of block l / kGs, head l % kGs (each sum in WarpSum's
  // order whatever the layout). The loop is rolled, the next run's summaries loading while this
  // one is scored: the code is one run's (a launch runs it cold, so its length costs time).
  const float4* mean4 = reinterpret_cast<const float4*>(a.mean);
  const float4* mn4 = reinterpret_cast<const float4*>(a.min);
  const float4* mx4 = reinterpret_cast<const float4*>(a.max);
  const int gs = G <= 4 ? 4 : kG;          // the head slots a run scores
  const int my_g = lane % gs;              // this lane's head after the reduce-scatter
  float top = -INFINITY;                   // of head my_g over this lane's blocks
  uint32_t s_lo = 0xffffffffu, s_hi = 0u;  // this lane's candidates' keys: least, greatest
  auto score = [&](auto quest_c, auto slots_c) {
    constexpr bool kQuest = decltype(quest_c)::value;
    constexpr int kGs = decltype(slots_c)::value, kRun = 32 / kGs;
    constexpr int kQ = kQuest ? kRun : 1;
    constexpr int kStride = kWarps * kRun;
    const int my_r = lane / kGs;
    float4 mv[kRun], lov[kQ], hiv[kQ];
    auto load = [&](int i0, float4(&m)[kRun], float4(&l)[kQ], float4(&h)[kQ]) {
#pragma unroll
      for (int r = 0; r < kRun; ++r) {
        const int i = Min(i0 + r, s1 - 1);
        const size_t row = (size_t{kv} * a.nb + b_lo + static_cast<uint32_t>(i)) * (D / 4);
        m[r] = __ldg(mean4 + row + x4);
        if constexpr (kQuest) l[r] = __ldg(mn4 + row + x4), h[r] = __ldg(mx4 + row + x4);
      }
    };
    int i0 = s0 + warp * kRun;
    if (i0 < s1) load(i0, mv, lov, hiv);
#pragma unroll 1
    for (; i0 < s1; i0 += kStride) {
      float4 nm[kRun], nl[kQ], nh[kQ];
      if (i0 + kStride < s1) load(i0 + kStride, nm, nl, nh);  // warp-uniform
      float v[32];
#pragma unroll
      for (int r = 0; r < kRun; ++r)
#pragma unroll
        for (int g = 0; g < kGs; ++g) v[r * kGs + g] = lane < D / 4 ? Dot4(q4[g], mv[r]) : 0.f;
      const float dot = ReduceScatter32(v);
      float sel = dot;
      if constexpr (kQuest) {
#pragma unroll
        for (int r = 0; r < kRun; ++r)
#pragma unroll
          for (int g = 0; g < kGs; ++g)
            v[r * kGs + g] = lane < D / 4 ? Bound4(q4[g], lov[r], hiv[r]) : 0.f;
        sel = ReduceScatter32(v);
      }
      const int i = i0 + my_r;
      const bool mine = i < s1 && my_g < G;
      // A candidate's key: the highest selection score of the member heads (one block's lanes).
      float key = mine ? sel : -INFINITY;
#pragma unroll
      for (int o = 1; o < kGs; o <<= 1) key = fmaxf(key, __shfl_xor_sync(0xffffffffu, key, o));
      const float x = dot * a.scale;
      if (mine) {
        top = fmaxf(top, x);
        slice_ms(my_g)[i - s0] = x;
      }
      if (my_g == 0 && i < s1) {
        const uint32_t sk = SortKey(key);
        slice_key[i - s0] = sk;
        if (i >= 1 && i <= ncand) s_lo = min(s_lo, sk), s_hi = max(s_hi, sk);
      }
#pragma unroll
      for (int r = 0; r < kRun; ++r) {
        mv[r] = nm[r];
        if constexpr (kQuest) lov[r] = nl[r], hiv[r] = nh[r];
      }
    }
  };
  auto score_slots = [&](auto quest_c) {
    if (gs == 4) {
      score(quest_c, std::integral_constant<int, 4>{});
    } else {
      score(quest_c, std::integral_constant<int, kG>{});
    }
  };
  if (a.quest) {
    score_slots(std::true_type{});
  } else {
    score_slots(std::false_type{});
  }
  if (warp == 0 && lane < D / 4) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const HiLo4 q = SplitHiLo<__half>(q4[g]);
      *reinterpret_cast<uint2*>(qh + g * kStr + 4 * lane) = q.hi;
      *reinterpret_cast<uint2*>(qh + (g + 8) * kStr + 4 * lane) = q.lo;
    }
  }
  mark(2);
  for (int o = gs; o < 32; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  if (lane < kG) warp_a[warp][lane] = top;  // head lane % gs: read for the heads < G only
  constexpr int kPer = kMaxCand / kThreads;
  uint32_t mine[kPer];
  auto& range = *reinterpret_cast<RangeScratch<kBins>*>(rings + F::kRing);  // warp 1's ring
  __shared__ uint32_t warp_lo[kWarps], warp_hi[kWarps];
  s_lo = __reduce_min_sync(0xffffffffu, s_lo);
  s_hi = __reduce_max_sync(0xffffffffu, s_hi);
  if (lane == 0) warp_lo[warp] = s_lo, warp_hi[warp] = s_hi;
  RangeSelectClear<kThreads>(range);
  __shared__ float all_top[C][kG];
  __shared__ uint32_t all_lo[C], all_hi[C];
  ClusterWait();  // every rank is running: its memory may be written
  __syncthreads();
  mark(3);
  if (tid < G) {
    float t = -INFINITY;
    for (int w = 0; w < kWarps; ++w) t = fmaxf(t, warp_a[w][tid]);
#pragma unroll
    for (int r = 0; r < C; ++r) StAsync(&all_top[rank][tid], t, &xbar, r);
  } else if (tid == kG) {
    uint32_t l = 0xffffffffu, h = 0u;
    for (int w = 0; w < kWarps; ++w) l = min(l, warp_lo[w]), h = max(h, warp_hi[w]);
#pragma unroll
    for (int r = 0; r < C; ++r) {
      StAsync(&all_lo[rank], l, &xbar, r);
      StAsync(&all_hi[rank], h, &xbar, r);
    }
  }
  {
    const int len = s1 - s0;
    const int lg = len <= 1 ? 0 : 32 - __clz(len - 1);
    for (int p = tid; p < (C << lg); p += kThreads) {
      const int r = p >> lg, j = p & ((1 << lg) - 1), v = s0 + j;
      if (j < len && v >= 1 && v <= ncand) StAsync(keys + v - 1, slice_key[j], &xbar, r);
    }
  }
  mark(4);
  MbarWait(&xbar, 0);  // every rank's keys, top scores and key range have arrived here
  __syncthreads();     // (the block barrier the cluster barrier was)
  if (tid < G) {
    float m = -INFINITY;
#pragma unroll
    for (int r = 0; r < C; ++r) m = fmaxf(m, all_top[r][tid]);
    s_top[tid] = m;
  }
  uint32_t k_lo = 0xffffffffu, k_hi = 0u;
#pragma unroll
  for (int r = 0; r < C; ++r) k_lo = min(k_lo, all_lo[r]), k_hi = max(k_hi, all_hi[r]);
  // Thread t's keys: candidates t·kPer .. t·kPer + kPer − 1 (the compaction's order).
  static_assert(kPer % 4 == 0, "whole uint4s of keys");
#pragma unroll
  for (int j = 0; j < kPer; j += 4) {
    const uint4 x = reinterpret_cast<const uint4*>(keys + tid * kPer)[j / 4];
    mine[j] = x.x, mine[j + 1] = x.y, mine[j + 2] = x.z, mine[j + 3] = x.w;
  }
  const int nmine = max(0, min(kPer, ncand - tid * kPer));
  mark(5);
  const int keep = Min<int>(static_cast<int>(a.k_top), ncand);
  // Candidate i is visible block 1 + i; the flags are kept for this rank's slice only.
  auto flag = [&](int i, bool t) {
    if (1 + i >= s0 && 1 + i < s1) taken[1 + i - s0] = t;
  };
  if (keep == ncand || keep == 0) {
    mark(6);
    for (int i = tid; i < ncand; i += kThreads) {
      flag(i, keep > 0);
      if (keep > 0) chosen[i] = static_cast<uint16_t>(1 + i);
    }
  } else {
    auto key = [keys](int i) { return keys[i]; };
    Threshold th;
    if (!RangeSelect<kThreads>(range, mine, nmine, k_lo, k_hi, keep, &th)) {
      th = RadixSelect<kThreads>(key, ncand, keep);
    }
    mark(6);
    auto visit = [&](int i, bool t, int r) {
      flag(i, t);
      if (t) chosen[r] = static_cast<uint16_t>(1 + i);
    };
    CompactRegisters<kThreads, kPer>(mine, ncand, th, visit);
  }
  FenceProxyAsync();  // the keys' plain accesses before the first tiles' bulk copies
  __syncthreads();
  mark(7);
  // 3. Attention over this block's share of the chosen rows; each warp its own run of tiles.
  const uint32_t len0 = min((b_lo + 1) * B, hi) - lo;
  const uint32_t mid = static_cast<uint32_t>(keep) * B;
  const uint32_t last = nvis >= 2 ? hi - b_hi * B : 0;
  const uint32_t total = len0 + mid + last;
  const uint32_t e0 = static_cast<uint32_t>(uint64_t{total} * me / C);
  const uint32_t e1 = static_cast<uint32_t>(uint64_t{total} * (me + 1) / C);
  const uint32_t tiles = (e1 - e0 + kTk - 1) / kTk;
  const uint32_t w_first = e0 + SplitPoint(tiles, warp, kWarps) * kTk;
  const int ntiles =
      static_cast<int>(SplitPoint(tiles, warp + 1, kWarps) - SplitPoint(tiles, warp, kWarps));
  // Block sizes are powers of two in practice: shifts then, not a division's ~20 dependent
  // instructions on the way to every tile request.
  const bool pow2 = (B & (B - 1)) == 0;
  const uint32_t lg_b = static_cast<uint32_t>(__ffs(static_cast<int>(B)) - 1);
  auto row_of = [&](uint32_t e) -> uint32_t {
    if (e < len0) return lo + e;
    if (e < len0 + mid) {
      const uint32_t x = e - len0, q = pow2 ? x >> lg_b : x / B;
      return (b_lo + chosen[q]) * B + (x - q * B);
    }
    return b_hi * B + (e - len0 - mid);
  };
  const __half* kbase = static_cast<const __half*>(a.k) + size_t{kv} * a.rows * D;
  const __half* vbase = static_cast<const __half*>(a.v) + size_t{kv} * a.rows * D;
  __half* ring = reinterpret_cast<__half*>(rings + warp * F::kRing);
  auto tile_k = [&](int buf) { return ring + buf * 2 * kTk * kStr; };
  auto tile_v = [&](int buf) { return ring + (buf * 2 + 1) * kTk * kStr; };
  // Tile t into buffer t % kS with bulk copies: lane j < 16 copies K row j, lane 16 + j V row
  // j, counted on the buffer's mbarrier (its k-th fill completes phase k, parity k & 1); rows
  // past the share are zeroed instead, so p = 0 never meets garbage (0 · NaN).
  const int pj = lane & 15;
  const __half* src_base = lane < 16 ? kbase : vbase;
  // Tensor tiles (FusedSparseArgs::tensor_tiles): a full tile of 16 contiguous rows (within one
  // block) comes as one 2-D copy for K and one for V, issued by lane 0; the rings must be
  // 128-byte aligned for it (else the per-row copies stay).
  const bool tensor = a.tensor_tiles && (SmemAddr(rings) & 127u) == 0;
  auto prefetch = [&](int t) {
    if (t >= ntiles) return;
    const int buf = t % kS;
    const uint32_t first = w_first + static_cast<uint32_t>(t * kTk);
    const uint32_t valid = min(static_cast<uint32_t>(kTk), e1 - first);
    __half* dst = (lane < 16 ? tile_k(buf) : tile_v(buf)) + pj * kStr;
    if (tensor && valid == static_cast<uint32_t>(kTk)) {
      const uint32_t r0 = row_of(first);
      if (row_of(first + kTk - 1) == r0 + kTk - 1) {  // warp-uniform
        if (lane == 0) {
          MbarArriveExpect(&bars[warp][buf], 2 * kTk * kStr * 2);
          const int c1 = static_cast<int>(kv * a.rows + r0);
          TensorCopy2d(tile_k(buf), &a.map_k, 0, c1, &bars[warp][buf]);
          TensorCopy2d(tile_v(buf), &a.map_v, 0, c1, &bars[warp][buf]);
        }
        return;
      }
    }
    FenceProxyAsync();  // this lane's zeroing of the row (an earlier fill) before the copy
    if (lane == 0) MbarArriveExpect(&bars[warp][buf], valid * 2 * D * 2);
    __syncwarp();
    if (static_cast<uint32_t>(pj) < valid) {
      BulkCopy(dst, src_base + size_t{row_of(first + pj)} * D, D * 2, &bars[warp][buf]);
    } else {
#pragma unroll
      for (int x = 0; x < D / 8; ++x) reinterpret_cast<uint4*>(dst)[x] = make_uint4(0, 0, 0, 0);
    }
  };
  // Tile 0 now; the other stages but the last after the omitted sums, so the copy unit's queue
  // (every warp's requests) holds each warp's first tile first.
  prefetch(0);
  mark(8);

  // The omitted-mass proxy over this rank's slice, while the first tiles land: block weights
  // count · exp(x − top), summed per head (a warp's sums, then the warps').
  {
    // Thread t weighs head t % kG's blocks s0 + t / kG, + kThreads / kG, …: a head's lanes are
    // kG apart, summed by shuffles over the lane bits above kG.
    const int h = tid % kG;
    float all = 0.f, left = 0.f;
    if (h < G) {
      const float tp = s_top[h];
      const float* ms = slice_ms(h);
      for (int i = s0 + tid / kG; i < s1; i += kThreads / kG) {
        const uint32_t b = b_lo + static_cast<uint32_t>(i);
        const float rows = static_cast<float>(min((b + 1) * B, hi) - max(b * B, lo));
        const float w = rows * expf(ms[i - s0] - tp);
        all += w;
        if (i >= 1 && i <= ncand && !taken[i - s0]) left += w;
      }
    }
#pragma unroll
    for (int o = kG; o < 32; o <<= 1) {
      all += __shfl_xor_sync(0xffffffffu, all, o);
      left += __shfl_xor_sync(0xffffffffu, left, o);
    }
    if (lane < kG) warp_a[warp][lane] = all, warp_b[warp][lane] = left;
    FenceProxyAsync();  // reads of the last stages before their bulk copies
    __syncthreads();    // also: the last stages may fill
    if (tid < G) {
      float sa = 0.f, sl = 0.f;
      for (int w = 0; w < kWarps; ++w) sa += warp_a[w][tid], sl += warp_b[w][tid];
      part_all[tid] = sa;
      part_left[tid] = sl;
    }
  }
#pragma unroll 1
  for (int t = 1; t < kS - 1; ++t) prefetch(t);  // the last stage fills in the loop
  mark(9);

  // Lane: row g (head g's high parts) and g + 8 (its low parts), columns c2, c2 + 1.
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int lm = lane >> 3, lr = lane & 7;  // ldmatrix addressing
  uint32_t qa[D / 16][4];                   // the query fragments, every tile's A operand
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    Ldm4(qa[ks], qh + ((lm & 1) * 8 + lr) * kStr + ks * 16 + (lm >> 1) * 8);
  const float sl2 = a.scale * kLog2e;
  float m_run = -INFINITY, l_run = 0.f;  // log2 domain
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % kS;
    prefetch(t + kS - 1);
    MbarWait(&bars[warp][buf], static_cast<uint32_t>(t / kS) & 1u);
    __syncwarp();
    if (t == 0) mark(10);
    const __half* kb = tile_k(buf);
    const __half* vb = tile_v(buf);
    // Scores: even and odd k-steps in two chains; rows g + 8 hold the low parts' products.
    float s[2][4] = {}, s2[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[4];
      Ldm4(b, kb + ((lm >> 1) * 8 + lr) * kStr + ks * 16 + (lm & 1) * 8);
      Mma(ks % 2 ? s2[0] : s[0], qa[ks], b[0], b[1]);
      Mma(ks % 2 ? s2[1] : s[1], qa[ks], b[2], b[3]);
    }
    const uint32_t first = w_first + static_cast<uint32_t>(t * kTk);
    float x[2][2], mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = s[n][e] + s[n][e + 2] + s2[n][e] + s2[n][e + 2];
        x[n][e] = first + n * 8 + c2 + e < e1 ? v * sl2 : -INFINITY;
        mx = fmaxf(mx, x[n][e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);  // finite: a tile's first row is in the share
    const float alpha = exp2f(m_run - m_new);
    m_run = m_new;
    l_run *= alpha;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        x[n][e] = exp2f(x[n][e] - m_new);
        l_run += x[n][e];
      }
    }
    if (__any_sync(0xffffffffu, alpha != 1.f)) {
      ScaleAcc(o, alpha);
    }
    // o += P·V: P's rows g are the weights' high parts, rows g + 8 their low parts.
    uint32_t ph[4];
    PackRowsHiLo<__half>(ph, x[0][0], x[0][1], x[1][0], x[1][1]);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      Ldm4T(b, vb + ((lm & 1) * 8 + lr) * kStr + dn * 16 + (lm >> 1) * 8);
      Mma(o[2 * dn], ph, b[0], b[1]);
      Mma(o[2 * dn + 1], ph, b[2], b[3]);
    }
    __syncwarp();  // the buffer is refilled next iteration: all lanes are done with it
  }
  if (ntiles == 0) mark(10);
  // The warp's state for head g: the quad's row sums, rows g + 8's products added to rows g.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  __syncthreads();  // every warp is done with the rings: they hold the warps' outputs now
  mark(11);
  float* wo = reinterpret_cast<float*>(rings);  // [kWarps][kG][kWo]
  // What the other ranks send this one: their (m, l) of every member head, their output
  // columns of this rank's share, and (rank h < G) their omitted-mass sums of head h.
  constexpr int kShare = (kG * D / 4 + C - 1) / C;  // float4 output columns a rank merges
  __shared__ float4 recv_o[C][kShare];
  __shared__ float recv_m[C][kG], recv_l[C][kG], recv_all[C], recv_left[C];
  const int ncol = G * (D / 4);  // the member heads' float4 output columns
  if (g < G) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(wo + (warp * kG + g) * F::kWo + n * 8 + c2) =
          make_float2(o[n][0] + o[n][2], o[n][1] + o[n][3]);
    }
    if ((lane & 3) == 0) warp_a[warp][g] = m_run, warp_b[warp][g] = l_run;
  }
  __syncthreads();
  // Merge the warps into this rank's state and send it where it is merged (stores to the other
  // ranks' shared memory: nothing waits on them until the cluster barrier): per head its m and
  // l to every rank, its omitted sums to rank h, the warps' weights (warp_a becomes them); then
  // a float4 column a thread to the rank whose share holds it.
  if (tid < G) {
    SendHeadStateAsync(rank, tid, MergeWarpStates(warp_a, warp_b, tid), recv_m, recv_l, &recv_bar);
    StAsync(&recv_all[rank], part_all[tid], &recv_bar, tid);
    StAsync(&recv_left[rank], part_left[tid], &recv_bar, tid);
  }
  __syncthreads();
  SendColumnsAsync<C, kWarps, kG, kShare, F::kWo>(rank, wo, warp_a, recv_o, ncol, D, tid, kThreads,
                                                  &recv_bar);
  mark(12);
  MbarWait(&recv_bar, 0);  // every rank's state has arrived here
  mark(13);

  // 4. Rank r merges its share of the member heads' float4 output columns from every rank's
  // part; rank h (< G) writes head h's LSE, omitted fraction and receipts.
  {
    MergeShare(recv_m, recv_l, recv_o, heads, ncol, D, rank, tid, a.out);
    if (rank < G) {
      const int h = rank;
      const int32_t head = heads[h];
      if (warp == kWarps - 1) {  // lane r: rank r's m, l and omitted sums (warp 0 merges columns)
        const bool in = lane < C;
        const float all = in ? recv_all[lane] : 0.f;
        const float left = in ? recv_left[lane] : 0.f;
        const float lse = ClusterLse(recv_m, recv_l, h, lane);
        const float sa = WarpSum(all), sf = WarpSum(left);
        if (lane == 0) {
          a.lse[head] = lse;
          a.omitted[head] = sa > 0.f ? sf / sa : 0.f;
          int32_t* hb = a.blocks + size_t(head) * (a.k_top + 2);
          const bool two = b_hi != b_lo;
          hb[0] = static_cast<int32_t>(b_lo);
          if (two) hb[1 + keep] = static_cast<int32_t>(b_hi);
          a.nchosen[head] = 1 + keep + (two ? 1 : 0);
          a.counts[head] = static_cast<int32_t>(total);
        }
      }
      for (int i = tid; i < keep; i += kThreads) {
        a.blocks[size_t(head) * (a.k_top + 2) + 1 + i] = static_cast<int32_t>(b_lo + chosen[i]);
      }
    }
  }
  mark(14);
  mark(15);  // (the phase after the merge: none — no exit barrier)
#else
  __trap();  // built without clusters: never launched (ActiveClusters checks the loaded code)
#endif
}

// The kernel for (D, C) with its attributes set (once), or the error that refused them.
template <int D, int C>
cudaError_t Prepare() {
  static const cudaError_t attr = [] {
    cudaError_t e =
        cudaFuncSetAttribute(SparseAutoShared<D, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(Fused<D, C>::kBytes));
    if (e == cudaSuccess && C > 8) {
      e = cudaFuncSetAttribute(SparseAutoShared<D, C>,
                               cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    }
    return e;
  }();
  return attr;
}

template <int D, int C>
cudaLaunchConfig_t Config(uint32_t blocks, cudaStream_t stream, cudaLaunchAttribute* attr) {
  return ClusterLaunch(blocks, kThreads, Fused<D, C>::kBytes, C, stream, attr);
}

// How many clusters of the (D, C) kernel the device runs at once (0: none; clusters of 16 need
// a whole GPC of free multiprocessors). 0 as well where the loaded code is not the sm_90 build:
// a newer GPU JIT-compiling the portable compute_80 PTX gets a body that only traps.
template <int D, int C>
int ActiveClusters() {
  static const int n = [] {
    if (Prepare<D, C>() != cudaSuccess) return 0;
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, SparseAutoShared<D, C>) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    if (fa.ptxVersion < 90) return 0;
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = Config<D, C>(C, nullptr, &attr);
    int clusters = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, SparseAutoShared<D, C>, &cfg);
    if (e != cudaSuccess) cudaGetLastError();
    return e == cudaSuccess ? clusters : 0;
  }();
  return n;
}

template <typename F>
auto WithCluster(uint32_t c, F&& f) {
  if (c == 16) return f(std::integral_constant<int, 16>{});
  return f(std::integral_constant<int, 8>{});
}

bool IsClusterSize(uint32_t c) { return c == 8 || c == 16; }

int Active(uint32_t d, uint32_t c) {
  return d == 64
             ? WithCluster(c, [](auto cc) { return ActiveClusters<64, decltype(cc)::value>(); })
             : WithCluster(c, [](auto cc) { return ActiveClusters<128, decltype(cc)::value>(); });
}

template <int D, int C>
Status Launch(const FusedSparseArgs& a_in, cudaStream_t stream) {
  FusedSparseArgs a = a_in;
  if (a.tensor_tiles) {
    // K and V as 2-D tensors [heads·rows][d] of fp16; boxes of 16 rows × (d + 8) columns, the
    // last 8 out of bounds (zero-filled): the padded tile row of Fused<D, C>::kStr. Where the
    // driver cannot encode them, the per-row copies serve.
    static_assert(Fused<D, C>::kStr == D + 8, "a box row is a padded tile row");
    a.tensor_tiles = EncodeRows(&a.map_k, a.k, 2, a.heads, a.rows, D, D + 8, kTk).ok() &&
                     EncodeRows(&a.map_v, a.v, 2, a.heads, a.rows, D, D + 8, kTk).ok();
  }
  const cudaError_t attr = Prepare<D, C>();
  if (attr != cudaSuccess) return gpu::CudaError(attr, "fused sparse-auto kernel attributes");
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t cfg = Config<D, C>(a.heads * C, stream, &cluster);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, SparseAutoShared<D, C>, a);
  return e == cudaSuccess ? KernelStatus("fused sparse-auto kernel")
                          : gpu::CudaError(e, "fused sparse-auto kernel");
}

}  // namespace

bool SparseAutoSharedFits(DType dtype, uint32_t d, uint32_t group, uint32_t visible_blocks,
                          uint32_t heads) {
  if (dtype != DType::kF16 || (d != 64 && d != 128) || group < 1 || heads == 0 ||
      heads > static_cast<uint32_t>(kMaxFusedHeads) ||
      group > static_cast<uint32_t>(kMaxSharedGroup) ||
      visible_blocks > static_cast<uint32_t>(kMaxCand) + 2 || gpu::Info().cc_major < 9) {
    return false;
  }
  return Active(d, 8) >= static_cast<int>(heads);
}

int SparseAutoSharedActiveClusters(uint32_t d, uint32_t cluster) {
  return gpu::Info().cc_major >= 9 && (d == 64 || d == 128) && IsClusterSize(cluster)
             ? Active(d, cluster)
             : 0;
}

uint32_t SparseAutoSharedCluster(uint32_t d, uint32_t heads, uint32_t want) {
  // Measured on the H200 (bench/results/attention-gpu-2026-12-01.md): a head's rows spread over
  // more blocks only pay while every cluster runs at once; two or more clusters a head (each
  // scoring and selecting again) and smaller clusters measured slower.
  if (want == 8 || want == 16) return want == 16 && Active(d, 16) > 0 ? 16 : 8;
  return Active(d, 16) >= static_cast<int>(heads) ? 16 : 8;
}

Status LaunchSparseAutoShared(const FusedSparseArgs& a, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (a.heads == 0 || a.hi <= a.lo) return Status::Ok();
  const uint32_t nvis = (a.hi - 1) / a.block - a.lo / a.block + 1;
  if (nvis > static_cast<uint32_t>(kMaxCand) + 2) {
    return Status(ErrorKind::kErr, "fused sparse-auto takes at most " +
                                       std::to_string(kMaxCand + 2) + " visible blocks");
  }
  if (gpu::Info().cc_major < 9 || Active(a.d == 64 ? 64 : 128, 8) == 0) {
    return Status(ErrorKind::kErr,
                  "fused sparse-auto needs thread-block clusters and this binary's sm_90 code");
  }
  if (!IsClusterSize(a.cluster)) {
    return Status(ErrorKind::kErr,
                  "fused sparse-auto: cluster " + std::to_string(a.cluster) + " (8 or 16 blocks)");
  }
  if (a.d == 64) {
    return WithCluster(a.cluster, [&](auto cc) { return Launch<64, decltype(cc)::value>(a, s); });
  }
  if (a.d == 128) {
    return WithCluster(a.cluster, [&](auto cc) { return Launch<128, decltype(cc)::value>(a, s); });
  }
  return Status(ErrorKind::kErr,
                "fused sparse-auto has no kernel for head dim " + std::to_string(a.d));
}

}  // namespace pion::kernels::cuda
