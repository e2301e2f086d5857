// The batched tensor-core kernel for fp16, bf16 and fp8 K/V with many query rows per K/V head
// (M > 1 or wide GQA groups; d <= 128): flash attention on mma.sync m16n8k16 where each of the
// block's four warps owns two 16-row groups (32 rows, 128 a block), so every K and V fragment read
// from shared memory feeds two MMAs, and each K/V tile (32 keys, cp.async stages) serves 128 rows.
// The online softmax, partials, LSE and output stay fp32; what enters the tensor cores:
//   fp16  Q and P as fp16 (flash-attention precision).
//   bf16  bf16 MMAs; Q split into bf16 hi + lo parts (two MMAs a score: a single bf16 Q, 8
//         significand bits, put 2e-2 of error on peaked softmaxes in numpy, hi + lo 2.5e-3, as
//         fp16's flash precision does), P as bf16. Two stages, not three: Q's two parts take
//         the shared memory, and two blocks still fit a multiprocessor.
//   fp8   e4m3 tiles (with their rows' scales) land by cp.async and are widened in shared
//         memory to fp16 (cvt e4m3x2 -> f16x2, exact) once per tile for all 128 rows; then as
//         fp16, with a score (q·k_e4m3)·scale_k and P entering P·V as p·scale_v / U, U the
//         largest V scale seen so far (P stays in [0, 1], fp16's normal range); when a tile
//         raises U the output so far is rescaled with the softmax factor, and the partial is
//         multiplied by U once at the end.
// Same arguments and partial layout as the other kernels. bf16 and fp8 take it where
// LowpBatched() (the default; compute-sanitizer racecheck on GpuExecutor.BatchedSmoke, the
// kernel alone in its process, reports no hazard — the 2 once reported on GpuExecutor.Smoke were
// racecheck's view of earlier kernels' mbarriers, see scripts/test-gpu.sh); fp16 with eight row
// groups always.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_mma.cuh"

