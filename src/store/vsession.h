// VSession: a token-indexed value session (seed 000 V.*): rows of fixed width `dim`, stored
// in one codec, addressed by non-negative int64 ids.
//
// Rows live in chunks of kRowsPerChunk consecutive ids (the 64-token block of KV.PREFIX); each
// chunk's bytes are one residency object (residency/object.h), so a session larger than memory
// keeps its cold chunks on disk and brings them back when read. Which rows a chunk holds (its
// `written` bitmap) stays in memory, so completeness checks never touch the disk.
//
// Chunks are immutable once shared: a snapshot, a reply in flight or a save holds a reference,
// and a later write to that chunk copies it first (copy-on-write). That makes V.SNAPSHOT
// O(chunks) and lets RAW range fetches be sent straight from the chunk bytes.
//
// Reads and writes need the chunks they touch in host memory. They report the ones that are
// not (ViewRange, Missing*) so the caller can bring them in (Engine::Require) and call again;
// nothing here waits for the disk. Not thread-safe: a session is owned by one shard.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/buffer.h"
#include "common/status.h"
#include "residency/disk_file.h"
#include "residency/object.h"
#include "store/codec/codec.h"

namespace pion::residency {
class Engine;
}

namespace pion::store {

inline constexpr uint32_t kRowsPerChunk = 64;

class VSession {
 public:
  struct Chunk {
    residency::ObjectRef obj;  // one block: kRowsPerChunk * row_bytes
    uint64_t written = 0;      // bit i: row i of this chunk has been written
  };
  using ChunkMap = std::map<int64_t, std::shared_ptr<Chunk>>;  // chunk index -> chunk

  // A point-in-time copy of the session's chunks (shares them).
  struct Snapshot {
    ChunkMap chunks;
    uint64_t rows = 0;
  };

  // The host bytes of the chunks a read covers; holding it keeps them valid.
  class HostView {
   public:
    const BufferRef* Find(int64_t chunk) const;
    size_t size() const { return chunks_.size(); }

   private:
    friend class VSession;
    std::vector<std::pair<int64_t, BufferRef>> chunks_;  // sorted by chunk index
  };

  // Chunk bytes are charged to the engine's vstore family and allocated from `alloc` (a
  // tenant's shared-memory arena when the same-host data plane is on, so a client can map
  // them; the heap otherwise) — promotions from disk too.
  VSession(codec::RowCodec codec, residency::Engine* engine,
           BufferAllocator* alloc = BufferAllocator::Default());

  const codec::RowCodec& codec() const { return codec_; }
  uint32_t dim() const { return codec_.dim(); }
  uint64_t rows() const { return rows_; }  // distinct ids written
  uint64_t chunk_bytes() const;            // bytes of this session's chunks, in any tier
  size_t chunk_count() const { return chunks_.size(); }
  uint64_t chunk_size() const { return uint64_t{kRowsPerChunk} * codec_.row_bytes(); }
  // Bytes of this session's chunks that are in host memory now.
  uint64_t host_bytes() const;
  // Chunks of this session whose only copy failed validation (they are never served).
  uint64_t lost_chunks() const { return loss_->load(std::memory_order_relaxed); }

  // ---- Writes (all or nothing: on error nothing was changed) ----------------------------
  // The existing chunks a store into these ids writes, in host memory or not: the caller pins
  // every one in host memory (Engine::Require / TryPinAll) and holds the pins through the store,
  // so that nothing — making room for the store's own new bytes included — drops one meanwhile.
  void ChunksForRange(int64_t start, size_t n, std::vector<residency::ObjectRef>* out) const;
  void ChunksForIds(const int64_t* ids, size_t n, std::vector<residency::ObjectRef>* out) const;
  // Those of them that are not in host memory (a read-only check).
  void MissingForRange(int64_t start, size_t n, std::vector<residency::ObjectRef>* out) const;
  // At most the new host bytes such a store allocates (new chunks, copies of shared ones).
  uint64_t BytesToStoreRange(int64_t start, size_t n) const;
  uint64_t BytesToStoreIds(const int64_t* ids, size_t n) const;
  // Quantizes and stores n rows (n*dim floats) at ids start..start+n-1. `held` pins the chunks
  // ChunksForRange names (a chunk is written in place when no one else holds or pins it, else
  // copied). kOom when its new bytes do not fit; kErr naming the chunk when one it writes is not
  // pinned in host memory (a caller that did not pin it).
  Status StoreRange(int64_t start, const float* rows, size_t n, const residency::PinSet& held);
  // Stores rows at scattered ids (ids may repeat: the last row wins), likewise.
  Status StoreIds(const int64_t* ids, const float* rows, size_t n, const residency::PinSet& held);

