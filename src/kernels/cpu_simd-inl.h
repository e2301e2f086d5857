// Per-target helpers shared by the CPU backend's Highway files (cpu_attention.cc, cpu_decode.cc,
// cpu_mla.cc): fp16 conversion, row access, dot products and the many-rows tile kernels. Included
// once per target after highway.h (the include guard toggles with HWY_TARGET_TOGGLE, as Highway's
// own -inl.h headers do).
#if defined(PION_KERNELS_CPU_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PION_KERNELS_CPU_SIMD_INL_H_
#undef PION_KERNELS_CPU_SIMD_INL_H_
#else
#define PION_KERNELS_CPU_SIMD_INL_H_
#endif

#include <hwy/highway.h>

#include <cstring>
#include <type_traits>

#include "common/bf16_simd-inl.h"
#include "kernels/attention.h"
#include "kernels/cpu_common.h"
#include "kernels/fp16.h"

HWY_BEFORE_NAMESPACE();
namespace pion::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
constexpr bool kHaveF16C = true;  // vcvtph2ps: fp16 K/V are converted in registers
#else
constexpr bool kHaveF16C = false;  // fp16 K/V are converted into fp32 blocks first
#endif

inline void HalfToFloat(const uint8_t* HWY_RESTRICT src, size_t n, float* HWY_RESTRICT dst) {
  size_t i = 0;
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t lanes = hn::Lanes(df);
  const auto* src16 = reinterpret_cast<const hwy::float16_t*>(src);
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src16 + i)), df, dst + i);
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src16 + i + lanes)), df, dst + i + lanes);
  }
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src16 + i)), df, dst + i);
  }
#endif
  for (; i < n; ++i) dst[i] = internal::LoadF16(src + 2 * i);
}

// n e4m3fn bytes → fp32 times `scale` (one row of an fp8 tensor), converted in registers: the
// byte's exponent and mantissa bits shifted into a binary32's place and multiplied by 2^120
// (the bias difference; e4m3 subnormals become binary32 subnormals, exact), NaN where the
// bits are S.1111.111, the sign or'ed back, then the one multiplication by the row's scale —
// the codec's decode, bit for bit.
inline void Fp8ToFloat(const uint8_t* HWY_RESTRICT src, size_t n, float scale,
                       float* HWY_RESTRICT dst) {
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t lanes = hn::Lanes(df);
  const auto k7f = hn::Set(du, 0x7Fu);
  const auto k80 = hn::Set(du, 0x80u);
  const VF bias = hn::Set(df, 0x1p120f);
  const VF nan = hn::BitCast(df, hn::Set(du, 0x7FC00000u));
  const VF vs = hn::Set(df, scale);
  for (; i + lanes <= n; i += lanes) {
    const auto b = hn::PromoteTo(du, hn::LoadU(d8, src + i));
    const auto em = hn::And(b, k7f);
    VF f = hn::Mul(hn::BitCast(df, hn::ShiftLeft<20>(em)), bias);
    f = hn::IfThenElse(hn::RebindMask(df, hn::Eq(em, k7f)), nan, f);
    f = hn::Or(f, hn::BitCast(df, hn::ShiftLeft<24>(hn::And(b, k80))));
    hn::StoreU(hn::Mul(f, vs), df, dst + i);
  }
#endif
  for (; i < n; ++i) dst[i] = internal::LoadFp8(src + i, scale);
}

// `count` rows of `t` from (head, row) on — 16-bit elements (fp16 or bf16) or fp8 rows with
// their scales — → fp32.
inline void WidenRows(const Tensor3& t, uint32_t head, size_t row, size_t count,
                      float* HWY_RESTRICT dst) {
  const uint8_t* src = t.Row(head, static_cast<uint32_t>(row));
  const size_t n = count * t.d;
  if (t.dtype == DType::kFP8) {
    for (size_t r = 0; r < count; ++r) {
      Fp8ToFloat(src + r * t.d, t.d, t.Scale(head, static_cast<uint32_t>(row + r)), dst + r * t.d);
    }
  } else if (t.dtype == DType::kBF16) {
    simd::HWY_NAMESPACE::WidenBf16(src, n, dst);
  } else {
    HalfToFloat(src, n, dst);
  }
}