namespace pion::kernels::cuda {
namespace {

template <typename T, int D>
struct Batched {
  static constexpr bool kF8 = std::is_same_v<T, __nv_fp8_e4m3>;
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  // The 16-bit element type of the MMAs (fp8 tiles widen to fp16).
  using TM = std::conditional_t<kBf16, __nv_bfloat16, __half>;
  static constexpr int kMt = 2;            // 16-row groups per warp
  static constexpr int kGroups = 4 * kMt;  // 16-row groups (items) per block
  static constexpr int kRows = 16 * kGroups;
  static constexpr int kBn = 32;  // keys per tile
  static constexpr int kStages = kBf16 ? 2 : 3;
  static constexpr int kQParts = kBf16 ? 2 : 1;  // Q's hi (and lo) parts
  static constexpr int kStr = D + 8;  // padded smem row (TM): ldmatrix rows hit distinct banks
  // A staged tile row as loaded: padded TM rows, or fp8's D e4m3 bytes.
  static constexpr int kRawStr = kF8 ? D : kStr;
  static constexpr size_t kQ = size_t{kRows} * kStr * 2 * kQParts;
  static constexpr size_t kTile = size_t{kBn} * kRawStr * sizeof(T);
  // fp8: the widened K and V tile (one: a tile is widened right before its use) and the staged
  // tiles' row scales ([kStages][K, V][kBn] floats).
  static constexpr size_t kWide = kF8 ? size_t{2} * kBn * kStr * 2 : 0;
  static constexpr size_t kScales = kF8 ? size_t{kStages} * 2 * kBn * 4 : 0;
  static constexpr size_t kBytes = kQ + 2 * kStages * kTile + kWide + kScales;
  static_assert(kQ % 16 == 0 && kTile % 16 == 0 && kWide % 16 == 0, "16-byte aligned regions");
};

template <typename T, int D>
__global__ void __launch_bounds__(128) BatchedKernel(AttendArgs a) {
  using C = Batched<T, D>;
  using TM = typename C::TM;
  constexpr bool kF8 = C::kF8, kBf16 = C::kBf16;
  constexpr int kStr = C::kStr, kRawStr = C::kRawStr, kBn = C::kBn, kS = C::kStages;
  constexpr int kMt = C::kMt;
  constexpr int kNt = kBn / 8;  // 8-key MMA tiles per K/V tile
  extern __shared__ __align__(16) uint8_t smem[];
  TM* qs = reinterpret_cast<TM*>(smem);        // [kRows][kStr] (hi)
  TM* ql = qs + C::kRows * kStr;               // bf16: [kRows][kStr] (lo)
  T* kt = reinterpret_cast<T*>(smem + C::kQ);  // [kS][kBn][kRawStr]
  T* vt = kt + kS * kBn * kRawStr;             // [kS][kBn][kRawStr]
  __half* kw = reinterpret_cast<__half*>(smem + C::kQ + 2 * kS * C::kTile);  // fp8: [kBn][kStr]
  __half* vw = kw + kBn * kStr;
  float* sc = reinterpret_cast<float*>(smem + C::kQ + 2 * kS * C::kTile + C::kWide);
  __shared__ int64_t qpos[C::kRows];
  __shared__ int32_t rowid[C::kRows];
  __shared__ uint32_t range[2];
  __shared__ int64_t qspan[2];

  WaitForPrimary();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t first_item = blockIdx.x * C::kGroups;
  const int32_t kv = a.items[first_item].kv;
  for (int t = tid; t < C::kRows; t += 128) {
    const uint32_t it = first_item + t / 16;
    const int j = t % 16;
    int32_t r = -1;
    if (it < a.n_items && j < a.items[it].n) r = a.items[it].rows[j];
    rowid[t] = r;
    qpos[t] = r >= 0 ? a.q_pos0 + static_cast<int64_t>(r % a.m) : 0;
  }
  if (tid == 0) {  // an item's rows ascend by query position: its first and last bound it
    int64_t pmin = INT64_MAX, pmax = INT64_MIN;
    for (int i = 0; i < C::kGroups; ++i) {
      const uint32_t it = first_item + i;
      if (it >= a.n_items || a.items[it].n == 0) continue;
      pmin = Min<int64_t>(pmin, a.q_pos0 + a.items[it].rows[0] % a.m);
      pmax = Max<int64_t>(pmax, a.q_pos0 + a.items[it].rows[a.items[it].n - 1] % a.m);
    }
    qspan[0] = pmin;
    qspan[1] = pmax;
    const KeySpan span = pmin <= pmax ? VisibleSpan(a, pmin, pmax) : KeySpan{0, 0};
    range[0] = span.lo;
    range[1] = span.len;
  }
  __syncthreads();
  // This split's tiles: the range's 32-key tiles spread evenly over the splits.
  const uint32_t lo = range[0], len = range[1];
  const uint32_t tiles = (len + kBn - 1) / kBn;
  const uint32_t k0 = lo + Min<uint32_t>(len, SplitPoint(tiles, blockIdx.y, a.splits) * kBn);
  const uint32_t k1 = lo + Min<uint32_t>(len, SplitPoint(tiles, blockIdx.y + 1, a.splits) * kBn);
  const int ntiles = static_cast<int>((k1 - k0 + kBn - 1) / kBn);
  const T* kbase = static_cast<const T*>(a.k) + size_t(kv) * a.rows * D;
  const T* vbase = static_cast<const T*>(a.v) + size_t(kv) * a.rows * D;

  // Tile t into buffer t % kS; one commit group per call (empty past the end), so that
  // wait_prior(kS − 1) means "tile t has landed". kBn × D/kEl chunks of 16 bytes over 128
  // threads, and for fp8 the tile's row scales in the same group.
  constexpr int kEl = 16 / int(sizeof(T)), kCpr = D / kEl, kChunks = kBn * kCpr;
  auto prefetch = [&](int t) {
    if (t < ntiles) {
      const int buf = t % kS;
      const uint32_t first = k0 + t * kBn;
      const int tk = Min<int>(kBn, k1 - first);
      const T* kg = kbase + size_t(first) * D;
      const T* vg = vbase + size_t(first) * D;
      T* ks = kt + buf * kBn * kRawStr;
      T* vs = vt + buf * kBn * kRawStr;
#pragma unroll
      for (int i = 0; i < (kChunks + 127) / 128; ++i) {
        const int e = tid + 128 * i;
        if (kChunks % 128 != 0 && e >= kChunks) break;
        const int j = e / kCpr, c = (e % kCpr) * kEl;
        if (j < tk) {
          CpAsync16(ks + j * kRawStr + c, kg + j * D + c);
          CpAsync16(vs + j * kRawStr + c, vg + j * D + c);
        } else {  // zero rows past the range: p = 0 must not meet garbage (0 · NaN)
          *reinterpret_cast<uint4*>(ks + j * kRawStr + c) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(vs + j * kRawStr + c) = make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (kF8) {
        if (tid < 2 * kBn) {  // K scales, then V scales; zero past the range
          const int j = tid % kBn;
          const float* src = tid < kBn ? a.k_scale : a.v_scale;
          float* dst = sc + (buf * 2 + tid / kBn) * kBn + j;
          if (j < tk) {
            __pipeline_memcpy_async(dst, src + size_t(kv) * a.rows + first + j, 4);
          } else {
            *dst = 0.f;
          }
        }
      }
    }
    __pipeline_commit();
  };

  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int lm = lane >> 3, lr = lane & 7;
  // This thread's rows: for each of its warp's groups mt, rows g and g + 8 (index mt*2 + half).
  int64_t qp[kMt * 2];
  bool valid[kMt * 2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (warp * kMt + mt) * 16 + g + 8 * h;
      qp[mt * 2 + h] = qpos[row];
      valid[mt * 2 + h] = rowid[row] >= 0;
    }
  }
  const int64_t qmin = qspan[0], qmax = qspan[1];
  const float sl2 = a.scale * kLog2e;
  float m_run[kMt * 2], l_run[kMt * 2];
  float o[kMt][D / 8][4];
#pragma unroll
  for (int i = 0; i < kMt * 2; ++i) m_run[i] = -INFINITY, l_run[i] = 0.f;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  float v_unit = 0.f, v_inv = 0.f;  // fp8: U, the largest V scale so far, and 1 / U

#pragma unroll
  for (int t = 0; t < kS - 1; ++t) prefetch(t);
    // Q (fp16 or bf16 hi, and bf16's lo part) into shared memory while the first tiles are on
    // their way (loads 4 at a time).
#pragma unroll 4
  for (int e = tid; e < C::kRows * D / 4; e += 128) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rowid[r] >= 0) x = *reinterpret_cast<const float4*>(a.q + size_t(rowid[r]) * D + c);
    const HiLo4 q = SplitHiLo<TM>(x);
    *reinterpret_cast<uint2*>(qs + r * kStr + c) = q.hi;
    if constexpr (kBf16) *reinterpret_cast<uint2*>(ql + r * kStr + c) = q.lo;
  }
  __syncthreads();
  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % kS;
    prefetch(t + kS - 1);
    __pipeline_wait_prior(kS - 1);
    __syncthreads();
    const TM* kb;
    const TM* vb;
    float kscale[kNt][2], vscale[kNt][2];  // fp8: this thread's keys' row scales
    float unit_fix = 1.f;                  // fp8: U before / U after this tile
    if constexpr (kF8) {
      // Widen the tile's e4m3 bytes (K and V: 2·kBn·D/16 chunks of 16) to padded fp16 rows.
      constexpr int kWc = kBn * D / 16;
      const uint8_t* kr = reinterpret_cast<const uint8_t*>(kt + buf * kBn * kRawStr);
      const uint8_t* vr = reinterpret_cast<const uint8_t*>(vt + buf * kBn * kRawStr);
#pragma unroll
      for (int i = 0; i < (2 * kWc + 127) / 128; ++i) {
        const int e = tid + 128 * i;
        if ((2 * kWc) % 128 != 0 && e >= 2 * kWc) break;
        const bool is_v = e >= kWc;
        const int ee = is_v ? e - kWc : e;
        const int j = ee / (D / 16), c = (ee % (D / 16)) * 16;
        const uint4 w = *reinterpret_cast<const uint4*>((is_v ? vr : kr) + j * D + c);
        __half* dst = (is_v ? vw : kw) + j * kStr + c;
        *reinterpret_cast<uint4*>(dst) = make_uint4(Fp8x2ToHalf2(w.x), Fp8x2ToHalf2(w.x >> 16),
                                                    Fp8x2ToHalf2(w.y), Fp8x2ToHalf2(w.y >> 16));
        *reinterpret_cast<uint4*>(dst + 8) = make_uint4(Fp8x2ToHalf2(w.z), Fp8x2ToHalf2(w.z >> 16),
                                                        Fp8x2ToHalf2(w.w), Fp8x2ToHalf2(w.w >> 16));
      }
      const float* ksc = sc + (buf * 2) * kBn;
      const float* vsc = ksc + kBn;
      // The tile's largest V scale (kBn = 32: a lane a key); U only grows, so P stays <= 1.
      static_assert(kBn == 32, "a lane a key's scale");
      const float tmax = WarpMax(vsc[lane]);
      if (tmax > v_unit) {
        unit_fix = v_unit / tmax;
        v_unit = tmax;
        v_inv = 1.f / tmax;
      }
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          kscale[n][b] = ksc[n * 8 + c2 + b];
          vscale[n][b] = vsc[n * 8 + c2 + b] * v_inv;
        }
      }
      __syncthreads();  // the widened tile is complete
      kb = reinterpret_cast<const TM*>(kw);
      vb = reinterpret_cast<const TM*>(vw);
    } else {
      kb = reinterpret_cast<const TM*>(kt + buf * kBn * kRawStr);
      vb = reinterpret_cast<const TM*>(vt + buf * kBn * kRawStr);
    }
    float s[kMt][kNt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int n = 0; n < kNt; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        // S = Q·Kᵀ: each K fragment feeds both row groups (bf16: Q's hi and lo parts).
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[kNt / 2][4];
#pragma unroll
      for (int j = 0; j < kNt / 2; ++j)
        Ldm4(b[j], kb + (j * 16 + (lm >> 1) * 8 + lr) * kStr + ks * 16 + (lm & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int qr = (warp * kMt + mt) * 16 + (lm & 1) * 8 + lr;
#pragma unroll
        for (int part = 0; part < C::kQParts; ++part) {
          uint32_t aq[4];
          Ldm4(aq, (part == 0 ? qs : ql) + qr * kStr + ks * 16 + (lm >> 1) * 8);
#pragma unroll
          for (int j = 0; j < kNt / 2; ++j) {
            Mma16<TM>(s[mt][2 * j], aq, b[j][0], b[j][1]);
            Mma16<TM>(s[mt][2 * j + 1], aq, b[j][2], b[j][3]);
          }
        }
      }
    }
    // Mask (position, window, range, padding rows), scale into the log2 domain, row max. A
    // tile every row of the block fully sees skips the per-key tests.
    const int64_t e0 = int64_t(k0) + t * kBn;
    const bool full = e0 + kBn <= k1 && a.k_pos0 + e0 + kBn - 1 <= qmin &&
                      (a.window <= 0 || a.k_pos0 + e0 > qmax - a.window);
    float alpha[kMt * 2];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          bool ok = valid[mt * 2 + h];
          if (!full) {
            const int64_t entry = e0 + n * 8 + c2 + (e & 1);
            const int64_t kpos = a.k_pos0 + entry;
            const int64_t q = qp[mt * 2 + h];
            ok = ok && entry < k1 && kpos <= q && (a.window <= 0 || kpos > q - a.window);
          }
          float x = s[mt][n][e];
          if constexpr (kF8) x *= kscale[n][e & 1];
          s[mt][n][e] = ok ? x * sl2 : -INFINITY;
          mx[h] = fmaxf(mx[h], s[mt][n][e]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = mt * 2 + h;
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[i], mx[h]);
        alpha[i] = m_new == -INFINITY ? 1.f : exp2f(m_run[i] - m_new);
        m_run[i] = m_new;
        l_run[i] *= alpha[i];
      }
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = mt * 2 + (e >> 1);
          const float p = m_run[i] == -INFINITY ? 0.f : exp2f(s[mt][n][e] - m_run[i]);
          l_run[i] += p;
          // fp8: P·V takes p · scale_v / U (the output is in units of U).
          if constexpr (kF8) {
            s[mt][n][e] = p * vscale[n][e & 1];
          } else {
            s[mt][n][e] = p;
          }
        }
      }
    }
    // Once the running maxima (and fp8's unit) settle the factors are 1: skip the rescale
    // (warp-uniform test).
    bool rescale = false;
