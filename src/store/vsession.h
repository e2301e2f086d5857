// VSession: a token-indexed value session (seed 000 V.*): rows of fixed width `dim`, stored
// in one codec, addressed by non-negative int64 ids.
//
// Rows live in chunks of kRowsPerChunk consecutive ids (the 64-token block of KV.PREFIX).
// Chunks are immutable once shared: a snapshot or a reply in flight holds a reference, and a
// later write to that chunk copies it first (copy-on-write). That makes V.SNAPSHOT O(chunks)
// and lets RAW range fetches be sent straight from the chunk bytes. Every chunk's bytes are
// charged to the budget while the chunk exists, whoever holds it.
// Not thread-safe: a session is owned by one shard. Chunks may be released on any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"
#include "store/codec/codec.h"

namespace pion::store {

inline constexpr uint32_t kRowsPerChunk = 64;

class VSession {
 public:
  struct Chunk;
  using ChunkRef = std::shared_ptr<const Chunk>;
  using ChunkMap = std::map<int64_t, std::shared_ptr<Chunk>>;  // chunk index -> chunk

  // A point-in-time copy of the session's chunks (shares them).
  struct Snapshot {
    ChunkMap chunks;
    uint64_t rows = 0;
  };

  // Chunks come from alloc (a tenant's shared-memory arena when the same-host data plane is
  // on, so a client can map them; the heap otherwise).
  VSession(codec::RowCodec codec, const ByteBudget* budget,
           BufferAllocator* alloc = BufferAllocator::Default());

  const codec::RowCodec& codec() const { return codec_; }
  uint32_t dim() const { return codec_.dim(); }
  uint64_t rows() const { return rows_; }  // distinct ids written
  uint64_t chunk_bytes() const;            // bytes of this session's chunks
  size_t chunk_count() const { return chunks_.size(); }

  // Quantizes and stores n rows (n*dim floats) at ids start..start+n-1. All or nothing:
  // on error (bad id, kOom) nothing was changed.
  Status StoreRange(int64_t start, const float* rows, size_t n);
  // Stores rows at scattered ids (ids may repeat: the last row wins).
  Status StoreIds(const int64_t* ids, const float* rows, size_t n);

  // kErr naming the first id in [start, end) that was never written.
  Status CheckRange(int64_t start, int64_t end) const;
  Status CheckIds(const int64_t* ids, size_t n) const;
  // True when every id in [start, end) is written.
  bool RangeWritten(int64_t start, int64_t end) const { return CheckRange(start, end).ok(); }
  // Written rows among ids [start, end).
  uint64_t CountWritten(int64_t start, int64_t end) const;

  // Decodes rows into out (n * dim floats). The ids must be written (Check* first).
  void DecodeRange(int64_t start, int64_t end, float* out) const;
  void DecodeIds(const int64_t* ids, size_t n, float* out) const;

  // The encoded bytes of [start, end) in order, as pieces inside chunk buffers: sink(buf, p,
  // len) per piece, so a reply can reference them without copying.
  using PieceSink = std::function<void(const BufferRef&, const uint8_t*, size_t)>;
  void RawRange(int64_t start, int64_t end, const PieceSink& sink) const;
  // Copies the encoded bytes of the given ids, in order, to out (n * row_bytes).
  void RawIds(const int64_t* ids, size_t n, uint8_t* out) const;

  Snapshot TakeSnapshot() const { return Snapshot{chunks_, rows_}; }

  // Replaces the contents with chunks read back from disk (index -> bytes, written bitmap).
  // Each buffer must be kRowsPerChunk * row_bytes. All chunks are charged first; kOom leaves
  // the session unchanged.
  Status Load(const std::vector<std::tuple<int64_t, BufferRef, uint64_t>>& chunks);
  void Restore(const Snapshot& s);

 private:
  // Returns a chunk this session may write (allocated or copied as needed), or kOom.
  StatusOr<Chunk*> WritableChunk(int64_t index);
  // Makes every listed chunk writable, or on failure removes the chunks it had to create
  // (they hold no rows yet) so a refused store leaves neither rows nor charged bytes behind.
  Status PrepareChunks(const std::vector<int64_t>& indexes);
  const Chunk* FindChunk(int64_t index) const;

  codec::RowCodec codec_;
  const ByteBudget* budget_;
  BufferAllocator* alloc_;
  ChunkMap chunks_;
  uint64_t rows_ = 0;
};

struct VSession::Chunk {
  Chunk(BufferRef b, const ByteBudget* budget) : bytes(std::move(b)), budget_(budget) {}
  ~Chunk();
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  BufferRef bytes;       // kRowsPerChunk * row_bytes
  uint64_t written = 0;  // bit i: row i of this chunk has been written

 private:
  const ByteBudget* budget_;
};

}  // namespace pion::store
