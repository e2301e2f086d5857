// The SIMD kernels against an independent scalar reference, on every Highway target this CPU
// can run (pinned one at a time). The reference below is written from README.md with different
// algorithms where the format allows it (fp16 and fp8 via frexp/nearbyint, bf16 by comparing the
// two neighbours, turbo with plain loops and a bit-by-bit packer); it shares nothing with the
// kernels but the Lloyd-Max tables, which lloyd_max_test checks on their own.
//
// Contract: fp16, bf16, int8, fp8 and fp8_e5m2 bit for bit; turbo within 1e-6 relative. The turbo
// kernels are in fact designed to be bit-exact too (fixed summation order, no FMA), so the bytes
// are also compared exactly.

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "store/codec/codec.h"
#include "store/codec/codec_internal.h"
#include "store/codec/lloyd_max_tables.h"

namespace pion::codec {
namespace {

// ---- Scalar reference ------------------------------------------------------------------------

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

// fp16 by frexp and nearbyint in double (exact there), RNE; NaN keeps sign + top payload, quiet.
uint16_t RefF16(float f) {
  const uint16_t sign = (Bits(f) >> 31) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7E00 | ((Bits(f) >> 13) & 0x3FF);
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) {  // subnormal range: multiples of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24)));  // 1024 = min normal
  }
  int e2;
  const double m = std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int e = e2 - 1;                       // a = (2m) * 2^e, 2m in [1, 2)
  double frac = std::nearbyint((2 * m - 1) * 1024);
  if (frac == 1024) frac = 0, ++e;
  if (e > 15) return sign | 0x7C00;
  return sign | static_cast<uint16_t>(((e + 15) << 10) | static_cast<int>(frac));
}

float RefF16ToF32(uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0x1F) {
    if (m == 0) return static_cast<float>(sign * std::numeric_limits<double>::infinity());
    return FromBits((h & 0x8000u) << 16 | 0x7FC00000u | (static_cast<uint32_t>(m) << 13));
  }
  if (e == 0) return static_cast<float>(sign * std::ldexp(m, -24));
  return static_cast<float>(sign * std::ldexp(1024 + m, e - 25));
}

// bf16: pick the nearer of the truncation and the next bf16 up (2^128 stands in for inf), ties
// to even; NaN -> quiet NaN with the same sign and top payload.
uint16_t RefBf16(float f) {
  const uint32_t u = Bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  if (std::isinf(f)) return static_cast<uint16_t>(u >> 16);
  const uint32_t lo = u & 0xFFFF0000u;
  const uint32_t mag_hi = (lo & 0x7FFFFFFFu) + 0x10000u;  // next bf16 away from zero
  const double a = std::fabs(static_cast<double>(f));
  const double lo_v = std::fabs(static_cast<double>(FromBits(lo)));
  const double hi_v = mag_hi == 0x7F800000u ? std::ldexp(1.0, 128) : FromBits(mag_hi);
  const bool up = (a - lo_v > hi_v - a) || (a - lo_v == hi_v - a && ((lo >> 16) & 1));
  return static_cast<uint16_t>((up ? (mag_hi | (u & 0x80000000u)) : lo) >> 16);
}

std::vector<uint8_t> RefEncodeInt8(const std::vector<float>& x, size_t n_rows, uint32_t dim) {
  std::vector<uint8_t> out;
  for (size_t r = 0; r < n_rows; ++r) {
    for (uint32_t b = 0; b < dim; b += 32) {
      const uint32_t len = std::min<uint32_t>(32, dim - b);
      const float* v = &x[r * dim + b];
      float amax = 0;
      for (uint32_t j = 0; j < len; ++j) {
        if (!std::isnan(v[j])) amax = std::max(amax, std::fabs(v[j]));
      }
      uint16_t h = RefF16(amax / 127.0f);
      if ((h & 0x7FFF) >= 0x7C00) h = 0x7BFF;  // saturate the scale at 65504
      const float d = RefF16ToF32(h);
      const float id = d == 0 ? 0.0f : 1.0f / d;
      out.push_back(h & 0xFF);
      out.push_back(h >> 8);
      for (uint32_t j = 0; j < len; ++j) {
        float q = std::round((std::isnan(v[j]) ? 0.0f : v[j]) * id);
        q = std::clamp(q, -127.0f, 127.0f);
        out.push_back(static_cast<uint8_t>(static_cast<int8_t>(q)));
      }
    }
  }
  return out;
}

