// The SIMT attention kernel (every dtype, D, dense or sparse item) and the split combine.
//
// One thread block (128 threads) owns one item — up to kItemRows query rows of one K/V head —
// and one split of its keys. Keys stream through shared memory in tiles, three buffers with
// cp.async so the next tile's loads are in flight while this one is computed:
//   scores   thread per (row, key): the whole dot over D from shared memory (K rows padded by
//            16 bytes so a warp's rows hit distinct banks; q broadcast) — or, with many rows,
//            per 2 rows × 2 keys, each q and K vector read once for two products
//   softmax  warp per row: tile max, rescale factor, p = exp(s − m), running l
//   p·V      thread per 4 consecutive outputs of a row (of two rows, one V load for both, when
//            D is a multiple of 64), o kept in registers across tiles
// and the block writes its rows' (m, l, o) partials; LaunchCombine merges the splits.
// fp8 (e4m3fn) tiles stay e4m3 in shared memory, with their rows' scales beside them (copied
// with the rows): a score is (q · k_e4m3) · scale_k · softmax scale, and p·V takes p · scale_v,
// so the e4m3 → fp32 conversion (through fp16, exact: cvt.f16x2.e4m3x2 on sm_89+) is the only
// extra work per element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gpu.h"

namespace pion::kernels::cuda {

namespace {

// kLong (SimtLong: fp32 over long dense ranges, per-row lists over 2-byte K/V): tiles of ~14 KB,
// two stages — the block fits three to a multiprocessor, where the rest do better with three
// stages of ~16 KB tiles.
template <typename T>
inline constexpr bool kIsFp8 = std::is_same_v<T, __nv_fp8_e4m3>;

template <typename T, int D, bool kLong = false>
struct Simt {
  static constexpr int kThreads = 128;
  static constexpr int kTk =
      std::clamp<int>((kLong ? 14336 : 16384) / (D * int(sizeof(T))), 8, 64);  // keys/tile
  static constexpr int kStride = D + 16 / int(sizeof(T));  // smem row, padded by 16 bytes
  static constexpr int kVecs = D * int(sizeof(T)) / 16;    // 16-byte vectors per row
  static constexpr int kMaxO = (kItemRows * D / 4 + kThreads - 1) / kThreads;
  // Each thread's float4 outputs pair up (o[2i], o[2i+1]: one column of rows r and
  // r + kItemRows/2, so one V load feeds both) when they split evenly: D a multiple of 64.
  static constexpr bool kPaired =
      kMaxO % 2 == 0 && (kItemRows / 2) * (D / 4) == (kMaxO / 2) * kThreads;

