// The streaming decode: dense M = 1 attention over fp16, bf16 or fp8 K/V (d 64 or 128, up to 8
// query heads a K/V head) on sm_90, as split-K partials for LaunchCombine.
//
// A decode reads every K/V byte once and does little with it, so the kernel is built around
// the read. Each block (a K/V head, a split of its visible range) streams its keys through a
// ring of kStages tiles (16 KB of K rows: 64 or 128 keys) a team of four warps; a tile of K and
// of V is one tensor copy (TMA) each per 128 bytes of row — d = 128 fp16 two, the others one —
// landing 128-byte (64-byte for fp8 d = 64) swizzled so the fragment loads below hit distinct
// banks, and an fp8 tile's row scales are a copy each too. One thread issues a tile's copies;
// every stage completes on its mbarrier; the team's four warps take a quarter of every tile each
// (16 or 32 keys; a softmax step a 32). A block is one team, whose warps sync once a tile before
// the stage is refilled, or — where a ring holds under 64 KB (fp8 d = 64: 8 KB tiles) and the range
// is long (WithTeams) — two, taking the split's tiles in turn through a ring each: eight warps and
// about 96 KB in flight, as two blocks had, over half the splits; there the last warp of a team
// out of a stage refills it (a count a stage), so no warp waits for the others a tile.
// Measured on an H100 without the math (bench/gpu_decode_patterns.cu, 2026-12-06): this read
// runs at the plain streaming read's rate (d = 128 fp16 at 128K 169.9 µs vs 171.1), where the
// per-warp rings of 16-row cp.async pieces the tensor-core decode uses (flash.cu) run 5-8 %
// slower (179.0).
//
// The math is flash.cu's packed decode: Q's fp16 (bf16) hi and lo parts as the MMA's rows 0..7
// and 8..15 (so a row's score is the sum of its two accumulator rows, about fp32's accuracy),
// K fragments by ldmatrix, online softmax in fp32, P (hi + lo) · V by ldmatrix.trans; fp8 tiles
// are widened in registers (cvt e4m3x2 -> f16x2), K read in KPerm's order of d (cuda_mma.cuh) and V
// by words paired across rows, a score (q · k_e4m3) · scale_k and P entering P·V as
// p · scale_v / unit. Rows past the range in a tile (only a range's last tile has them) are
// masked, and their V rows zeroed in shared memory first (0 · NaN must not reach the sums).
// The block's warps then merge in shared memory and write its partial (cuda_mma.cuh's
// StoreWarpRow and MergeWarpsIntoPartial, as flash.cu's decode does).
//
// Calls overlap (OverlapCalls, on by default): a decode lets the launch after it (its combine)
// place its blocks from its start, and waits for the launch before it only after its loop, where
// it first writes — so back-to-back calls stream without a gap: a call's first tiles arrive while
// the one before drains its last tiles and merges. Its reads ahead of the wait (K, V, Q) are of
// bytes only copies write. H100, GQA 32/8, CUDA graph of 20 calls, µs, overlap off / on: fp16
// d = 128 32K 48.8 / 41.6 (the plain streaming read 44.1), 128K 180.5 / 166.7 (174.9); fp8
// d = 128 128K 98.0 / 87.5; fp8 d = 64 32K 18.5 / 12.3.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"