std::vector<float> RefDecodeInt8(const std::vector<uint8_t>& in, size_t n_rows, uint32_t dim) {
  std::vector<float> out;
  size_t p = 0;
  for (size_t r = 0; r < n_rows; ++r) {
    for (uint32_t b = 0; b < dim; b += 32) {
      const uint32_t len = std::min<uint32_t>(32, dim - b);
      const float d = RefF16ToF32(static_cast<uint16_t>(in[p] | in[p + 1] << 8));
      p += 2;
      for (uint32_t j = 0; j < len; ++j) out.push_back(static_cast<float>(int8_t(in[p++])) * d);
    }
  }
  return out;
}

// ---- fp8 reference: frexp / nearbyint in double, then the README's row rules

// An fp8 format for the reference: mantissa bits, bias, largest finite value, whether it has
// IEEE infinities (e5m2) or saturates them (e4m3fn).
struct RefFp8Format {
  int m, bias;
  double max;
  bool ieee;
};
constexpr RefFp8Format kRefE4m3{3, 7, 448.0, false};
constexpr RefFp8Format kRefE5m2{2, 15, 57344.0, true};

// y rounded to nearest even on the format's grid, saturating at ±max; NaN: e4m3fn 0x7F,
// e5m2 sign | 0x7E. (±inf are the row encoder's business.)
uint8_t RefFp8(const RefFp8Format& f, float y) {
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  if (std::isnan(y)) return f.ieee ? (sign | 0x7E) : 0x7F;
  const double a = std::fabs(static_cast<double>(y));
  const uint8_t max_code = f.ieee ? 0x7B : 0x7E;
  if (a >= f.max) return sign | max_code;
  const int emin = 1 - f.bias;
  int e2 = 0;
  std::frexp(a, &e2);
  const int e = a == 0 ? emin : std::max(e2 - 1, emin);
  const double q = std::nearbyint(std::ldexp(a, f.m - e));  // multiples of 2^(e − m)
  int qi = static_cast<int>(q), be = e + f.bias;
  if (qi >= (2 << f.m)) qi = 1 << f.m, ++be;                    // rounded up into the next binade
  if (qi < (1 << f.m)) return sign | static_cast<uint8_t>(qi);  // subnormal
  const int code = (be << f.m) | (qi - (1 << f.m));
  return sign | static_cast<uint8_t>(std::min(code, int{max_code}));
}

