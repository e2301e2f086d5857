// bfloat16 → binary32 widening, per Highway target: shared by the value codecs (codec_simd.cc)
// and the CPU attention kernels (cpu_simd-inl.h). Included after highway.h in a file compiled
// once per target (the include guard toggles with HWY_TARGET_TOGGLE, as Highway's -inl.h do).
// Exact for every input: a bf16 is the high half of its binary32. Little-endian bytes.
#if defined(PION_COMMON_BF16_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PION_COMMON_BF16_SIMD_INL_H_
#undef PION_COMMON_BF16_SIMD_INL_H_
#else
#define PION_COMMON_BF16_SIMD_INL_H_
#endif

#include <hwy/highway.h>

#include <bit>
#include <cstdint>
#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace pion::simd {
namespace HWY_NAMESPACE {

inline void WidenBf16(const uint8_t* HWY_RESTRICT in, size_t n, float* HWY_RESTRICT out) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const size_t lanes = hn::Lanes(df);
  const auto* in16 = reinterpret_cast<const uint16_t*>(in);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto wide = hn::PromoteTo(du, hn::LoadU(du16, in16 + i));
    hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(wide)), df, out + i);
  }
  for (; i < n; ++i) {
    const uint16_t h = static_cast<uint16_t>(in[2 * i] | (in[2 * i + 1] << 8));
    out[i] = std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace pion::simd
HWY_AFTER_NAMESPACE();

#endif  // PION_COMMON_BF16_SIMD_INL_H_
