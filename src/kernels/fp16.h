// Scalar IEEE binary16 (and bfloat16) -> binary32 decoding, shared by the reference and by the CPU
// backend's targets without F16C. Exact for every input: subnormals, ±inf and NaN (payload kept).
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

}  // namespace pion::kernels::internal
