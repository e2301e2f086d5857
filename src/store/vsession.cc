#include "store/vsession.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "residency/engine.h"

namespace pion::store {
namespace {

// Chunk index and row-in-chunk of an id (ids are non-negative).
inline int64_t ChunkOf(int64_t id) { return id / kRowsPerChunk; }
inline uint32_t SlotOf(int64_t id) { return static_cast<uint32_t>(id % kRowsPerChunk); }

using residency::Family;
using residency::ObjectRef;

}  // namespace

const BufferRef* VSession::HostView::Find(int64_t chunk) const {
  auto it = std::lower_bound(chunks_.begin(), chunks_.end(), chunk,
                             [](const auto& e, int64_t c) { return e.first < c; });
  return it != chunks_.end() && it->first == chunk ? &it->second : nullptr;
}

VSession::VSession(codec::RowCodec codec, residency::Engine* engine, BufferAllocator* alloc)
    : codec_(codec), engine_(engine), alloc_(alloc) {}

uint64_t VSession::chunk_bytes() const {
  return static_cast<uint64_t>(chunks_.size()) * chunk_size();
}

uint64_t VSession::host_bytes() const {
  uint64_t n = 0;
  for (const auto& [i, c] : chunks_) {
    if (c->obj->Resident(residency::Tier::kHost)) n += chunk_size();
  }
  return n;
}

const VSession::Chunk* VSession::FindChunk(int64_t index) const {
  auto it = chunks_.find(index);
  return it == chunks_.end() ? nullptr : it->second.get();
}

std::vector<int64_t> VSession::ChunksOfRange(int64_t start, size_t n) {
  std::vector<int64_t> out;
  if (n == 0 || start < 0) return out;
  const int64_t end = start + static_cast<int64_t>(n);
  for (int64_t c = ChunkOf(start); c <= ChunkOf(end - 1); ++c) out.push_back(c);
  return out;
}

std::vector<int64_t> VSession::ChunksOfIds(const int64_t* ids, size_t n) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] >= 0) out.push_back(ChunkOf(ids[i]));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void VSession::Existing(const std::vector<int64_t>& indexes, bool missing_only,
                        std::vector<ObjectRef>* out) const {
  for (int64_t c : indexes) {
    const Chunk* chunk = FindChunk(c);
    if (chunk != nullptr && (!missing_only || !chunk->obj->Resident(residency::Tier::kHost))) {
      out->push_back(chunk->obj);
    }
  }
}

void VSession::ChunksForRange(int64_t start, size_t n, std::vector<ObjectRef>* out) const {
  Existing(ChunksOfRange(start, n), /*missing_only=*/false, out);
}

void VSession::ChunksForIds(const int64_t* ids, size_t n, std::vector<ObjectRef>* out) const {
  Existing(ChunksOfIds(ids, n), /*missing_only=*/false, out);
}

void VSession::MissingForRange(int64_t start, size_t n, std::vector<ObjectRef>* out) const {
  Existing(ChunksOfRange(start, n), /*missing_only=*/true, out);
}

uint64_t VSession::BytesToStore(const std::vector<int64_t>& indexes) const {
  return static_cast<uint64_t>(indexes.size()) * chunk_size();  // new or copied, at most
}

uint64_t VSession::BytesToStoreRange(int64_t start, size_t n) const {
  return BytesToStore(ChunksOfRange(start, n));
}

uint64_t VSession::BytesToStoreIds(const int64_t* ids, size_t n) const {
  return BytesToStore(ChunksOfIds(ids, n));
}

StatusOr<VSession::Writable> VSession::WritableChunk(int64_t index, const HeldPins& held) {
  const size_t size = chunk_size();
  auto it = chunks_.find(index);
  uint32_t own_pins = 0;
  if (it != chunks_.end()) {
    auto pinned = held.find(it->second->obj.get());
    own_pins = pinned == held.end() ? 0 : pinned->second;
    if (own_pins == 0) {  // the caller's bug: nothing keeps it in memory until it is written
      return Error("chunk " + std::to_string(index) +
                   " of the session is written without being pinned in host memory");
    }
  }
  if (it != chunks_.end() && it->second.use_count() == 1) {
    // Ours alone (no snapshot shares the chunk): write in place if nobody else holds its bytes.
    if (uint8_t* p = it->second->obj->BeginWrite(0, own_pins)) {
      return Writable{it->second.get(), p, it->second->obj.get()};
    }
  }
  BufferRef old;
  if (it != chunks_.end()) old = it->second->obj->HostBlock(0);  // pinned: resident
  auto charge = engine_->ReserveHost(Family::kVStore, size);
  if (!charge.ok()) return charge.status();
  auto buf = alloc_->Allocate(size);
  if (!buf.ok()) return buf.status();
  uint8_t* bytes = buf.value()->data();
  auto chunk = std::make_shared<Chunk>();
  chunk->obj = engine_->CreateInHost(Family::kVStore, {std::move(buf).value()},
                                     std::move(charge).value(), alloc_);
  chunk->obj->set_loss_counter(loss_);
  if (it != chunks_.end()) {
    // Shared with a snapshot, a reply in flight or a save: copy, then write the copy.
    std::memcpy(bytes, old->data(), size);
    chunk->written = it->second->written;
    it->second = chunk;
  } else {
    std::memset(bytes, 0, size);
    chunks_.emplace(index, chunk);
  }
  return Writable{chunk.get(), bytes, nullptr};
}

