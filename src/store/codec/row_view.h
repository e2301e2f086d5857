// RowView: stored rows as a reader asks for them — V.FETCH's HEADS (a tensor-parallel reader's
// columns) and AS (another codec) on top of RAW.
//
// Columns [first, first + count) of each stored row (all of them by default) come out as:
//   - fp32 (decoded): the values a full decode gives for those columns;
//   - the stored encoding (RAW): each output row a valid row of the stored format of width
//     `count` that decodes to exactly those values — the columns' own bytes (fp32/fp16/bf16),
//     with the row's scale (fp8, fp8_e5m2), or the whole 32-value blocks (int8) / turbo blocks
//     they cover, which must then start and end on a block boundary;
//   - another codec (AS): the decoded values as that codec's encoder stores them (so lossless
//     where it holds them exactly: fp16 or bf16 as fp32, fp8 as fp32), or, when it is the
//     stored codec, the stored bytes themselves.
// Immutable and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/status.h"
#include "store/codec/codec.h"

namespace pion::codec {

class RowView {
 public:
  enum class Output { kFp32, kStored, kCodec };

  // kErr naming what is wrong: columns outside the row, RAW columns that split an int8 or turbo
  // block, an AS codec that cannot hold `count` values (a turbo block that does not divide it).
  static StatusOr<RowView> Create(const RowCodec& stored, uint32_t first, uint32_t count,
                                  Output output, std::optional<Format> as = std::nullopt);

  // Bytes of one output row.
  size_t out_row_bytes() const { return out_row_bytes_; }
  // The output is the stored rows unchanged (all columns, stored encoding or the same codec).
  bool identity() const { return identity_; }
  // The codec of the output rows (fp32 for kFp32).
  const RowCodec& out_codec() const { return out_; }
  Output output() const { return output_; }
  // The stored columns it reads: [first, first + count).
  uint32_t first() const { return first_; }
  uint32_t count() const { return count_; }
  // A byte range of a stored row: {offset, length}.
  struct Part {
    size_t offset, length;
  };
  // Some columns in the stored encoding (RAW, HEADS): each output row is these byte ranges of
  // its stored row, concatenated (the columns' bytes; for fp8 the row's scale, then them), so a
  // reader can copy them out of the stored rows itself. Empty for any other output.
  std::vector<Part> StoredParts() const;

  // n stored rows (n * stored.row_bytes()) -> n output rows (n * out_row_bytes()). `scratch`
  // holds decoded floats between calls (grown as needed).
  void Apply(const uint8_t* in, size_t n, uint8_t* out, std::vector<float>* scratch) const;

 private:
  RowView(RowCodec stored, RowCodec out) : stored_(stored), out_(out) {}

  RowCodec stored_;
  RowCodec out_;
  Output output_ = Output::kFp32;
  uint32_t first_ = 0, count_ = 0;
  bool identity_ = false;
  // kStored of a block format: the byte range of each row to copy.
  size_t byte_first_ = 0, byte_count_ = 0;
  size_t out_row_bytes_ = 0;
};

}  // namespace pion::codec
