// The tensor-core attention kernel for fp16 and bf16 K/V (d <= 256; bf16 the decode shapes only):
// flash attention on mma.sync m16n8k16 (fp16 or bf16 inputs, fp32 accumulation), K/V tiles of 64
// keys double-buffered in shared memory with cp.async, ldmatrix fragments (K plain, V transposed),
// online softmax in registers.
//
// Three shapes, chosen by rows per K/V head (ShapeOf):
//   WR = 4  batched: the block's four warps own 16 query rows each (64 rows) and share every
//           K/V tile — the flash-attention layout for M > 1 (with many rows and d <= 128,
//           flash_batched.cu's eight-group kernel takes over: FlashRowGroups). Q and P enter the
//           tensor cores as fp16 (flash-attention precision; partials, LSE and the output stay
//           fp32).
//   WR = 1  decode: one group of up to 16 rows (all query heads of a K/V head, a few positions);
//           each warp streams its own run of 16-key tiles through its own cp.async ring and the
//           four warps merge their states at the end. Q and P are split into fp16 hi + lo parts
//           (two MMAs each), so the scores and weights keep fp32-level accuracy.
//   packed  decode with at most 8 rows (GQA groups up to 8 at M = 1): the low parts ride as the
//           MMA's rows 8..15 (rows g + 8 of Q and P are the low parts of rows g), so one MMA
//           computes both parts and the row's value is the sum of its two accumulator rows —
//           the same accuracy as the decode shape with half the tensor-core work.
//
// fp8 (e4m3fn with a scale per row) takes the packed decode shape: tiles arrive as e4m3 bytes
// (half of fp16's traffic) with their rows' scales, and each lane widens its own bytes to the
// fp16 MMA fragments in registers (cvt e4m3x2 -> f16x2, exact) — no widened copy in shared
// memory, no ldmatrix. The lanes read K in a permuted order of d (KPerm: a lane's bytes of a key
// are one run, a word a k-step; Q is stored in the same order) and V by words, paired across
// rows with byte_perm, its output columns permuted as fp32's are (32q + 4g + b). A score is
// (q · k_e4m3) · scale_k, and P enters P·V as p · scale_v / c (c: a power of two per warp near
// its first tile's V scales, keeping p · scale_v / c in fp16's normal range for the hi + lo
// split), the output multiplied back by c before the warps merge. Against widening each tile in
// shared memory first (H200, GQA 32/8, µs): d = 128 128K 132.5 -> 81.2, 32K 40.1 -> 27.8, 8K
// 15.1 -> 12.5; d = 64 128K 57.3 -> 54.4; with 5 or 8 ring stages instead of 3 it was no faster
// (128K 82.1, 128.2 — one block a multiprocessor at 8).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>
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

constexpr int kBk = 64;  // keys per tile
template <typename T, int D, int WR, bool kSplit, bool kPack>
struct Flash {
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr bool kF8 = std::is_same_v<T, __nv_fp8_e4m3>;
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(!kBf16 || WR == 1, "bf16 K/V: the decode shapes only");
  static_assert(!kF32 || (WR == 1 && kPack && !kSplit && D % 32 == 0 && D <= 128),
                "fp32 K/V: the packed decode shape only, d a multiple of 32 up to 128");
  static_assert(!kF8 || (WR == 1 && kPack && !kSplit && D % 32 == 0 && D <= 128),
                "fp8 K/V: the packed decode shape only, d a multiple of 32 up to 128");
  // The element type of Q in shared memory (fp8: fp16, as the MMAs take it).
  using TC = std::conditional_t<kF8, __half, T>;
  // The element type of the 16-bit MMAs (and of Q's and P's hi / lo parts): bf16 for bf16 K/V,
  // else fp16.
  using TM = std::conditional_t<kBf16, __nv_bfloat16, __half>;
  // Padded smem row (elements, 16 bytes of padding): ldmatrix rows hit distinct banks, and for
  // fp32 the V loads of rows 2t and 2t + 1 too (row stride ≡ 16 bytes mod 128). kStr: the rows
  // as loaded (T), kStrC: as the MMAs read them (TC; the same but for fp8).
  static constexpr int kStr = D + 16 / int(sizeof(T));
  static constexpr int kStrC = D + 16 / int(sizeof(TC));
  static constexpr int kRows = 16 * WR;
  static constexpr int kKw = kBk * WR / 4;  // keys per warp per tile
  // Decode keeps three tiles in flight (it is bound by reading K/V); batched two.
  static constexpr int kStages = WR == 1 ? 3 : 2;
  // Q: fp16 rows (hi, and lo parts when split), or fp32's tf32 A fragments in lane order
  // (D/8 k-steps × 32 lanes × 16 bytes).
  static constexpr size_t kQ =
      kF32 ? size_t{D / 8} * 32 * 16 : size_t{kRows} * kStrC * 2 * (kSplit ? 2 : 1);
  static constexpr size_t kTile = size_t{kBk} * kStr * sizeof(T);
  // fp8: the row scales of every staged tile ([K, V][4 warps][kStages][16] floats).
  static constexpr size_t kScales = kF8 ? size_t{2} * 4 * kStages * 16 * 4 : 0;
  // Decode merge: the warps' outputs [4][16][kOs] (rows padded by 8 floats: a quad's float2
  // stores of 8 rows then hit distinct banks — unpadded they were 8-way conflicts) and their
  // m, l and weights (64 floats each).
  static constexpr int kOs = D + 8;
  static constexpr size_t kMerge = WR == 1 ? (size_t{4} * 16 * kOs + 192) * 4 : 0;
  static constexpr size_t kBytes = std::max(kQ + 2 * kStages * kTile + kScales, kQ + kMerge);
};