#pragma unroll
    for (int i = 0; i < kMt * 2; ++i) {
      alpha[i] *= unit_fix;
      rescale = rescale || alpha[i] != 1.f;
    }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[mt][n][0] *= alpha[mt * 2];
          o[mt][n][1] *= alpha[mt * 2];
          o[mt][n][2] *= alpha[mt * 2 + 1];
          o[mt][n][3] *= alpha[mt * 2 + 1];
        }
    }
    // O += P·V, 16 keys at a time: each V fragment feeds both row groups.
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      uint32_t ph[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        ph[mt][0] = Pack16<TM>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        ph[mt][1] = Pack16<TM>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        ph[mt][2] = Pack16<TM>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        ph[mt][3] = Pack16<TM>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        Ldm4T(b, vb + (kk * 16 + (lm & 1) * 8 + lr) * kStr + dn * 16 + (lm >> 1) * 8);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          Mma16<TM>(o[mt][2 * dn], ph[mt], b[0], b[1]);
          Mma16<TM>(o[mt][2 * dn + 1], ph[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the buffer (and fp8's widened tile) is refilled next iteration
  }
  LaunchDependents();
  // Row sums over the quad, then each warp writes its rows' partials (m in natural log units;
  // fp8's output back from units of U).
  const float o_unit = kF8 ? v_unit : 1.f;
  const size_t part = a.part0 + blockIdx.y;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = mt * 2 + h;
      float l = l_run[i];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = (warp * kMt + mt) * 16 + g + 8 * h;
      if (rowid[row] < 0) continue;
      const size_t pr = part * a.nrows + size_t(rowid[row]);
      if ((lane & 3) == 0) {
        a.part_m[pr] = m_run[i] == -INFINITY ? -INFINITY : m_run[i] * kLn2;
        a.part_l[pr] = l;
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<float2*>(a.part_o + pr * D + n * 8 + c2) =
            make_float2(o[mt][n][2 * h] * o_unit, o[mt][n][2 * h + 1] * o_unit);
      }
    }
  }
  FinishSplits(a, rowid, C::kRows);
}