namespace pion::kernels::cuda {
namespace {

// Bytes of K (or V) a tile: 64 keys of 256-byte rows (fp16 d = 128), 128 of 128-byte rows.
constexpr int kTileTarget = 16384;
// A range under this many keys a block is short: it takes twice the blocks a multiprocessor
// (StreamDecodeBlocksPerSm), and one team (WithTeams).
constexpr uint64_t kShortKeys = 512;

template <typename T, int D, int Tk, int Tm = 1>
struct Sd {
  static constexpr int kTk = Tk;  // keys a tile: kTk / 4 a warp, 16 or 32 a softmax step
  static constexpr int kWk = Tk / 4;
  // Tiles in the ring. Deeper rings measured slower with calls overlapping (H100, GQA 32/8,
  // µs, 3 / 4 / 6 tiles: fp16 d = 128 32K 41.0 / 44.0 / 43.8, 128K 165.8 / 173.6 / 173.8; fp8
  // d = 128 128K 86.9 / 91.0 / 91.4; fp8 d = 64 32K 12.5 / 14.1 / 12.9).
  static constexpr int kStages = 3;
  static constexpr bool kF8 = std::is_same_v<T, __nv_fp8_e4m3>;
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  // The MMAs' 16-bit element type (and Q's hi / lo parts): bf16 for bf16 K/V, else fp16.
  using TM = std::conditional_t<kBf16, __nv_bfloat16, __half>;
  static constexpr int kRow = D * int(sizeof(T));       // bytes of a K or V row
  static constexpr int kBox = kRow < 128 ? kRow : 128;  // bytes of a row one tensor copy holds
  static constexpr int kBoxes = kRow / kBox;            // tensor copies a tile
  static_assert(kBox == 128 || kBox == 64, "128-byte (or 64-byte) swizzled boxes");
  static constexpr uint32_t kSwz = kBox == 128 ? 7 : 3;  // the swizzle's row bits
  static_assert(kWk % 16 == 0 && kTk <= 256, "whole 16-key pieces a warp; a box has <= 256 rows");
  static constexpr int kTile = kTk * kRow;  // bytes of a K (or V) tile
  // fp8: a tile's K (or V) row scales arrive as kTk + 4 floats from the 16-byte boundary at or
  // before its first row's (a tensor copy's first element must be 16-byte aligned), each in a
  // 128-byte aligned slot.
  static constexpr int kScaleBox = kF8 ? kTk + 4 : 0;
  static constexpr int kScaleSlot = (kScaleBox * 4 + 127) / 128 * 128;
  // A stage: K, V, (fp8) K scales, V scales; stages start 1024-aligned (the swizzle's period).
  static constexpr int kStage = (2 * kTile + 2 * kScaleSlot + 1023) / 1024 * 1024;
  static constexpr uint32_t kTx = 2 * kTile + 2 * kScaleBox * 4;  // bytes a stage receives
  static constexpr int kRing = kStages * kStage;
  // Teams of four warps, each streaming its own ring (Tm: one, or two where a ring holds under
  // 64 KB — StreamDecodeTeams).
  static constexpr bool kTwoTeamsFit = kRing < 65536;
  static constexpr int kTeams = Tm;
  static_assert(Tm == 1 || (Tm == 2 && kTwoTeamsFit), "two teams where a ring is under 64 KB");
  static constexpr int kWarps = 4 * kTeams, kThreads = 32 * kWarps;
  // The warps' merge, in the rings once streaming is done: m, l and weights (8 floats a warp
  // each), then the outputs [kWarps][8 rows][kOs] (rows padded: distinct banks for the quads'
  // stores).
  static constexpr int kOs = D + 8;
  static constexpr int kMerge = (3 * 8 * kWarps + kWarps * 8 * kOs) * 4;
  static constexpr int kStrQ = D + 8;  // Q rows (TM) padded: ldmatrix rows hit distinct banks
  static constexpr int kQOff = kTeams * kRing > kMerge ? kTeams* kRing : kMerge;
  static constexpr size_t kBytes = 1024 + kQOff + size_t{16} * kStrQ * 2;
  static_assert(kBoxes * kBox == kRow && kTx <= kStage && kSwz >= 3, "a stage holds its tiles");
};

// Byte offset in a tile of byte c of row r, as the swizzled tensor copies lay it out: box
// c / kBox holds [kTk rows][kBox bytes], and within each 1024 bytes (512 for 64-byte boxes)
// the 16-byte chunks of a row are permuted by its row bits.
template <typename C>
__device__ inline uint32_t Swz(int r, int c) {
  const uint32_t off =
      uint32_t(c / C::kBox) * (C::kTk * C::kBox) + uint32_t(r) * C::kBox + uint32_t(c % C::kBox);
  return off ^ (((off >> 7) & C::kSwz) << 4);
}

template <typename T, int D, int Tk, int Tm>
__global__ void __launch_bounds__(Sd<T, D, Tk, Tm>::kThreads)
    StreamDecodeKernel(const __grid_constant__ AttendArgs a, bool overlap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = Sd<T, D, Tk, Tm>;
  constexpr int kStages = C::kStages, kTeams = C::kTeams;
  using TM = typename C::TM;
  constexpr int kStr = C::kStrQ, kTk = C::kTk, kWk = C::kWk;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* ring = smem_raw + ((1024u - (SmemAddr(smem_raw) & 1023u)) & 1023u);
  TM* qh = reinterpret_cast<TM*>(ring + C::kQOff);  // [16][kStr]: rows 0..7 hi, 8..15 lo
  __shared__ __align__(8) uint64_t bars[kTeams][kStages];
  // Two teams: no barrier a tile — the last warp of a team out of a stage refills it.
  constexpr bool kRefill = kTeams > 1;
  __shared__ uint32_t released[kTeams][kStages];  // warps done with the stage's tile
  __shared__ int32_t rowid[8];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int team = warp / 4, wt = warp % 4;  // wt: the warp's quarter of its team's tiles
  const int group = static_cast<int>(a.uniform_group);
  const int kv = static_cast<int>(blockIdx.x);
  // Every row is at q_pos0: one visible range, split in whole tiles over blockIdx.y.
  const KeySpan vis = VisibleSpan(a, a.q_pos0, a.q_pos0);
  const uint32_t lo = vis.lo, len = vis.len;
  const uint32_t tiles = (len + kTk - 1) / kTk;
  const uint32_t k0 = lo + Min<uint32_t>(len, SplitPoint(tiles, blockIdx.y, a.splits) * kTk);
  const uint32_t k1 = lo + Min<uint32_t>(len, SplitPoint(tiles, blockIdx.y + 1, a.splits) * kTk);
  const int ntiles = static_cast<int>((k1 - k0 + kTk - 1) / kTk);
  // Team τ streams the split's tiles τ, τ + kTeams, ... through ring τ: the block's reads stay
  // one window moving along the range.
  const int mytiles = ntiles > team ? (ntiles - team + kTeams - 1) / kTeams : 0;

  // fp8: the scales of row kv·rows + k0 + kTk·t sit this many floats into the tile's scale box.
  const int scale_skew = static_cast<int>((uint32_t(kv) * a.rows + k0) & 3u);
  // Team τ's j-th tile (the split's tile t = j·kTeams + τ) into stage j % kStages of ring τ
  // (one thread): the boxes of K and V at rows k0 + kTk·t.. of head kv (rows past the slot land
  // as zeros), fp8's scales from the 16-byte boundary before the head's row kv·rows + k0 + kTk·t.
  auto issue = [&](int tau, int j) {
    const int t = j * kTeams + tau;
    if (t >= ntiles) return;
    uint8_t* st = ring + tau * C::kRing + (j % kStages) * C::kStage;
    uint64_t* bar = &bars[tau][j % kStages];
    const int first = static_cast<int>(k0 + t * kTk);
    MbarArriveExpect(bar, C::kTx);
#pragma unroll
    for (int b = 0; b < C::kBoxes; ++b) {
      TensorCopy3d(st + b * kTk * C::kBox, &a.map_k, b * C::kBox, first, kv, bar);
      TensorCopy3d(st + C::kTile + b * kTk * C::kBox, &a.map_v, b * C::kBox, first, kv, bar);
    }
    if constexpr (C::kF8) {
      const int srow = kv * static_cast<int>(a.rows) + first - scale_skew;
      TensorCopy1d(st + 2 * C::kTile, &a.map_ks, srow, bar);
      TensorCopy1d(st + 2 * C::kTile + C::kScaleSlot, &a.map_vs, srow, bar);
    }
  };
  if (tid == 0) {
#pragma unroll
    for (int tau = 0; tau < kTeams; ++tau) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) MbarInit(&bars[tau][s], 1), released[tau][s] = 0;
    }
    FenceMbarInit();
    // The K/V tiles are never written by a kernel (slots arrive by copies), so the first ones
    // are requested before waiting for the kernel ahead in the stream.
#pragma unroll
    for (int j = 0; j < (kRefill ? kStages : kStages - 1); ++j) {
#pragma unroll
      for (int tau = 0; tau < kTeams; ++tau) issue(tau, j);
    }
  }
  if (tid < 8) rowid[tid] = tid < group ? kv * group + tid : -1;
  // Overlapping calls: a launch after this one (the combine) may place its blocks now, and this
  // launch waits for the one before it only where it writes — every read ahead of that (K, V,
  // Q) is of bytes that copies, never kernels, write. Otherwise: wait here.
  if (overlap) {
    LaunchDependents();
  } else {
    WaitForPrimary();
  }
  // Q: rows 0..7 its fp16 (bf16) high parts, rows 8..15 the low parts (fp8: in KPerm order).
#pragma unroll
  for (int i = 0; i < (8 * D / 4 + C::kThreads - 1) / C::kThreads; ++i) {
    const int e = tid + C::kThreads * i;
    if (e >= 8 * D / 4) break;
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < group) {
      const float* qr = a.q + size_t(kv * group + r) * D;
      if constexpr (C::kF8) {
        x = make_float4(qr[KPerm<D>(c)], qr[KPerm<D>(c + 1)], qr[KPerm<D>(c + 2)],
                        qr[KPerm<D>(c + 3)]);
      } else {
        x = *reinterpret_cast<const float4*>(qr + c);
      }
    }
    const HiLo4 q = SplitHiLo<TM>(x);
    *reinterpret_cast<uint2*>(qh + r * kStr + c) = q.hi;
    *reinterpret_cast<uint2*>(qh + (r + 8) * kStr + c) = q.lo;
  }
  __syncthreads();  // Q, rowid and the barriers' init are visible to every warp

  const int g = lane >> 2, c2 = (lane & 3) * 2, lm = lane >> 3, lr = lane & 7;
  const bool valid = g < group;
  // Q's A fragments, kept in registers for every tile.
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    Ldm4(qa[ks], qh + ((lm & 1) * 8 + lr) * kStr + ks * 16 + (lm >> 1) * 8);
  }
  const float sl2 = a.scale * kLog2e;
  float m_run = -INFINITY, l_run = 0.f;
  float v_unit = 1.f, v_inv = 1.f;  // fp8: P·V takes p · scale_v / v_unit
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  for (int j = 0; j < mytiles; ++j) {
    const int buf = j % kStages, t = j * kTeams + team;
    if (!kRefill && tid == 0) issue(team, j + kStages - 1);  // into the stage released last
    MbarWait(&bars[team][buf], static_cast<uint32_t>(j / kStages) & 1u);
    const uint8_t* kt = ring + team * C::kRing + buf * C::kStage;
    uint8_t* vt = ring + team * C::kRing + buf * C::kStage + C::kTile;
    const float* ksc_t = reinterpret_cast<const float*>(kt + 2 * C::kTile) + scale_skew;  // fp8
    const float* vsc_t =
        reinterpret_cast<const float*>(kt + 2 * C::kTile + C::kScaleSlot) + scale_skew;
    const uint32_t wfirst = k0 + t * kTk + kWk * wt;  // this warp's first key
    if (wfirst + kWk > k1) {  // V rows past the range (the range's last tile only) to zero
      constexpr int kChunks = C::kRow / 16;
#pragma unroll 4
      for (int e = lane; e < kWk * kChunks; e += 32) {
        const int r = e / kChunks;
        if (wfirst + r >= k1) {
          *reinterpret_cast<uint4*>(vt + Swz<C>(kWk * wt + r, (e % kChunks) * 16)) =
              make_uint4(0, 0, 0, 0);
        }
      }
      __syncwarp();
    }
    if constexpr (C::kF8) {
      if (j == 0) {  // this warp's unit: a power of two near its first piece's V scales
        float mx = 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r) mx = fmaxf(mx, vsc_t[kWk * wt + r]);
        const float unit = __uint_as_float(__float_as_uint(mx) & 0x7f800000u);
        if (unit > 0.f && isfinite(unit)) v_unit = unit, v_inv = 1.f / unit;
      }
    }
    // A softmax step takes 32 keys where a warp's share of a tile holds whole 32s (16 else):
    // one maximum, rescale and pair of shuffles per 32 keys, and two independent score chains
    // in flight. H100, GQA 32/8, µs, 16 keys a step / 32 / 32 with PackLo16's low parts from
    // the packed high parts (not a second rounding): fp8
    // d = 64 32K 12.4 / 11.9 / 11.8, fp8 d = 128 128K 87.0 / 84.2 / 83.7; fp16 and bf16 alike
    // (d = 64 32K 20.3, d = 128 128K 164.5). Outputs equal to 1e-6. But not fp8 d = 128: there
    // 32-key steps save 2-3 % inside a graph of back-to-back calls but make a lone call (calls
    // apart, as the server runs a query after its copy) 27-33 % slower — H100, µs, 32 / 16 keys a
    // step, overlapping; apart: 32K 20.3 / 20.9, 36.4 / 28.6; 128K 82.5 / 84.5, 125.5 / 94.3.
    constexpr int kP = kWk % 32 == 0 && !(C::kF8 && D == 128) ? 32 : 16;
    constexpr int kN = kP / 8;  // 8-key n-tiles a step