template <typename T, int D, int WR, bool kSplit, bool kPack>
__global__ void __launch_bounds__(128) FlashKernel(const __grid_constant__ AttendArgs a) {
  using C = Flash<T, D, WR, kSplit, kPack>;
  using TC = typename C::TC;
  using TM = typename C::TM;
  constexpr int kStr = C::kStr, kStrC = C::kStrC, kKw = C::kKw, kNt = kKw / 8, kS = C::kStages;
  extern __shared__ __align__(128) uint8_t smem[];
  __half* qh = reinterpret_cast<__half*>(smem);
  __half* ql = qh + C::kRows * kStrC;
  const uint4* qf = reinterpret_cast<const uint4*>(smem);  // fp32: [D/8][32] A fragments
  T* kt = reinterpret_cast<T*>(smem + C::kQ);              // [kS][kBk][kStr]
  T* vt = kt + kS * kBk * kStr;                            // [kS][kBk][kStr]
  // fp8: the staged row scales ([2][4][kS][16]).
  float* ksc = reinterpret_cast<float*>(smem + C::kQ + 2 * kS * C::kTile);
  float* vsc = ksc + 4 * kS * 16;
  __shared__ int64_t qpos[C::kRows];
  __shared__ int32_t rowid[C::kRows];
  __shared__ uint32_t range[2];
  __shared__ int64_t qspan[2];       // min and max position of the block's rows
  __shared__ int32_t kidx[kS][kBk];  // sparse: the key rows of each buffered tile
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(8) uint64_t bars[WR == 1 ? 4 : 1][kS];  // decode tensor copies, per warp
#endif

  WaitForPrimary();  // what the kernel before it in the stream wrote (e.g. selection lists)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = warp % WR;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Decode's copy barriers (tensor tiles, below), one ring a warp, set up before the block's
  // first barrier, which orders them before any use and any other shared access. (Set up after
  // it, where a warp's tiles were tensor copies, racecheck took the init instruction — under a
  // uniform predicate, off in a sparse block — for writes to kidx's bytes: hazards, none real.)
  if constexpr (WR == 1) {
    if (a.tensor_tiles && lane == 0) MbarInitRing(bars[warp]);
  }
#endif
  const uint32_t first_item = blockIdx.x * WR;
  const bool sparse = a.list != nullptr;  // WR == 1, one row per item
  // Uniform dense decode: rows, positions and key range follow from the arguments (every row
  // is at q_pos0), so the first tiles are requested without waiting for the items.
  const int ug = WR == 1 && !sparse ? static_cast<int>(a.uniform_group) : 0;
  const int32_t kv = ug > 0 ? static_cast<int32_t>(blockIdx.x) : a.items[first_item].kv;
  if (tid < C::kRows) {  // kRows <= 64
    int32_t r = -1;
    if (ug > 0) {
      if (tid < ug) r = kv * ug + tid;
    } else {
      const uint32_t it = first_item + tid / 16;
      const int j = tid % 16;
      if (it < a.n_items && j < a.items[it].n) r = a.items[it].rows[j];
    }
    rowid[tid] = r;
    qpos[tid] = r >= 0 ? a.q_pos0 + static_cast<int64_t>(r % a.m) : 0;
  }
  if (tid == 0) {
    // The block's key range and position span. An item's rows ascend by query position
    // (DenseItems, RowItems), so its first and last rows bound it.
    int64_t pmin = ug > 0 ? a.q_pos0 : INT64_MAX, pmax = ug > 0 ? a.q_pos0 : INT64_MIN;
    for (int i = 0; i < WR && ug == 0; ++i) {
      const uint32_t it = first_item + i;
      if (it >= a.n_items || a.items[it].n == 0) continue;
      pmin = Min<int64_t>(pmin, a.q_pos0 + a.items[it].rows[0] % a.m);
      pmax = Max<int64_t>(pmax, a.q_pos0 + a.items[it].rows[a.items[it].n - 1] % a.m);
    }
    qspan[0] = pmin;
    qspan[1] = pmax;
    KeySpan span{0, 0};
    if (sparse) {
      const int32_t r0 = a.items[first_item].n > 0 ? a.items[first_item].rows[0] : -1;
      span.len = r0 >= 0 ? static_cast<uint32_t>(a.counts[r0]) : 0;
    } else if (pmin <= pmax) {
      span = VisibleSpan(a, pmin, pmax);
    }
    range[0] = span.lo;
    range[1] = span.len;
  }
  __syncthreads();
  // Decode (WR = 1): each warp streams its own quarter of the block's keys through its own
  // ring of 16-row tiles, synchronizing only with itself (__syncwarp), so the four warps hide
  // each other's latencies. Batched (WR = 4): the block streams 64-row tiles all warps share.
  constexpr bool kIndep = WR == 1;
  constexpr int kTileRows = kIndep ? 16 : kBk;
  constexpr int kLoaders = kIndep ? 32 : 128;
  const int ltid = kIndep ? lane : tid;
  // Split the range's tiles evenly over the launch's workers (splits × 4 warps for decode,
  // splits blocks batched), so every tile but the range's last is full. Interleaved decode (a
  // block of at least 32 tiles): the range splits by blocks, and warp w takes the block's tiles
  // w, w + 4, ... — the block reads one contiguous run (AttendArgs::interleave).
  const uint32_t lo = range[0], len = range[1];
  const uint32_t tiles = (len + kTileRows - 1) / kTileRows;
  const bool inter = kIndep && a.interleave && tiles >= 32 * a.splits;
  const uint32_t workers = a.splits * (kIndep && !inter ? 4 : 1);
  const uint32_t wk = blockIdx.y * (kIndep && !inter ? 4 : 1) + (kIndep && !inter ? warp : 0);
  uint32_t k0 = lo + Min<uint32_t>(len, SplitPoint(tiles, wk, workers) * kTileRows);
  uint32_t k1 = lo + Min<uint32_t>(len, SplitPoint(tiles, wk + 1, workers) * kTileRows);
  if (inter) k0 = Min<uint32_t>(k1, k0 + warp * kTileRows);
  uint32_t step = inter ? 4 * kTileRows : kTileRows;  // rows from one tile to the next
  // Head-wide interleave (AttendArgs::interleave == 2, and fp8's default where the block
  // interleave applies): every warp of every split takes the range's tiles in turn, so a K/V
  // head's warps read one contiguous window that moves along. Measured on the H200 (GQA 32/8,
  // same binary, A/B, µs): fp8 d = 128 128K 81.9 -> 80.0, 32K 27.5 -> 26.6; fp16 d = 128 32K
  // 40.76 -> 40.60 but 128K 135.1 -> 136.7, d = 64 128K 73.8 -> 74.8, so not fp16's.
  if (kIndep && (a.interleave == 2 || (C::kF8 && inter))) {
    const uint32_t gw = blockIdx.y * 4 + warp;
    k0 = lo + Min<uint32_t>(len, gw * kTileRows);
    k1 = lo + len;
    step = a.splits * 4 * kTileRows;
  }
  const int ntiles = static_cast<int>((k1 - k0 + step - 1) / step);
  const T* kbase = static_cast<const T*>(a.k) + size_t(kv) * a.rows * D;
  const T* vbase = static_cast<const T*>(a.v) + size_t(kv) * a.rows * D;
  const int32_t* list = sparse && rowid[0] >= 0 ? a.list + size_t(rowid[0]) * a.stride : nullptr;
  // Buffer `buf` of this warp's (decode) or the block's (batched) ring, and its key indices.
  auto tile_k = [&](int buf) { return kt + (kIndep ? (warp * kS + buf) * 16 : buf * kBk) * kStr; };
  auto tile_v = [&](int buf) { return vt + (kIndep ? (warp * kS + buf) * 16 : buf * kBk) * kStr; };
  const int kidx0 = kIndep ? warp * 16 : 0;
  // Each loader copies 16-byte chunks (kEl elements) of kTileRows × kCpr; when the loaders cover
  // whole rows (fp16 D = 32, 64, 128, 256; fp32 D = 32, 64, 128) every chunk of a loader sits in
  // the same column.
  constexpr int kEl = 16 / int(sizeof(T)), kCpr = D / kEl;
  constexpr int kChunks = kTileRows * kCpr / kLoaders;  // per loader and tile
  constexpr bool kLaneCols = kLoaders % kCpr == 0;
  const int lrow = ltid / kCpr, lcol = (ltid % kCpr) * kEl;

  // Decode on sm_90 (AttendArgs::tensor_tiles): a full dense tile — 16 contiguous rows — comes
  // as one 2-D tensor copy each for K and V (lane 0), counted on the buffer's mbarrier. Only a
  // range's last tile can be partial (cp.async), so every earlier fill of a buffer was a tensor
  // copy: tile t's fill is the buffer's (t / kS)-th, parity (t / kS) & 1. The tiles must sit
  // 128-byte aligned (they do: every tile is a multiple of 128 bytes from a 128-aligned base).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool tensor = kIndep && a.tensor_tiles && list == nullptr && (SmemAddr(kt) & 127u) == 0;
#else
  constexpr bool tensor = false;
#endif
  auto tensor_tile = [&](int t) { return tensor && k0 + t * step + kTileRows <= k1; };
  // Tile t into buffer t % kS; always one commit group per call (empty past the end) so that
  // wait_prior(kS − 1) means "tile t has landed".
  auto prefetch = [&](int t) {
    if (t < ntiles) {
      const int buf = t % kS;
      const uint32_t first = k0 + t * step;
      const int tk = Min<int>(kTileRows, k1 - first);
      const T* kg = kbase + size_t(first) * D;  // dense: rows first.. are contiguous
      const T* vg = vbase + size_t(first) * D;
      T* ks = tile_k(buf);
      T* vs = tile_v(buf);
      if constexpr (C::kF8) {  // the tile's row scales, in the same commit group (zero past it)
        if (lane < 16) {
          float* kd = ksc + (warp * kS + buf) * 16 + lane;
          float* vd = vsc + (warp * kS + buf) * 16 + lane;
          if (lane < tk) {
            const size_t row = size_t(kv) * a.rows + first + lane;
            __pipeline_memcpy_async(kd, a.k_scale + row, 4);
            __pipeline_memcpy_async(vd, a.v_scale + row, 4);
          } else {
            *kd = 0.f;
            *vd = 0.f;
          }
        }
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (tensor_tile(t)) {
        if (lane == 0) {
          MbarArriveExpect(&bars[warp][buf], 2 * kTileRows * kStr * sizeof(T));
          const int c1 = static_cast<int>(size_t(kv) * a.rows + first);
          TensorCopy2d(ks, &a.map_k, 0, c1, &bars[warp][buf]);
          TensorCopy2d(vs, &a.map_v, 0, c1, &bars[warp][buf]);
        }
        __pipeline_commit();
        return;
      }
#endif
      if constexpr (kLaneCols) {
        if (list == nullptr && tk == kTileRows) {  // a full dense tile: offsets fixed per loader
          const uint32_t kd = SmemAddr(ks + lrow * kStr + lcol);
          const uint32_t vd = SmemAddr(vs + lrow * kStr + lcol);
          const T* kgl = kg + lrow * D + lcol;
          const T* vgl = vg + lrow * D + lcol;
          Unroll<0, kChunks>([&](auto I) {
            constexpr int kRow = decltype(I)::value * (kLoaders / kCpr);
            constexpr int kSo = kRow * kStr * int(sizeof(T)), kGo = kRow * D * int(sizeof(T));
            CpAsync16At<kSo, kGo>(kd, kgl);
            CpAsync16At<kSo, kGo>(vd, vgl);
          });
          __pipeline_commit();
          return;
        }
      }
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {  // kTileRows × kCpr chunks of 16 bytes over the loaders
        const int e = ltid + kLoaders * i;
        const int j = e / kCpr, c = (e % kCpr) * kEl;
        const int so = j * kStr + c;
        if (j < tk) {
          ptrdiff_t go;
          if (list != nullptr) {
            const int32_t key = list[first + j];
            if (c == 0) kidx[buf][kidx0 + j] = key;
            go = (ptrdiff_t(key) - ptrdiff_t(first)) * D + c;
          } else {
            go = j * D + c;
          }
          CpAsync16(ks + so, kg + go);
          CpAsync16(vs + so, vg + go);
        } else {  // zero rows past the range: p = 0 must not meet garbage (0 · NaN)
          *reinterpret_cast<uint4*>(ks + so) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(vs + so) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    __pipeline_commit();
  };

  // This thread's rows: g and g + 8 of its warp's row group.
  const int g = lane >> 2, c2 = (lane & 3) * 2;
  const int row_a = rg * 16 + g, row_b = row_a + 8;
  const bool valid_a = rowid[row_a] >= 0, valid_b = rowid[row_b] >= 0;
  const int64_t qp_a = qpos[row_a], qp_b = qpos[row_b];
  const int64_t qmin = qspan[0], qmax = qspan[1];
  const float sl2 = a.scale * kLog2e;
  // Packed: a thread's row g only (rows g + 8 carry the low parts of Q and P).
  constexpr int kRowsPerThread = kPack ? 1 : 2;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  // fp8: P·V takes p · scale_v / v_unit (a power of two, set from this warp's first tile).
  float v_unit = 1.f, v_inv = 1.f;
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  // ldmatrix lane addressing.
  const int lm = lane >> 3, lr = lane & 7;
#pragma unroll
  for (int t = 0; t < kS - 1; ++t) prefetch(t);
  // Q (fp16, and its low part) into shared memory while the first tiles are on their way.
  constexpr int kQRows = kPack ? 8 : C::kRows;  // packed: rows 8..15 are built from 0..7
  if constexpr (C::kF32) {
    // fp32: the tf32 A fragments of m16n8k8, in lane order (one 16-byte load a lane and k-step).
    // Lane (g, t) of k-step ks holds row g's columns 8ks + t and 8ks + t + 4, as the MMA's rows
    // g (the high part, tf32-rounded) and g + 8 (the low part, x − hi).
    uint4* qw = reinterpret_cast<uint4*>(smem);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {  // D/8 × 32 fragments over 128 threads
      const int e = tid + 128 * i, l = e % 32, r = l >> 2, c = (e / 32) * 8 + (l & 3);
      float x0 = 0.f, x1 = 0.f;
      if (rowid[r] >= 0) {
        const float* q = a.q + size_t(rowid[r]) * D + c;
        x0 = q[0];
        x1 = q[4];
      }
      const uint32_t h0 = Tf32(x0), h1 = Tf32(x1);
      qw[e] = make_uint4(h0, Tf32(x0 - __uint_as_float(h0)), h1, Tf32(x1 - __uint_as_float(h1)));
    }
  } else {
    // Decode unrolls the loads (they are all in flight at once); batched keeps its registers.
#pragma unroll(WR == 1 ? (kQRows * D / 4 + 127) / 128 : 1)
    for (int i = 0; i < (kQRows * D / 4 + 127) / 128; ++i) {
      const int e = tid + 128 * i;
      if (e >= kQRows * D / 4) break;
      const int r = e / (D / 4), c = (e % (D / 4)) * 4;
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (rowid[r] >= 0) {
        const float* qr = a.q + size_t(rowid[r]) * D;
        if constexpr (C::kF8) {  // logical columns c.. in the lanes' order of d (KPerm)
          x = make_float4(qr[KPerm<D>(c)], qr[KPerm<D>(c + 1)], qr[KPerm<D>(c + 2)],
                          qr[KPerm<D>(c + 3)]);
        } else {
          x = *reinterpret_cast<const float4*>(qr + c);
        }
      }
      const HiLo4 q = SplitHiLo<TM>(x);
      *reinterpret_cast<uint2*>(qh + r * kStrC + c) = q.hi;
      if constexpr (kPack) {  // rows 0..7 hold the rows' high parts, rows 8..15 their low parts
        *reinterpret_cast<uint2*>(qh + (r + 8) * kStrC + c) = q.lo;
      } else if constexpr (kSplit) {
        *reinterpret_cast<uint2*>(ql + r * kStrC + c) = q.lo;
      }
    }
  }
  __syncthreads();
  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % kS;
    prefetch(t + kS - 1);
    __pipeline_wait_prior(kS - 1);
    if constexpr (kIndep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (tensor_tile(t)) MbarWait(&bars[warp][buf], static_cast<uint32_t>(t / kS) & 1u);
#endif
      __syncwarp();
    } else {
      __syncthreads();
    }
    const TC* kb = reinterpret_cast<const TC*>(tile_k(buf));  // fp16 and fp32 tiles as staged
    const TC* vb = reinterpret_cast<const TC*>(tile_v(buf));
    const float* kscale_t = ksc + (warp * kS + buf) * 16;  // fp8: this tile's row scales
    const float* vscale_t = vsc + (warp * kS + buf) * 16;
    if constexpr (C::kF8) {
      if (t == 0) {  // this warp's unit for P · scale_v: a power of two near its V scales
        float mx = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) mx = fmaxf(mx, vscale_t[j]);
        const float unit = __uint_as_float(__float_as_uint(mx) & 0x7f800000u);
        if (unit > 0.f && isfinite(unit)) v_unit = unit, v_inv = 1.f / unit;
      }
    }
    float s[kNt][4], s2[kNt][4];  // s2: the odd k-steps' chain (packed)
#pragma unroll
    for (int n = 0; n < kNt; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      s2[n][0] = s2[n][1] = s2[n][2] = s2[n][3] = 0.f;
    }
    if constexpr (C::kF8) {
      // fp8: this lane's K words of keys g and 8 + g (D/16 each, one a k-step, in
      // KPerm's order), widened per k-step into the B fragments of the two 8-key n-tiles.
      const uint8_t* k8 = reinterpret_cast<const uint8_t*>(tile_k(buf));
      uint32_t kw[2][D / 16];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint8_t* src = k8 + (n * 8 + g) * kStr + (lane & 3) * (D / 4);
        if constexpr ((D / 16) % 4 == 0) {
#pragma unroll
          for (int i = 0; i < D / 64; ++i) {
            const uint4 u = *reinterpret_cast<const uint4*>(src + 16 * i);
            kw[n][4 * i] = u.x, kw[n][4 * i + 1] = u.y, kw[n][4 * i + 2] = u.z;
            kw[n][4 * i + 3] = u.w;
          }
        } else {
#pragma unroll
          for (int i = 0; i < D / 32; ++i) {
            const uint2 u = *reinterpret_cast<const uint2*>(src + 8 * i);
            kw[n][2 * i] = u.x, kw[n][2 * i + 1] = u.y;
          }
        }
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t ah[4];
        Ldm4(ah, qh + ((lm & 1) * 8 + lr) * kStrC + ks * 16 + (lm >> 1) * 8);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          Mma16<TM>(ks % 2 ? s2[n] : s[n], ah, Fp8x2ToHalf2(kw[n][ks]),
                    Fp8x2ToHalf2(kw[n][ks] >> 16));
        }
      }
    } else if constexpr (C::kF32) {
      // fp32 (tf32 m16n8k8, K as B: b0 = K[key g][8ks + t], b1 = [8ks + t + 4]): one ldmatrix
      // x4 (fp32 words as pairs of b16) brings an 8-key tile's fragments for k-steps 2kp and
      // 2kp + 1. K splits into tf32 hi + lo in two MMA chains (s: hi, s2: lo); the A rows g + 8
      // carry Q's low parts, so the four products hi·hi, hi·lo, lo·hi, lo·lo all land.
#pragma unroll
      for (int kp = 0; kp < D / 16; ++kp) {
        uint32_t kf[kNt][4];
#pragma unroll
        for (int n = 0; n < kNt; ++n) Ldm4(kf[n], kb + (n * 8 + lr) * kStrC + kp * 16 + lm * 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 q = qf[(2 * kp + h) * 32 + lane];
          const uint32_t aq[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int n = 0; n < kNt; ++n) {
            uint32_t hi[2], lo[2];
            SplitTf32(kf[n][2 * h], hi[0], lo[0]);
            SplitTf32(kf[n][2 * h + 1], hi[1], lo[1]);
            MmaTf32(s[n], aq, hi[0], hi[1]);
            MmaTf32(s2[n], aq, lo[0], lo[1]);
          }
        }
      }
    } else {
      // D <= 128: every K fragment of the tile is loaded before the first MMA, so the ldmatrix
      // latencies overlap instead of each MMA waiting on its own (larger D: one at a time).
      constexpr int kPre = D <= 128 ? D / 16 : 1;
      uint32_t kf[kPre][kNt / 2][4];
      if constexpr (kPre > 1) {
#pragma unroll
        for (int ks = 0; ks < kPre; ++ks)
#pragma unroll
          for (int j = 0; j < kNt / 2; ++j)
            Ldm4(kf[ks][j], kb + (j * 16 + (lm >> 1) * 8 + lr) * kStrC + ks * 16 + (lm & 1) * 8);
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t ah[4], al[4];
        const int qr = rg * 16 + (lm & 1) * 8 + lr, qc = ks * 16 + (lm >> 1) * 8;
        Ldm4(ah, qh + qr * kStrC + qc);
        if constexpr (kSplit) Ldm4(al, ql + qr * kStrC + qc);
#pragma unroll
        for (int j = 0; j < kNt / 2; ++j) {
          uint32_t bb[4];
          if constexpr (kPre == 1)
            Ldm4(bb, kb + (j * 16 + (lm >> 1) * 8 + lr) * kStrC + ks * 16 + (lm & 1) * 8);
          const uint32_t(&b)[4] = kPre > 1 ? kf[ks % kPre][j] : bb;
          if constexpr (kPack) {
            Mma16<TM>(ks % 2 ? s2[2 * j] : s[2 * j], ah, b[0], b[1]);
            Mma16<TM>(ks % 2 ? s2[2 * j + 1] : s[2 * j + 1], ah, b[2], b[3]);
          } else {
            Mma16<TM>(s[2 * j], ah, b[0], b[1]);
            Mma16<TM>(s[2 * j + 1], ah, b[2], b[3]);
          }
          if constexpr (kSplit) {
            Mma16<TM>(s[2 * j], al, b[0], b[1]);
            Mma16<TM>(s[2 * j + 1], al, b[2], b[3]);
          }
        }
      }
    }
    if constexpr (kPack) {  // row g's score = its high part (row g) + its low part (row g + 8)
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
        s[n][0] += s[n][2] + s2[n][0] + s2[n][2];
        s[n][1] += s[n][3] + s2[n][1] + s2[n][3];
      }
    }
    if constexpr (C::kF8) {  // q · k_e4m3 times the key's scale (padding rows: scale 0)
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
        s[n][0] *= kscale_t[n * 8 + c2];
        s[n][1] *= kscale_t[n * 8 + c2 + 1];
      }
    }
    // Mask (position, window, range, padding rows), scale into the log2 domain, row max. A
    // dense tile every row of the block fully sees skips the per-key tests.
    const int64_t e0 = int64_t(k0) + int64_t(t) * step;  // this warp's first entry
    const bool full = !sparse && e0 + kKw <= k1 && a.k_pos0 + e0 + kKw - 1 <= qmin &&
                      (a.window <= 0 || a.k_pos0 + e0 > qmax - a.window);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kNt; ++n) {
#pragma unroll
      for (int e = 0; e < 2 * kRowsPerThread; ++e) {
        const bool rb = e >= 2;
        bool ok = rb ? valid_b : valid_a;
        if (!full) {
          const int local = kidx0 + n * 8 + c2 + (e & 1);
          const int64_t entry = e0 + n * 8 + c2 + (e & 1);
          const int64_t kpos = a.k_pos0 + (sparse ? kidx[buf][local < kBk ? local : 0] : entry);
          const int64_t qp = rb ? qp_b : qp_a;
          ok = ok && entry < k1 && kpos <= qp && (a.window <= 0 || kpos > qp - a.window);
        }
        s[n][e] = ok ? s[n][e] * sl2 : -INFINITY;
        mx[rb] = fmaxf(mx[rb], s[n][e]);
      }
    }
    float alpha[2] = {1.f, 1.f};
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      const float m_new = fmaxf(m_run[i], mx[i]);
      alpha[i] = m_new == -INFINITY ? 1.f : exp2f(m_run[i] - m_new);
      m_run[i] = m_new;
      l_run[i] *= alpha[i];
    }
