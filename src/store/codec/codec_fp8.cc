// fp8: e4m3fn (README.md "fp8") or e5m2 (README.md "fp8_e5m2") values with one f32 scale per
// row; fp8_ds_mla (README.md): e4m3fn with one f32 scale per 128 values and a bf16 tail. The decode
// is a 256-entry table and one multiplication per value. The encode rounds on the f32 bits (round
// to nearest even at the format's last mantissa bit, carries into the exponent; the subnormal range
// by adding 2^23 in f32), branch-free per value: Highway compiles this file once per x86 target
// (foreach_target) and the compiler vectorizes the loops for each (SSE2 to AVX-512),
// HWY_DYNAMIC_DISPATCH picking the best the CPU runs. Integer operations and exactly rounded f32
// ones only (no contraction: -ffp-contract=off), so the same bytes on every target;
// codec_reference_test checks them against a frexp / nearbyint reference over a dense sweep of f32
// values, on every target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "store/codec/codec_fp8.cc"
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "store/codec/codec.h"  // kDsMlaGroup, kDsMlaRope
#include "store/codec/codec_internal.h"

#ifndef PION_CODEC_FP8_FORMATS_
#define PION_CODEC_FP8_FORMATS_  // once, not per target
namespace pion::codec::internal::fp8 {

// An fp8 format: kM mantissa bits, exponent bias kBias; its largest finite code kMaxCode and
// value kMax; the codes ±inf inputs take (e4m3 has no infinities: they saturate); the NaN code
// (e4m3fn: 0x7F without a sign, e5m2: 0x7E with the input's sign); the scale of a row with no
// finite non-zero value (e4m3: 0, decoding to zeros; e5m2: 1, so that its infinities decode as
// infinities, not as inf · 0 = NaN).
struct E4m3 {
  static constexpr int kM = 3, kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E, kInfCode = 0x7E, kNanCode = 0x7F;
  static constexpr bool kNanSigned = false;
  static constexpr float kMax = 448.0f, kEmptyScale = 0.0f;
};
struct E5m2 {
  static constexpr int kM = 2, kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B, kInfCode = 0x7C, kNanCode = 0x7E;
  static constexpr bool kNanSigned = true;
  static constexpr float kMax = 57344.0f, kEmptyScale = 1.0f;
};

// The value of every byte of format F: e4m3fn (no infinities; S.1111.111 is NaN) or e5m2 (the
// top byte of an IEEE binary16: S.11111.00 is ±inf, S.11111.mm NaN).
template <class F>
struct Table {
  float v[256];
  Table() {
    constexpr int kEmax = (1 << (7 - F::kM)) - 1;  // the all-ones exponent field
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> F::kM) & kEmax, m = b & ((1 << F::kM) - 1);
      float x;
      if (F::kNanSigned && e == kEmax) {  // e5m2: IEEE specials
        x = m == 0 ? std::numeric_limits<float>::infinity() : std::nanf("");
      } else if (!F::kNanSigned && e == kEmax && m == (1 << F::kM) - 1) {  // e4m3fn's only NaN
        x = std::nanf("");
      } else if (e == 0) {  // subnormal: m / 2^M · 2^(1 − bias)
        x = std::ldexp(static_cast<float>(m), 1 - F::kBias - F::kM);
      } else {  // (1 + m / 2^M) · 2^(e − bias)
        x = std::ldexp(static_cast<float>((1 << F::kM) + m), e - F::kBias - F::kM);
      }
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
template <class F>
const float* TableOf() {
  static const Table<F> t;
  return t.v;
}

}  // namespace pion::codec::internal::fp8
#endif  // PION_CODEC_FP8_FORMATS_

HWY_BEFORE_NAMESPACE();
namespace pion::codec::internal {
namespace HWY_NAMESPACE {
using fp8::E4m3;
using fp8::E5m2;

// y (finite or NaN) to format F's byte: round to nearest even, saturating at ±kMax.
template <class F>
HWY_INLINE uint8_t Round(float y) {
  constexpr int kShift = 23 - F::kM;
  constexpr uint32_t kMinNormal = uint32_t(127 + 1 - F::kBias) << 23;  // 2^(1 − bias), as bits
  constexpr uint32_t kRebias = uint32_t(127 - F::kBias) << F::kM;
  // 2^(kM − (1 − bias)): multiples of the subnormal step become integers.
  constexpr float kSubScale = static_cast<float>(1u << (F::kM + F::kBias - 1));
  const uint32_t u = std::bit_cast<uint32_t>(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t au = u & 0x7FFFFFFFu;
  // Normal: the f32 bits rounded to kM mantissa bits (a carry moves into the exponent), then
  // the exponent rebiased. Subnormal (|y| < 2^(1 − bias)): |y| / step rounded by the f32 adder
  // (exact: the sum's ulp is 1); a result of 2^kM is the smallest normal's code, as it should be.
  const uint32_t normal =
      ((au + ((1u << (kShift - 1)) - 1) + ((au >> kShift) & 1u)) >> kShift) - kRebias;
  const uint32_t clamped = au < kMinNormal ? au : kMinNormal;
  const float b = std::bit_cast<float>(clamped) * kSubScale;
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>((b + 8388608.0f) - 8388608.0f));
  // Selects as masks (no branches: the loops over a row vectorize).
  const uint32_t is_normal = 0u - static_cast<uint32_t>(au >= kMinNormal);
  uint32_t code = (normal & is_normal) | (sub & ~is_normal);
  const uint32_t over = 0u - static_cast<uint32_t>(code > F::kMaxCode);
  code = (F::kMaxCode & over) | (code & ~over);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(au > 0x7F800000u);
  const uint32_t nan = F::kNanCode | (F::kNanSigned ? sign : 0u);
  return static_cast<uint8_t>((nan & is_nan) | ((sign | code) & ~is_nan));
}

// n values → n bytes of format F and their scale: scale = amax / kMax over the finite values,
// each value ×(kMax / amax) rounded (÷ scale where kMax / amax overflows f32: values whose
// largest is below ~kMax / FLT_MAX); ±inf as kInfCode. With no finite non-zero value (or one so
// small that amax / kMax is 0) the scale is kEmptyScale. A row of fp8 / fp8_e5m2 is one group;
// fp8_ds_mla's compressed part is groups of 128.
template <class F>
HWY_INLINE float EncodeGroup(const float* HWY_RESTRICT x, uint32_t n, uint8_t* HWY_RESTRICT q) {
  // amax over the finite values, as bits (non-negative floats order as their bits do, as
  // signed integers too: a max reduction that vectorizes on SSE2).
  int32_t amax_bits = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t a = std::bit_cast<int32_t>(x[i]) & 0x7FFFFFFF;
    amax_bits = std::max(amax_bits, a < 0x7F800000 ? a : 0);
  }
  const float amax = std::bit_cast<float>(amax_bits);
  float scale = amax / F::kMax, inv;
  if (scale != 0) {
    inv = F::kMax / amax;
  } else {
    scale = inv = F::kEmptyScale;
  }
  if (std::isfinite(inv)) {
    for (uint32_t i = 0; i < n; ++i) q[i] = Round<F>(x[i] * inv);
  } else {
    for (uint32_t i = 0; i < n; ++i) q[i] = Round<F>(x[i] / scale);
  }
  for (uint32_t i = 0; i < n; ++i) {  // ±inf inputs: their codes
    const uint32_t u = std::bit_cast<uint32_t>(x[i]);
    const bool inf = (u & 0x7FFFFFFFu) == 0x7F800000u;
    q[i] = inf ? static_cast<uint8_t>(F::kInfCode | ((u >> 24) & 0x80u)) : q[i];
  }
  return scale;
}

// Rows [f32 scale][dim × byte], the whole row one group.
template <class F>
void EncodeScaled(const float* HWY_RESTRICT rows, size_t n_rows, uint32_t dim,
                  uint8_t* HWY_RESTRICT out) {
  for (size_t r = 0; r < n_rows; ++r, rows += dim, out += 4 + dim) {
    const float scale = EncodeGroup<F>(rows, dim, out + 4);
    std::memcpy(out, &scale, 4);
  }
}

// fp8_ds_mla's compressed part of each row: [nope e4m3][nope/128 f32 scales] at the start of
// rows of `row_bytes` (the RoPE part after them is written by the caller).
void EncodeDsMlaNope(const float* HWY_RESTRICT rows, size_t n_rows, uint32_t dim, size_t row_bytes,
                     uint8_t* HWY_RESTRICT out) {
  const uint32_t nope = dim - kDsMlaRope;
  for (size_t r = 0; r < n_rows; ++r, rows += dim, out += row_bytes) {
    for (uint32_t g = 0; g < nope / kDsMlaGroup; ++g) {
      const float scale =
          EncodeGroup<E4m3>(rows + g * kDsMlaGroup, kDsMlaGroup, out + g * kDsMlaGroup);
      std::memcpy(out + nope + 4 * g, &scale, 4);
    }
  }
}

void EncodeFp8(const float* HWY_RESTRICT rows, size_t n_rows, uint32_t dim,
               uint8_t* HWY_RESTRICT out) {
  EncodeScaled<E4m3>(rows, n_rows, dim, out);
}

void EncodeFp8E5m2(const float* HWY_RESTRICT rows, size_t n_rows, uint32_t dim,
                   uint8_t* HWY_RESTRICT out) {
  EncodeScaled<E5m2>(rows, n_rows, dim, out);
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::codec::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pion::codec::internal {
namespace {

void DecodeScaled(const float* table, const uint8_t* in, size_t n_rows, uint32_t dim, float* out) {
  for (size_t r = 0; r < n_rows; ++r, in += 4 + dim, out += dim) {
    float scale;
    std::memcpy(&scale, in, 4);
    for (uint32_t i = 0; i < dim; ++i) out[i] = table[in[4 + i]] * scale;
  }
}

}  // namespace

HWY_EXPORT(EncodeFp8);
HWY_EXPORT(EncodeFp8E5m2);
HWY_EXPORT(EncodeDsMlaNope);

size_t DsMlaRowBytes(uint32_t dim) {
  const size_t nope = dim - kDsMlaRope;
  return nope + 4 * (nope / kDsMlaGroup) + 2 * kDsMlaRope;
}

void EncodeFp8(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeFp8)(rows, n_rows, dim, out);
}

void DecodeFp8(const uint8_t* in, size_t n_rows, uint32_t dim, float* out) {
  DecodeScaled(fp8::TableOf<fp8::E4m3>(), in, n_rows, dim, out);
}

void EncodeFp8E5m2(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeFp8E5m2)(rows, n_rows, dim, out);
}

void DecodeFp8E5m2(const uint8_t* in, size_t n_rows, uint32_t dim, float* out) {
  DecodeScaled(fp8::TableOf<fp8::E5m2>(), in, n_rows, dim, out);
}

void EncodeFp8DsMla(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out) {
  const size_t rb = DsMlaRowBytes(dim), nope = dim - kDsMlaRope;
  HWY_DYNAMIC_DISPATCH(EncodeDsMlaNope)(rows, n_rows, dim, rb, out);
  const size_t rope_at = nope + 4 * (nope / kDsMlaGroup);
  for (size_t r = 0; r < n_rows; ++r) {
    EncodeBf16(rows + r * dim + nope, kDsMlaRope, out + r * rb + rope_at);
  }
}

void DecodeFp8DsMla(const uint8_t* in, size_t n_rows, uint32_t dim, float* out) {
  const float* table = fp8::TableOf<fp8::E4m3>();
  const size_t rb = DsMlaRowBytes(dim), nope = dim - kDsMlaRope;
  const size_t rope_at = nope + 4 * (nope / kDsMlaGroup);
  for (size_t r = 0; r < n_rows; ++r, in += rb, out += dim) {
    for (size_t g = 0; g < nope / kDsMlaGroup; ++g) {
      float scale;
      std::memcpy(&scale, in + nope + 4 * g, 4);
      for (size_t i = g * kDsMlaGroup; i < (g + 1) * kDsMlaGroup; ++i)
        out[i] = table[in[i]] * scale;
    }
    DecodeBf16(in + rope_at, kDsMlaRope, out + nope);
  }
}

}  // namespace pion::codec::internal
#endif  // HWY_ONCE
