// SIMD kernels of the value codecs. Highway compiles this file once per x86 target
// (foreach_target) and HWY_DYNAMIC_DISPATCH picks the best one the CPU supports at run time.
//
// Every kernel performs the same IEEE operations in the same order on every target, so the bytes
// and floats do not depend on the CPU: no FMA contraction (-ffp-contract=off), the turbo sums in
// the canonical 32-partial-sum order (CanonicalSum, not a target-width reduction), and the
// Hadamard butterflies stage by stage in increasing stride. README.md documents the arithmetic.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "store/codec/codec_simd.cc"
#include <hwy/aligned_allocator.h>
#include <hwy/cache_control.h>
#include <hwy/foreach_target.h>  // must precede highway.h; re-includes this file per target
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common/bf16_simd-inl.h"
#include "store/codec/codec_internal.h"

HWY_BEFORE_NAMESPACE();
namespace pion::codec::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// ---- fp16 ------------------------------------------------------------------------------------
// AVX2 and AVX-512 targets have F16C (vcvtps2ph with imm 8 = round to nearest even, vcvtph2ps);
// Highway's emulation on older targets truncates and mishandles inf/NaN, so they use the scalar
// conversion, which the tests pin to the F16C results bit for bit.

void EncodeFp16(const float* HWY_RESTRICT in, size_t n, uint8_t* HWY_RESTRICT out) {
  size_t i = 0;
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t lanes = hn::Lanes(df);
  auto* out16 = reinterpret_cast<hwy::float16_t*>(out);
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, in + i)), dh, out16 + i);
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, in + i + lanes)), dh, out16 + i + lanes);
  }
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, in + i)), dh, out16 + i);
  }
#endif
  for (; i < n; ++i) StoreLe16(out + 2 * i, F32ToF16Bits(in[i]));
}

void DecodeFp16(const uint8_t* HWY_RESTRICT in, size_t n, float* HWY_RESTRICT out) {
  size_t i = 0;
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t lanes = hn::Lanes(df);
  const auto* in16 = reinterpret_cast<const hwy::float16_t*>(in);
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, in16 + i)), df, out + i);
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, in16 + i + lanes)), df, out + i + lanes);
  }
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, in16 + i)), df, out + i);
  }
#endif
  for (; i < n; ++i) out[i] = F16BitsToF32(LoadLe16(in + 2 * i));
}

// ---- bf16 ------------------------------------------------------------------------------------
// Round to nearest even by integer arithmetic: add 0x7FFF plus the lowest kept bit, keep the top
// 16 bits (finite values past the largest bf16 round to inf). NaN -> top 16 bits | 0x0040 (quiet).

inline uint16_t F32ToBf16Bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

void EncodeBf16(const float* HWY_RESTRICT in, size_t n, uint8_t* HWY_RESTRICT out) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> du16;
  const size_t lanes = hn::Lanes(df);
  auto* out16 = reinterpret_cast<uint16_t*>(out);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    // Twelve integer ops per vector leave the hardware prefetcher behind on long rows (~1.3x
    // measured at 16 MiB); prefetching 4 KiB ahead does not fault past the end.
    hwy::Prefetch(in + i + 1024);
    const auto v = hn::LoadU(df, in + i);
    const auto bits = hn::BitCast(du, v);
    const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
    const auto rounded = hn::ShiftRight<16>(hn::Add(hn::Add(bits, hn::Set(du, 0x7FFFu)), lsb));
    const auto quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x40u));
    const auto result = hn::IfThenElse(hn::RebindMask(du, hn::Eq(v, v)), rounded, quiet_nan);
    hn::StoreU(hn::TruncateTo(du16, result), du16, out16 + i);
  }
  for (; i < n; ++i) StoreLe16(out + 2 * i, F32ToBf16Bits(in[i]));
}

void DecodeBf16(const uint8_t* HWY_RESTRICT in, size_t n, float* HWY_RESTRICT out) {
  simd::HWY_NAMESPACE::WidenBf16(in, n, out);
}

// ---- int8 ------------------------------------------------------------------------------------
// Per block of 32 (the last one may be shorter): d = fp16(amax / 127), saturated at 65504;
// q = clamp(round_half_away(x * (1 / d)), -127, 127) with 1/d computed from the stored fp16 d
// (0 when d is 0); NaN inputs count as 0.