#pragma unroll
    for (int piece = 0; piece < kWk / kP; ++piece) {
      const int wr = kWk * wt + kP * piece;  // the step's first row in the tile
      const uint32_t first = wfirst + kP * piece;
      if (first >= k1) break;  // (warp-uniform) nothing of the range left in this tile
      const bool full = first + kP <= k1;
      const float* ksc = ksc_t + wr;
      const float* vsc = vsc_t + wr;
      // S = Q·Kᵀ for the step's keys (kN 8-key n-tiles); the odd k-steps in a second chain.
      float s[kN][4], s2[kN][4];
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        s2[n][0] = s2[n][1] = s2[n][2] = s2[n][3] = 0.f;
      }
      if constexpr (C::kF8) {
        // This lane's K words of keys 8n + g: bytes (lane & 3)·D/4 .., a word a k-step.
        uint32_t kw[kN][D / 16];
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
          for (int i = 0; i < D / 64; ++i) {
            const uint4 u = *reinterpret_cast<const uint4*>(
                kt + Swz<C>(wr + n * 8 + g, (lane & 3) * (D / 4) + 16 * i));
            kw[n][4 * i] = u.x, kw[n][4 * i + 1] = u.y, kw[n][4 * i + 2] = u.z;
            kw[n][4 * i + 3] = u.w;
          }
        }
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
          for (int n = 0; n < kN; ++n) {
            Mma16<TM>(ks % 2 ? s2[n] : s[n], qa[ks], Fp8x2ToHalf2(kw[n][ks]),
                      Fp8x2ToHalf2(kw[n][ks] >> 16));
          }
        }
      } else {
#pragma unroll
        for (int h = 0; h < kN / 2; ++h) {  // 16 keys an ldmatrix pass
          uint32_t kf[D / 16][4];
#pragma unroll
          for (int ks = 0; ks < D / 16; ++ks) {
            Ldm4(kf[ks],
                 kt + Swz<C>(wr + 16 * h + (lm >> 1) * 8 + lr, (ks * 16 + (lm & 1) * 8) * 2));
          }
#pragma unroll
          for (int ks = 0; ks < D / 16; ++ks) {
            Mma16<TM>(ks % 2 ? s2[2 * h] : s[2 * h], qa[ks], kf[ks][0], kf[ks][1]);
            Mma16<TM>(ks % 2 ? s2[2 * h + 1] : s[2 * h + 1], qa[ks], kf[ks][2], kf[ks][3]);
          }
        }
      }
      // Row g's score: its high part (row g) + its low part (row g + 8), both chains.
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        float x[2] = {s[n][0] + s[n][2] + s2[n][0] + s2[n][2],
                      s[n][1] + s[n][3] + s2[n][1] + s2[n][3]};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if constexpr (C::kF8) x[e] *= ksc[n * 8 + c2 + e];
          const bool ok = valid && (full || first + n * 8 + c2 + e < k1);
          s[n][e] = ok ? x[e] * sl2 : -INFINITY;
          mx = fmaxf(mx, s[n][e]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_run - m_new);
      m_run = m_new;
      l_run *= alpha;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = m_run == -INFINITY ? 0.f : exp2f(s[n][e] - m_run);
          l_run += p;
          s[n][e] = C::kF8 ? p * (vsc[n * 8 + c2 + e] * v_inv) : p;
        }
      }
      // Once the running maximum settles the factor is 1: skip the rescale (warp-uniform test).
      if (__any_sync(0xffffffffu, alpha != 1.f)) {
        ScaleAcc(o, alpha);
      }
      // O += P·V, 16 keys an MMA k-step: P's rows 0..7 the weights' high parts, rows 8..15 their
      // low parts.