#pragma unroll
    for (int n = 0; n < kNt; ++n) {
#pragma unroll
      for (int e = 0; e < 2 * kRowsPerThread; ++e) {
        const int i = e >> 1;
        const float p = m_run[i] == -INFINITY ? 0.f : exp2f(s[n][e] - m_run[i]);
        s[n][e] = p;
        l_run[i] += p;
        if constexpr (C::kF8) s[n][e] = p * (vscale_t[n * 8 + c2 + (e & 1)] * v_inv);
      }
    }
    // Once the running maxima settle the factors are 1: skip the rescale (warp-uniform test).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[kRowsPerThread - 1];
        o[n][3] *= alpha[kRowsPerThread - 1];
      }
    }
    if constexpr (C::kF8) {  // o += P·V, 16 keys (MmaFp8V)
      uint32_t ph[4];
      PackRowsHiLo<TM>(ph, s[0][0], s[0][1], s[1][0], s[1][1]);
      const uint8_t* v8 = reinterpret_cast<const uint8_t*>(tile_v(buf)) + c2 * kStr + 4 * g;
#pragma unroll
      for (int q = 0; q < D / 32; ++q) {
        MmaFp8V<TM>(o, q, ph, *reinterpret_cast<const uint32_t*>(v8 + 32 * q),
                    *reinterpret_cast<const uint32_t*>(v8 + kStr + 32 * q),
                    *reinterpret_cast<const uint32_t*>(v8 + 8 * kStr + 32 * q),
                    *reinterpret_cast<const uint32_t*>(v8 + 9 * kStr + 32 * q));
      }
    } else if constexpr (C::kF32) {
      // o += P·V on tf32 m16n8k8, 8 keys a k-step. The MMA's key order is permuted so every
      // operand is local: its key t is tile key 2t, key t + 4 is 2t + 1 — so A (P: row g's hi
      // part, row g + 8's lo part) is this thread's s[n][0], s[n][1] as they are, and B (V) is
      // rows 2t and 2t + 1. Output columns are permuted too: d tile 4q + b's column g is
      // d = 32q + 4g + b, so one 16-byte load of each V row feeds four d tiles, and its
      // accumulator holds d = 32q + 8t + b (c0) and 32q + 8t + 4 + b (c1).
      const int t4 = lane & 3;
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
        uint32_t ap[4];
        SplitTf32(__float_as_uint(s[n][0]), ap[0], ap[1]);
        SplitTf32(__float_as_uint(s[n][1]), ap[2], ap[3]);
        const TC* vr = vb + (n * 8 + 2 * t4) * kStrC + 4 * g;
#pragma unroll
        for (int q = 0; q < D / 32; ++q) {
          const float4 x = *reinterpret_cast<const float4*>(vr + 32 * q);
          const float4 y = *reinterpret_cast<const float4*>(vr + kStrC + 32 * q);
          const float xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            uint32_t hi[2], lo[2];
            SplitTf32(__float_as_uint(xs[b]), hi[0], lo[0]);
            SplitTf32(__float_as_uint(ys[b]), hi[1], lo[1]);
            MmaTf32(o[4 * q + b], ap, hi[0], hi[1]);
            MmaTf32(o[4 * q + b], ap, lo[0], lo[1]);
          }
        }
      }
    } else {
      // o += P·V, 16 keys at a time.
#pragma unroll
      for (int kk = 0; kk < kKw / 16; ++kk) {
        const uint32_t hi[4] = {Pack16<TM>(s[2 * kk][0], s[2 * kk][1]),
                                Pack16<TM>(s[2 * kk][2], s[2 * kk][3]),
                                Pack16<TM>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                Pack16<TM>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        uint32_t ph[4] = {hi[0], hi[1], hi[2], hi[3]};
        if constexpr (kPack) {  // P's rows g + 8: the low parts of rows g
          ph[1] = PackLo16<TM>(s[2 * kk][0], s[2 * kk][1], hi[0]);
          ph[3] = PackLo16<TM>(s[2 * kk + 1][0], s[2 * kk + 1][1], hi[2]);
        }
        uint32_t pl[4];
        if constexpr (kSplit) {
          pl[0] = PackLo16<TM>(s[2 * kk][0], s[2 * kk][1], hi[0]);
          pl[1] = PackLo16<TM>(s[2 * kk][2], s[2 * kk][3], hi[1]);
          pl[2] = PackLo16<TM>(s[2 * kk + 1][0], s[2 * kk + 1][1], hi[2]);
          pl[3] = PackLo16<TM>(s[2 * kk + 1][2], s[2 * kk + 1][3], hi[3]);
        }
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t b[4];
          Ldm4T(b, vb + (kk * 16 + (lm & 1) * 8 + lr) * kStrC + dn * 16 + (lm >> 1) * 8);
          Mma16<TM>(o[2 * dn], ph, b[0], b[1]);
          Mma16<TM>(o[2 * dn + 1], ph, b[2], b[3]);
          if constexpr (kSplit) {
            Mma16<TM>(o[2 * dn], pl, b[0], b[1]);
            Mma16<TM>(o[2 * dn + 1], pl, b[2], b[3]);
          }
        }
      }
    }
    if constexpr (kIndep) {  // the buffer is refilled next iteration: all lanes are done with it
      __syncwarp();
    } else {
      __syncthreads();
    }
  }
  LaunchDependents();     // a combine launched after this one may start its blocks
  if constexpr (kPack) {  // rows g + 8 accumulated P's low parts times V: add them to rows g
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] += o[n][2];
      o[n][1] += o[n][3];
      if constexpr (C::kF8) {  // back from units of v_unit (a power of two: exact)
        o[n][0] *= v_unit;
        o[n][1] *= v_unit;
      }
    }
  }
  // Row sums over the quad.
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  const size_t part = a.part0 + blockIdx.y;
  if constexpr (WR == 4) {
    // Each warp owns its rows: write the partials directly (m back to natural log units).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = i == 0 ? row_a : row_b;
      if (rowid[row] < 0) continue;
      const size_t pr = part * a.nrows + size_t(rowid[row]);
      if ((lane & 3) == 0) {
        a.part_m[pr] = m_run[i] == -INFINITY ? -INFINITY : m_run[i] * kLn2;
        a.part_l[pr] = l_run[i];
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<float2*>(a.part_o + pr * D + n * 8 + c2) =
            make_float2(o[n][2 * i], o[n][2 * i + 1]);
      }
    }
  } else {
    // Four warps hold states of the same 16 rows over different keys: merge in shared memory
    // (the tile rings, once every warp is done streaming).
    __syncthreads();
    float* ms = reinterpret_cast<float*>(smem + C::kQ);  // [4][16]
    float* ls = ms + 64;                                 // [4][16]
    float* os = ls + 64;                                 // [4][16][D]
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = g + 8 * i;
      if ((lane & 3) == 0) {
        ms[warp * 16 + row] = m_run[i];
        ls[warp * 16 + row] = l_run[i];
      }
      StoreWarpRow<D, 16, C::kOs, C::kF32 || C::kF8>(os, warp, row, c2, i, o);
    }
    float* fs = os + 4 * 16 * C::kOs;  // [16][4]
    MergeWarpsIntoPartial<D, 16, C::kOs, 16, kPack ? 8 : 16>(a, part, rowid, ms, ls, fs, os);
  }
  FinishSplits(a, rowid, C::kRows);
}