constexpr uint32_t kInt8Block = 32;

// Rounds half away from zero exactly like std::round: x - trunc(x) is exact in float.
template <class D, class V>
HWY_INLINE V RoundHalfAway(D d, V x) {
  const V t = hn::Trunc(x);
  const auto away = hn::Ge(hn::Abs(hn::Sub(x, t)), hn::Set(d, 0.5f));
  return hn::Add(t, hn::IfThenElseZero(away, hn::CopySign(hn::Set(d, 1.0f), x)));
}

inline int8_t QuantizeInt8(float x, float inv_scale) {
  const float xs = x == x ? x : 0.0f;
  const float r = std::round(xs * inv_scale);
  return static_cast<int8_t>(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
}

// |v| with NaN lanes counted as 0.
template <class D, class V>
HWY_INLINE V AbsOrZero(D /*d*/, V v) {
  return hn::Abs(hn::IfThenElseZero(hn::Eq(v, v), v));
}

// q[j] = clamp(round_half_away(x[j] * inv_scale), -127, 127) for j < len.
HWY_INLINE void QuantizeInt8Block(const float* HWY_RESTRICT x, size_t len, float inv_scale,
                                  int8_t* HWY_RESTRICT q) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<int8_t, DF> di8;
  const size_t lanes = hn::Lanes(df);
  const auto vinv = hn::Set(df, inv_scale);
  size_t j = 0;
  for (; j + lanes <= len; j += lanes) {
    const auto v = hn::LoadU(df, x + j);
    const auto r = RoundHalfAway(df, hn::Mul(hn::IfThenElseZero(hn::Eq(v, v), v), vinv));
    const auto clamped = hn::Min(hn::Max(r, hn::Set(df, -127.0f)), hn::Set(df, 127.0f));
    hn::StoreU(hn::DemoteTo(di8, hn::ConvertTo(di, clamped)), di8, q + j);
  }
  for (; j < len; ++j) q[j] = QuantizeInt8(x[j], inv_scale);
}

#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
// Four full blocks at once: their abs-maxima are reduced into the four lanes of one 128-bit
// vector and the scales computed there together, with the same IEEE operations as the scalar
// path (min(d, 65504) then RNE equals ScaleToF16; max is exact in any order). Returns the
// number of bytes written (4 * 34).
HWY_INLINE size_t EncodeInt8Quad(const float* HWY_RESTRICT x, uint8_t* HWY_RESTRICT out) {
  const DF df;
  const hn::Full128<float> d4;
  const hn::Repartition<uint64_t, decltype(d4)> du64;
  const hn::Rebind<hwy::float16_t, decltype(d4)> dh4;
  const hn::Rebind<uint16_t, decltype(d4)> du16;
  const size_t lanes = hn::Lanes(df);
  hn::Vec<decltype(d4)> m[4];
  for (size_t k = 0; k < 4; ++k) {
    auto acc = AbsOrZero(df, hn::LoadU(df, x + k * kInt8Block));
    for (size_t j = lanes; j < kInt8Block; j += lanes) {
      acc = hn::Max(acc, AbsOrZero(df, hn::LoadU(df, x + k * kInt8Block + j)));
    }
#if HWY_TARGET <= HWY_AVX3  // 16 lanes: 512 -> 256 -> 128 bits
    const hn::Half<DF> dh;
    const auto m8 = hn::Max(hn::LowerHalf(dh, acc), hn::UpperHalf(dh, acc));
    m[k] = hn::Max(hn::LowerHalf(d4, m8), hn::UpperHalf(d4, m8));
#else  // AVX2, 8 lanes: 256 -> 128 bits
    m[k] = hn::Max(hn::LowerHalf(d4, acc), hn::UpperHalf(d4, acc));
#endif
  }
  // 4x4 transpose-reduce: lane k of amax = max over the four lanes of m[k].
  const auto t0 = hn::Max(hn::InterleaveLower(d4, m[0], m[1]), hn::InterleaveUpper(d4, m[0], m[1]));
  const auto t1 = hn::Max(hn::InterleaveLower(d4, m[2], m[3]), hn::InterleaveUpper(d4, m[2], m[3]));
  const auto u0 = hn::BitCast(du64, t0), u1 = hn::BitCast(du64, t1);
  const auto amax = hn::Max(hn::BitCast(d4, hn::InterleaveLower(du64, u0, u1)),
                            hn::BitCast(d4, hn::InterleaveUpper(du64, u0, u1)));
  const auto d = hn::Min(hn::Div(amax, hn::Set(d4, 127.0f)), hn::Set(d4, 65504.0f));
  const auto d16 = hn::DemoteTo(dh4, d);
  const auto scale = hn::PromoteTo(d4, d16);
  const auto inv =
      hn::IfThenElseZero(hn::Ne(scale, hn::Zero(d4)), hn::Div(hn::Set(d4, 1.0f), scale));
  alignas(16) float inv_k[4];
  alignas(16) uint16_t bits_k[4];
  hn::Store(inv, d4, inv_k);
  hn::Store(hn::BitCast(du16, d16), du16, bits_k);
  for (size_t k = 0; k < 4; ++k, out += 2 + kInt8Block) {
    StoreLe16(out, bits_k[k]);
    QuantizeInt8Block(x + k * kInt8Block, kInt8Block, inv_k[k], reinterpret_cast<int8_t*>(out + 2));
  }
  return 4 * (2 + kInt8Block);
}
#endif