#pragma unroll
      for (int h = 0; h < kN / 2; ++h) {
        uint32_t ph[4];
        PackRowsHiLo<TM>(ph, s[2 * h][0], s[2 * h][1], s[2 * h + 1][0], s[2 * h + 1][1]);
        const int vr = wr + 16 * h;
        if constexpr (C::kF8) {
#pragma unroll
          for (int q = 0; q < D / 32; ++q) {  // MmaFp8V: V words at byte 4g + 32q of rows c2 ..
            const int col = 4 * g + 32 * q;
            MmaFp8V<TM>(o, q, ph, *reinterpret_cast<const uint32_t*>(vt + Swz<C>(vr + c2, col)),
                        *reinterpret_cast<const uint32_t*>(vt + Swz<C>(vr + c2 + 1, col)),
                        *reinterpret_cast<const uint32_t*>(vt + Swz<C>(vr + c2 + 8, col)),
                        *reinterpret_cast<const uint32_t*>(vt + Swz<C>(vr + c2 + 9, col)));
          }
        } else {
#pragma unroll
          for (int dn = 0; dn < D / 16; ++dn) {
            uint32_t b[4];
            Ldm4T(b, vt + Swz<C>(vr + (lm & 1) * 8 + lr, (dn * 16 + (lm >> 1) * 8) * 2));
            Mma16<TM>(o[2 * dn], ph, b[0], b[1]);
            Mma16<TM>(o[2 * dn + 1], ph, b[2], b[3]);
          }
        }
      }
    }
    if constexpr (kRefill) {
      // Release: this warp's reads of the stage are done before its count; the last of the
      // team's four sees every count before it issues the refill.
      __syncwarp();
      if (lane == 0) {
        __threadfence_block();
        if (atomicAdd(&released[team][buf], 1u) == 3u) {
          released[team][buf] = 0;
          __threadfence_block();
          issue(team, j + kStages);
        }
      }
    } else {
      __syncthreads();  // every warp is done with the stage: it is refilled next tile
    }
  }
  if constexpr (kTeams > 1) __syncthreads();  // every team is out of its ring (the merge's)
  if (overlap) {
    WaitForPrimary();  // the launch before this one may still read the partials written below
  } else {
    LaunchDependents();  // a combine launched after this one may start its blocks
  }

  // Rows g + 8 accumulated the weights' low parts: add them to rows g (fp8: back from units of
  // v_unit, a power of two). Row sums over the quad.
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    o[n][0] = (o[n][0] + o[n][2]) * (C::kF8 ? v_unit : 1.f);
    o[n][1] = (o[n][1] + o[n][3]) * (C::kF8 ? v_unit : 1.f);
  }
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  // The warps' states of the same rows over different keys, merged in shared memory.
  float* ms = reinterpret_cast<float*>(ring);  // [kWarps][8]
  float* ls = ms + 8 * C::kWarps;              // [kWarps][8]
  float* fs = ls + 8 * C::kWarps;              // [8][kWarps]
  float* os = fs + 8 * C::kWarps;              // [kWarps][8][kOs]
  if ((lane & 3) == 0) {
    ms[warp * 8 + g] = m_run;
    ls[warp * 8 + g] = l_run;
  }
  StoreWarpRow<D, 8, C::kOs, C::kF8>(os, warp, g, c2, 0, o);
  MergeWarpsIntoPartial<D, 8, C::kOs, 8, 8, C::kWarps>(a, a.part0 + blockIdx.y, rowid, ms, ls, fs,
                                                       os);
  FinishSplits(a, rowid, 8);
