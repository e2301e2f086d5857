// Tensor-core building blocks shared by the mma.sync kernels (flash.cu, flash_batched.cu): not a
// public interface. Fragments follow the PTX m16n8k16 (fp16) and m16n8k8 (tf32) layouts; lane l
// holds rows g = l / 4 and g + 8, columns 2·(l % 4) and + 1 of its accumulator tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"

namespace pion::kernels::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Two e4m3fn values (the low 16 bits of w) -> an fp16 pair (exact: every e4m3 value is an fp16
// value), low value in the low half.
__device__ inline uint32_t Fp8x2ToHalf2(uint32_t w) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

__device__ inline void Ldm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ inline void Ldm4T(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ inline void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// tf32 m16n8k8 (fp32 K/V): A rows g, g + 8 at columns t, t + 4 (a0 = (g, t), a1 = (g + 8, t),
// a2 = (g, t + 4), a3 = (g + 8, t + 4)); B rows t, t + 4 at column g; C as m16n8k16's.
__device__ inline void MmaTf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x rounded to tf32 (round to nearest, ties away: 10 mantissa bits), as the MMA's operand bits.
__device__ inline uint32_t Tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
// An fp32 (its bits) as tf32 hi + lo: hi = tf32(x), lo = x − hi exactly in fp32, which the MMA
// reads to tf32 precision (it ignores the low 13 mantissa bits) — |x − hi − tf32(lo)| <=
// 2^-21·|x|, about fp32's own rounding.
__device__ inline void SplitTf32(uint32_t x, uint32_t& hi, uint32_t& lo) {
  hi = Tf32(__uint_as_float(x));
  lo = __float_as_uint(__uint_as_float(x) - __uint_as_float(hi));
}
__device__ inline uint32_t Pack(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ inline uint32_t PackBf16(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}
// The m16n8k16 MMA and the hi / lo packing of its 16-bit element type E (__half or
// __nv_bfloat16): the fp16 kernels' code paths serve bf16 K/V with E = __nv_bfloat16.
template <typename E>
__device__ inline void Mma16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    MmaBf16(c, a, b0, b1);
  } else {
    Mma(c, a, b0, b1);
  }
}
template <typename E>
__device__ inline uint32_t Pack16(float x, float y) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return PackBf16(x, y);
  } else {
    return Pack(x, y);
  }
}
// The low parts of a hi / lo split, x − hi(x) and y − hi(y), packed, for hi = Pack16<E>(x, y)
// (fp16 hi + lo, or bf16's, keeps about fp32's significand): widening hi back costs less than
// rounding x and y a second time, and gives the same parts.
template <typename E>
__device__ inline uint32_t PackLo16(float x, float y, uint32_t hi) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return PackBf16(x - __uint_as_float(hi << 16), y - __uint_as_float(hi & 0xffff0000u));
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    return Pack(x - f.x, y - f.y);
  }
}
// Four values split in hi / lo: hi their pairs (x, y), (z, w) packed in E, lo what each misses
// (a row of Q for the MMAs: its hi and lo parts go to different rows).
struct HiLo4 {
  uint2 hi, lo;
};
template <typename E>
__device__ inline HiLo4 SplitHiLo(float4 x) {
  const uint2 hi{Pack16<E>(x.x, x.y), Pack16<E>(x.z, x.w)};
  return {hi, uint2{PackLo16<E>(x.x, x.y, hi.x), PackLo16<E>(x.z, x.w, hi.y)}};
}
// The packed decode's P as the A fragment of a 16-key k-step: rows 0..7 (a[0], a[2]) the high
// parts of this thread's weights (x0, y0) and (x1, y1) — keys c2, c2 + 1 and c2 + 8, c2 + 9 —
// and rows 8..15 (a[1], a[3]) their low parts.
template <typename E>
__device__ inline void PackRowsHiLo(uint32_t (&a)[4], float x0, float y0, float x1, float y1) {
  a[0] = Pack16<E>(x0, y0);
  a[1] = PackLo16<E>(x0, y0, a[0]);
  a[2] = Pack16<E>(x1, y1);
  a[3] = PackLo16<E>(x1, y1, a[2]);
}