  // Shared memory layout (bytes).
  static constexpr size_t kQ = size_t{kItemRows} * D * 4;
  static constexpr size_t kTile = size_t{kTk} * kStride * sizeof(T);
  static constexpr size_t kS = size_t{kItemRows} * kTk * 4;
  static constexpr int kStages = kLong ? 2 : 3;  // tiles in flight while one is computed
  // fp8: the K and V row scales of every staged tile, [2][kStages][kTk] floats after the rest.
  static constexpr size_t kScales = kIsFp8<T> ? size_t{2} * kStages * kTk * 4 : 0;
  static constexpr size_t kBytes =
      kQ + 2 * kStages * kTile + kS + kStages * kTk * 4 + 3 * kItemRows * 4 + kScales;
};

__device__ inline void Load8(const float* p, float (&x)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ inline void Load8(const __half* p, float (&x)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}
// bf16: widened with a shift, exact (the element is the high half of its fp32).
__device__ inline float Widen(uint32_t pair, int hi) {
  return __uint_as_float(hi ? (pair & 0xffff0000u) : (pair << 16));
}
__device__ inline void Load8(const __nv_bfloat16* p, float (&x)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) x[2 * i] = Widen(w[i], 0), x[2 * i + 1] = Widen(w[i], 1);
}
// e4m3fn pairs → fp32 through fp16 (every e4m3 value is an fp16 value: exact).
__device__ inline float2 Fp8x2ToFloat2(uint32_t pair16) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair16 & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
}
__device__ inline void Load8(const __nv_fp8_e4m3* p, float (&x)[8]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const uint32_t w[2] = {u.x, u.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 a = Fp8x2ToFloat2(w[i]), b = Fp8x2ToFloat2(w[i] >> 16);
    x[4 * i] = a.x, x[4 * i + 1] = a.y, x[4 * i + 2] = b.x, x[4 * i + 3] = b.y;
  }
}
__device__ inline float4 Load4(const __nv_fp8_e4m3* p) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
  const float2 a = Fp8x2ToFloat2(u), b = Fp8x2ToFloat2(u >> 16);
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ inline float4 Load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ inline float4 Load4(const __half* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ inline float4 Load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(Widen(u.x, 0), Widen(u.x, 1), Widen(u.y, 0), Widen(u.y, 1));
}

// The output o[s] of thread tid holds: row *r (valid when < the item's rows) and float4 column
// *c. Paired layout (C::kPaired): o[2i] and o[2i+1] are one column of rows r and r + kItemRows/2.
template <typename C, int D>
__device__ inline void OutputOf(int tid, int s, int* r, int* c) {
  if constexpr (C::kPaired) {
    const int t = tid + (s / 2) * C::kThreads;
    *r = t / (D / 4) + (s % 2) * (kItemRows / 2);
    *c = t % (D / 4);
  } else {
    const int e = tid + s * C::kThreads;
    *r = e / (D / 4);
    *c = e % (D / 4);
  }
}

// Eight products of q[d..d+8) and x[0..8) into two accumulators (even and odd d): the FMA order
// of every score, tiled or not, so that both give the same bits.
__device__ inline void Fma8(float& e, float& o, const float* q, const float (&x)[8]) {
  const float4 q0 = *reinterpret_cast<const float4*>(q);
  const float4 q1 = *reinterpret_cast<const float4*>(q + 4);
  e = fmaf(q0.x, x[0], e);
  o = fmaf(q0.y, x[1], o);
  e = fmaf(q0.z, x[2], e);
  o = fmaf(q0.w, x[3], o);
  e = fmaf(q1.x, x[4], e);
  o = fmaf(q1.y, x[5], o);
  e = fmaf(q1.z, x[6], e);
  o = fmaf(q1.w, x[7], o);
}

// The dot products of query rows qa, qb with key rows ka, kb: out = {qa·ka, qa·kb, qb·ka, qb·kb},
// each K and q vector read from shared memory once for two products.
template <typename T, int D>
__device__ inline void Dots2x2(const float* qa, const float* qb, const T* ka, const T* kb,
                               float (&out)[4]) {
  float e[4] = {0.f, 0.f, 0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int d = 0; d < D; d += 8) {
    float x[8], y[8];
    Load8(ka + d, x);
    Load8(kb + d, y);
    Fma8(e[0], o[0], qa + d, x);
    Fma8(e[1], o[1], qa + d, y);
    Fma8(e[2], o[2], qb + d, x);
    Fma8(e[3], o[3], qb + d, y);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = e[i] + o[i];
}

template <typename T, int D, bool kLong>
__global__ void __launch_bounds__(128) AttendSimt(AttendArgs a) {
  using C = Simt<T, D, kLong>;
  extern __shared__ __align__(16) uint8_t smem[];
  float* qs = reinterpret_cast<float*>(smem);
  T* ks = reinterpret_cast<T*>(smem + C::kQ);  // [2][kTk][kStride]
  constexpr int kSt = C::kStages;
  T* vs = reinterpret_cast<T*>(smem + C::kQ + kSt * C::kTile);              // [kSt][kTk][kStride]
  float* ss = reinterpret_cast<float*>(smem + C::kQ + 2 * kSt * C::kTile);  // [kItemRows][kTk]
  int32_t* kidx =
      reinterpret_cast<int32_t*>(smem + C::kQ + 2 * kSt * C::kTile + C::kS);  // [kSt][kTk]
  float* rm = reinterpret_cast<float*>(kidx + kSt * C::kTk);
  float* rl = rm + kItemRows;
  float* ralpha = rl + kItemRows;
  float* ksc = ralpha + kItemRows;  // fp8: [kSt][kTk] K row scales, then V's
  float* vsc = ksc + kSt * C::kTk;
  __shared__ int64_t qpos[kItemRows];
  __shared__ int32_t rowid[kItemRows];
  __shared__ uint32_t range[2];

  WaitForPrimary();  // what the kernel before it in the stream wrote (e.g. selection lists)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t split = blockIdx.y;
  const bool sparse = a.list != nullptr;
  // Uniform dense items (AttendArgs::uniform_group): rows and positions from the arguments, so
  // the first tiles are requested without waiting for the item.
  const int ug = sparse ? 0 : static_cast<int>(a.uniform_group);
  const Item& item = a.items[blockIdx.x];
  const int nr = ug > 0 ? ug : item.n;
  const int32_t kv = ug > 0 ? static_cast<int32_t>(blockIdx.x) : item.kv;
  if (tid < nr) {
    const int32_t r = ug > 0 ? kv * ug + tid : item.rows[tid];
    rowid[tid] = r;
    qpos[tid] = a.q_pos0 + static_cast<int64_t>(r % a.m);
    rm[tid] = -INFINITY;
    rl[tid] = 0.f;
  }
  __syncthreads();
  for (int e = tid; e < nr * D / 4; e += C::kThreads) {
    const int r = e / (D / 4), c = e % (D / 4);
    reinterpret_cast<float4*>(qs)[r * (D / 4) + c] =
        reinterpret_cast<const float4*>(a.q + static_cast<size_t>(rowid[r]) * D)[c];
  }
  // This block's keys: [k0, k1) of the dense range, or entries [k0, k1) of the row's list.
  if (tid == 0) {
    uint32_t lo, hi;
    if (sparse) {
      lo = 0;
      hi = static_cast<uint32_t>(a.counts[rowid[0]]);
    } else {
      int64_t vlo = INT64_MAX, vhi = INT64_MIN;
      for (int r = 0; r < nr; ++r) {
        const int64_t p = qpos[r];
        const int64_t first = a.window > 0 ? p - a.window + 1 : INT64_MIN / 2;
        vlo = min(vlo, first - a.k_pos0);
        vhi = max(vhi, p - a.k_pos0 + 1);
      }
      const int64_t b = Max<int64_t>(vlo, a.begin), e = Min<int64_t>(vhi, a.end);
      lo = static_cast<uint32_t>(b < e ? b : 0);
      hi = static_cast<uint32_t>(b < e ? e : 0);
    }
    const uint64_t len = hi - lo;
    range[0] = lo + static_cast<uint32_t>(len * split / a.splits);
    range[1] = lo + static_cast<uint32_t>(len * (split + 1) / a.splits);
  }
  __syncthreads();
  const uint32_t k0 = range[0], k1 = range[1];
  const int ntiles = static_cast<int>((k1 - k0 + C::kTk - 1) / C::kTk);
  const T* kbase = static_cast<const T*>(a.k) + static_cast<size_t>(kv) * a.rows * D;
  const T* vbase = static_cast<const T*>(a.v) + static_cast<size_t>(kv) * a.rows * D;
  const int32_t* list = sparse ? a.list + static_cast<size_t>(rowid[0]) * a.stride : nullptr;
  const float* kscale = kIsFp8<T> ? a.k_scale + static_cast<size_t>(kv) * a.rows : nullptr;
  const float* vscale = kIsFp8<T> ? a.v_scale + static_cast<size_t>(kv) * a.rows : nullptr;

  // Tile t into buffer t % kSt; one commit group per call (empty past the end), so that
  // wait_prior(kSt − 1) means "tile t has landed".
  auto prefetch = [&](int t) {
    if (t >= ntiles) return __pipeline_commit();
    const int buf = t % kSt;
    const uint32_t first = k0 + t * C::kTk;
    const int tk = Min<int>(C::kTk, k1 - first);
    for (int e = tid; e < tk * C::kVecs; e += C::kThreads) {
      const int j = e / C::kVecs, c = e % C::kVecs;
      const int32_t key = sparse ? list[first + j] : static_cast<int32_t>(first + j);
      if (c == 0) {
        kidx[buf * C::kTk + j] = key;
        if constexpr (kIsFp8<T>) {
          __pipeline_memcpy_async(ksc + buf * C::kTk + j, kscale + key, 4);
          __pipeline_memcpy_async(vsc + buf * C::kTk + j, vscale + key, 4);
        }
      }
      const size_t off = static_cast<size_t>(key) * D;
      const size_t soff = (static_cast<size_t>(buf) * C::kTk + j) * C::kStride;
      CpAsync16(ks + soff + c * (16 / sizeof(T)), kbase + off + c * (16 / sizeof(T)));
      CpAsync16(vs + soff + c * (16 / sizeof(T)), vbase + off + c * (16 / sizeof(T)));
    }
    __pipeline_commit();
  };

  float4 o[C::kMaxO];
#pragma unroll
  for (int s = 0; s < C::kMaxO; ++s) o[s] = make_float4(0.f, 0.f, 0.f, 0.f);

#pragma unroll
  for (int t = 0; t < kSt - 1; ++t) prefetch(t);
  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % kSt;
    prefetch(t + kSt - 1);
    __pipeline_wait_prior(kSt - 1);
    __syncthreads();
    const int tk = Min<int>(C::kTk, k1 - (k0 + t * C::kTk));
    const T* kt = ks + static_cast<size_t>(buf) * C::kTk * C::kStride;
    const T* vt = vs + static_cast<size_t>(buf) * C::kTk * C::kStride;
    // Scores: s = q·k·scale where the key is visible to the row (causal, window), else −inf.
    auto visible = [&](int r, int j) {
      if (j >= tk) return false;
      const int64_t kpos = a.k_pos0 + kidx[buf * C::kTk + j];
      const int64_t qp = qpos[r];
      return kpos <= qp && (a.window <= 0 || kpos > qp - a.window);
    };
    auto put = [&](int r, int j, float dot) {
      if constexpr (kIsFp8<T>) dot *= ksc[buf * C::kTk + j];  // only read for visible keys
      ss[r * C::kTk + j] = visible(r, j) ? dot * a.scale : -INFINITY;
    };
    if (nr * C::kTk >= 2 * C::kThreads) {
      // Many rows (batched queries, GQA groups): a thread scores rows ra, ra+R against keys ja,
      // ja+J — half the shared-memory reads of one score per thread; consecutive threads take
      // consecutive keys (no bank conflicts).
      constexpr int J = (C::kTk + 1) / 2;
      const int R = (nr + 1) / 2;
      for (int p = tid; p < R * J; p += C::kThreads) {
        const int ra = p / J, ja = p % J, rb = ra + R, jb = ja + J;
        const bool rb_ok = rb < nr, jb_ok = jb < C::kTk;
        float dot[4];
        Dots2x2<T, D>(qs + ra * D, qs + (rb_ok ? rb : ra) * D, kt + ja * C::kStride,
                      kt + (jb_ok ? jb : ja) * C::kStride, dot);
        put(ra, ja, dot[0]);
        if (jb_ok) put(ra, jb, dot[1]);
        if (rb_ok) put(rb, ja, dot[2]);
        if (rb_ok && jb_ok) put(rb, jb, dot[3]);
      }
    } else {
      for (int p = tid; p < nr * C::kTk; p += C::kThreads) {
        const int r = p / C::kTk, j = p % C::kTk;
        float dot = 0.f;
        if (visible(r, j)) {  // masked keys cost no products
          const float* qr = qs + r * D;
          const T* kr = kt + j * C::kStride;
          float e = 0.f, o = 0.f;
#pragma unroll
          for (int d = 0; d < D; d += 8) {
            float kx[8];
            Load8(kr + d, kx);
            Fma8(e, o, qr + d, kx);
          }
          dot = e + o;
        }
        put(r, j, dot);
      }
    }
    __syncthreads();
    // Online softmax, a warp per row.
    for (int r = warp; r < nr; r += C::kThreads / 32) {
      float* sr = ss + r * C::kTk;
      const float x0 = lane < C::kTk ? sr[lane] : -INFINITY;
      const float x1 = lane + 32 < C::kTk ? sr[lane + 32] : -INFINITY;
      const float mx = WarpMax(fmaxf(x0, x1));
      const float m_old = rm[r];
      const float m_new = fmaxf(m_old, mx);
      float p0 = 0.f, p1 = 0.f, alpha = 1.f;
      if (m_new != -INFINITY) {
        p0 = expf(x0 - m_new);
        p1 = expf(x1 - m_new);
        alpha = expf(m_old - m_new);
      }
      const float sum = WarpSum(p0 + p1);
      if constexpr (kIsFp8<T>) {  // p·V over e4m3 rows: p times the row's V scale (p = 0 kept)
        const float* vs_t = vsc + buf * C::kTk;
        if (p0 != 0.f) p0 *= vs_t[lane];
        if (p1 != 0.f) p1 *= vs_t[lane + 32];
      }
      if (lane < C::kTk) sr[lane] = p0;
      if (lane + 32 < C::kTk) sr[lane + 32] = p1;
      __syncwarp();  // every lane has read rm[r] and rl[r]
      if (lane == 0) {
        rl[r] = rl[r] * alpha + sum;
        rm[r] = m_new;
        ralpha[r] = alpha;
      }
    }
    __syncthreads();
    // o = alpha·o + p·V.
    auto accumulate = [&](float4& o_acc, float al, const float* pr, float4& other, float al2,
                          const float* pr2, int c, bool two) {
      float4 acc = make_float4(o_acc.x * al, o_acc.y * al, o_acc.z * al, o_acc.w * al);
      float4 acc2 = make_float4(other.x * al2, other.y * al2, other.z * al2, other.w * al2);
      for (int j = 0; j < tk; ++j) {
        const float4 v = Load4(vt + j * C::kStride + c * 4);
        const float pj = pr[j];
        acc.x = fmaf(pj, v.x, acc.x);
        acc.y = fmaf(pj, v.y, acc.y);
        acc.z = fmaf(pj, v.z, acc.z);
        acc.w = fmaf(pj, v.w, acc.w);
        if (two) {  // the same V vector for a second row
          const float qj = pr2[j];
          acc2.x = fmaf(qj, v.x, acc2.x);
          acc2.y = fmaf(qj, v.y, acc2.y);
          acc2.z = fmaf(qj, v.z, acc2.z);
          acc2.w = fmaf(qj, v.w, acc2.w);
        }
      }
      o_acc = acc;
      if (two) other = acc2;
    };
    if constexpr (C::kPaired) {
#pragma unroll
      for (int i = 0; i < C::kMaxO / 2; ++i) {
        int ra, c;
        OutputOf<C, D>(tid, 2 * i, &ra, &c);
        const int rb = ra + kItemRows / 2;
        if (ra < nr) {
          const bool two = rb < nr;
          accumulate(o[2 * i], ralpha[ra], ss + ra * C::kTk, o[2 * i + 1], two ? ralpha[rb] : 0.f,
                     ss + (two ? rb : ra) * C::kTk, c, two);
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < C::kMaxO; ++s) {
        int r, c;
        OutputOf<C, D>(tid, s, &r, &c);
        if (r < nr) {
          float4 unused = o[s];
          accumulate(o[s], ralpha[r], ss + r * C::kTk, unused, 0.f, nullptr, c, false);
        }
      }
    }
    __syncthreads();
  }
  LaunchDependents();  // a combine launched after this one may start its blocks
  // Partials of this split.
  const size_t part = a.part0 + split;
  if (tid < nr) {
    a.part_m[part * a.nrows + rowid[tid]] = rm[tid];
    a.part_l[part * a.nrows + rowid[tid]] = rl[tid];
  }
#pragma unroll
  for (int s = 0; s < C::kMaxO; ++s) {
    int r, c;
    OutputOf<C, D>(tid, s, &r, &c);
    if (r < nr) reinterpret_cast<float4*>(a.part_o + (part * a.nrows + rowid[r]) * D)[c] = o[s];
  }
  FinishSplits(a, rowid, nr);
}

template <typename T, int D, bool kLong>
Status LaunchSimt(const AttendArgs& a, cudaStream_t stream) {
  using C = Simt<T, D, kLong>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(AttendSimt<T, D, kLong>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(C::kBytes));
  if (attr != cudaSuccess) return gpu::CudaError(attr, "attention kernel shared memory");
  dim3 grid(a.n_items, a.splits);
  return LaunchDependent(AttendSimt<T, D, kLong>, grid, dim3(C::kThreads), C::kBytes, stream,
                         "attention kernel", a);
}

template <typename T, bool kLong>
Status LaunchSimtD(const AttendArgs& a, cudaStream_t stream) {
  switch (a.d) {
    case 32:
      return LaunchSimt<T, 32, kLong>(a, stream);
    case 64:
      return LaunchSimt<T, 64, kLong>(a, stream);
    case 96:
      return LaunchSimt<T, 96, kLong>(a, stream);
    case 128:
      return LaunchSimt<T, 128, kLong>(a, stream);
    case 160:
      return LaunchSimt<T, 160, kLong>(a, stream);
    case 192:
      return LaunchSimt<T, 192, kLong>(a, stream);
    case 256:
      return LaunchSimt<T, 256, kLong>(a, stream);
    case 512:
      return LaunchSimt<T, 512, kLong>(a, stream);
  }
  return Status(ErrorKind::kErr, "unsupported head dim " + std::to_string(a.d));
}

// One block (4 warps) per output row. First every part's m and l are loaded at once (up to
// kCombineParts of them, kept in shared memory) and turned into weights exp(m_p − M); then each
// lane owns 4 consecutive columns and warp w sums the parts p ≡ w (mod 4), loads issued 4 parts
// at a time so they overlap, none waiting on another load; the four warp sums meet in shared
// memory. Past kCombineParts parts the weights are recomputed from m as the sums go.
constexpr uint32_t kCombineParts = 1024;
__global__ void __launch_bounds__(128)
    Combine(uint32_t parts, uint32_t nrows, uint32_t d, const float* pm, const float* pl,
            const float* po, float* out, float* lse, bool overlap) {
  __shared__ float top, wsum[4];
  __shared__ float wts[kCombineParts], lts[kCombineParts];
  __shared__ float4 part_o[4][128];  // [warp][column group], d <= 512
  if (overlap) LaunchDependents();   // the next launch may place its blocks (OverlapCalls)
  WaitForPrimary();                  // launched early (programmatic dependent launch)
  const uint32_t row = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool staged = parts <= kCombineParts;
  float mx = -INFINITY;
  for (uint32_t p = threadIdx.x; p < parts; p += blockDim.x) {
    const float m = pm[size_t{p} * nrows + row];
    if (staged) {
      wts[p] = m;
      lts[p] = pl[size_t{p} * nrows + row];
    }
    mx = fmaxf(mx, m);
  }
  mx = WarpMax(mx);
  if (lane == 0) wsum[warp] = mx;
  __syncthreads();
  if (threadIdx.x == 0) top = fmaxf(fmaxf(wsum[0], wsum[1]), fmaxf(wsum[2], wsum[3]));
  __syncthreads();
  mx = top;
  float* o = out + size_t{row} * d;
  if (mx == -INFINITY) {
    for (uint32_t x = threadIdx.x; x < d; x += blockDim.x) o[x] = 0.f;
    if (threadIdx.x == 0 && lse != nullptr) lse[row] = -INFINITY;
    return;
  }
  float l = 0.f;
  if (staged) {
    for (uint32_t p = threadIdx.x; p < parts; p += blockDim.x) {
      const float w = wts[p] == -INFINITY ? 0.f : expf(wts[p] - mx);
      wts[p] = w;
      l += w * lts[p];
    }
    __syncthreads();
  }
  const uint32_t groups = d / 4;  // float4 columns
  for (uint32_t g0 = 0; g0 < groups; g0 += 32) {
    const uint32_t g = g0 + lane;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (uint32_t p0 = warp; p0 < parts; p0 += 16) {
      float w[4];
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const uint32_t p = p0 + 4 * u;
        if (staged) {
          w[u] = p < parts ? wts[p] : 0.f;
        } else {
          const float m = p < parts ? pm[size_t{p} * nrows + row] : -INFINITY;
          w[u] = m == -INFINITY ? 0.f : expf(m - mx);
          if (g0 == 0 && lane == 0 && w[u] != 0.f) l += w[u] * pl[size_t{p} * nrows + row];
        }
        v[u] = w[u] != 0.f && g < groups
                   ? reinterpret_cast<const float4*>(po + (size_t{p} * nrows + row) * d)[g]
                   : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        acc.x += w[u] * v[u].x;
        acc.y += w[u] * v[u].y;
        acc.z += w[u] * v[u].z;
        acc.w += w[u] * v[u].w;
      }
    }
    if (g < groups) part_o[warp][g] = acc;
  }
  if (staged) l = WarpSum(l);  // every lane summed its own parts' l
  if (lane == 0) wsum[warp] = l;
  __syncthreads();
  const float total = wsum[0] + wsum[1] + wsum[2] + wsum[3];
  for (uint32_t g = threadIdx.x; g < groups; g += blockDim.x) {
    const float4 a = part_o[0][g], b = part_o[1][g], c = part_o[2][g], e = part_o[3][g];
    reinterpret_cast<float4*>(o)[g] =
        make_float4((a.x + b.x + c.x + e.x) / total, (a.y + b.y + c.y + e.y) / total,
                    (a.z + b.z + c.z + e.z) / total, (a.w + b.w + c.w + e.w) / total);
  }
  if (threadIdx.x == 0 && lse != nullptr) lse[row] = mx + logf(total);
}

// The combine for few parts (at most kP <= 64) and d <= 128 — where the merge is pure latency:
// one warp a row, lane p holding parts p and p + 32's m and l, lane g float4 column g of every
// part's output, the loads of 32 parts issued at once; weights and sums by shuffles — no shared
// memory, no block barrier.
template <int kP>
__global__ void __launch_bounds__(128)
    CombineWarp(uint32_t parts, uint32_t nrows, uint32_t d, const float* pm, const float* pl,
                const float* po, float* out, float* lse, bool overlap) {
  if (overlap) LaunchDependents();       // the next launch may place its blocks (OverlapCalls)
  WaitForPrimary();                      // launched early (programmatic dependent launch)
  constexpr int kC = (kP + 31) / 32;     // parts a lane holds the m and l of
  constexpr int kB = kP < 32 ? kP : 32;  // output parts loaded at once
  const int lane = threadIdx.x & 31;
  const uint32_t row = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (row >= nrows) return;
  const uint32_t groups = d / 4;
  const bool col = static_cast<uint32_t>(lane) < groups;
  float4 v[kB];
#pragma unroll
  for (int p = 0; p < kB; ++p) {
    v[p] = p < parts && col
               ? reinterpret_cast<const float4*>(po + (size_t(p) * nrows + row) * d)[lane]
               : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float m[kC], l[kC];
  float top = -INFINITY;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const uint32_t p = lane + 32 * c;
    m[c] = p < parts ? pm[size_t(p) * nrows + row] : -INFINITY;
    l[c] = p < parts ? pl[size_t(p) * nrows + row] : 0.f;
    top = fmaxf(top, m[c]);
  }
  const float mx = WarpMax(top);
  float* o = out + size_t{row} * d;
  if (mx == -INFINITY) {  // no part saw a key
    if (col) reinterpret_cast<float4*>(o)[lane] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (lane == 0 && lse != nullptr) lse[row] = -INFINITY;
    return;
  }
  float w[kC], wl = 0.f;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    w[c] = m[c] == -INFINITY ? 0.f : expf(m[c] - mx);
    wl += w[c] * l[c];
  }
  const float total = WarpSum(wl);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    if (c > 0) {  // the next 32 parts' outputs
#pragma unroll
      for (int p = 0; p < kB; ++p) {
        const uint32_t pp = 32 * c + p;
        v[p] = pp < parts && col
                   ? reinterpret_cast<const float4*>(po + (size_t(pp) * nrows + row) * d)[lane]
                   : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int p = 0; p < kB; ++p) {
      const float wp = __shfl_sync(0xffffffffu, w[c], p);
      if (wp != 0.f) {  // a part without keys may hold anything: skip it, not 0·x
        acc.x += wp * v[p].x;
        acc.y += wp * v[p].y;
        acc.z += wp * v[p].z;
        acc.w += wp * v[p].w;
      }
    }
  }
  if (col) {
    reinterpret_cast<float4*>(o)[lane] =
        make_float4(acc.x / total, acc.y / total, acc.z / total, acc.w / total);
  }
  if (lane == 0 && lse != nullptr) lse[row] = mx + logf(total);
}

