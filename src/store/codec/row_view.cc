#include "store/codec/row_view.h"

#include <cstring>
#include <string>

namespace pion::codec {
namespace {

bool Elementwise(Format f) {
  return f == Format::kFp32 || f == Format::kFp16 || f == Format::kBf16;
}
bool RowScaled(Format f) { return f == Format::kFp8 || f == Format::kFp8E5m2; }
bool Turbo(Format f) {
  return f == Format::kTurbo4 || f == Format::kTurbo3 || f == Format::kTurbo2;
}

std::string Cols(uint32_t first, uint32_t count) {
  std::string s = "[";  // appended, not "[" + ...: GCC 12 warns falsely on that (-Wrestrict)
  s += std::to_string(first);
  s += ", ";
  s += std::to_string(uint64_t{first} + count);
  s += ")";
  return s;
}

}  // namespace

StatusOr<RowView> RowView::Create(const RowCodec& stored, uint32_t first, uint32_t count,
                                  Output output, std::optional<Format> as) {
  const uint32_t dim = stored.dim();
  if (count == 0 || first >= dim || count > dim - first) {
    return Error("columns " + Cols(first, count) + " are not inside rows of " +
                 std::to_string(dim) + " values");
  }
  const bool all = first == 0 && count == dim;
  StatusOr<RowCodec> out = stored;
  if (output == Output::kFp32) {
    out = RowCodec::Create(Format::kFp32, count);
  } else if (output == Output::kCodec) {
    if (!as) return Error("AS needs a codec");
    if (*as == stored.format() && !all && (Turbo(*as) || *as == Format::kInt8)) {
      // The same block codec over a part of the row: its blocks, or a re-encode below.
      out = RowCodec::Create(*as, count, stored.block());
    } else {
      out = RowCodec::Create(*as, count, *as == stored.format() ? stored.block() : 0);
    }
    if (!out.ok()) {
      return Error("AS " + std::string(FormatName(*as)) + " cannot hold rows of " +
                   std::to_string(count) + " values: " + out.status().message());
    }
  } else if (!all) {
    const Format f = stored.format();
    if (f == Format::kFp8DsMla) {
      return Error("RAW columns " + Cols(first, count) +
                   " of an fp8_ds_mla row: its rows are whole latents (kv_lora_rank + 64); fetch "
                   "them decoded (without RAW) or re-encoded (AS <codec>)");
    }
    if (f == Format::kInt8 || Turbo(f)) {
      const uint32_t n = f == Format::kInt8 ? 32 : stored.block();
      const uint32_t end = first + count;
      if (first % n != 0 || (end % n != 0 && end != dim)) {
        return Error("RAW columns " + Cols(first, count) + " of a " + std::string(FormatName(f)) +
                     " row split its blocks of " + std::to_string(n) +
                     " values; fetch them decoded (without RAW) or re-encoded (AS <codec>)");
      }
    }
    out = RowCodec::Create(stored.format(), count, stored.block());
    if (!out.ok()) {
      return Error("RAW columns " + Cols(first, count) + " of a " +
                   std::string(FormatName(stored.format())) + " row: " + out.status().message());
    }
  }
  RowView v(stored, out.value());
  v.output_ = output;
  v.first_ = first;
  v.count_ = count;
  v.out_row_bytes_ = v.out_.row_bytes();
  v.identity_ =
      all && (output == Output::kStored || (output == Output::kCodec && *as == stored.format()) ||
              (output == Output::kFp32 && stored.format() == Format::kFp32));
  if (output == Output::kStored && !all) {
    const Format f = stored.format();
    if (Elementwise(f)) {
      const size_t w = stored.row_bytes() / dim;
      v.byte_first_ = size_t{first} * w;
      v.byte_count_ = size_t{count} * w;
    } else if (RowScaled(f)) {
      v.byte_first_ = 4 + size_t{first};  // after the row's scale, which is copied too
      v.byte_count_ = count;
    } else {
      // Whole blocks: int8 (32 values, 2 + 32 bytes; the row's last may be short) and turbo
      // (n values per block; every block uses the same signs, so a block decodes anywhere).
      const uint32_t n = f == Format::kInt8 ? 32 : stored.block();  // checked above
      const size_t per_block = f == Format::kInt8 ? 2 + 32 : stored.row_bytes() / (dim / n);
      v.byte_first_ = size_t{first / n} * per_block;
      v.byte_count_ = v.out_.row_bytes();
    }
  }
  return v;
}

std::vector<RowView::Part> RowView::StoredParts() const {
  if (output_ != Output::kStored || identity_) return {};
  if (RowScaled(stored_.format())) return {{0, 4}, {byte_first_, byte_count_}};
  return {{byte_first_, byte_count_}};
}

void RowView::Apply(const uint8_t* in, size_t n, uint8_t* out, std::vector<float>* scratch) const {
  const size_t in_row = stored_.row_bytes();
  if (identity_) {
    std::memcpy(out, in, n * in_row);
    return;
  }
  if (output_ == Output::kStored) {
    const bool scaled = RowScaled(stored_.format());
    for (size_t r = 0; r < n; ++r) {
      const uint8_t* src = in + r * in_row;
      uint8_t* dst = out + r * out_row_bytes_;
      if (scaled) {
        std::memcpy(dst, src, 4);  // the row's scale: the columns decode as in the full row
        std::memcpy(dst + 4, src + byte_first_, byte_count_);
      } else {
        std::memcpy(dst, src + byte_first_, byte_count_);
      }
    }
    return;
  }
  // Decoded (and re-encoded for AS), a batch of rows at a time so the scratch stays small.
  constexpr size_t kBatch = 64;
  const uint32_t dim = stored_.dim();
  scratch->resize(kBatch * (size_t{dim} + count_));
  float* full = scratch->data();
  float* cols = full + kBatch * size_t{dim};
  for (size_t r0 = 0; r0 < n; r0 += kBatch) {
    const size_t m = std::min(kBatch, n - r0);
    stored_.Decode(in + r0 * in_row, m, full);
    const float* src = full;
    if (first_ != 0 || count_ != dim) {
      for (size_t r = 0; r < m; ++r) {
        std::memcpy(cols + r * count_, full + r * dim + first_, size_t{count_} * sizeof(float));
      }
      src = cols;
    }
    out_.Encode(src, m, out + r0 * out_row_bytes_);
  }
}

}  // namespace pion::codec