// The kernel's opt-in to its dynamic shared memory, once.
template <typename T, int D, int WR, bool kSplit, bool kPack>
cudaError_t OptIn() {
  static const cudaError_t attr = cudaFuncSetAttribute(
      FlashKernel<T, D, WR, kSplit, kPack>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(Flash<T, D, WR, kSplit, kPack>::kBytes));
  return attr;
}

// Its resident 128-thread blocks per multiprocessor, as the occupancy calculator counts them
// (registers, static and dynamic shared memory, the driver's reserve per block), once.
template <typename T, int D, int WR, bool kSplit, bool kPack>
int BlocksPerSm() {
  static const int n = [] {
    int blocks = 0;
    if (OptIn<T, D, WR, kSplit, kPack>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, FlashKernel<T, D, WR, kSplit, kPack>, 128,
            Flash<T, D, WR, kSplit, kPack>::kBytes) != cudaSuccess) {
      return 1;
    }
    return std::max(blocks, 1);
  }();
  return n;
}

template <typename T, int D, int WR, bool kSplit, bool kPack>
Status Launch(const AttendArgs& a, cudaStream_t stream) {
  using C = Flash<T, D, WR, kSplit, kPack>;
  auto* kernel = FlashKernel<T, D, WR, kSplit, kPack>;
  const cudaError_t attr = OptIn<T, D, WR, kSplit, kPack>();
  if (attr != cudaSuccess) return gpu::CudaError(attr, "tensor-core kernel shared memory");
  dim3 grid((a.n_items + WR - 1) / WR, a.splits);
  return LaunchDependent(kernel, grid, dim3(128), C::kBytes, stream, "tensor-core attention kernel",
                         a);
}