template <typename T, bool kLong>
size_t SimtBytes(uint32_t d) {
  switch (d) {
    case 32:
      return Simt<T, 32, kLong>::kBytes;
    case 64:
      return Simt<T, 64, kLong>::kBytes;
    case 96:
      return Simt<T, 96, kLong>::kBytes;
    case 128:
      return Simt<T, 128, kLong>::kBytes;
    case 160:
      return Simt<T, 160, kLong>::kBytes;
    case 192:
      return Simt<T, 192, kLong>::kBytes;
    case 256:
      return Simt<T, 256, kLong>::kBytes;
  }
  return Simt<T, 512, kLong>::kBytes;
}

// fp32 dense passes over at least 8K keys take the long-range SIMT shape (measured on the H200
// at D = 128: N = 32K 92.1 -> 86.9 us, 128K 330 -> 314; N = 2K 12.5 -> 14.1, so short ranges
// keep the other), and so do per-row lists over 2-byte K/V: three blocks a multiprocessor
// instead of one, where one query row per block leaves too few warps to hide the gathers.
bool SimtLong(const AttendArgs& a) {
  if (a.list != nullptr) return a.dtype != DType::kF32;
  return a.dtype == DType::kF32 && a.end >= a.begin + 8192;
}

// The SIMT kernel in the shape SimtLong picks for `a`.
template <typename T>
Status LaunchSimtShape(const AttendArgs& a, cudaStream_t stream) {
  return SimtLong(a) ? LaunchSimtD<T, true>(a, stream) : LaunchSimtD<T, false>(a, stream);
}

