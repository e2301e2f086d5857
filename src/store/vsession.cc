#include "store/vsession.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace pion::store {
namespace {

// Chunk index and row-in-chunk of an id (ids are non-negative).
inline int64_t ChunkOf(int64_t id) { return id / kRowsPerChunk; }
inline uint32_t SlotOf(int64_t id) { return static_cast<uint32_t>(id % kRowsPerChunk); }

}  // namespace

VSession::Chunk::~Chunk() {
  if (budget_ != nullptr && budget_->release) budget_->release(bytes->size());
}

VSession::VSession(codec::RowCodec codec, const ByteBudget* budget, BufferAllocator* alloc)
    : codec_(codec), budget_(budget), alloc_(alloc) {}

uint64_t VSession::chunk_bytes() const {
  return static_cast<uint64_t>(chunks_.size()) * kRowsPerChunk * codec_.row_bytes();
}

const VSession::Chunk* VSession::FindChunk(int64_t index) const {
  auto it = chunks_.find(index);
  return it == chunks_.end() ? nullptr : it->second.get();
}

StatusOr<VSession::Chunk*> VSession::WritableChunk(int64_t index) {
  const size_t size = static_cast<size_t>(kRowsPerChunk) * codec_.row_bytes();
  auto it = chunks_.find(index);
  if (it != chunks_.end() && it->second.use_count() == 1 && it->second->bytes.use_count() == 1) {
    return it->second.get();  // ours alone: write in place
  }
  if (budget_ != nullptr && budget_->reserve) {
    Status s = budget_->reserve(size);
    if (!s.ok()) return s;
  }
  auto buf = alloc_->Allocate(size);
  if (!buf.ok()) {
    if (budget_ != nullptr && budget_->release) budget_->release(size);
    return buf.status();
  }
  auto chunk = std::make_shared<Chunk>(std::move(buf).value(), budget_);
  if (it != chunks_.end()) {
    // Shared with a snapshot or a reply in flight: copy, then write the copy.
    std::memcpy(chunk->bytes->data(), it->second->bytes->data(), size);
    chunk->written = it->second->written;
    it->second = chunk;
  } else {
    std::memset(chunk->bytes->data(), 0, size);
    chunks_.emplace(index, chunk);
  }
  return chunk.get();
}

Status VSession::PrepareChunks(const std::vector<int64_t>& indexes) {
  std::vector<int64_t> created;
  for (int64_t c : indexes) {
    bool existed = chunks_.count(c) != 0;
    auto w = WritableChunk(c);
    if (!w.ok()) {
      for (int64_t e : created) chunks_.erase(e);
      return w.status();
    }
    if (!existed) created.push_back(c);
  }
  return Status::Ok();
}

Status VSession::StoreRange(int64_t start, const float* rows, size_t n) {
  if (start < 0) return Error("start id must be >= 0, got " + std::to_string(start));
  if (n == 0) return Status::Ok();
  if (static_cast<uint64_t>(start) + n > static_cast<uint64_t>(INT64_MAX)) {
    return Error("id range overflows int64");
  }
  const int64_t end = start + static_cast<int64_t>(n);
  // Reserve every chunk first so that an OOM leaves the session unchanged (chunks copied for
  // writing keep identical contents).
  std::vector<int64_t> need;
  for (int64_t c = ChunkOf(start); c <= ChunkOf(end - 1); ++c) need.push_back(c);
  Status prepared = PrepareChunks(need);
  if (!prepared.ok()) return prepared;
  const size_t rb = codec_.row_bytes();
  int64_t id = start;
  while (id < end) {
    Chunk* chunk = chunks_[ChunkOf(id)].get();
    uint32_t slot = SlotOf(id);
    size_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    codec_.Encode(rows + static_cast<size_t>(id - start) * codec_.dim(), take,
                  chunk->bytes->data() + slot * rb);
    uint64_t mask = take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1) << slot;
    rows_ += static_cast<uint64_t>(std::popcount(mask & ~chunk->written));
    chunk->written |= mask;
    id += static_cast<int64_t>(take);
  }
  return Status::Ok();
}

Status VSession::StoreIds(const int64_t* ids, const float* rows, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0) {
      return Error("id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                   " is negative");
    }
  }
  std::vector<int64_t> need;
  for (size_t i = 0; i < n; ++i) need.push_back(ChunkOf(ids[i]));
  std::sort(need.begin(), need.end());
  need.erase(std::unique(need.begin(), need.end()), need.end());
  Status prepared = PrepareChunks(need);
  if (!prepared.ok()) return prepared;
  const size_t rb = codec_.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    Chunk* chunk = chunks_[ChunkOf(ids[i])].get();
    uint32_t slot = SlotOf(ids[i]);
    codec_.Encode(rows + i * codec_.dim(), 1, chunk->bytes->data() + slot * rb);
    uint64_t bit = uint64_t{1} << slot;
    if (!(chunk->written & bit)) ++rows_;
    chunk->written |= bit;
  }
  return Status::Ok();
}