#else
  __trap();  // sm_90 only: StreamDecodeFits never takes another device
#endif
}

template <typename T, int D, int Tk, int Tm>
cudaError_t OptIn() {
  static const cudaError_t attr = cudaFuncSetAttribute(StreamDecodeKernel<T, D, Tk, Tm>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(Sd<T, D, Tk, Tm>::kBytes));
  return attr;
}

// Blocks of the kernel that fit a multiprocessor (occupancy calculator).
template <typename T, int D, int Tk, int Tm>
int FitPerSm() {
  static const int n = [] {
    int fit = 0;
    if (OptIn<T, D, Tk, Tm>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, StreamDecodeKernel<T, D, Tk, Tm>,
                                                      Sd<T, D, Tk, Tm>::kThreads,
                                                      Sd<T, D, Tk, Tm>::kBytes) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    return std::max(fit, 1);
  }();
  return n;
}

std::atomic<uint32_t> tile_override{0};
std::atomic<uint32_t> blocks_override{0};
std::atomic<uint32_t> teams_override{0};
std::atomic<bool> overlap_calls{true};

// f(T{}, integral_constant<int, D>{}, integral_constant<int, Tk>{}) for a's element type, head
// dim (64 or 128) and tile: kTileTarget bytes of rows up to 128 keys (64 keys of fp16 d = 128,
// 128 of the others), or 64 keys where SetStreamDecodeTile(64).
template <typename F>
auto WithShape(const AttendArgs& a, F&& f) {
  const bool small = tile_override.load(std::memory_order_relaxed) == 64;
  auto with_d = [&](auto t) {
    using T = decltype(t);
    auto with_tile = [&](auto d) {
      constexpr int kRow = decltype(d)::value * int(sizeof(T));
      constexpr int kAuto = kTileTarget / kRow < 128 ? kTileTarget / kRow : 128;
      return small ? f(t, d, std::integral_constant<int, 64>{})
                   : f(t, d, std::integral_constant<int, kAuto>{});
    };
    return a.d == 64 ? with_tile(std::integral_constant<int, 64>{})
                     : with_tile(std::integral_constant<int, 128>{});
  };
  if (a.dtype == DType::kBF16) return with_d(__nv_bfloat16{});
  if (a.dtype == DType::kFP8) return with_d(__nv_fp8_e4m3{});
  return with_d(__half{});
}