void EncodeInt8(const float* HWY_RESTRICT rows, size_t n_rows, uint32_t dim,
                uint8_t* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  for (size_t r = 0; r < n_rows; ++r) {
    const float* row = rows + r * dim;
    uint32_t b = 0;
#if HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
    for (; b + 4 * kInt8Block <= dim; b += 4 * kInt8Block) out += EncodeInt8Quad(row + b, out);
#endif
    for (; b < dim; b += kInt8Block) {
      const size_t len = std::min(kInt8Block, dim - b);
      const float* x = row + b;
      float amax = 0.0f;
      size_t j = 0;
      if (len >= lanes) {
        auto m = hn::Zero(df);
        for (; j + lanes <= len; j += lanes) m = hn::Max(m, AbsOrZero(df, hn::LoadU(df, x + j)));
        amax = hn::GetLane(hn::MaxOfLanes(df, m));
      }
      for (; j < len; ++j) amax = std::fabs(x[j]) > amax ? std::fabs(x[j]) : amax;  // NaN: skip

      const uint16_t scale_bits = ScaleToF16(amax / 127.0f);
      const float scale = F16BitsToF32(scale_bits);
      StoreLe16(out, scale_bits);
      QuantizeInt8Block(x, len, scale != 0.0f ? 1.0f / scale : 0.0f,
                        reinterpret_cast<int8_t*>(out + 2));
      out += 2 + len;
    }
  }
}

void DecodeInt8(const uint8_t* HWY_RESTRICT in, size_t n_rows, uint32_t dim,
                float* HWY_RESTRICT out) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<int8_t, DF> di8;
  const size_t lanes = hn::Lanes(df);
  for (size_t r = 0; r < n_rows; ++r) {
    for (uint32_t b = 0; b < dim; b += kInt8Block) {
      const size_t len = std::min(kInt8Block, dim - b);
      const float scale = F16BitsToF32(LoadLe16(in));
      const auto* q = reinterpret_cast<const int8_t*>(in + 2);
      const auto vscale = hn::Set(df, scale);
      size_t j = 0;
      for (; j + lanes <= len; j += lanes) {
        const auto qf = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(di8, q + j)));
        hn::StoreU(hn::Mul(qf, vscale), df, out + j);
      }
      for (; j < len; ++j) out[j] = static_cast<float>(q[j]) * scale;
      in += 2 + len;
      out += len;
    }
  }
}

// ---- turbo -----------------------------------------------------------------------------------

// Sums in the canonical order (README.md "Reproducibility"): 32 partial sums s[j] over the
// i = j (mod 32), each accumulated in increasing i (s[j] = 0 when j >= n), then folded
// s[j] += s[j+w] for w = 16, 8, 4, 2, 1. With vectors of L lanes, virtual lane j lives in
// accumulator j / L, so every target adds the same numbers in the same order, and the chain of
// dependent adds is n/32 long.
template <class D>
struct CanonicalSum {
  static constexpr size_t kLanes = hn::MaxLanes(D());
  static_assert(32 % kLanes == 0, "lanes must divide 32");
  static constexpr size_t kAcc = 32 / kLanes;
  hn::Vec<D> acc[kAcc];