// Rows [row, row + count) of one head as fp32: in place for fp32, converted into buf for fp16,
// bf16 and fp8.
inline const float* RowsF32(const Tensor3& t, uint32_t head, size_t row, size_t count, float* buf) {
  if (t.dtype == DType::kF32) {
    return reinterpret_cast<const float*>(t.Row(head, static_cast<uint32_t>(row)));
  }
  WidenRows(t, head, row, count, buf);
  return buf;
}

// One row, gathered into dst as fp32.
inline void CopyRowF32(const Tensor3& t, uint32_t head, uint32_t row, float* dst) {
  if (t.dtype == DType::kF32) {
    std::memcpy(dst, t.Row(head, row), t.d * sizeof(float));
  } else {
    WidenRows(t, head, row, 1, dst);
  }
}

// Loads one vector of elements of type T (float, or fp16 where kHaveF16C) as fp32.
template <class T>
HWY_INLINE VF LoadF32(const T* HWY_RESTRICT p) {
  const DF df;
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, p);
  } else {
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::float16_t, DF>(), p));
#else
    static_assert(std::is_same_v<T, float>, "fp16 loads need F16C");
    return hn::Zero(df);
#endif
  }
}

template <class T>
HWY_INLINE float Dot(const float* HWY_RESTRICT a, const T* HWY_RESTRICT b, size_t n) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF s0 = hn::Zero(df), s1 = hn::Zero(df), s2 = hn::Zero(df), s3 = hn::Zero(df);
  size_t j = 0;
  for (; j + 4 * lanes <= n; j += 4 * lanes) {
    s0 = hn::MulAdd(hn::LoadU(df, a + j), LoadF32(b + j), s0);
    s1 = hn::MulAdd(hn::LoadU(df, a + j + lanes), LoadF32(b + j + lanes), s1);
    s2 = hn::MulAdd(hn::LoadU(df, a + j + 2 * lanes), LoadF32(b + j + 2 * lanes), s2);
    s3 = hn::MulAdd(hn::LoadU(df, a + j + 3 * lanes), LoadF32(b + j + 3 * lanes), s3);
  }
  for (; j + lanes <= n; j += lanes) s0 = hn::MulAdd(hn::LoadU(df, a + j), LoadF32(b + j), s0);
  float tail = 0.0f;
  if constexpr (std::is_same_v<T, float>) {
    for (; j < n; ++j) tail += a[j] * b[j];
  }
  return hn::GetLane(hn::SumOfLanes(df, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3)))) + tail;
}

// The decode layout (cpu_decode.cc, compiled for the same targets): query rows heads[0, nheads)
// of K/V head g, all rows of each (nheads * q.m <= kMaxDecodeRows), dense keys.
void AttendDecodeGroup(const Queries& q, const Keys& keys, float scale, int64_t window, uint32_t g,
                       const uint32_t* heads, size_t nheads, const Partial& out, Scratch& scratch);
// Query rows rows[0, n) (n <= kMaxDecodeRows, all at the position of rows[0]) over the sparse
// key list of rows[0] (keys.rows != nullptr): each listed row is gathered once for all of them.
void AttendSparseRows(const Queries& q, const Keys& keys, float scale, int64_t window,
                      const size_t* rows, size_t n, const Partial& out, Scratch& scratch);

// ---- tile layout: many query rows in lanes (cpu_attention.cc's prefill, cpu_mla.cc) ---------
// Query rows sit in lanes, NV vectors of them; a tile's rows are `rt` floats apart.

#if HWY_TARGET <= HWY_AVX3
constexpr size_t kTileVecs = 4;  // 32 vector registers: 16 accumulators + operands
#else
constexpr size_t kTileVecs = 2;  // 16 vector registers
#endif
constexpr size_t kTileKeys = 4;