// f(T{}, D, Tk, integral_constant<int, Tm>{}) with Tm the teams a block for `a` over `keys`:
// two where a ring holds under 64 KB (fp8 d = 64's 8 KB tiles) and one block a multiprocessor
// gets at least kShortKeys keys — eight warps and about 96 KB of tiles in flight, as two one-team
// blocks had, over half the splits (half the partials to write and combine, and each block's
// ramp and merge over twice the keys); else one (or SetStreamDecodeTeams' choice). Measured on
// an H100 (GQA 32/8, fp8 d = 64, µs, CUDA graph of 20 calls, one team / two, overlapping; calls
// apart): 8K 5.54 / 5.86, 8.80 / 8.91; 12K 7.47 / 5.07, 11.77 / 9.93; 16K 9.10 / 5.68, 13.53 /
// 11.09; 24K 9.98 / 7.66; 32K 11.87 / 9.79 (the plain streaming read of the same bytes 9.70),
// 17.80 / 16.22; 128K 45.61 / 44.47, 55.14 / 53.56.
template <typename F>
auto WithTeams(const AttendArgs& a, uint64_t keys, F&& f) {
  return WithShape(a, [&](auto t, auto d, auto tk) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value, kTk = decltype(tk)::value;
    if constexpr (Sd<T, D, kTk>::kTwoTeamsFit) {
      const uint32_t o = teams_override.load(std::memory_order_relaxed);
      const uint64_t sms = static_cast<uint64_t>(std::max(gpu::Info().sms, 1));
      const bool two = o != 0 ? o == 2 : keys * std::max<uint32_t>(a.heads, 1) >= kShortKeys * sms;
      if (two) return f(t, d, tk, std::integral_constant<int, 2>{});
    }
    return f(t, d, tk, std::integral_constant<int, 1>{});
  });
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

