// Value codecs: how a row of `dim` fp32 values is quantized on store and restored on read.
//
// Ten formats trade precision for bytes: raw fp32/fp16/bf16, int8 with one fp16 scale per 32
// values (q8_0-like), fp8 and fp8_e5m2 (e4m3fn / e5m2 with one f32 scale per row, as fp8 K/V
// caches store), turbo4/3/2, the MSE variant of TurboQuant (randomized Hadamard rotation +
// Lloyd-Max scalar quantization of N(0,1), 4/3/2 bits per value plus one fp16 norm per block),
// and fp8_ds_mla, DeepSeek-V3.2's fp8 MLA latent row (e4m3 with one f32 scale per 128 values,
// then 64 RoPE values in bf16: 656 bytes for 512 + 64). The encoded bytes of a row are what
// `V.FETCH ... RAW` sends to clients; their exact layout is specified in src/store/codec/README.md
// and reproduced by reference_decode.py.
//
// Encode/Decode are SIMD (Highway, dispatched at runtime to the best of SSSE3/SSE4/AVX2/AVX-512
// the CPU has) and produce the same bytes and floats on every target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/status.h"

namespace pion::codec {

// The values are part of stored state (disk tier, snapshots): new formats go at the end.
enum class Format : uint8_t {
  kFp32,
  kFp16,
  kBf16,
  kInt8,
  kTurbo4,
  kTurbo3,
  kTurbo2,
  kFp8,
  kFp8E5m2,
  kFp8DsMla,
};

// fp8_ds_mla rows: kv_lora_rank compressed values (a multiple of kDsMlaGroup) in e4m3 with one f32
// scale per kDsMlaGroup, then kDsMlaRope RoPE values in bf16.
inline constexpr uint32_t kDsMlaGroup = 128;
inline constexpr uint32_t kDsMlaRope = 64;

// "fp32", "fp16", "bf16", "int8", "turbo4", "turbo3", "turbo2", "fp8", "fp8_e5m2", "fp8_ds_mla"
// (case-insensitive); nullopt for anything else.
std::optional<Format> ParseFormat(std::string_view name);
// The lower-case name ParseFormat accepts.
std::string_view FormatName(Format f);
// Every name, "fp32|fp16|...": what an error about a format expects.
std::string_view FormatChoices();

// Encodes and decodes rows of one (format, dim, block). Immutable, thread-safe, cheap to copy.
class RowCodec {
 public:
  // Block sizes:
  //   fp32, fp16, bf16, fp8, fp8_e5m2: no blocks; block must be 0 and block() returns 0.
  //   int8:   always 32 (block 0 or 32); the last block of a row is partial when 32 ∤ dim.
  //   turboB: a power of two in [8, 4096] that divides dim; 0 means 128.
  //   fp8_ds_mla: always 128, the scale group (block 0 or 128); dim = kv_lora_rank + 64 with
  //           kv_lora_rank a positive multiple of 128 (DeepSeek V2/V3: 512 + 64 = 576).
  // dim must be in [1, kMaxDim]. Returns kErr naming the expected and the received value when
  // the combination is invalid.
  static StatusOr<RowCodec> Create(Format f, uint32_t dim, uint32_t block = 0);

  static constexpr uint32_t kMaxDim = 1u << 20;
  static constexpr uint32_t kMaxTurboBlock = 4096;

  Format format() const { return format_; }
  uint32_t dim() const { return dim_; }
  uint32_t block() const { return block_; }
  // Encoded bytes per row (rows are stored back to back, no padding).
  size_t row_bytes() const { return row_bytes_; }

  // rows: n_rows * dim floats; out: n_rows * row_bytes() bytes. Neither needs any alignment.
  // Never fails: non-finite inputs are encoded as documented in README.md ("Special values").
  void Encode(const float* rows, size_t n_rows, uint8_t* out) const;
  // in: n_rows * row_bytes() bytes; out: n_rows * dim floats. Any input bytes are accepted
  // (decoding garbage yields garbage floats, never out-of-bounds access).
  void Decode(const uint8_t* in, size_t n_rows, float* out) const;

 private:
  RowCodec(Format f, uint32_t dim, uint32_t block, size_t row_bytes)
      : format_(f), dim_(dim), block_(block), row_bytes_(row_bytes) {}

  Format format_;
  uint32_t dim_;
  uint32_t block_;
  size_t row_bytes_;
};

}  // namespace pion::codec