// S[t][lane] = Σ_j k[t][j] · qt[j][lane] for rows t in [0, nb) of width d, NV vectors of lanes.
template <size_t NV>
void TileScores(const float* HWY_RESTRICT k, size_t nb, size_t d, const float* HWY_RESTRICT qt,
                size_t rt, float* HWY_RESTRICT s) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t t = 0;
  for (; t + kTileKeys <= nb; t += kTileKeys) {
    VF acc[kTileKeys][NV];
    for (size_t kk = 0; kk < kTileKeys; ++kk) {
      for (size_t c = 0; c < NV; ++c) acc[kk][c] = hn::Zero(df);
    }
    const float* kt = k + t * d;
    for (size_t j = 0; j < d; ++j) {
      VF qv[NV];
      for (size_t c = 0; c < NV; ++c) qv[c] = hn::LoadU(df, qt + j * rt + c * lanes);
      for (size_t kk = 0; kk < kTileKeys; ++kk) {
        const VF kb = hn::Set(df, kt[kk * d + j]);
        for (size_t c = 0; c < NV; ++c) acc[kk][c] = hn::MulAdd(kb, qv[c], acc[kk][c]);
      }
    }
    for (size_t kk = 0; kk < kTileKeys; ++kk) {
      for (size_t c = 0; c < NV; ++c) hn::StoreU(acc[kk][c], df, s + (t + kk) * rt + c * lanes);
    }
  }
  for (; t < nb; ++t) {
    VF acc[NV];
    for (size_t c = 0; c < NV; ++c) acc[c] = hn::Zero(df);
    const float* kt = k + t * d;
    for (size_t j = 0; j < d; ++j) {
      const VF kb = hn::Set(df, kt[j]);
      for (size_t c = 0; c < NV; ++c) {
        acc[c] = hn::MulAdd(kb, hn::LoadU(df, qt + j * rt + c * lanes), acc[c]);
      }
    }
    for (size_t c = 0; c < NV; ++c) hn::StoreU(acc[c], df, s + t * rt + c * lanes);
  }
}

// ot[j][lane] = ot[j][lane] · alpha[lane] + Σ_t v[t][j] · p[t][lane] for j < dv, the value rows
// `stride` floats apart (the first dv values of each widened latent row).
template <size_t NV>
void TileAccumulate(const float* HWY_RESTRICT v, size_t nb, size_t dv, size_t stride,
                    const float* HWY_RESTRICT p, const float* HWY_RESTRICT alpha, size_t rt,
                    float* HWY_RESTRICT ot) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  constexpr size_t kJ = 4;
  VF va[NV];
  for (size_t c = 0; c < NV; ++c) va[c] = hn::LoadU(df, alpha + c * lanes);
  for (size_t j = 0; j < dv; j += kJ) {
    VF acc[kJ][NV];
    for (size_t jj = 0; jj < kJ; ++jj) {
      for (size_t c = 0; c < NV; ++c) {
        acc[jj][c] = hn::Mul(hn::LoadU(df, ot + (j + jj) * rt + c * lanes), va[c]);
      }
    }
    for (size_t t = 0; t < nb; ++t) {
      VF pv[NV];
      for (size_t c = 0; c < NV; ++c) pv[c] = hn::LoadU(df, p + t * rt + c * lanes);
      const float* vt = v + t * stride + j;
      for (size_t jj = 0; jj < kJ; ++jj) {
        const VF vb = hn::Set(df, vt[jj]);
        for (size_t c = 0; c < NV; ++c) acc[jj][c] = hn::MulAdd(vb, pv[c], acc[jj][c]);
      }
    }
    for (size_t jj = 0; jj < kJ; ++jj) {
      for (size_t c = 0; c < NV; ++c) hn::StoreU(acc[jj][c], df, ot + (j + jj) * rt + c * lanes);
    }
  }
}

template <size_t NV>
void TileScoresN(size_t nv, const float* k, size_t nb, size_t d, const float* qt, size_t rt,
                 float* s) {
  if constexpr (NV > 1) {
    if (nv < NV) return TileScoresN<NV - 1>(nv, k, nb, d, qt, rt, s);
  }
  TileScores<NV>(k, nb, d, qt, rt, s);
}

template <size_t NV>
void TileAccumulateN(size_t nv, const float* v, size_t nb, size_t dv, size_t stride, const float* p,
                     const float* alpha, size_t rt, float* ot) {
  if constexpr (NV > 1) {
    if (nv < NV) return TileAccumulateN<NV - 1>(nv, v, nb, dv, stride, p, alpha, rt, ot);
  }
  TileAccumulate<NV>(v, nb, dv, stride, p, alpha, rt, ot);
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::kernels::cpu
HWY_AFTER_NAMESPACE();

#endif  // PION_KERNELS_CPU_SIMD_INL_H_