// Per head dim: f(integral_constant<int, D>) for the supported D (fp32: up to 128).
template <typename T, typename F>
auto WithD(uint32_t d, F&& f) {
  using I = std::integral_constant<int, 0>;
  switch (d) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 96:
      return f(std::integral_constant<int, 96>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
  }
  if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
    switch (d) {
      case 160:
        return f(std::integral_constant<int, 160>{});
      case 192:
        return f(std::integral_constant<int, 192>{});
      case 256:
        return f(std::integral_constant<int, 256>{});
    }
  }
  return f(I{});  // no kernel: the caller's D = 0 case
}

template <typename T, int WR, bool kSplit, bool kPack>
size_t BytesD(uint32_t d) {
  return WithD<T>(d, [](auto D) -> size_t {
    if constexpr (decltype(D)::value == 0) {
      return 0;
    } else {
      return Flash<T, decltype(D)::value, WR, kSplit, kPack>::kBytes;
    }
  });
}

template <typename T, int WR, bool kSplit, bool kPack>
int BlocksPerSmD(uint32_t d) {
  return WithD<T>(d, [](auto D) -> int {
    if constexpr (decltype(D)::value == 0) {
      return 1;
    } else {
      return BlocksPerSm<T, decltype(D)::value, WR, kSplit, kPack>();
    }
  });
}