  explicit CanonicalSum(D d) {
    for (size_t a = 0; a < kAcc; ++a) acc[a] = hn::Zero(d);
  }
  // v holds elements [i, i + kLanes) of the block; call in increasing i.
  HWY_INLINE void Add(size_t i, hn::Vec<D> v) {
    const size_t a = (i / kLanes) % kAcc;
    acc[a] = hn::Add(acc[a], v);
  }
  HWY_INLINE float Total(D d) {
    for (size_t k = kAcc; k > 1; k /= 2) {  // folds w >= kLanes, one vector add per lane group
      for (size_t a = 0; a < k / 2; ++a) acc[a] = hn::Add(acc[a], acc[a + k / 2]);
    }
    alignas(64) float part[kLanes];
    hn::Store(acc[0], d, part);
    for (size_t w = kLanes / 2; w >= 1; w /= 2) {
      for (size_t j = 0; j < w; ++j) part[j] += part[j + w];
    }
    return part[0];
  }
};

// Butterfly stages with stride h < lanes act within one vector: lane i pairs with lane i ^ h and
// becomes v[i] + v[i^h] (i & h == 0) or v[i^h] - v[i] (i & h != 0), i.e. (a, b) -> (a+b, a-b).
template <class D>
struct InVectorStages {
  using IndicesT = decltype(hn::IndicesFromVec(D(), hn::Zero(hn::RebindToSigned<D>())));
  static constexpr size_t kMaxStages = 5;  // up to 32 lanes
  IndicesT partner[kMaxStages];
  hn::Vec<D> negate[kMaxStages];
  size_t count = 0;

  explicit InVectorStages(D d) {
    const hn::RebindToSigned<D> di;
    const auto iota = hn::Iota(di, 0);
    for (size_t h = 1; h < hn::Lanes(d) && count < kMaxStages; h *= 2, ++count) {
      const auto hv = hn::Set(di, static_cast<int32_t>(h));
      partner[count] = hn::IndicesFromVec(d, hn::Xor(iota, hv));
      const auto upper = hn::Ne(hn::And(iota, hv), hn::Zero(di));
      negate[count] = hn::BitCast(d, hn::IfThenElseZero(upper, hn::Set(di, INT32_MIN)));
    }
  }

  HWY_INLINE hn::Vec<D> Apply(hn::Vec<D> v) const {
    for (size_t s = 0; s < count; ++s) {
      v = hn::Add(hn::Xor(v, negate[s]), hn::TableLookupLanes(v, partner[s]));
    }
    return v;
  }
};

// The remaining stages (stride h >= lanes) over an aligned block w of n floats, two stages per
// pass where possible; each element sees the same adds in the same order as stage-by-stage.
template <class D>
HWY_INLINE void CrossVectorStages(D d, float* HWY_RESTRICT w, size_t n) {
  const size_t lanes = hn::Lanes(d);
  size_t h = lanes;
  for (; 4 * h <= n; h *= 4) {
    for (size_t base = 0; base < n; base += 4 * h) {
      for (size_t j = base; j < base + h; j += lanes) {
        const auto a = hn::Load(d, w + j);
        const auto b = hn::Load(d, w + j + h);
        const auto c = hn::Load(d, w + j + 2 * h);
        const auto e = hn::Load(d, w + j + 3 * h);
        const auto ab0 = hn::Add(a, b), ab1 = hn::Sub(a, b);
        const auto ce0 = hn::Add(c, e), ce1 = hn::Sub(c, e);
        hn::Store(hn::Add(ab0, ce0), d, w + j);
        hn::Store(hn::Add(ab1, ce1), d, w + j + h);
        hn::Store(hn::Sub(ab0, ce0), d, w + j + 2 * h);
        hn::Store(hn::Sub(ab1, ce1), d, w + j + 3 * h);
      }
    }
  }
  if (2 * h <= n) {
    for (size_t j = 0; j < h; j += lanes) {
      const auto a = hn::Load(d, w + j);
      const auto b = hn::Load(d, w + j + h);
      hn::Store(hn::Add(a, b), d, w + j);
      hn::Store(hn::Sub(a, b), d, w + j + h);
    }
  }
}

