// Internals shared by codec.cc and the SIMD kernels (codec_simd.cc): scalar fp16 conversion,
// the turbo constants (rotation sign vectors, Lloyd-Max tables), index bit packing, and the
// per-format kernel entry points. Not part of the public API; tests use it to pin targets.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pion::codec::internal {

static_assert(std::endian::native == std::endian::little,
              "the RAW layout is little-endian and the kernels store host words directly");

// ---- fp16 (IEEE binary16), scalar ------------------------------------------------------------

// Round to nearest even; |f| >= 65520 -> inf; subnormals exact; NaN -> quiet NaN with the sign and
// the top 9 payload bits kept (what x86 F16C's vcvtps2ph produces).
inline uint16_t F32ToF16Bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 or inf
  if (abs >= 0x38800000u) {                                              // normal: >= 2^-14
    const uint32_t rebiased = abs - 0x38000000u;                         // exponent 127 -> 15
    return static_cast<uint16_t>(sign | ((rebiased + 0xFFFu + ((abs >> 13) & 1u)) >> 13));
  }
  const uint32_t exp = abs >> 23;
  if (exp < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
  // Subnormal half: the value in units of 2^-24, rounded to nearest even (1024 = min normal).
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // 14..24
  const uint32_t q = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
  return static_cast<uint16_t>(sign | q);
}

// Exact; a signalling NaN comes back quiet (as vcvtph2ps does).
inline float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) {
    return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  }
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 0x1p-24f;  // exact
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(v));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

// A non-negative scale or norm as fp16, saturating at 65504 instead of overflowing to inf.
inline uint16_t ScaleToF16(float v) {
  const uint16_t h = F32ToF16Bits(v);
  return (h & 0x7FFFu) >= 0x7C00u ? uint16_t{0x7BFF} : h;
}

inline void StoreLe16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline uint16_t LoadLe16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ---- turbo constants -------------------------------------------------------------------------

inline constexpr uint32_t kMaxTurboBlock = 4096;
// Seeds of the SplitMix64 streams that give the rotation's sign vectors D1 and D2 (README.md).
inline constexpr uint64_t kSignSeed1 = 0x50494F4E00000001ull;  // "PION" 1
inline constexpr uint64_t kSignSeed2 = 0x50494F4E00000002ull;  // "PION" 2

// Sign i of D1 (which = 1) or D2 (which = 2) as a float sign-bit mask: 0x80000000 for -1, 0 for
// +1; kMaxTurboBlock entries, a block of n uses the first n. Thread-safe, built on first use.
const uint32_t* SignMasks(int which);

// The Lloyd-Max quantizer of N(0,1) with 2^bits levels (lloyd_max_tables.h), in the forms the
// kernels use. Entries past 2^bits are zero padding so a 16-lane vector can load any table.
struct TurboTable {
  int bits;
  int levels;                  // 2^bits
  float centroids[16];         // ascending; index k encodes centroids[k]
  float centroid_squares[16];  // centroids[k] * centroids[k] in float
  float positive_bounds[8];    // the levels/2 - 1 positive boundaries, ascending
};
const TurboTable& TurboTableFor(int bits);

// ---- index bit packing -----------------------------------------------------------------------
// Indices form one LSB-first bit stream per block: index i occupies bits [i*bits, (i+1)*bits),
// bit k of the stream is bit (k % 8) of byte k / 8. Eight indices are `bits` whole bytes, so
// both directions work on groups of 8 indices held one per byte in a little-endian uint64.

template <int kBits>
inline constexpr uint64_t kLaneMask = ((1ull << kBits) - 1) * 0x0101010101010101ull;
template <int kBits>
inline constexpr uint64_t kPairMask = ((1ull << (2 * kBits)) - 1) * 0x0001000100010001ull;
template <int kBits>
inline constexpr uint64_t kQuadMask = ((1ull << (4 * kBits)) - 1) * 0x0000000100000001ull;