// The kernel for T and D with its dynamic shared memory allowed (once), or the error that
// refused it.
template <typename T, int D>
cudaError_t Prepare() {
  static const cudaError_t attr =
      cudaFuncSetAttribute(BatchedKernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Batched<T, D>::kBytes));
  return attr;
}

// Resident blocks per multiprocessor (registers bound this kernel before shared memory does).
template <typename T, int D>
int BlocksPerSm() {
  static const int n = [] {
    int blocks = 1;
    if (Prepare<T, D>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, BatchedKernel<T, D>, 128,
                                                      Batched<T, D>::kBytes) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    return std::max(blocks, 1);
  }();
  return n;
}

template <typename T, int D>
Status Launch(const AttendArgs& a, cudaStream_t stream) {
  using C = Batched<T, D>;
  const cudaError_t attr = Prepare<T, D>();
  if (attr != cudaSuccess) return gpu::CudaError(attr, "batched tensor-core kernel shared memory");
  dim3 grid((a.n_items + C::kGroups - 1) / C::kGroups, a.splits);
  return LaunchDependent(BatchedKernel<T, D>, grid, dim3(128), C::kBytes, stream,
                         "batched tensor-core attention kernel", a);
}

// f(T{}) for the element type of a's slot (fp16, bf16 or fp8).
template <typename F>
auto WithType(DType dtype, F&& f) {
  if (dtype == DType::kBF16) return f(__nv_bfloat16{});
  if (dtype == DType::kFP8) return f(__nv_fp8_e4m3{});
  return f(__half{});
}

}  // namespace