bool StreamDecodeFits(const AttendArgs& a) {
  if (!a.stream_decode || gpu::Info().cc_major < 9 || a.list != nullptr || !a.dense_items) {
    return false;
  }
  if (a.dtype != DType::kF16 && a.dtype != DType::kBF16 && a.dtype != DType::kFP8) return false;
  if (a.d != 64 && a.d != 128) return false;
  if (a.m != 1 || a.uniform_group < 1 || a.uniform_group > 8 || a.heads == 0) return false;
  if (a.n_items != a.heads || a.rows == 0 || a.rows >= (1u << 30)) return false;
  if (!Aligned16(a.k) || !Aligned16(a.v)) return false;
  if (a.dtype == DType::kFP8) {  // the row scales' 1-D maps: 16-byte bases, int32 coordinates
    if (a.k_scale == nullptr || a.v_scale == nullptr || !Aligned16(a.k_scale) ||
        !Aligned16(a.v_scale) || uint64_t{a.heads} * a.rows + 512 >= (1ull << 31)) {
      return false;
    }
  }
  return true;
}

int StreamDecodeBlocksPerSm(const AttendArgs& a, uint64_t keys) {
  return WithTeams(a, keys, [&](auto t, auto d, auto tk, auto tm) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value, kTk = decltype(tk)::value, kTm = decltype(tm)::value;
    // Enough rings for about 96 KB of tiles in flight: one block of fp16 d = 128 (64-key
    // tiles), fp16 d = 64 and fp8 d = 128 (128-key tiles), and of fp8 d = 64's two teams.
    // Measured on an H100, GQA 32/8, µs, one block an SM / two: fp16 d = 128 32K 48.6 / 49.7;
    // fp16 d = 64 32K 27.2 / 28.4, 128K 92.9 / 93.7; fp8 d = 128 32K 28.9 / 31.8, 128K 96.6 /
    // 100.2; fp8 d = 64 (one team, two blocks / four) 32K 17.8 / 23.9, 128K 55.4 / 75.0. Short
    // ranges (under kShortKeys a block) take twice the blocks: fp16 d = 128 8K 10.59 -> 10.38,
    // d = 64 8.67 -> 8.23.
    constexpr int kInFlight = kTm * Sd<T, D, kTk>::kRing;  // bytes a block
    int want = (98304 + kInFlight - 1) / kInFlight;
    const uint64_t slots = uint64_t(want) * std::max(gpu::Info().sms, 1);
    if (keys * std::max<uint32_t>(a.heads, 1) < kShortKeys * slots) want *= 2;
    if (const uint32_t n = blocks_override.load(std::memory_order_relaxed); n > 0) want = int(n);
    return std::clamp(want, 1, FitPerSm<T, D, kTk, kTm>());
  });
}