// 16 bytes global -> shared at compile-time byte offsets from two base addresses (the offsets
// ride in the instruction: no address arithmetic per copy).
template <int kSmemOff, int kGlobalOff>
__device__ inline void CpAsync16At(uint32_t smem_base, const void* gmem_base) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0+%2], [%1+%3], 16;\n" ::"r"(smem_base),
               "l"(gmem_base), "n"(kSmemOff), "n"(kGlobalOff));
}
// fp8 in registers: the d that Q's logical column L (k-step L / 16, MMA column L % 16) holds.
// Lane (g, t) of a k-step needs MMA columns 2t, 2t + 1, 2t + 8, 2t + 9 of key g: they are d =
// t·D/4 + 4·ks + 0..3, so a lane's K bytes of a key are one run of D/4 and each k-step's four
// are one word.
template <int D>
__device__ inline int KPerm(int l) {
  const int ks = l / 16, kk = l % 16;
  return ((kk & 7) >> 1) * (D / 4) + 4 * ks + (kk & 1) + 2 * (kk >> 3);
}
// The accumulators times a row's softmax factor (every row of the thread's, alike).
template <int N>
__device__ inline void ScaleAcc(float (&o)[N][4], float alpha) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    o[n][0] *= alpha;
    o[n][1] *= alpha;
    o[n][2] *= alpha;
    o[n][3] *= alpha;
  }
}
// o += P·V over 16 keys for one 32-column block q of fp8 V: B = V rows c2, c2 + 1 (b0) and
// c2 + 8, c2 + 9 (b1), and d tile 4q + b's column g is d = 32q + 4g + b, so the lane's word at
// byte 4g + 32q of each of the four rows (w0, w1, w8, w9) — bytes paired across rows by
// byte_perm, then widened — feeds the four d tiles o[4q .. 4q + 3].
template <typename TM, int N>
__device__ inline void MmaFp8V(float (&o)[N][4], int q, const uint32_t (&ph)[4], uint32_t w0,
                               uint32_t w1, uint32_t w8, uint32_t w9) {
  const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
  const uint32_t lo89 = __byte_perm(w8, w9, 0x5140), hi89 = __byte_perm(w8, w9, 0x7362);
  Mma16<TM>(o[4 * q], ph, Fp8x2ToHalf2(lo01), Fp8x2ToHalf2(lo89));
  Mma16<TM>(o[4 * q + 1], ph, Fp8x2ToHalf2(lo01 >> 16), Fp8x2ToHalf2(lo89 >> 16));
  Mma16<TM>(o[4 * q + 2], ph, Fp8x2ToHalf2(hi01), Fp8x2ToHalf2(hi89));
  Mma16<TM>(o[4 * q + 3], ph, Fp8x2ToHalf2(hi01 >> 16), Fp8x2ToHalf2(hi89 >> 16));
}
// The decode shapes' merge of a block's kW warps (four, or the streaming decode's eight where
// it runs two rings) — states of the same rows over different keys — into its split-K partial,
// through shared memory: ms, ls [kW warps][kRs rows] (m in the log2 domain), os [kW][kRs][kOs]
// the warps' outputs, fs [kRs][kW] the weights.
// StoreWarpRow: this thread's row `row` of its warp's output: accumulator columns n·8 + c2, + 1
// (o[n][2h], o[n][2h + 1]), or with kPermuted the fp32 / fp8 P·V's columns (d tile 4q + b's
// column g is d = 32q + 4g + b: 8 consecutive d a quad lane).
template <int D, int kRs, int kOs, bool kPermuted>
__device__ inline void StoreWarpRow(float* os, int warp, int row, int c2, int h,
                                    const float (&o)[D / 8][4]) {
  float* orow = os + (warp * kRs + row) * kOs;
  if constexpr (kPermuted) {
#pragma unroll
    for (int q = 0; q < D / 32; ++q) {
      float* dst = orow + 32 * q + 4 * c2;
      *reinterpret_cast<float4*>(dst) =
          make_float4(o[4 * q][0], o[4 * q + 1][0], o[4 * q + 2][0], o[4 * q + 3][0]);
      *reinterpret_cast<float4*>(dst + 4) =
          make_float4(o[4 * q][1], o[4 * q + 1][1], o[4 * q + 2][1], o[4 * q + 3][1]);
    }
  } else {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(orow + n * 8 + c2) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
    }
  }
}
// MergeWarpsIntoPartial, once every warp stored its rows (it starts with the barrier): rows r
// < kRows with rowid[r] >= 0 get the warps' weights (a thread a row) and partial `part`'s m
// (natural log) and l; then rows r < kOutRows the weighted sum of the warps' outputs (a thread
// a float4 column: a quarter of the shared-memory loads and global stores of a thread a column
// — H200, same binary: f16 2K 8.14 -> 7.57 µs, 4K 10.04 -> 9.38, 8K 13.34 -> 12.76, M = 3 at 2K
// 11.33 -> 9.57, 32K 40.6 -> 40.0).
template <int D, int kRs, int kOs, int kRows, int kOutRows, int kW = 4>
__device__ inline void MergeWarpsIntoPartial(const AttendArgs& a, size_t part, const int32_t* rowid,
                                             const float* ms, const float* ls, float* fs,
                                             const float* os) {
  const int tid = threadIdx.x;
  __syncthreads();
  if (tid < kRows && rowid[tid] >= 0) {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kW; ++w) m = fmaxf(m, ms[w * kRs + tid]);
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      const float f = m == -INFINITY ? 0.f : exp2f(ms[w * kRs + tid] - m);
      fs[tid * kW + w] = f;
      l += ls[w * kRs + tid] * f;
    }
    const size_t pr = part * a.nrows + size_t(rowid[tid]);
    a.part_m[pr] = m == -INFINITY ? -INFINITY : m * kLn2;
    a.part_l[pr] = l;
  }
  __syncthreads();
  constexpr int kC4 = D / 4;
