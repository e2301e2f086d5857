// Scalar IEEE binary16 (and bfloat16, and fp8 e4m3fn) -> binary32 decoding, shared by the reference
// and by the CPU backend's targets without F16C. Exact for every input: subnormals, ±inf and NaN
// (payload kept).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace pion::kernels::internal {

inline float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24, exact in float.
  const float mag = static_cast<float>(mant) * 0x1p-24f;
  return sign != 0 ? -mag : mag;
}

inline float LoadF16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return F16BitsToF32(h);
}

// bfloat16 is the high half of a binary32: widening is exact for every input.
inline float LoadBF16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// e4m3fn → binary32, exact: the exponent and mantissa bits moved into a binary32's place and the
// bias corrected by a power of two (subnormals included: 2^-9 · m), 0x7F/0xFF NaN.
constexpr float E4m3ToF32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t em = b & 0x7Fu;
  if (em == 0x7Fu) return std::bit_cast<float>(sign | 0x7FC00000u);
  if (em < 8) {  // subnormal or zero: m · 2^-9
    const float mag = static_cast<float>(em) * 0x1p-9f;
    return sign != 0 ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((em + (120u << 3)) << 20));
}

// One fp8 element: its e4m3 value times its row's scale (one float32 multiplication, as the
// codec decodes it).
inline float LoadFp8(const uint8_t* p, float scale) { return E4m3ToF32(*p) * scale; }

}  // namespace pion::kernels::internal