template <typename T, int WR, bool kSplit, bool kPack>
Status LaunchD(const AttendArgs& a, cudaStream_t stream) {
  return WithD<T>(a.d, [&](auto D) -> Status {
    if constexpr (decltype(D)::value == 0) {
      return Status(ErrorKind::kErr, "no tensor-core kernel for head dim " + std::to_string(a.d));
    } else {
      return Launch<T, decltype(D)::value, WR, kSplit, kPack>(a, stream);
    }
  });
}

// The three kernel shapes: batched (fp16 Q and P), decode with hi/lo parts in separate MMAs,
// and decode with the low parts packed as rows 8..15 (items of at most 8 rows: half the MMAs).
enum class Shape { kBatched, kDecode, kDecodePacked };
Shape ShapeOf(const AttendArgs& a) {
  if (FlashRowGroups(a) >= 4) return Shape::kBatched;
  return a.item_rows <= kItemRows / 2 ? Shape::kDecodePacked : Shape::kDecode;
}

}  // namespace

Status EncodeTensorMap(TensorMapBytes* map, TensorElem elem, uint32_t rank, const void* base,
                       const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                       TensorSwizzle swizzle) {
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return Status(ErrorKind::kErr, "cuTensorMapEncodeTiled unavailable");
  if (rank == 0 || rank > 3) return Status(ErrorKind::kErr, "tensor maps of rank 1 to 3 only");
  static_assert(sizeof(CUtensorMap) == sizeof(TensorMapBytes), "tensor map size");
  // A map is a pure function of these arguments, and a query launches over the same slot's K
  // and V again and again: this thread's last few maps are reused instead of encoded per launch.
  struct Key {
    const void* base = nullptr;
    TensorElem elem = TensorElem::kU8;
    TensorSwizzle swizzle = TensorSwizzle::kNone;
    uint32_t rank = 0;
    uint64_t dims[3] = {}, strides[2] = {};
    uint32_t box[3] = {};
    bool operator==(const Key& o) const {
      return base == o.base && elem == o.elem && swizzle == o.swizzle && rank == o.rank &&
             std::equal(dims, dims + 3, o.dims) && std::equal(strides, strides + 2, o.strides) &&
             std::equal(box, box + 3, o.box);
    }
  };
  struct Entry {
    Key key{};
    TensorMapBytes map;
    bool used = false;
  };
  thread_local Entry recent[16];
  thread_local unsigned next = 0;
  Key key;
  key.base = base;
  key.elem = elem;
  key.swizzle = swizzle;
  key.rank = rank;
  std::copy(dims, dims + rank, key.dims);
  std::copy(strides, strides + rank - 1, key.strides);
  std::copy(box, box + rank, key.box);
  for (const Entry& e : recent) {
    if (e.used && e.key == key) {
      *map = e.map;
      return Status::Ok();
    }
  }
  const CUtensorMapDataType types[] = {CU_TENSOR_MAP_DATA_TYPE_UINT8,
                                       CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                       CU_TENSOR_MAP_DATA_TYPE_FLOAT32};
  const CUtensorMapSwizzle swizzles[] = {CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
                                         CU_TENSOR_MAP_SWIZZLE_128B};
  cuuint64_t d[3], st[2];
  cuuint32_t bx[3], steps[3] = {1, 1, 1};
  for (uint32_t i = 0; i < rank; ++i) d[i] = dims[i], bx[i] = box[i];
  for (uint32_t i = 0; i + 1 < rank; ++i) st[i] = strides[i];
  const CUresult r = encode(reinterpret_cast<CUtensorMap*>(map->b), types[static_cast<int>(elem)],
                            rank, const_cast<void*>(base), d, st, bx, steps,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzles[static_cast<int>(swizzle)],
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status(ErrorKind::kErr, "cuTensorMapEncodeTiled failed: " + std::to_string(int(r)));
  }
  recent[next] = Entry{key, *map, true};
  next = (next + 1) % 16;
  return Status::Ok();
}