  // Already-encoded rows (this codec's row_bytes each) at ids start.. into the chunks this
  // session does not hold yet; rows falling in chunks it holds are left as they are (a
  // transcoded copy, filled by the reads that make it). Nothing stored when a new chunk cannot
  // be made (kOom).
  Status AdoptEncoded(int64_t start, const uint8_t* rows, size_t n);

  // ---- Completeness (memory only) -------------------------------------------------------------
  // kErr naming the first id in [start, end) that was never written.
  Status CheckRange(int64_t start, int64_t end) const;
  Status CheckIds(const int64_t* ids, size_t n) const;
  bool RangeWritten(int64_t start, int64_t end) const { return CheckRange(start, end).ok(); }
  uint64_t CountWritten(int64_t start, int64_t end) const;

  // ---- Reads -----------------------------------------------------------------------------
  // The host bytes of the chunks covering the written ids [start, end) (Check* first): true
  // with `view` filled when all are host-resident; false with the others in *missing.
  bool ViewRange(int64_t start, int64_t end, HostView* view,
                 std::vector<residency::ObjectRef>* missing) const;
  bool ViewIds(const int64_t* ids, size_t n, HostView* view,
               std::vector<residency::ObjectRef>* missing) const;
  // Decodes rows into out (n * dim floats) from a view covering them.
  void DecodeRange(const HostView& view, int64_t start, int64_t end, float* out) const;
  void DecodeIds(const HostView& view, const int64_t* ids, size_t n, float* out) const;
  // The encoded bytes of [start, end) in order, as pieces inside chunk buffers: sink(buf, p,
  // len) per piece, so a reply can reference them without copying.
  using PieceSink = std::function<void(const BufferRef&, const uint8_t*, size_t)>;
  void RawRange(const HostView& view, int64_t start, int64_t end, const PieceSink& sink) const;
  // Copies the encoded bytes of the given ids, in order, to out (n * row_bytes).
  void RawIds(const HostView& view, const int64_t* ids, size_t n, uint8_t* out) const;

  // Every chunk, in index order (for a save).
  const ChunkMap& chunks() const { return chunks_; }
  Snapshot TakeSnapshot() const { return Snapshot{chunks_, rows_}; }
  void Restore(const Snapshot& s);

  // Replaces the contents with chunks known only by their copies in `file` (a saved object):
  // (chunk index, written bitmap, file block) each. kCorrupt when a block has the wrong size.
  // Nothing is read until a chunk is used.
  struct DiskChunk {
    int64_t index;
    uint64_t written;
    uint32_t block;
  };
  Status LoadFromDisk(const std::shared_ptr<residency::DiskFile>& file,
                      const std::vector<DiskChunk>& chunks);

 private:
  struct Writable {
    Chunk* chunk;
    uint8_t* bytes;
    residency::Object* began;  // non-null: EndWrite() it after the store
  };
  // Makes every listed chunk writable (in place when nobody else holds it, else a copy), or
  // on failure removes the chunks it had to create (they hold no rows yet) and ends the
  // in-place writes it began, so a refused store leaves the session as it was.
  // `held`: the caller's host pins by object (PinSet::Counts).
  using HeldPins = std::unordered_map<const residency::Object*, uint32_t>;
  Status PrepareChunks(const std::vector<int64_t>& indexes, const residency::PinSet& held,
                       std::vector<Writable>* out);
  StatusOr<Writable> WritableChunk(int64_t index, const HeldPins& held);
  const Chunk* FindChunk(int64_t index) const;
  static std::vector<int64_t> ChunksOfRange(int64_t start, size_t n);
  static std::vector<int64_t> ChunksOfIds(const int64_t* ids, size_t n);
  void Existing(const std::vector<int64_t>& indexes, bool missing_only,
                std::vector<residency::ObjectRef>* out) const;
  uint64_t BytesToStore(const std::vector<int64_t>& indexes) const;

  codec::RowCodec codec_;
  residency::Engine* engine_;
  BufferAllocator* alloc_;
  ChunkMap chunks_;
  uint64_t rows_ = 0;
  std::shared_ptr<std::atomic<uint64_t>> loss_ = std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace pion::store