Status VSession::PrepareChunks(const std::vector<int64_t>& indexes, const residency::PinSet& held,
                               std::vector<Writable>* out) {
  std::vector<int64_t> created;
  out->clear();
  const HeldPins pins = held.Counts(residency::Tier::kHost);
  for (int64_t c : indexes) {
    const bool existed = chunks_.count(c) != 0;
    auto w = WritableChunk(c, pins);
    if (!w.ok()) {
      for (int64_t e : created) chunks_.erase(e);
      for (const Writable& x : *out) {
        if (x.began != nullptr) x.began->EndWrite();
      }
      out->clear();
      return w.status();
    }
    if (!existed) created.push_back(c);
    out->push_back(w.value());
  }
  return Status::Ok();
}

Status VSession::StoreRange(int64_t start, const float* rows, size_t n,
                            const residency::PinSet& held) {
  if (start < 0) return Error("start id must be >= 0, got " + std::to_string(start));
  if (n == 0) return Status::Ok();
  if (static_cast<uint64_t>(start) + n > static_cast<uint64_t>(INT64_MAX)) {
    return Error("id range overflows int64");
  }
  const int64_t end = start + static_cast<int64_t>(n);
  // Every chunk first, so a refusal leaves the session unchanged (copies keep identical
  // contents).
  std::vector<int64_t> need = ChunksOfRange(start, n);
  std::vector<Writable> w;
  Status prepared = PrepareChunks(need, held, &w);
  if (!prepared.ok()) return prepared;
  const size_t rb = codec_.row_bytes();
  int64_t id = start;
  for (size_t k = 0; id < end; ++k) {
    Chunk* chunk = w[k].chunk;
    uint32_t slot = SlotOf(id);
    size_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    codec_.Encode(rows + static_cast<size_t>(id - start) * codec_.dim(), take,
                  w[k].bytes + slot * rb);
    uint64_t mask = take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1) << slot;
    rows_ += static_cast<uint64_t>(std::popcount(mask & ~chunk->written));
    chunk->written |= mask;
    id += static_cast<int64_t>(take);
  }
  for (const Writable& x : w) {
    if (x.began != nullptr) x.began->EndWrite();
  }
  return Status::Ok();
}

Status VSession::AdoptEncoded(int64_t start, const uint8_t* rows, size_t n) {
  if (start < 0 || n == 0) return Status::Ok();
  const int64_t end = start + static_cast<int64_t>(n);
  std::vector<int64_t> fresh;
  for (int64_t c : ChunksOfRange(start, n)) {
    if (chunks_.count(c) == 0) fresh.push_back(c);
  }
  if (fresh.empty()) return Status::Ok();
  std::vector<Writable> w;
  Status prepared = PrepareChunks(fresh, residency::PinSet(), &w);
  if (!prepared.ok()) return prepared;
  const size_t rb = codec_.row_bytes();
  for (size_t k = 0; k < fresh.size(); ++k) {
    const int64_t first = std::max<int64_t>(start, fresh[k] * kRowsPerChunk);
    const int64_t last = std::min<int64_t>(end, (fresh[k] + 1) * kRowsPerChunk);
    const uint32_t slot = SlotOf(first);
    const size_t take = static_cast<size_t>(last - first);
    std::memcpy(w[k].bytes + slot * rb, rows + static_cast<size_t>(first - start) * rb, take * rb);
    const uint64_t mask = take == 64 ? ~uint64_t{0} : ((uint64_t{1} << take) - 1) << slot;
    rows_ += static_cast<uint64_t>(std::popcount(mask & ~w[k].chunk->written));
    w[k].chunk->written |= mask;
  }
  for (const Writable& x : w) {
    if (x.began != nullptr) x.began->EndWrite();
  }
  return Status::Ok();
}