int BatchedBlocksPerSm(const AttendArgs& a) {
  return WithType(a.dtype, [&](auto t) {
    using T = decltype(t);
    switch (a.d) {
      case 32:
        return BlocksPerSm<T, 32>();
      case 64:
        return BlocksPerSm<T, 64>();
      case 96:
        return BlocksPerSm<T, 96>();
    }
    return BlocksPerSm<T, 128>();
  });
}

Status LaunchBatched(const AttendArgs& a, cudaStream_t stream) {
  if (a.dtype != DType::kF16 && a.dtype != DType::kBF16 && a.dtype != DType::kFP8) {
    return Status(ErrorKind::kErr, "no batched tensor-core kernel for this dtype");
  }
  if (a.dtype == DType::kFP8 && (a.k_scale == nullptr || a.v_scale == nullptr)) {
    return Status(ErrorKind::kErr, "fp8 attention needs the K and V row scales");
  }
  return WithType(a.dtype, [&](auto t) {
    using T = decltype(t);
    switch (a.d) {
      case 32:
        return Launch<T, 32>(a, stream);
      case 64:
        return Launch<T, 64>(a, stream);
      case 96:
        return Launch<T, 96>(a, stream);
      case 128:
        return Launch<T, 128>(a, stream);
    }
    return Status(ErrorKind::kErr,
                  "no batched tensor-core kernel for head dim " + std::to_string(a.d));
  });
}

}  // namespace pion::kernels::cuda