// Shared memory per block of the SIMT shape LaunchAttend runs `a` on (2-byte types alike).
size_t SimtSmem(const AttendArgs& a) {
  const bool f32 = a.dtype == DType::kF32, f8 = a.dtype == DType::kFP8;
  if (SimtLong(a)) {
    return f32  ? SimtBytes<float, true>(a.d)
           : f8 ? SimtBytes<__nv_fp8_e4m3, true>(a.d)
                : SimtBytes<__half, true>(a.d);
  }
  return f32  ? SimtBytes<float, false>(a.d)
         : f8 ? SimtBytes<__nv_fp8_e4m3, false>(a.d)
              : SimtBytes<__half, false>(a.d);
}

}  // namespace

uint32_t GridBlocks(const AttendArgs& a) {
  return UsesTensorCores(a) ? (a.n_items + FlashRowGroups(a) - 1) / FlashRowGroups(a) : a.n_items;
}

uint32_t PlanSplits(const AttendArgs& a, uint64_t keys) {
  const bool tc = UsesTensorCores(a);
  // Resident 128-thread blocks per SM, up to 16 warps' worth: the SIMT kernel's by its shared
  // memory (227 KiB usable), the tensor-core kernels' as the occupancy calculator counts them
  // (registers, static shared memory and the driver's 1 KiB a block count too: the fp16 d = 64
  // decode's 57.6 KB a block fit 3 an SM, not the 4 its dynamic bytes alone suggest, and the
  // fourth block's wave of splits ran alone — H200, GQA 32/8, fp16 d = 64: 128K 88.6 -> 72.9 µs
  // with 49 splits in one wave instead of 66, 32K 29.6 -> 25.0).
  const bool stream = StreamDecodeFits(a);
  const uint64_t per_sm =
      stream ? static_cast<uint64_t>(StreamDecodeBlocksPerSm(a, keys))
      : tc   ? std::clamp<uint64_t>(static_cast<uint64_t>(FlashBlocksPerSm(a)), 1,
                                  FlashRowGroups(a) == 8 ? 64 : 4)
             : std::clamp<uint64_t>((227u << 10) / std::max<size_t>(SimtSmem(a), 1), 1, 4);
  const uint64_t slots = per_sm * std::max(gpu::Info().sms, 1);
  const uint64_t blocks = GridBlocks(a);
  uint64_t splits = std::max<uint64_t>(1, slots / std::max<uint64_t>(blocks, 1));
  // Short dense ranges are latency-bound: a split takes at least 128 keys, but the fp16
  // tensor-core decode keeps 16 splits down to 128 keys a split and takes 256 from there, and
  // fp32 on the SIMT kernel 32 down to 64 keys a split. Measured on the H200 (GQA 32/8, d = 128,
  // pion-gpu-attn-bench dense with PION_BENCH_SPLITS): fp16 4K 11.6 -> 10.7 µs (16 splits, not
  // 32), 8K 15.4 -> 14.0 (32, not 33), from 32K unchanged (one block a slot: 128K 138 µs, 145
  // with 32); fp32 2K 12.5 -> 11.6 (32, not 16), 4K 17.6 (32; 17.9 with 33).
  const bool dense = a.list == nullptr;
  uint64_t cap = keys / 128;
  if (tc && dense && FlashRowGroups(a) == 1) {
    cap = std::max(std::min<uint64_t>(16, keys / 128), keys / 256);
  } else if (!tc && dense && a.dtype == DType::kF32) {
    cap = std::max(std::min<uint64_t>(32, keys / 64), keys / 128);
  }
  splits = std::min<uint64_t>(splits, std::max<uint64_t>(1, cap));
  // The streaming decode's partials merge in CombineWarp, which takes up to 64 (fp8 d = 64 over a
  // short range plans 4 blocks a multiprocessor: 66 splits for 8 K/V heads on 132 would take the
  // block combine).
  if (stream) splits = std::min<uint64_t>(splits, 64);
  return static_cast<uint32_t>(std::min<uint64_t>(splits, 4096));
}