void SetOverlapCalls(bool on) { overlap_calls.store(on, std::memory_order_relaxed); }
bool OverlapCalls() { return overlap_calls.load(std::memory_order_relaxed); }

void SetStreamDecodeBlocks(uint32_t n) { blocks_override.store(n, std::memory_order_relaxed); }
uint32_t StreamDecodeTeams(const AttendArgs& a, uint64_t keys) {
  return WithTeams(a, keys,
                   [](auto, auto, auto, auto tm) { return uint32_t{decltype(tm)::value}; });
}
void SetStreamDecodeTeams(uint32_t n) {
  teams_override.store(n == 1 || n == 2 ? n : 0, std::memory_order_relaxed);
}
void SetStreamDecodeTile(uint32_t keys) {
  tile_override.store(keys == 64 ? 64 : 0, std::memory_order_relaxed);
}
uint32_t StreamDecodeTile(const AttendArgs& a) {
  return WithShape(a, [](auto, auto, auto tk) { return uint32_t{decltype(tk)::value}; });
}

Status LaunchStreamDecode(const AttendArgs& a_in, cudaStream_t stream) {
  AttendArgs a = a_in;
  const uint32_t keys = VisibleSpan(a, a.q_pos0, a.q_pos0).len;
  return WithTeams(a, keys, [&](auto t, auto d, auto tk, auto tm) -> Status {
    using T = decltype(t);
    constexpr int D = decltype(d)::value, kTk = decltype(tk)::value, kTm = decltype(tm)::value;
    using C = Sd<T, D, kTk, kTm>;
    // K and V as [heads][rows][row bytes]: boxes of kBox bytes × kTk rows × one head, so a tile
    // never reads another head's rows (past the slot's rows it lands as zeros).
    const uint64_t dims[3] = {uint64_t{C::kRow}, a.rows, a.heads};
    const uint64_t strides[2] = {uint64_t{C::kRow}, uint64_t{C::kRow} * a.rows};
    const uint32_t box[3] = {uint32_t{C::kBox}, uint32_t{kTk}, 1};
    const TensorSwizzle sw = C::kBox == 128 ? TensorSwizzle::k128B : TensorSwizzle::k64B;
    const Status km = EncodeTensorMap(&a.map_k, TensorElem::kU8, 3, a.k, dims, strides, box, sw);
    if (!km.ok()) return km;
    const Status vm = EncodeTensorMap(&a.map_v, TensorElem::kU8, 3, a.v, dims, strides, box, sw);
    if (!vm.ok()) return vm;
    if constexpr (C::kF8) {  // the row scales, [heads·rows] floats
      const uint64_t sdims[1] = {uint64_t{a.heads} * a.rows};
      const uint32_t sbox[1] = {uint32_t{C::kScaleBox}};
      const Status ks = EncodeTensorMap(&a.map_ks, TensorElem::kF32, 1, a.k_scale, sdims, nullptr,
                                        sbox, TensorSwizzle::kNone);
      if (!ks.ok()) return ks;
      const Status vs = EncodeTensorMap(&a.map_vs, TensorElem::kF32, 1, a.v_scale, sdims, nullptr,
                                        sbox, TensorSwizzle::kNone);
      if (!vs.ok()) return vs;
    }
    const cudaError_t attr = OptIn<T, D, kTk, kTm>();
    if (attr != cudaSuccess) return gpu::CudaError(attr, "streaming decode shared memory");
    return LaunchDependent(StreamDecodeKernel<T, D, kTk, kTm>, dim3(a.heads, a.splits),
                           dim3(C::kThreads), C::kBytes, stream, "streaming decode kernel", a,
                           OverlapCalls());
  });
}

}  // namespace pion::kernels::cuda