// Centroid (or squared centroid) for each index lane; tables hold 16 floats.
template <int kBits, class D, class VI>
HWY_INLINE hn::Vec<D> LookupTable(D d, VI idx, const float* HWY_RESTRICT table) {
  constexpr size_t kLevels = size_t{1} << kBits;
  constexpr size_t kLanes = hn::MaxLanes(D());
  if constexpr (kLanes >= kLevels) {
    return hn::TableLookupLanes(hn::LoadU(d, table), hn::IndicesFromVec(d, idx));
  } else {
    const hn::RebindToSigned<D> di;
    const auto lane = hn::IndicesFromVec(d, hn::And(idx, hn::Set(di, kLanes - 1)));
    auto r = hn::TableLookupLanes(hn::LoadU(d, table), lane);
    for (size_t c = 1; c < kLevels / kLanes; ++c) {
      const auto first = hn::Set(di, static_cast<int32_t>(c * kLanes) - 1);
      const auto in_chunk = hn::RebindMask(d, hn::Gt(idx, first));  // idx >= c * kLanes
      r = hn::IfThenElse(in_chunk, hn::TableLookupLanes(hn::LoadU(d, table + c * kLanes), lane), r);
    }
    return r;
  }
}

// Index of the Lloyd-Max cell of t (a coordinate scaled to N(0,1)): with c = the number of
// positive boundaries b <= |t|, t < 0 -> levels/2 - 1 - c, otherwise levels/2 + c.
template <int kBits, class D>
HWY_INLINE hn::Vec<hn::RebindToSigned<D>> QuantizeIndex(D d, hn::Vec<D> t,
                                                        const TurboTable& table) {
  constexpr int kHalf = 1 << (kBits - 1);
  const hn::RebindToSigned<D> di;
  const auto a = hn::Abs(t);
  auto count = hn::Zero(di);
  for (int k = 0; k < kHalf - 1; ++k) {
    const auto ge = hn::RebindMask(di, hn::Ge(a, hn::Set(d, table.positive_bounds[k])));
    count = hn::Sub(count, hn::VecFromMask(di, ge));  // mask lanes are -1
  }
  const auto negative = hn::RebindMask(di, hn::Lt(t, hn::Zero(d)));
  return hn::IfThenElse(negative, hn::Sub(hn::Set(di, kHalf - 1), count),
                        hn::Add(hn::Set(di, kHalf), count));
}

// Index bit packing in registers, for vectors of at least 8 lanes (8 indices = kBits whole bytes):
// the same LSB-first stream as PackIndices/UnpackIndices (codec_internal.h), which 128-bit
// targets use through the idx scratch buffer.
template <class D>
inline constexpr bool kPackInRegisters = hn::MaxLanes(D()) >= 8;

// Writes the kLanes * kBits / 8 bytes of q's indices (int32 lanes, each < 2^kBits) to out.
template <int kBits, class D>
HWY_INLINE void PackLanes(D d, hn::Vec<hn::RebindToSigned<D>> q, uint8_t* HWY_RESTRICT out) {
  const hn::Rebind<uint8_t, D> du8;                     // one byte per index
  const hn::Repartition<uint64_t, decltype(du8)> du64;  // eight indices per u64 lane
  auto x = hn::BitCast(du64, hn::DemoteTo(du8, q));
  x = hn::And(hn::Or(x, hn::ShiftRight<8 - kBits>(x)), hn::Set(du64, kPairMask<kBits>));
  x = hn::And(hn::Or(x, hn::ShiftRight<16 - 2 * kBits>(x)), hn::Set(du64, kQuadMask<kBits>));
  x = hn::Or(x, hn::ShiftRight<32 - 4 * kBits>(x));  // low kBits bytes of each lane
  if constexpr (kBits == 4) {
    const hn::Rebind<uint32_t, decltype(du64)> du32;
    hn::StoreU(hn::TruncateTo(du32, x), du32, reinterpret_cast<uint32_t*>(out));
  } else if constexpr (kBits == 2) {
    const hn::Rebind<uint16_t, decltype(du64)> du16;
    hn::StoreU(hn::TruncateTo(du16, x), du16, reinterpret_cast<uint16_t*>(out));
  } else {
    for (size_t k = 0; k < hn::Lanes(du64); ++k) {
      StoreGroup<kBits>(out + kBits * k, hn::ExtractLane(x, k));
    }
  }
}

