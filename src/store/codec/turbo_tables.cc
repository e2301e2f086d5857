// The turbo codecs' fixed constants: rotation sign vectors and Lloyd-Max tables.

#include <array>

#include "store/codec/codec_internal.h"
#include "store/codec/lloyd_max_tables.h"

namespace pion::codec::internal {
namespace {

// SplitMix64 (Steele, Lea & Flood 2014), as in java.util.SplittableRandom.
uint64_t SplitMix64Next(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

using SignArray = std::array<uint32_t, kMaxTurboBlock>;

// Sign i is bit (i % 64) of the (i / 64)-th output of the stream: 1 -> -1, 0 -> +1.
SignArray MakeSigns(uint64_t seed) {
  SignArray masks{};
  uint64_t state = seed;
  uint64_t word = 0;
  for (uint32_t i = 0; i < kMaxTurboBlock; ++i) {
    if (i % 64 == 0) word = SplitMix64Next(state);
    masks[i] = ((word >> (i % 64)) & 1) ? 0x80000000u : 0u;
  }
  return masks;
}

template <size_t kLevels>
TurboTable MakeTable(int bits, const float (&centroids)[kLevels],
                     const float (&boundaries)[kLevels - 1]) {
  TurboTable t{};
  t.bits = bits;
  t.levels = static_cast<int>(kLevels);
  for (size_t k = 0; k < kLevels; ++k) {
    t.centroids[k] = centroids[k];
    t.centroid_squares[k] = centroids[k] * centroids[k];
  }
  for (size_t k = 0; k + 1 < kLevels / 2; ++k) t.positive_bounds[k] = boundaries[kLevels / 2 + k];
  return t;
}

}  // namespace

const uint32_t* SignMasks(int which) {
  static const SignArray kD1 = MakeSigns(kSignSeed1);
  static const SignArray kD2 = MakeSigns(kSignSeed2);
  return which == 1 ? kD1.data() : kD2.data();
}

const TurboTable& TurboTableFor(int bits) {
  static const TurboTable k2 = MakeTable(2, kLloydMax2Centroids, kLloydMax2Boundaries);
  static const TurboTable k3 = MakeTable(3, kLloydMax3Centroids, kLloydMax3Boundaries);
  static const TurboTable k4 = MakeTable(4, kLloydMax4Centroids, kLloydMax4Boundaries);
  return bits == 2 ? k2 : bits == 3 ? k3 : k4;
}

}  // namespace pion::codec::internal