float RefFp8Value(const RefFp8Format& f, uint8_t b) {
  const int ef = (1 << (7 - f.m)) - 1, e = (b >> f.m) & ef, m = b & ((1 << f.m) - 1);
  double x;
  if (f.ieee && e == ef) {
    x = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else if (!f.ieee && e == ef && m == (1 << f.m) - 1) {
    x = std::nan("");
  } else if (e == 0) {
    x = std::ldexp(m, 1 - f.bias - f.m);
  } else {
    x = std::ldexp((1 << f.m) + m, e - f.bias - f.m);
  }
  return static_cast<float>((b & 0x80) ? -x : x);
}

// The README's rows: scale = amax / max (e5m2: 1 when that is 0), each value · (max / amax)
// (÷ scale when that overflows), ±inf as ±max (e4m3fn) or ±inf (e5m2).
std::vector<uint8_t> RefEncodeFp8(const RefFp8Format& f, const std::vector<float>& x, size_t n_rows,
                                  uint32_t dim) {
  std::vector<uint8_t> out;
  const float max = static_cast<float>(f.max);
  for (size_t r = 0; r < n_rows; ++r) {
    const float* v = &x[r * dim];
    float amax = 0;
    for (uint32_t j = 0; j < dim; ++j) {
      if (std::isfinite(v[j])) amax = std::max(amax, std::fabs(v[j]));
    }
    float scale = amax / max, inv = scale != 0 ? max / amax : 0.0f;
    if (scale == 0 && f.ieee) scale = inv = 1.0f;
    uint8_t sb[4];
    std::memcpy(sb, &scale, 4);
    out.insert(out.end(), sb, sb + 4);
    for (uint32_t j = 0; j < dim; ++j) {
      if (std::isinf(v[j])) {
        out.push_back((v[j] < 0 ? 0x80 : 0) | (f.ieee ? 0x7C : 0x7E));
      } else {
        out.push_back(RefFp8(f, std::isfinite(inv) ? v[j] * inv : v[j] / scale));
      }
    }
  }
  return out;
}

// ---- turbo reference

struct RefTurbo {
  int bits;
  uint32_t n;
  std::vector<float> centroids, bounds;  // ascending; 2^bits and 2^bits - 1 entries
  std::vector<float> s1, s2;             // +-1

  static std::vector<float> Signs(uint64_t seed, uint32_t n) {
    std::vector<float> s(n);
    uint64_t state = seed, word = 0;
    for (uint32_t i = 0; i < n; ++i) {
      if (i % 64 == 0) {
        state += 0x9E3779B97F4A7C15ull;
        uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        word = z ^ (z >> 31);
      }
      s[i] = ((word >> (i % 64)) & 1) ? -1.0f : 1.0f;
    }
    return s;
  }

  RefTurbo(int b, uint32_t block) : bits(b), n(block) {
    const float* c = b == 4   ? internal::kLloydMax4Centroids
                     : b == 3 ? internal::kLloydMax3Centroids
                              : internal::kLloydMax2Centroids;
    const float* bd = b == 4   ? internal::kLloydMax4Boundaries
                      : b == 3 ? internal::kLloydMax3Boundaries
                               : internal::kLloydMax2Boundaries;
    centroids.assign(c, c + (1 << b));
    bounds.assign(bd, bd + (1 << b) - 1);
    s1 = Signs(0x50494F4E00000001ull, n);
    s2 = Signs(0x50494F4E00000002ull, n);
  }

  static void Fwht(std::vector<float>& v) {
    for (size_t h = 1; h < v.size(); h *= 2) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (i & h) continue;
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }

  // README: 32 partial sums over i mod 32 (zero when unused), folded 16, 8, 4, 2, 1.
  static float Sum32(const std::vector<float>& v) {
    float p[32] = {};
    for (size_t i = 0; i < v.size(); ++i) p[i % 32] += v[i];
    for (int w = 16; w >= 1; w /= 2) {
      for (int j = 0; j < w; ++j) p[j] += p[j + w];
    }
    return p[0];
  }

  int Index(float t) const {
    // Symmetric cells: count the positive boundaries <= |t|, mirror for t < 0.
    const int half = 1 << (bits - 1);
    int c = 0;
    for (int k = half; k < (1 << bits) - 1; ++k) c += std::fabs(t) >= bounds[k];
    return t < 0 ? half - 1 - c : half + c;
  }

  void EncodeBlock(const float* x, uint8_t* out) const {
    std::vector<float> sq(n), w(n);
    for (uint32_t i = 0; i < n; ++i) sq[i] = x[i] * x[i];
    const float norm = std::sqrt(Sum32(sq));
    std::vector<int> idx(n, 1 << (bits - 1));
    uint16_t stored = 0;
    if (norm > 0 && std::isfinite(norm)) {
      for (uint32_t i = 0; i < n; ++i) w[i] = x[i] * s1[i];
      Fwht(w);
      const float inv = 1.0f / norm;
      for (uint32_t i = 0; i < n; ++i) idx[i] = Index((w[i] * s2[i]) * inv);
      for (uint32_t i = 0; i < n; ++i) sq[i] = centroids[idx[i]] * centroids[idx[i]];
      const float cnorm = std::sqrt(Sum32(sq));
      stored = RefF16((norm / cnorm) * std::sqrt(static_cast<float>(n)));
      if ((stored & 0x7FFF) >= 0x7C00) stored = 0x7BFF;
    }
    out[0] = stored & 0xFF;
    out[1] = stored >> 8;
    uint8_t* packed = out + 2;
    std::memset(packed, 0, n * bits / 8);
    for (uint32_t i = 0; i < n; ++i) {
      for (int b = 0; b < bits; ++b) {
        const size_t k = size_t{i} * bits + b;  // LSB-first bit stream
        if ((idx[i] >> b) & 1) packed[k / 8] |= static_cast<uint8_t>(1u << (k % 8));
      }
    }
  }

  void DecodeBlock(const uint8_t* in, float* x) const {
    const float k = RefF16ToF32(static_cast<uint16_t>(in[0] | in[1] << 8)) / static_cast<float>(n);
    std::vector<float> v(n);
    for (uint32_t i = 0; i < n; ++i) {
      int q = 0;
      for (int b = 0; b < bits; ++b) {
        const size_t bit = size_t{i} * bits + b;
        q |= ((in[2 + bit / 8] >> (bit % 8)) & 1) << b;
      }
      v[i] = centroids[q] * s2[i];
    }
    Fwht(v);
    for (uint32_t i = 0; i < n; ++i) x[i] = (v[i] * k) * s1[i];
  }

  size_t BlockBytes() const { return 2 + size_t{n} * bits / 8; }
};

// ---- Test data -------------------------------------------------------------------------------

// Gaussian rows at scales from 1e-9 to 1e9 (fp16 underflow and overflow), plus sprinkled special
// values when `specials` is set.
std::vector<float> MakeRows(size_t n_rows, uint32_t dim, uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> gauss;
  std::uniform_int_distribution<int> scale_exp(-9, 9);
  std::vector<float> x(n_rows * dim);
  for (size_t r = 0; r < n_rows; ++r) {
    const float scale = r % 4 == 0 ? 1.0f : std::pow(10.0f, static_cast<float>(scale_exp(rng)));
    for (uint32_t j = 0; j < dim; ++j) x[r * dim + j] = gauss(rng) * scale;
  }
  if (specials) {
    const float kSpecial[] = {0.0f,
                              -0.0f,
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(),
                              -std::numeric_limits<float>::quiet_NaN(),
                              FromBits(0x7F800001u),  // signalling NaN
                              FromBits(0x7FBFFFFFu),
                              std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::denorm_min(),
                              65504.0f,
                              65519.996f,
                              65520.0f,
                              0x1p-24f,
                              0x1p-25f,
                              0x1.000002p-25f,
                              0x1.8p-24f,
                              0x1p-14f};
    std::uniform_int_distribution<size_t> where(0, x.size() - 1);
    for (size_t i = 0; i < x.size() / 16 + 1; ++i) {
      x[where(rng)] = kSpecial[i % std::size(kSpecial)];
    }
  }
  return x;
}

template <class Fn>
void ForEachTarget(Fn fn) {
  const std::vector<int64_t> targets = internal::CompiledTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    ASSERT_EQ(internal::DispatchedTarget(), target);
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
}

// Bitwise equality of float vectors; reports the first few differences.
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    if (Bits(got[i]) != Bits(want[i])) {
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << " (0x" << std::hex
                    << Bits(got[i]) << "), want " << want[i] << " (0x" << Bits(want[i]) << ")"
                    << std::dec;
      ++reported;
    }
  }
}

void ExpectSameBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << " byte " << i << ": got " << int{got[i]} << ", want "
                    << int{want[i]};
      ++reported;
    }
  }
}

// ---- Tests -----------------------------------------------------------------------------------

TEST(CodecReference, TargetsIncludeAvx2OrBetterWhenTheCpuHasIt) {
  // Not a correctness check: documents which kernels ran in this test binary.
  std::string names;
  for (int64_t t : internal::CompiledTargets()) names += std::string(hwy::TargetName(t)) + " ";
  RecordProperty("targets", names);
  std::cout << "codec kernels compiled and runnable here: " << names << "\n";
  EXPECT_FALSE(names.empty());
}

TEST(CodecReference, Fp16ReferenceMatchesKnownValues) {
  // Sanity of the reference itself before it judges the kernels.
  EXPECT_EQ(RefF16(1.0f), 0x3C00);
  EXPECT_EQ(RefF16(-2.0f), 0xC000);
  EXPECT_EQ(RefF16(65504.0f), 0x7BFF);
  EXPECT_EQ(RefF16(65519.996f), 0x7BFF);
  EXPECT_EQ(RefF16(65520.0f), 0x7C00);
  EXPECT_EQ(RefF16(0x1p-24f), 0x0001);
  EXPECT_EQ(RefF16(0x1p-25f), 0x0000);         // tie to even (0)
  EXPECT_EQ(RefF16(0x1.000002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(RefF16(0x1.8p-24f), 0x0002);       // 1.5 ulp: tie to even (2)
  EXPECT_EQ(RefF16(1.0f + 0x1p-11f), 0x3C00);  // tie to even
  EXPECT_EQ(RefF16(1.0f + 0x1.8p-11f), 0x3C01);
  EXPECT_EQ(RefBf16(1.0f + 0x1p-8f), 0x3F80);         // tie to even
  EXPECT_EQ(RefBf16(FromBits(0x3F818000u)), 0x3F82);  // tie, odd -> up
  EXPECT_EQ(RefBf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(RefBf16(FromBits(0x7F800001u)), 0x7FC0);
}

TEST(CodecReference, Fp16EveryHalfAndItsRoundingNeighbours) {
  // For every fp16 value h: h itself, the float just below and above h, and the float just below,
  // at and above the midpoint to the next fp16: every rounding decision the encoder can take.
  std::vector<float> in;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1F) == 0x1F) continue;  // inf/NaN: in MakeRows' specials
    const float v = RefF16ToF32(static_cast<uint16_t>(h));
    const float next =
        RefF16ToF32(static_cast<uint16_t>(h + 1 == 0x7C00 || h + 1 == 0xFC00 ? h : h + 1));
    const float mid = static_cast<float>((static_cast<double>(v) + next) / 2);
    for (float f : {v, std::nextafter(v, -INFINITY), std::nextafter(v, INFINITY), mid,
                    std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) {
      in.push_back(f);
    }
  }
  for (float f : {65519.0f, 65519.996f, 65520.0f, 65520.004f, 1e30f, INFINITY}) {
    in.push_back(f);
    in.push_back(-f);
  }
  std::vector<uint8_t> want(in.size() * 2);
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t h = RefF16(in[i]);
    std::memcpy(&want[2 * i], &h, 2);
  }
  ForEachTarget([&] {
    std::vector<uint8_t> got(want.size());
    internal::EncodeFp16(in.data(), in.size(), got.data());
    ExpectSameBytes(got, want, "fp16 encode");
  });
}

