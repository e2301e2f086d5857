#include "store/codec/codec.h"

#include <cstring>
#include <string>

#include "store/codec/codec_internal.h"

namespace pion::codec {
namespace {

constexpr std::string_view kNames[] = {"fp32",   "fp16",   "bf16", "int8",     "turbo4",
                                       "turbo3", "turbo2", "fp8",  "fp8_e5m2", "fp8_ds_mla"};
constexpr uint32_t kInt8Block = 32;
constexpr uint32_t kDefaultTurboBlock = 128;
constexpr uint32_t kMinTurboBlock = 8;

int TurboBits(Format f) {
  switch (f) {
    case Format::kTurbo4:
      return 4;
    case Format::kTurbo3:
      return 3;
    case Format::kTurbo2:
      return 2;
    default:
      return 0;
  }
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char c = a[i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != b[i]) return false;
  }
  return true;
}

std::string Name(Format f) { return std::string(FormatName(f)); }

}  // namespace

std::optional<Format> ParseFormat(std::string_view name) {
  for (size_t i = 0; i < std::size(kNames); ++i) {
    if (EqualsIgnoreCase(name, kNames[i])) return static_cast<Format>(i);
  }
  return std::nullopt;
}

std::string_view FormatChoices() {
  static const std::string choices = [] {  // kNames joined by '|'
    std::string s;
    for (std::string_view n : kNames) s.append(s.empty() ? "" : "|").append(n);
    return s;
  }();
  return choices;
}

std::string_view FormatName(Format f) {
  const auto i = static_cast<size_t>(f);
  return i < std::size(kNames) ? kNames[i] : std::string_view("unknown");
}

StatusOr<RowCodec> RowCodec::Create(Format f, uint32_t dim, uint32_t block) {
  if (static_cast<size_t>(f) >= std::size(kNames)) {
    return Error("unknown value format " + std::to_string(static_cast<int>(f)) +
                 ", expected one of " + std::string(FormatChoices()));
  }
  if (dim == 0 || dim > kMaxDim) {
    return Error(Name(f) + " dim must be in [1, " + std::to_string(kMaxDim) + "], got " +
                 std::to_string(dim));
  }
  switch (f) {
    case Format::kFp32:
    case Format::kFp16:
    case Format::kBf16: {
      if (block != 0) {
        return Error(Name(f) + " has no blocks: block must be 0, got " + std::to_string(block));
      }
      const size_t width = f == Format::kFp32 ? 4 : 2;
      return RowCodec(f, dim, 0, width * dim);
    }
    case Format::kFp8:
    case Format::kFp8E5m2: {
      if (block != 0) {
        return Error(Name(f) + " has no blocks (one scale per row): block must be 0, got " +
                     std::to_string(block));
      }
      return RowCodec(f, dim, 0, 4 + size_t{dim});
    }
    case Format::kFp8DsMla: {
      if (block != 0 && block != kDsMlaGroup) {
        return Error("fp8_ds_mla scales groups of 128 values: block must be 128 (or 0), got " +
                     std::to_string(block));
      }
      if (dim <= kDsMlaRope || (dim - kDsMlaRope) % kDsMlaGroup != 0) {
        return Error(
            "fp8_ds_mla rows are kv_lora_rank + 64 RoPE values, kv_lora_rank a positive multiple "
            "of 128 (DeepSeek: 512 + 64 = 576), got dim " +
            std::to_string(dim));
      }
      const size_t nope = dim - kDsMlaRope;
      return RowCodec(f, dim, kDsMlaGroup, nope + 4 * (nope / kDsMlaGroup) + 2 * kDsMlaRope);
    }
    case Format::kInt8: {
      if (block != 0 && block != kInt8Block) {
        return Error("int8 block must be 32 (or 0 for the default), got " + std::to_string(block));
      }
      const size_t n_blocks = (dim + kInt8Block - 1) / kInt8Block;
      return RowCodec(f, dim, kInt8Block, size_t{dim} + 2 * n_blocks);
    }
    default: {
      const uint32_t n = block == 0 ? kDefaultTurboBlock : block;
      const std::string which = block == 0 ? " (the default)" : "";
      if (n < kMinTurboBlock || n > kMaxTurboBlock || (n & (n - 1)) != 0) {
        return Error(Name(f) + " block must be a power of two in [8, " +
                     std::to_string(kMaxTurboBlock) + "], got " + std::to_string(n));
      }
      if (dim % n != 0) {
        return Error(Name(f) + " block " + std::to_string(n) + which +
                     " must divide dim, got dim " + std::to_string(dim) +
                     " (dim % block = " + std::to_string(dim % n) + ")");
      }
      const size_t block_bytes = 2 + size_t{n} * TurboBits(f) / 8;
      return RowCodec(f, dim, n, (dim / n) * block_bytes);
    }
  }
}

void RowCodec::Encode(const float* rows, size_t n_rows, uint8_t* out) const {
  if (n_rows == 0) return;
  switch (format_) {
    case Format::kFp32:
      std::memcpy(out, rows, n_rows * row_bytes_);
      return;
    case Format::kFp16:
      return internal::EncodeFp16(rows, n_rows * dim_, out);
    case Format::kBf16:
      return internal::EncodeBf16(rows, n_rows * dim_, out);
    case Format::kInt8:
      return internal::EncodeInt8(rows, n_rows, dim_, out);
    case Format::kFp8:
      return internal::EncodeFp8(rows, n_rows, dim_, out);
    case Format::kFp8E5m2:
      return internal::EncodeFp8E5m2(rows, n_rows, dim_, out);
    case Format::kFp8DsMla:
      return internal::EncodeFp8DsMla(rows, n_rows, dim_, out);
    default:
      return internal::EncodeTurbo(TurboBits(format_), rows, n_rows, dim_, block_, out);
  }
}

void RowCodec::Decode(const uint8_t* in, size_t n_rows, float* out) const {
  if (n_rows == 0) return;
  switch (format_) {
    case Format::kFp32:
      std::memcpy(out, in, n_rows * row_bytes_);
      return;
    case Format::kFp16:
      return internal::DecodeFp16(in, n_rows * dim_, out);
    case Format::kBf16:
      return internal::DecodeBf16(in, n_rows * dim_, out);
    case Format::kInt8:
      return internal::DecodeInt8(in, n_rows, dim_, out);
    case Format::kFp8:
      return internal::DecodeFp8(in, n_rows, dim_, out);
    case Format::kFp8E5m2:
      return internal::DecodeFp8E5m2(in, n_rows, dim_, out);
    case Format::kFp8DsMla:
      return internal::DecodeFp8DsMla(in, n_rows, dim_, out);
    default:
      return internal::DecodeTurbo(TurboBits(format_), in, n_rows, dim_, block_, out);
  }
}

}  // namespace pion::codec