Status EncodeRows(TensorMapBytes* map, const void* base, uint32_t elem, uint32_t heads,
                  uint32_t rows, uint32_t d, uint32_t box_cols, uint32_t box_rows) {
  const uint64_t dims[2] = {d, uint64_t{heads} * rows};
  const uint64_t strides[1] = {uint64_t{d} * elem};
  const uint32_t box[2] = {box_cols, box_rows};
  return EncodeTensorMap(map, elem == 4 ? TensorElem::kF32 : TensorElem::kF16, 2, base, dims,
                         strides, box, TensorSwizzle::kNone);
}

namespace {
std::atomic<bool> lowp_batched{true};
}  // namespace

void SetLowpBatched(bool on) { lowp_batched.store(on, std::memory_order_relaxed); }
bool LowpBatched() { return lowp_batched.load(std::memory_order_relaxed); }

int FlashRowGroups(const AttendArgs& a) {
  // Batched when a K/V head has at least 64 query rows: four row groups per block, or eight
  // (two per warp, flash_batched.cu) for d <= 128 from where they measured faster on the H200
  // (GQA 32/8: d = 128 from 128 rows, M = 32 N = 32K 124 -> 111 us, M = 512 1736 -> 1369; smaller
  // d from 512 rows — at 128 and 256 rows d = 64 was 3-11 % slower). Sparse lists (one row per
  // item) and decode use one.
  if (a.list != nullptr || !a.dense_items) return 1;
  const uint64_t rows = uint64_t{a.heads > 0 ? a.hq / a.heads : 1} * a.m;
  // bf16 and fp8 have the eight-group kernel only (d <= 128; 4 says "batched, not on tensor
  // cores"), from 64 rows, where LowpBatched(): H200, GQA 32/8, d = 128, N = 32K, µs — M = 512
  // bf16 24705 -> 1587, fp8 14606 -> 1696 (torch flash 940, fp16 here 1357); M = 16 bf16 115,
  // fp8 124 (torch 130).
  if (a.dtype == DType::kBF16 || a.dtype == DType::kFP8) {
    return rows >= 64 ? (a.d <= 128 && LowpBatched() ? 8 : 4) : 1;
  }
  if (a.d <= 128 && rows >= (a.d == 128 ? 128u : 512u)) return 8;
  return rows >= 64 ? 4 : 1;
}