Status LaunchAttend(const AttendArgs& a, void* stream) {
  if (a.n_items == 0) return Status::Ok();
  auto s = static_cast<cudaStream_t>(stream);
  if (UsesTensorCores(a)) return LaunchFlash(a, s);
  switch (a.dtype) {
    case DType::kF16:
      return LaunchSimtShape<__half>(a, s);
    case DType::kBF16:
      return LaunchSimtShape<__nv_bfloat16>(a, s);
    case DType::kFP8:
      if (a.k_scale == nullptr || a.v_scale == nullptr) {
        return Status(ErrorKind::kErr, "fp8 attention needs the K and V row scales");
      }
      return LaunchSimtShape<__nv_fp8_e4m3>(a, s);
    default:
      return LaunchSimtShape<float>(a, s);
  }
}

Status LaunchCombine(uint32_t parts, uint32_t nrows, uint32_t d, const float* part_m,
                     const float* part_l, const float* part_o, float* out, float* lse,
                     void* stream) {
  if (nrows == 0) return Status::Ok();
  // A programmatic dependent launch: its blocks start as the attention launch before it drains
  // and wait for that grid's results (on the H200: about 1 µs less per query at N = 2K).
  // Up to 32 parts at d <= 128 a warp merges a row (CombineWarp; on the H200, GQA 32/8 d = 128,
  // same run: fp16 2K 8.55 -> 8.28 µs, 4K 10.40 -> 10.11, 8K 13.86 -> 13.69; fp32 2K even).
  auto launch = [&](auto kernel, dim3 grid) {
    return LaunchDependent(kernel, grid, dim3(128), 0, static_cast<cudaStream_t>(stream),
                           "combine kernel", parts, nrows, d, part_m, part_l, part_o, out, lse,
                           OverlapCalls());
  };
  const dim3 warps((nrows + 3) / 4);  // CombineWarp: four rows a block
  if (d <= 128 && parts <= 16) return launch(CombineWarp<16>, warps);
  if (d <= 128 && parts <= 32) return launch(CombineWarp<32>, warps);
  if (d <= 128 && parts <= 64) return launch(CombineWarp<64>, warps);
  return launch(Combine, dim3(nrows));
}

}  // namespace pion::kernels::cuda
