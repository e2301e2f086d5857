// fp8: e4m3fn values with one f32 scale per row (README.md "fp8"). Scalar: the decode is a
// 256-entry table and one multiplication per value; the encode rounds each value with exact
// power-of-two arithmetic (the same bytes on every CPU).
#include <cmath>
#include <cstring>

#include "store/codec/codec_internal.h"

namespace pion::codec::internal {
namespace {

constexpr float kE4m3Max = 448.0f;

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x;
      if (e == 15 && m == 7) {
        x = std::nanf("");
      } else if (e == 0) {
        x = std::ldexp(static_cast<float>(m), -9);  // subnormal: m/8 · 2^-6
      } else {
        x = std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m/8) · 2^(e-7)
      }
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
const E4m3Table& Table() {
  static const E4m3Table t;
  return t;
}

// Round-to-nearest-even to e4m3fn, saturating at ±448; NaN -> 0x7F.
uint8_t ToE4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= kE4m3Max) return sign | 0x7E;
  int e2 = 0;
  std::frexp(a, &e2);  // a = f · 2^e2, f in [0.5, 1): exponent e2 - 1
  const int e = a == 0 ? -6 : std::max(e2 - 1, -6);
  // Multiples of 2^(e-3) (2^-9 below the normal range): q = a / step, rounded to even.
  const float q = std::nearbyint(std::ldexp(a, 3 - e));
  int qi = static_cast<int>(q);
  int be = e + 7;
  if (qi >= 16) {  // rounded up into the next binade
    qi = 8;
    ++be;
  }
  if (qi < 8) return sign | static_cast<uint8_t>(qi);  // subnormal (be was 1: e == -6)
  if (be > 15 || (be == 15 && qi - 8 == 7)) return sign | 0x7E;
  return sign | static_cast<uint8_t>((be << 3) | (qi - 8));
}

}  // namespace

void EncodeFp8(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out) {
  for (size_t r = 0; r < n_rows; ++r, rows += dim, out += 4 + dim) {
    float amax = 0;
    for (uint32_t i = 0; i < dim; ++i) {
      const float a = std::fabs(rows[i]);
      if (std::isfinite(a) && a > amax) amax = a;
    }
    const float scale = amax / kE4m3Max;
    std::memcpy(out, &scale, 4);
    const float inv = scale != 0 ? kE4m3Max / amax : 0.f;
    for (uint32_t i = 0; i < dim; ++i) {
      const float x = rows[i];
      out[4 + i] = std::isinf(x) ? (x < 0 ? 0xFE : 0x7E) : ToE4m3(x * inv);
    }
  }
}

void DecodeFp8(const uint8_t* in, size_t n_rows, uint32_t dim, float* out) {
  const float* t = Table().v;
  for (size_t r = 0; r < n_rows; ++r, in += 4 + dim, out += dim) {
    float scale;
    std::memcpy(&scale, in, 4);
    for (uint32_t i = 0; i < dim; ++i) out[i] = t[in[4 + i]] * scale;
  }
}

}  // namespace pion::codec::internal