// Reads the indices of lanes [i, i + kLanes) from a block's packed stream: every 128-bit block of
// the vector holds the same 16 bytes from `chunk` (needs 16 readable bytes); lane j takes the two
// bytes at bit kBits*j, shifts and masks.
template <int kBits, class D>
struct LaneUnpacker {
  using DU = hn::RebindToUnsigned<D>;
  using DU8 = hn::Repartition<uint8_t, D>;
  hn::Vec<DU8> pattern;
  hn::Vec<DU> shift;

  explicit LaneUnpacker(D d) {
    const DU du;
    const auto bit = hn::Mul(hn::Iota(du, 0), hn::Set(du, kBits));
    const auto byte = hn::ShiftRight<3>(bit);
    const auto next = hn::Add(byte, hn::Set(du, 1));
    pattern = hn::BitCast(DU8(), hn::Or(byte, hn::Mul(next, hn::Set(du, 0x01010100u))));
    shift = hn::And(bit, hn::Set(du, 7));
  }

  HWY_INLINE hn::Vec<hn::RebindToSigned<D>> Indices(const uint8_t* HWY_RESTRICT chunk) const {
    const DU du;
    const auto src = hn::LoadDup128(DU8(), chunk);
    const auto two_bytes = hn::BitCast(du, hn::TableLookupBytes(src, pattern));
    const auto idx = hn::And(hn::Shr(two_bytes, shift), hn::Set(du, (1u << kBits) - 1));
    return hn::BitCast(hn::RebindToSigned<D>(), idx);
  }
};

// Scratch for one block: w (rotated values), idx (one index per byte) and padded (a copy of the
// last packed indices with 16 readable bytes after them). On the stack for blocks up to 1024,
// so that encoding or decoding a single row does not allocate.
class TurboScratch {
 public:
  explicit TurboScratch(size_t n) {
    if (n > kInline) {
      heap_w_ = hwy::AllocateAligned<float>(n);
      heap_bytes_ = hwy::AllocateAligned<uint8_t>(n + n / 2 + 16);
    }
    w = n > kInline ? heap_w_.get() : inline_w_;
    idx = n > kInline ? heap_bytes_.get() : inline_bytes_;
    padded = idx + n;
  }
  float* w;
  uint8_t* idx;
  uint8_t* padded;

 private:
  static constexpr size_t kInline = 1024;
  alignas(64) float inline_w_[kInline];
  alignas(64) uint8_t inline_bytes_[kInline + kInline / 2 + 16];
  hwy::AlignedFreeUniquePtr<float[]> heap_w_;
  hwy::AlignedFreeUniquePtr<uint8_t[]> heap_bytes_;
};

template <int kBits, class D>
void EncodeTurboRows(D d, const float* HWY_RESTRICT rows, size_t n_blocks, size_t n,
                     uint8_t* HWY_RESTRICT out) {
  constexpr int kHalf = 1 << (kBits - 1);
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint8_t, D> du8;
  const size_t lanes = hn::Lanes(d);
  const TurboTable& table = TurboTableFor(kBits);
  const uint32_t* sign1 = SignMasks(1);
  const uint32_t* sign2 = SignMasks(2);
  const float sqrt_n = std::sqrt(static_cast<float>(n));
  const InVectorStages<D> stages(d);
  TurboScratch scratch(n);
  float* HWY_RESTRICT w = scratch.w;
  uint8_t* HWY_RESTRICT idx = scratch.idx;
  const size_t packed_bytes = n * kBits / 8;

  for (size_t blk = 0; blk < n_blocks; ++blk, rows += n, out += 2 + packed_bytes) {
    const float* HWY_RESTRICT x = rows;
    // One pass: ||x||^2, and w = H * D1 * x (unnormalized) up to the in-vector stages.
    CanonicalSum<D> norm_sq(d);
    for (size_t i = 0; i < n; i += lanes) {
      const auto v = hn::LoadU(d, x + i);
      norm_sq.Add(i, hn::Mul(v, v));
      hn::Store(stages.Apply(hn::Xor(v, hn::BitCast(d, hn::LoadU(du, sign1 + i)))), d, w + i);
    }
    const float norm = std::sqrt(norm_sq.Total(d));
    if (!(norm > 0.0f) || !std::isfinite(norm)) {  // zero or non-finite: decodes to zeros
      StoreLe16(out, 0);
      std::memset(idx, kHalf, n);
      PackIndices<kBits>(idx, n, out + 2);
      continue;
    }
    CrossVectorStages(d, w, n);
    // t = D2 * w / ||x|| ~ N(0, 1) per coordinate -> index; sum the chosen centroids' squares.
    const auto inv_norm = hn::Set(d, 1.0f / norm);
    CanonicalSum<D> centroid_sq(d);
    for (size_t i = 0; i < n; i += lanes) {
      const auto t =
          hn::Mul(hn::Xor(hn::Load(d, w + i), hn::BitCast(d, hn::LoadU(du, sign2 + i))), inv_norm);
      const auto q = QuantizeIndex<kBits>(d, t, table);
      if constexpr (kPackInRegisters<D>) {
        PackLanes<kBits>(d, q, out + 2 + i * kBits / 8);
      } else {
        hn::StoreU(hn::DemoteTo(du8, q), du8, idx + i);
      }
      centroid_sq.Add(i, LookupTable<kBits>(d, q, table.centroid_squares));
    }
    if constexpr (!kPackInRegisters<D>) PackIndices<kBits>(idx, n, out + 2);
    // Decoded norm = stored * ||c|| / sqrt(n) with c the chosen N(0,1) centroids; make it ||x||.
    const float centroid_norm = std::sqrt(centroid_sq.Total(d));
    StoreLe16(out, ScaleToF16((norm / centroid_norm) * sqrt_n));
  }
}