TEST(CodecReference, Fp16DecodeEveryBitPattern) {
  std::vector<uint8_t> in(0x10000 * 2);
  std::vector<float> want(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    in[2 * h] = h & 0xFF;
    in[2 * h + 1] = h >> 8;
    want[h] = RefF16ToF32(static_cast<uint16_t>(h));
  }
  ForEachTarget([&] {
    std::vector<float> got(want.size());
    internal::DecodeFp16(in.data(), want.size(), got.data());
    ExpectSameBits(got, want, "fp16 decode");
  });
}

TEST(CodecReference, RawFormatsMatchOnRandomRowsWithSpecials) {
  for (uint32_t dim : {1u, 3u, 17u, 100u, 128u, 1000u, 1024u}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const size_t rows = 37;
    const std::vector<float> x = MakeRows(rows, dim, dim, /*specials=*/true);
    for (Format f : {Format::kFp16, Format::kBf16}) {
      SCOPED_TRACE(std::string(FormatName(f)));
      std::vector<uint8_t> want(x.size() * 2);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = f == Format::kFp16 ? RefF16(x[i]) : RefBf16(x[i]);
        std::memcpy(&want[2 * i], &h, 2);
      }
      std::vector<float> want_dec(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = static_cast<uint16_t>(want[2 * i] | want[2 * i + 1] << 8);
        want_dec[i] = f == Format::kFp16 ? RefF16ToF32(h) : FromBits(uint32_t{h} << 16);
      }
      auto codec = RowCodec::Create(f, dim);
      ASSERT_TRUE(codec.ok());
      ForEachTarget([&] {
        std::vector<uint8_t> got(rows * codec->row_bytes());
        codec->Encode(x.data(), rows, got.data());
        ExpectSameBytes(got, want, "encode");
        std::vector<float> dec(x.size());
        codec->Decode(got.data(), rows, dec.data());
        ExpectSameBits(dec, want_dec, "decode");
      });
    }
  }
}