Status VSession::CheckRange(int64_t start, int64_t end) const {
  if (start < 0 || end < start) {
    return Error("bad range [" + std::to_string(start) + ", " + std::to_string(end) + ")");
  }
  // O(1) when [start, end) holds every written id and as many ids as are written (a complete
  // KV.PREFIX namespace: LOOKUP of a 32K-token, 32-layer prefix would otherwise visit 16K chunks).
  if (end > start && rows_ == static_cast<uint64_t>(end - start) && !chunks_.empty()) {
    const auto& [lo_index, lo] = *chunks_.begin();
    const auto& [hi_index, hi] = *chunks_.rbegin();
    if (lo->written != 0 && hi->written != 0) {
      const int64_t first = lo_index * kRowsPerChunk + std::countr_zero(lo->written);
      const int64_t last = hi_index * kRowsPerChunk + 63 - std::countl_zero(hi->written);
      if (first >= start && last < end) return Status::Ok();
    }
  }
  for (int64_t id = start; id < end;) {
    const Chunk* chunk = FindChunk(ChunkOf(id));
    uint32_t slot = SlotOf(id);
    int64_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    uint64_t mask = take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1) << slot;
    uint64_t missing = chunk ? mask & ~chunk->written : mask;
    if (missing != 0) {
      int64_t first = ChunkOf(id) * kRowsPerChunk + std::countr_zero(missing);
      return Error("id " + std::to_string(first) + " was never stored");
    }
    id += take;
  }
  return Status::Ok();
}

Status VSession::CheckIds(const int64_t* ids, size_t n) const {
  for (size_t i = 0; i < n; ++i) {
    const Chunk* chunk = ids[i] < 0 ? nullptr : FindChunk(ChunkOf(ids[i]));
    if (chunk == nullptr || !(chunk->written & (uint64_t{1} << SlotOf(ids[i])))) {
      return Error("id " + std::to_string(ids[i]) + " was never stored");
    }
  }
  return Status::Ok();
}

uint64_t VSession::CountWritten(int64_t start, int64_t end) const {
  uint64_t count = 0;
  for (int64_t id = start; id < end;) {
    const Chunk* chunk = FindChunk(ChunkOf(id));
    uint32_t slot = SlotOf(id);
    int64_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    uint64_t mask = take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1) << slot;
    if (chunk) count += static_cast<uint64_t>(std::popcount(chunk->written & mask));
    id += take;
  }
  return count;
}

void VSession::DecodeRange(int64_t start, int64_t end, float* out) const {
  const size_t rb = codec_.row_bytes();
  for (int64_t id = start; id < end;) {
    const Chunk* chunk = FindChunk(ChunkOf(id));
    uint32_t slot = SlotOf(id);
    size_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    codec_.Decode(chunk->bytes->data() + slot * rb, take,
                  out + static_cast<size_t>(id - start) * codec_.dim());
    id += static_cast<int64_t>(take);
  }
}

void VSession::DecodeIds(const int64_t* ids, size_t n, float* out) const {
  const size_t rb = codec_.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    const Chunk* chunk = FindChunk(ChunkOf(ids[i]));
    codec_.Decode(chunk->bytes->data() + SlotOf(ids[i]) * rb, 1, out + i * codec_.dim());
  }
}

void VSession::RawRange(int64_t start, int64_t end, const PieceSink& sink) const {
  const size_t rb = codec_.row_bytes();
  for (int64_t id = start; id < end;) {
    const Chunk* chunk = FindChunk(ChunkOf(id));
    uint32_t slot = SlotOf(id);
    size_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    sink(chunk->bytes, chunk->bytes->data() + slot * rb, take * rb);
    id += static_cast<int64_t>(take);
  }
}

void VSession::RawIds(const int64_t* ids, size_t n, uint8_t* out) const {
  const size_t rb = codec_.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    const Chunk* chunk = FindChunk(ChunkOf(ids[i]));
    std::memcpy(out + i * rb, chunk->bytes->data() + SlotOf(ids[i]) * rb, rb);
  }
}

Status VSession::Load(const std::vector<std::tuple<int64_t, BufferRef, uint64_t>>& chunks) {
  const size_t size = static_cast<size_t>(kRowsPerChunk) * codec_.row_bytes();
  for (const auto& [index, bytes, written] : chunks) {
    if (index < 0 || bytes == nullptr || bytes->size() != size) {
      return Status(ErrorKind::kCorrupt, "chunk " + std::to_string(index) + " has " +
                                             std::to_string(bytes ? bytes->size() : 0) +
                                             " bytes, expected " + std::to_string(size));
    }
  }
  const uint64_t total = static_cast<uint64_t>(size) * chunks.size();
  if (budget_ != nullptr && budget_->reserve) {
    Status s = budget_->reserve(total);
    if (!s.ok()) return s;
  }
  ChunkMap loaded;
  uint64_t rows = 0;
  for (const auto& [index, bytes, written] : chunks) {
    auto chunk = std::make_shared<Chunk>(bytes, budget_);  // releases its share when freed
    chunk->written = written;
    rows += static_cast<uint64_t>(std::popcount(written));
    loaded[index] = std::move(chunk);
  }
  chunks_ = std::move(loaded);
  rows_ = rows;
  return Status::Ok();
}

void VSession::Restore(const Snapshot& s) {
  chunks_ = s.chunks;
  rows_ = s.rows;
}

}  // namespace pion::store