#pragma unroll
  for (int e = tid; e < kOutRows * kC4; e += kW * 32) {
    const int row = e / kC4, c = (e % kC4) * 4;
    if (rowid[row] < 0) continue;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      const float f = fs[row * kW + w];
      const float4 x = *reinterpret_cast<const float4*>(os + (w * kRs + row) * kOs + c);
      acc.x += x.x * f;
      acc.y += x.y * f;
      acc.z += x.z * f;
      acc.w += x.w * f;
    }
    const size_t pr = part * a.nrows + size_t(rowid[row]);
    *reinterpret_cast<float4*>(a.part_o + pr * D + c) = acc;
  }
}
// floor(n * i / parts) without a 64-bit division where the product fits 32 bits.
__device__ inline uint32_t SplitPoint(uint32_t n, uint32_t i, uint32_t parts) {
  const uint64_t p = uint64_t{n} * i;
  return p <= 0xffffffffu ? static_cast<uint32_t>(p) / parts : static_cast<uint32_t>(p / parts);
}
template <int I, int N, typename F>
__device__ inline void Unroll(F&& f) {
  if constexpr (I < N) {
    f(std::integral_constant<int, I>{});
    Unroll<I + 1, N>(f);
  }
}
// Sums 32 values across the warp and scatters the totals: afterwards lane l's v[0] is the warp's
// sum of every lane's v[l]. 31 shuffles for 32 sums (32 WarpSums take 160), and each total is
// added in WarpSum's order, so bit for bit the same value.
__device__ inline float ReduceScatter32(float (&v)[32]) {
  const int lane = threadIdx.x & 31;
  Unroll<0, 5>([&](auto S) {
    constexpr int kHalf = 16 >> decltype(S)::value;  // values left after this step
    const bool upper = lane & kHalf;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float keep = upper ? v[i + kHalf] : v[i];
      const float send = upper ? v[i] : v[i + kHalf];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kHalf);
    }
  });
  return v[0];
}
// ReduceScatter32 for values stored lane-permuted: lane l keeps value j at v[j ^ l]. Each step
// then keeps the low half and sends the high half with no selects (31 shuffles and 31 adds);
// the same pairs are added as by ReduceScatter32, so the same sums bit for bit. Afterwards lane
// l's v[0] is the warp's sum of value l.
__device__ inline float ReduceScatter32Xor(float (&v)[32]) {
  Unroll<0, 5>([&](auto S) {
    constexpr int kHalf = 16 >> decltype(S)::value;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i + kHalf], kHalf);
  });
  return v[0];
}

}  // namespace pion::kernels::cuda