// fp8 and fp8_e5m2 rounding over a dense sweep of f32 values at scale 1 (rows whose first
// value is the format's max): every 61st bit pattern from 0 to max, both signs, plus each
// grid value, its midpoints to the next and their f32 neighbours.
TEST(CodecReference, Fp8RoundingSweep) {
  for (auto [format, ref] : {std::pair{Format::kFp8, kRefE4m3}, {Format::kFp8E5m2, kRefE5m2}}) {
    SCOPED_TRACE(std::string(FormatName(format)));
    std::vector<float> in;
    const uint32_t top = Bits(static_cast<float>(ref.max));
    for (uint32_t u = 0; u <= top; u += 61) in.push_back(FromBits(u));
    for (int b = 0; b < 0x7F; ++b) {
      const float v = RefFp8Value(ref, static_cast<uint8_t>(b));
      const float next = RefFp8Value(ref, static_cast<uint8_t>(b + 1));
      if (!std::isfinite(v) || !std::isfinite(next)) continue;
      const float mid = static_cast<float>((double{v} + next) / 2);
      for (float f : {v, std::nextafter(v, 0.0f), std::nextafter(v, INFINITY), mid,
                      std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
        if (f <= ref.max) in.push_back(f);
      }
    }
    const size_t n = in.size();
    for (size_t i = 0; i < n; ++i) in.push_back(-in[i]);
    const uint32_t dim = 1024;
    const size_t rows = (in.size() + dim - 2) / (dim - 1);
    std::vector<float> x(rows * dim, 0.0f);
    for (size_t r = 0; r < rows; ++r) {
      x[r * dim] = static_cast<float>(ref.max);  // amax = max: scale 1, inv 1
      for (uint32_t j = 1; j < dim && r * (dim - 1) + j - 1 < in.size(); ++j) {
        x[r * dim + j] = in[r * (dim - 1) + j - 1];
      }
    }
    auto codec = RowCodec::Create(format, dim);
    ASSERT_TRUE(codec.ok());
    std::vector<uint8_t> got(rows * codec->row_bytes());
    codec->Encode(x.data(), rows, got.data());
    size_t wrong = 0;
    for (size_t r = 0; r < rows; ++r) {
      for (uint32_t j = 0; j < dim; ++j) {
        const uint8_t want = RefFp8(ref, x[r * dim + j]);
        const uint8_t have = got[r * (dim + 4) + 4 + j];
        if (have != want && wrong++ < 10) {
          ADD_FAILURE() << std::hexfloat << x[r * dim + j] << ": got 0x" << std::hex << int(have)
                        << ", want 0x" << int(want);
        }
      }
    }
    EXPECT_EQ(wrong, 0u) << "of " << rows * dim << " values";
  }
}

// Whole rows (MakeRows: Gaussian at scales 1e-9..1e9, zeros, infinities, NaNs, extremes, tiny
// rows) against the README's row rules, bytes and decoded floats bit for bit.
TEST(CodecReference, Fp8RowsMatchBitForBit) {
  for (auto [format, ref] : {std::pair{Format::kFp8, kRefE4m3}, {Format::kFp8E5m2, kRefE5m2}}) {
    SCOPED_TRACE(std::string(FormatName(format)));
    for (uint32_t dim : {1u, 3u, 17u, 64u, 100u, 128u, 1000u}) {
      SCOPED_TRACE("dim " + std::to_string(dim));
      const size_t rows = 41;
      std::vector<float> x = MakeRows(rows, dim, dim + 7, /*specials=*/true);
      for (uint32_t j = 0; j < dim; ++j) {  // tiny rows: max / amax overflows, amax / max is 0
        x[dim + j] *= 1e-37f;
        x[2 * dim + j] *= 1e-43f;
        x[3 * dim + j] = j % 2 ? 0.0f : std::numeric_limits<float>::infinity();
      }
      const std::vector<uint8_t> want = RefEncodeFp8(ref, x, rows, dim);
      auto codec = RowCodec::Create(format, dim);
      ASSERT_TRUE(codec.ok());
      std::vector<uint8_t> got(rows * codec->row_bytes());
      codec->Encode(x.data(), rows, got.data());
      ExpectSameBytes(got, want, "encode");
      std::vector<float> dec(x.size()), want_dec(x.size());
      codec->Decode(got.data(), rows, dec.data());
      for (size_t r = 0; r < rows; ++r) {
        float scale;
        std::memcpy(&scale, &want[r * (dim + 4)], 4);
        for (uint32_t j = 0; j < dim; ++j) {
          want_dec[r * dim + j] = RefFp8Value(ref, want[r * (dim + 4) + 4 + j]) * scale;
        }
      }
      for (size_t i = 0; i < x.size(); ++i) {
        if (std::isnan(want_dec[i])) {
          ASSERT_TRUE(std::isnan(dec[i])) << i;
        } else {
          ASSERT_EQ(Bits(dec[i]), Bits(want_dec[i])) << i;
        }
      }
    }
  }
}

TEST(CodecReference, Int8MatchesBitForBit) {
  std::vector<uint32_t> dims;
  for (uint32_t d = 1; d <= 70; ++d) dims.push_back(d);
  for (uint32_t d : {96u, 100u, 1000u, 1024u, 4096u}) dims.push_back(d);
  for (uint32_t dim : dims) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const size_t rows = 9;
    const std::vector<float> x = MakeRows(rows, dim, 1000 + dim, /*specials=*/true);
    const std::vector<uint8_t> want = RefEncodeInt8(x, rows, dim);
    const std::vector<float> want_dec = RefDecodeInt8(want, rows, dim);
    auto codec = RowCodec::Create(Format::kInt8, dim);
    ASSERT_TRUE(codec.ok());
    ASSERT_EQ(codec->row_bytes() * rows, want.size());
    ForEachTarget([&] {
      std::vector<uint8_t> got(want.size());
      codec->Encode(x.data(), rows, got.data());
      ExpectSameBytes(got, want, "encode");
      std::vector<float> dec(x.size());
      codec->Decode(got.data(), rows, dec.data());
      ExpectSameBits(dec, want_dec, "decode");
    });
  }
}