bool UsesTensorCores(const AttendArgs& a) {
  // Dense items, with or without one shared list per item (SHARED sparse-auto). Per-row lists
  // (one row per item) measured faster on the SIMT kernel: they stay there.
  if (!a.dense_items || gpu::Info().cc_major < 8) return false;
  if (a.dtype == DType::kF16) return a.d <= 256;
  // bf16: the fp16 decode shapes on bf16 MMAs (Q and P as bf16 hi + lo parts: 16 significand
  // bits, within fp32's tolerance), and from 64 rows a K/V head (d <= 128) where LowpBatched()
  // the eight-group batched kernel (flash_batched.cu: Q hi + lo, P as bf16 — flash-attention
  // precision).
  if (a.dtype == DType::kBF16) {
    const int groups = FlashRowGroups(a);
    return a.d <= 256 && a.bf16_tensor && (groups == 1 || groups == 8);
  }
  // fp8: the packed decode (fp16 MMAs over e4m3 tiles widened in registers) for dense
  // ranges and at most 8 query rows a K/V head, d = 32..128, and where LowpBatched() the
  // eight-group batched kernel (tiles widened in shared memory) from 64 rows, d <= 128
  // (AttendArgs::fp8_tensor); the rest of fp8 on the SIMT kernel.
  if (a.dtype == DType::kFP8) {
    const uint64_t rows = uint64_t{a.heads > 0 ? a.hq / a.heads : 1} * a.m;
    if (!a.fp8_tensor || a.list != nullptr) return false;
    if (FlashRowGroups(a) == 8) return true;
    return a.d % 32 == 0 && a.d <= 128 && rows <= 8 && a.item_rows <= kItemRows / 2;
  }
  // fp32: the packed decode on tf32 with hi/lo splits, for 4 to 8 query rows per K/V head
  // (GQA groups of 4 or 8 at M = 1, or a group of 4 at M = 2; item_rows is MaxRows once the
  // items exist — before, the padding is 1 either way) and d = 64, 96, 128, where the device
  // lets a block have its shared memory (210 KB at d = 128: sm_90, not sm_80). Measured on the
  // H200 against the SIMT kernel (pion-gpu-attn-bench dense f32 with PION_BENCH_F32TC=0, µs):
  // 32/8 d = 128 2K 11.6 vs 11.7, 8K 26.1 vs 30.0, 32K 76.4 vs 86.0, 128K 273 vs 309; 64/8 2K
  // 11.9 vs 15.6; 32/4 10.4 vs 12.8; M = 2 12.3 vs 15.8; d = 64 32K 43.2 vs 50.9. Fewer rows
  // stay on SIMT, which is faster there (8/8 2K 10.2 vs 11.4, 16/8 2K 10.6 vs 11.5, 128K even),
  // and so does d = 32 (32K 29.0 vs 31.6).
  if (a.dtype != DType::kF32 || !a.f32_tensor || a.d < 64 || a.d > 128 || a.d % 32 != 0) {
    return false;
  }
  const uint64_t rows = uint64_t{a.heads > 0 ? a.hq / a.heads : 1} * a.m;
  return FlashRowGroups(a) == 1 && rows >= 4 && a.item_rows <= kItemRows / 2 &&
         BytesD<float, 1, false, true>(a.d) + 4096 <= gpu::Info().smem_block_optin;
}

int FlashBlocksPerSm(const AttendArgs& a) {
  if (a.dtype != DType::kF32 && FlashRowGroups(a) == 8) return BatchedBlocksPerSm(a);
  if (a.dtype == DType::kF32) return BlocksPerSmD<float, 1, false, true>(a.d);
  if (a.dtype == DType::kFP8) return BlocksPerSmD<__nv_fp8_e4m3, 1, false, true>(a.d);
  if (a.dtype == DType::kBF16) {
    return ShapeOf(a) == Shape::kDecodePacked ? BlocksPerSmD<__nv_bfloat16, 1, false, true>(a.d)
                                              : BlocksPerSmD<__nv_bfloat16, 1, true, false>(a.d);
  }
  switch (ShapeOf(a)) {
    case Shape::kBatched:
      return BlocksPerSmD<__half, 4, false, false>(a.d);
    case Shape::kDecodePacked:
      return BlocksPerSmD<__half, 1, false, true>(a.d);
    case Shape::kDecode:
      break;
  }
  return BlocksPerSmD<__half, 1, true, false>(a.d);
}

Status LaunchFlash(const AttendArgs& a_in, cudaStream_t stream) {
  if (StreamDecodeFits(a_in)) return LaunchStreamDecode(a_in, stream);
  AttendArgs a = a_in;
  // Decode (one row group a block, dense): the tensor maps for its tile copies, boxes of 16 rows
  // × one padded tile row (Flash::kStr: d + 16 bytes' worth); per-piece copies where the device
  // or driver cannot, and for fp16 splits of 2048 keys or more. Measured on the H200 (GQA 32/8,
  // d = 128, µs, cp.async → tensor copies): fp16 2K 7.88 → 7.24, 8K 13.55 → 12.71, 32K (993 keys
  // a split) 40.98 → 40.69, but 128K (3972) 134.98 → 136.7; fp32 2K 11.75 → 11.31, 32K 76.9 →
  // 74.0, 128K 275.2 → 269.2.
  const uint32_t per_split = (a.end - a.begin) / (a.splits > 0 ? a.splits : 1);
  if (a.tensor_tiles && a.dtype != DType::kFP8 && (a.dtype == DType::kF32 || per_split < 2048)) {
    const uint32_t elem = a.dtype == DType::kF32 ? 4 : 2;
    a.tensor_tiles =
        gpu::Info().cc_major >= 9 && a.list == nullptr && FlashRowGroups(a) == 1 &&
        EncodeRows(&a.map_k, a.k, elem, a.heads, a.rows, a.d, a.d + 16 / elem, 16).ok() &&
        EncodeRows(&a.map_v, a.v, elem, a.heads, a.rows, a.d, a.d + 16 / elem, 16).ok();
  } else {
    a.tensor_tiles = false;
  }
  if (a.dtype == DType::kF32) return LaunchD<float, 1, false, true>(a, stream);
  // Eight row groups a block (fp16, bf16, fp8): flash_batched.cu.
  if (FlashRowGroups(a) == 8) return LaunchBatched(a, stream);
  if (a.dtype == DType::kFP8) {
    if (a.k_scale == nullptr || a.v_scale == nullptr) {
      return Status(ErrorKind::kErr, "fp8 attention needs the K and V row scales");
    }
    return LaunchD<__nv_fp8_e4m3, 1, false, true>(a, stream);
  }
  if (a.dtype == DType::kBF16) {
    if (FlashRowGroups(a) != 1) {
      return Status(ErrorKind::kErr,
                    "no bf16 tensor-core kernel for head dim " + std::to_string(a.d));
    }
    return ShapeOf(a) == Shape::kDecodePacked ? LaunchD<__nv_bfloat16, 1, false, true>(a, stream)
                                              : LaunchD<__nv_bfloat16, 1, true, false>(a, stream);
  }
  switch (ShapeOf(a)) {
    case Shape::kBatched:
      return LaunchD<__half, 4, false, false>(a, stream);
    case Shape::kDecodePacked:
      return LaunchD<__half, 1, false, true>(a, stream);
    case Shape::kDecode:
      break;
  }
  return LaunchD<__half, 1, true, false>(a, stream);
}

}  // namespace pion::kernels::cuda