Status VSession::StoreIds(const int64_t* ids, const float* rows, size_t n,
                          const residency::PinSet& held) {
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0) {
      return Error("id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                   " is negative");
    }
  }
  std::vector<int64_t> need = ChunksOfIds(ids, n);
  std::vector<Writable> w;
  Status prepared = PrepareChunks(need, held, &w);
  if (!prepared.ok()) return prepared;
  const size_t rb = codec_.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(
        std::lower_bound(need.begin(), need.end(), ChunkOf(ids[i])) - need.begin());
    Chunk* chunk = w[k].chunk;
    uint32_t slot = SlotOf(ids[i]);
    codec_.Encode(rows + i * codec_.dim(), 1, w[k].bytes + slot * rb);
    uint64_t bit = uint64_t{1} << slot;
    if (!(chunk->written & bit)) ++rows_;
    chunk->written |= bit;
  }
  for (const Writable& x : w) {
    if (x.began != nullptr) x.began->EndWrite();
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

bool VSession::ViewRange(int64_t start, int64_t end, HostView* view,
                         std::vector<ObjectRef>* missing) const {
  view->chunks_.clear();
  bool all = true;
  if (end <= start) return true;
  for (int64_t c = ChunkOf(start); c <= ChunkOf(end - 1); ++c) {
    const Chunk* chunk = FindChunk(c);
    if (chunk == nullptr) continue;  // never written: Check* refuses it first
    BufferRef b = chunk->obj->HostBlock(0);
    if (b) {
      view->chunks_.emplace_back(c, std::move(b));
    } else {
      all = false;
      missing->push_back(chunk->obj);
    }
  }
  return all;
}

bool VSession::ViewIds(const int64_t* ids, size_t n, HostView* view,
                       std::vector<ObjectRef>* missing) const {
  view->chunks_.clear();
  bool all = true;
  for (int64_t c : ChunksOfIds(ids, n)) {
    const Chunk* chunk = FindChunk(c);
    if (chunk == nullptr) continue;
    BufferRef b = chunk->obj->HostBlock(0);
    if (b) {
      view->chunks_.emplace_back(c, std::move(b));
    } else {
      all = false;
      missing->push_back(chunk->obj);
    }
  }
  return all;
}

void VSession::DecodeRange(const HostView& view, int64_t start, int64_t end, float* out) const {
  const size_t rb = codec_.row_bytes();
  for (int64_t id = start; id < end;) {
    const BufferRef& b = *view.Find(ChunkOf(id));
    uint32_t slot = SlotOf(id);
    size_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    codec_.Decode(b->data() + slot * rb, take,
                  out + static_cast<size_t>(id - start) * codec_.dim());
    id += static_cast<int64_t>(take);
  }
}

void VSession::DecodeIds(const HostView& view, const int64_t* ids, size_t n, float* out) const {
  const size_t rb = codec_.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    const BufferRef& b = *view.Find(ChunkOf(ids[i]));
    codec_.Decode(b->data() + SlotOf(ids[i]) * rb, 1, out + i * codec_.dim());
  }
}

void VSession::RawRange(const HostView& view, int64_t start, int64_t end,
                        const PieceSink& sink) const {
  const size_t rb = codec_.row_bytes();
  for (int64_t id = start; id < end;) {
    const BufferRef& b = *view.Find(ChunkOf(id));
    uint32_t slot = SlotOf(id);
    size_t take = std::min<int64_t>(kRowsPerChunk - slot, end - id);
    sink(b, b->data() + slot * rb, take * rb);
    id += static_cast<int64_t>(take);
  }
}

void VSession::RawIds(const HostView& view, const int64_t* ids, size_t n, uint8_t* out) const {
  const size_t rb = codec_.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    const BufferRef& b = *view.Find(ChunkOf(ids[i]));
    std::memcpy(out + i * rb, b->data() + SlotOf(ids[i]) * rb, rb);
  }
}

Status VSession::LoadFromDisk(const std::shared_ptr<residency::DiskFile>& file,
                              const std::vector<DiskChunk>& chunks) {
  const uint64_t size = chunk_size();
  for (const auto& c : chunks) {
    if (c.index < 0 || c.block >= file->file().block_count() ||
        file->file().block_length(c.block) != size) {
      return Status(ErrorKind::kCorrupt, file->path() + ": chunk " + std::to_string(c.index) +
                                             " has the wrong size or no block");
    }
  }
  ChunkMap loaded;
  uint64_t rows = 0;
  for (const auto& c : chunks) {
    auto chunk = std::make_shared<Chunk>();
    chunk->obj = engine_->CreateOnDisk(Family::kVStore, {size}, file, {c.block}, alloc_);
    chunk->obj->set_loss_counter(loss_);
    chunk->written = c.written;
    rows += static_cast<uint64_t>(std::popcount(c.written));
    loaded[c.index] = std::move(chunk);
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