TEST(CodecReference, TurboNormUsesTheCanonicalSummationOrder) {
  // Data where the order matters: a few big values among small ones that a single running sum
  // would absorb; a different partial-sum layout gives a different float.
  for (uint32_t n : {8u, 16u, 32u, 64u, 128u, 1024u, 4096u}) {
    std::mt19937_64 rng(n);
    std::uniform_real_distribution<float> small(0.5f, 1.5f);
    std::vector<float> x(n), sq(n);
    for (uint32_t rep = 0; rep < 50; ++rep) {
      for (uint32_t i = 0; i < n; ++i) {
        x[i] = (i % 37 == rep % 37) ? 4096.0f * small(rng) : small(rng);
      }
      for (uint32_t i = 0; i < n; ++i) sq[i] = x[i] * x[i];
      const float want = RefTurbo::Sum32(sq);
      float sequential = 0;
      for (float v : sq) sequential += v;
      if (n >= 64 && rep == 0) {
        EXPECT_NE(want, sequential) << "the data does not discriminate summation orders";
      }
      ForEachTarget([&] {
        EXPECT_EQ(Bits(internal::CanonicalSumOfSquares(x.data(), n)), Bits(want)) << "n " << n;
      });
    }
  }
}

TEST(CodecReference, TurboMatchesWithinOneMillionth) {
  struct Case {
    uint32_t dim, block;
  };
  const Case kCases[] = {{8, 8},     {64, 8},     {64, 32},     {128, 128},  {256, 64},
                         {384, 128}, {1024, 128}, {1024, 1024}, {4096, 4096}};
  for (Format f : {Format::kTurbo4, Format::kTurbo3, Format::kTurbo2}) {
    const int bits = f == Format::kTurbo4 ? 4 : f == Format::kTurbo3 ? 3 : 2;
    for (const Case& c : kCases) {
      SCOPED_TRACE(std::string(FormatName(f)) + " dim " + std::to_string(c.dim) + " block " +
                   std::to_string(c.block));
      const size_t rows = c.dim >= 1024 ? 16 : 64;
      std::vector<float> x = MakeRows(rows, c.dim, 7 * c.dim + c.block, /*specials=*/false);
      std::fill(x.begin(), x.begin() + c.dim, 0.0f);                      // a zero row
      x[c.dim + 1] = std::numeric_limits<float>::quiet_NaN();             // block -> zeros
      x[2 * c.dim + c.dim - 1] = std::numeric_limits<float>::infinity();  // last block -> zeros

      const RefTurbo ref(bits, c.block);
      const size_t n_blocks = rows * (c.dim / c.block);
      std::vector<uint8_t> want(n_blocks * ref.BlockBytes());
      std::vector<float> want_dec(x.size());
      for (size_t b = 0; b < n_blocks; ++b) {
        ref.EncodeBlock(&x[b * c.block], &want[b * ref.BlockBytes()]);
        ref.DecodeBlock(&want[b * ref.BlockBytes()], &want_dec[b * c.block]);
      }
      auto codec = RowCodec::Create(f, c.dim, c.block);
      ASSERT_TRUE(codec.ok()) << codec.status().message();
      ASSERT_EQ(codec->row_bytes() * rows, want.size());
      ForEachTarget([&] {
        std::vector<uint8_t> got(want.size());
        codec->Encode(x.data(), rows, got.data());
        ExpectSameBytes(got, want, "encode");
        std::vector<float> dec(x.size());
        codec->Decode(got.data(), rows, dec.data());
        // Contract: |got - want| <= 1e-6 * max |want| over the row.
        for (size_t r = 0; r < rows; ++r) {
          float amax = 0, worst = 0;
          for (uint32_t j = 0; j < c.dim; ++j) {
            amax = std::max(amax, std::fabs(want_dec[r * c.dim + j]));
            worst = std::max(worst, std::fabs(dec[r * c.dim + j] - want_dec[r * c.dim + j]));
          }
          ASSERT_LE(worst, 1e-6f * amax) << "row " << r;
        }
        ExpectSameBits(dec, want_dec, "decode (designed bit-exact)");
      });
    }
  }
}

}  // namespace
}  // namespace pion::codec