template <int kBits, class D>
void DecodeTurboRows(D d, const uint8_t* HWY_RESTRICT in, size_t n_blocks, size_t n,
                     float* HWY_RESTRICT out) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const size_t lanes = hn::Lanes(d);
  const TurboTable& table = TurboTableFor(kBits);
  const uint32_t* sign1 = SignMasks(1);
  const uint32_t* sign2 = SignMasks(2);
  const float inv_n = 1.0f / static_cast<float>(n);  // exact: n is a power of two
  const InVectorStages<D> stages(d);
  const size_t packed_bytes = n * kBits / 8;
  TurboScratch scratch(n);
  float* HWY_RESTRICT w = scratch.w;
  uint8_t* HWY_RESTRICT idx = scratch.idx;
  const uint8_t* in_end = in + n_blocks * (2 + packed_bytes);
  struct NoUnpacker {
    explicit NoUnpacker(D) {}
  };
  const std::conditional_t<kPackInRegisters<D>, LaneUnpacker<kBits, D>, NoUnpacker> unpacker(d);

  for (size_t blk = 0; blk < n_blocks; ++blk, in += 2 + packed_bytes, out += n) {
    const auto k = hn::Set(d, F16BitsToF32(LoadLe16(in)) * inv_n);
    const uint8_t* packed = in + 2;
    if constexpr (kPackInRegisters<D>) {
      if (in_end - packed < static_cast<ptrdiff_t>(packed_bytes + 16)) {
        // Near the end of the input LaneUnpacker's 16-byte loads would run past it.
        std::memcpy(scratch.padded, packed, packed_bytes);
        packed = scratch.padded;
      }
    } else {
      UnpackIndices<kBits>(packed, n, idx);
    }
    // x = D1 * H * (D2 * c) * (stored / n).
    for (size_t i = 0; i < n; i += lanes) {
      hn::Vec<decltype(di)> q;
      if constexpr (kPackInRegisters<D>) {
        q = unpacker.Indices(packed + i * kBits / 8);
      } else {
        q = hn::PromoteTo(di, hn::LoadU(du8, idx + i));
      }
      const auto c = LookupTable<kBits>(d, q, table.centroids);
      hn::Store(stages.Apply(hn::Xor(c, hn::BitCast(d, hn::LoadU(du, sign2 + i)))), d, w + i);
    }
    CrossVectorStages(d, w, n);
    for (size_t i = 0; i < n; i += lanes) {
      const auto v = hn::Mul(hn::Load(d, w + i), k);
      hn::StoreU(hn::Xor(v, hn::BitCast(d, hn::LoadU(du, sign1 + i))), d, out + i);
    }
  }
}

// Blocks smaller than a full vector (block 8 on AVX-512) use 8-lane vectors.
template <int kBits>
void EncodeTurboBits(const float* rows, size_t n_blocks, size_t n, uint8_t* out) {
  if (n >= hn::Lanes(DF())) {
    EncodeTurboRows<kBits>(DF(), rows, n_blocks, n, out);
  } else {
    EncodeTurboRows<kBits>(hn::CappedTag<float, 8>(), rows, n_blocks, n, out);
  }
}

