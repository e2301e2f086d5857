// VStore: the V-store sessions a shard owns, keyed by tenant and session id, with their
// point-in-time snapshots. Runs on the owning shard; Total() is readable from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "residency/disk_file.h"
#include "store/codec/row_view.h"
#include "store/tenant_key.h"
#include "store/vsession.h"

namespace pion::store {

class VStore {
 public:
  struct Entry {
    std::unique_ptr<VSession> session;
    std::map<uint64_t, VSession::Snapshot> snapshots;
    uint64_t next_snapshot = 1;
    // Saves of the live session (SHUTDOWN SAVE seals it as an image that start-up restores):
    // `writes` counts its changes, `imaged_writes` the count its newest image was taken at.
    uint64_t writes = 0;
    std::optional<uint64_t> imaged_writes;
    bool unsaved() const { return !imaged_writes || *imaged_writes != writes; }
    // Copies of the rows as readers shaped them (V.FETCH ... HEADS and AS: some columns, in
    // the stored encoding or another codec), filled by the reads that shape them and served
    // to the reads after (a prefix read many times by a tensor-parallel rank, or in the
    // reader's codec, is shaped once). Valid while `writes` is what it was when they were
    // made; derived data, never saved.
    struct Shaped {
      std::unique_ptr<VSession> session;
      uint64_t writes = 0;
      // The chunks of rows a read asked for before. Columns in the stored encoding (HEADS
      // without AS) are a slice, cheap to take again: they are kept only once a second read
      // asks for them (a range read once is not worth the copy's memory and time).
      std::vector<bool> asked;
      // Marks [start, end)'s chunks asked; true when every one of them was asked before.
      bool AskAgain(int64_t start, int64_t end);
    };
    // {output codec, first column, columns}.
    using ShapeKey = std::tuple<codec::Format, uint32_t, uint32_t>;
    std::map<ShapeKey, Shaped> shaped;
  };

  // The residency engine the sessions' chunks live in (set before any Create).
  void set_engine(residency::Engine* e) { engine_ = e; }
  // Where a tenant's session chunks are allocated (default: the heap).
  using AllocatorFor = std::function<BufferAllocator*(uint32_t tenant)>;
  void set_allocator(AllocatorFor f) { allocator_for_ = std::move(f); }

  // Creates a session. An existing session with the same codec parameters is kept as is;
  // one with different parameters is an error naming both.
  Status Create(const TenantKey& key, const codec::RowCodec& codec);
  Entry* Find(const TenantKey& key);
  // The shaped copy of session `key`'s rows as `shape` gives them (created empty, or emptied
  // when the session changed since it was made); null when the session is absent or the
  // shape's output is fp32 (decoded rows are not kept: larger than the stored ones).
  Entry::Shaped* ShapedOf(const TenantKey& key, const codec::RowView& shape);
  // Returns kErr "no such session" when absent.
  StatusOr<Entry*> Get(const TenantKey& key);
  bool Drop(const TenantKey& key);

  // Sealed (V.COMMIT) snapshots on disk, known even when the session is not in memory.
  struct Sealed {
    std::string path;
    codec::Format format;
    uint32_t dim;
    uint32_t block;
    std::shared_ptr<residency::DiskFile> file;  // open: a restore reads chunks from it
    bool image = false;  // the session's image (SHUTDOWN SAVE): start-up restores the newest
  };
  void AddSealed(const TenantKey& key, uint64_t snapshot, Sealed s) {
    sealed_[key][snapshot] = std::move(s);
  }
  const Sealed* FindSealed(const TenantKey& key, uint64_t snapshot) const;
  size_t SealedCount(const TenantKey& key) const;
  // Forgets the session's sealed snapshots and returns their files (V.DROP deletes them).
  std::vector<std::string> TakeSealed(const TenantKey& key);
  // Forgets one sealed snapshot and returns its file ("" when it is not known).
  std::string TakeSealed(const TenantKey& key, uint64_t snapshot);
  // f(key, snapshot, sealed) for every sealed snapshot of every tenant.
  template <typename F>
  void ForEachSealed(F&& f) const {
    for (const auto& [k, snaps] : sealed_) {
      for (const auto& [n, s] : snaps) f(k, n, s);
    }
  }

  // f(key, entry) for every session of every tenant.
  template <typename F>
  void ForEach(F&& f) const {
    for (const auto& [k, e] : sessions_) f(k, e);
  }

  // Keeps the rows gauge in step after a store into a session (rows_after - rows_before).
  void NoteRows(int64_t delta) { rows_gauge_.fetch_add(delta, std::memory_order_relaxed); }

  struct Usage {
    uint64_t sessions = 0;
    uint64_t rows = 0;
    uint64_t snapshots = 0;
  };
  Usage UsageOf(uint32_t tenant) const;
  Usage Total() const {
    return {sessions_gauge_.load(std::memory_order_relaxed),
            static_cast<uint64_t>(rows_gauge_.load(std::memory_order_relaxed)), 0};
  }

 private:
  residency::Engine* engine_ = nullptr;
  AllocatorFor allocator_for_;
  std::unordered_map<TenantKey, Entry, TenantKeyHash> sessions_;
  std::unordered_map<TenantKey, std::map<uint64_t, Sealed>, TenantKeyHash> sealed_;
  std::atomic<uint64_t> sessions_gauge_{0};
  std::atomic<int64_t> rows_gauge_{0};
};

}  // namespace pion::store