// kBits little-endian bytes <-> the low bits of a uint64. Built from whole-width loads and stores
// (not a memcpy into a zeroed word, whose narrow stores stall the wide reload).
template <int kBits>
inline uint64_t LoadGroup(const uint8_t* p) {
  if constexpr (kBits == 4) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  } else {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return kBits == 2 ? v : (v | uint64_t{p[2]} << 16);
  }
}
template <int kBits>
inline void StoreGroup(uint8_t* p, uint64_t x) {
  if constexpr (kBits == 4) {
    const auto v = static_cast<uint32_t>(x);
    std::memcpy(p, &v, 4);
  } else {
    const auto v = static_cast<uint16_t>(x);
    std::memcpy(p, &v, 2);
    if constexpr (kBits == 3) p[2] = static_cast<uint8_t>(x >> 16);
  }
}

// idx: n bytes, each < 2^kBits, n a multiple of 8; out: n * kBits / 8 bytes.
template <int kBits>
inline void PackIndices(const uint8_t* idx, size_t n, uint8_t* out) {
  for (size_t g = 0; g < n; g += 8, out += kBits) {
    uint64_t x;
    std::memcpy(&x, idx + g, 8);
    x = (x | (x >> (8 - kBits))) & kPairMask<kBits>;
    x = (x | (x >> (16 - 2 * kBits))) & kQuadMask<kBits>;
    StoreGroup<kBits>(out, x | (x >> (32 - 4 * kBits)));
  }
}

// in: n * kBits / 8 bytes; idx: n bytes.
template <int kBits>
inline void UnpackIndices(const uint8_t* in, size_t n, uint8_t* idx) {
  for (size_t g = 0; g < n; g += 8, in += kBits) {
    uint64_t x = LoadGroup<kBits>(in);
    x = (x | (x << (32 - 4 * kBits))) & kQuadMask<kBits>;
    x = (x | (x << (16 - 2 * kBits))) & kPairMask<kBits>;
    x = (x | (x << (8 - kBits))) & kLaneMask<kBits>;
    std::memcpy(idx + g, &x, 8);
  }
}

// ---- kernels (codec_simd.cc), dispatched to the best target the CPU supports -----------------
// Raw formats work on the flat n = n_rows * dim values; block formats on whole rows.

void EncodeFp16(const float* in, size_t n, uint8_t* out);
void DecodeFp16(const uint8_t* in, size_t n, float* out);
void EncodeBf16(const float* in, size_t n, uint8_t* out);
void DecodeBf16(const uint8_t* in, size_t n, float* out);
void EncodeInt8(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out);
void DecodeInt8(const uint8_t* in, size_t n_rows, uint32_t dim, float* out);
void EncodeFp8(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out);
void DecodeFp8(const uint8_t* in, size_t n_rows, uint32_t dim, float* out);
void EncodeFp8E5m2(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out);
void DecodeFp8E5m2(const uint8_t* in, size_t n_rows, uint32_t dim, float* out);
// DeepSeek-V3.2's latent rows (README "fp8_ds_mla"); dim = kv_lora_rank + 64.
void EncodeFp8DsMla(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out);
void DecodeFp8DsMla(const uint8_t* in, size_t n_rows, uint32_t dim, float* out);
void EncodeTurbo(int bits, const float* rows, size_t n_rows, uint32_t dim, uint32_t block,
                 uint8_t* out);
void DecodeTurbo(int bits, const uint8_t* in, size_t n_rows, uint32_t dim, uint32_t block,
                 float* out);

// The Highway targets compiled into the kernels that this CPU can run (HWY_AVX3, HWY_AVX2, ...),
// for tests that pin each one with hwy::SetSupportedTargetsForTest.
std::vector<int64_t> CompiledTargets();
// The target HWY_DYNAMIC_DISPATCH currently picks (to check that pinning took effect).
int64_t DispatchedTarget();
// sum x[i]^2 over a turbo block (n a power of two >= 8) exactly as the turbo encoder computes
// ||x||^2, to pin the canonical summation order in tests.
float CanonicalSumOfSquares(const float* x, size_t n);

}  // namespace pion::codec::internal