template <int kBits>
void DecodeTurboBits(const uint8_t* in, size_t n_blocks, size_t n, float* out) {
  if (n >= hn::Lanes(DF())) {
    DecodeTurboRows<kBits>(DF(), in, n_blocks, n, out);
  } else {
    DecodeTurboRows<kBits>(hn::CappedTag<float, 8>(), in, n_blocks, n, out);
  }
}

void EncodeTurbo(int bits, const float* rows, size_t n_rows, uint32_t dim, uint32_t block,
                 uint8_t* out) {
  const size_t n_blocks = n_rows * (dim / block);
  if (n_blocks == 0) return;
  switch (bits) {
    case 4:
      return EncodeTurboBits<4>(rows, n_blocks, block, out);
    case 3:
      return EncodeTurboBits<3>(rows, n_blocks, block, out);
    default:
      return EncodeTurboBits<2>(rows, n_blocks, block, out);
  }
}

void DecodeTurbo(int bits, const uint8_t* in, size_t n_rows, uint32_t dim, uint32_t block,
                 float* out) {
  const size_t n_blocks = n_rows * (dim / block);
  if (n_blocks == 0) return;
  switch (bits) {
    case 4:
      return DecodeTurboBits<4>(in, n_blocks, block, out);
    case 3:
      return DecodeTurboBits<3>(in, n_blocks, block, out);
    default:
      return DecodeTurboBits<2>(in, n_blocks, block, out);
  }
}

template <class D>
float SumOfSquaresWith(D d, const float* HWY_RESTRICT x, size_t n) {
  CanonicalSum<D> sum(d);
  for (size_t i = 0; i < n; i += hn::Lanes(d)) {
    const auto v = hn::LoadU(d, x + i);
    sum.Add(i, hn::Mul(v, v));
  }
  return sum.Total(d);
}

float CanonicalSumOfSquares(const float* x, size_t n) {
  return n >= hn::Lanes(DF()) ? SumOfSquaresWith(DF(), x, n)
                              : SumOfSquaresWith(hn::CappedTag<float, 8>(), x, n);
}

int64_t DispatchedTarget() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace pion::codec::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pion::codec::internal {

HWY_EXPORT(EncodeFp16);
HWY_EXPORT(DecodeFp16);
HWY_EXPORT(EncodeBf16);
HWY_EXPORT(DecodeBf16);
HWY_EXPORT(EncodeInt8);
HWY_EXPORT(DecodeInt8);
HWY_EXPORT(EncodeTurbo);
HWY_EXPORT(DecodeTurbo);
HWY_EXPORT(DispatchedTarget);
HWY_EXPORT(CanonicalSumOfSquares);

void EncodeFp16(const float* in, size_t n, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeFp16)(in, n, out);
}
void DecodeFp16(const uint8_t* in, size_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeFp16)(in, n, out);
}
void EncodeBf16(const float* in, size_t n, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeBf16)(in, n, out);
}
void DecodeBf16(const uint8_t* in, size_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeBf16)(in, n, out);
}
void EncodeInt8(const float* rows, size_t n_rows, uint32_t dim, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeInt8)(rows, n_rows, dim, out);
}
void DecodeInt8(const uint8_t* in, size_t n_rows, uint32_t dim, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeInt8)(in, n_rows, dim, out);
}
void EncodeTurbo(int bits, const float* rows, size_t n_rows, uint32_t dim, uint32_t block,
                 uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeTurbo)(bits, rows, n_rows, dim, block, out);
}
void DecodeTurbo(int bits, const uint8_t* in, size_t n_rows, uint32_t dim, uint32_t block,
                 float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeTurbo)(bits, in, n_rows, dim, block, out);
}

std::vector<int64_t> CompiledTargets() { return hwy::SupportedAndGeneratedTargets(); }
int64_t DispatchedTarget() { return HWY_DYNAMIC_DISPATCH(DispatchedTarget)(); }
float CanonicalSumOfSquares(const float* x, size_t n) {
  return HWY_DYNAMIC_DISPATCH(CanonicalSumOfSquares)(x, n);
}

}  // namespace pion::codec::internal
#endif  // HWY_ONCE
