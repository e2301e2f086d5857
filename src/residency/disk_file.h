// DiskFile and DiskCopy: an object's bytes on disk.
//
// A DiskFile is one open object file (store/disk/object_file.h: checksummed header, a checksum
// per block) that replicas point into: a saved file (a family's durable save: KV.PREFIX.SAVE,
// SSM.PREFIX.SAVE, ...) or a spill segment (the engine's demotions, several objects' blocks in
// one file, never outliving the process). It stays open for as long as a replica uses it, so
// a saved version that a newer save unlinked still reads (ABA-safe: the bytes a replica points
// at cannot be reused under it). Its bytes count against the disk quota until it is closed; a
// spill segment is unlinked then, and a spill block whose object dies is punched out at once.
//
// A DiskCopy is one object's replica: which file, and which block of it holds each of the
// object's blocks.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "store/disk/object_file.h"

namespace pion::residency {

class DiskQuota;

class DiskFile {
 public:
  enum class Kind { kSaved, kSpill };
  // Opens and validates the file at `path`, charging its size to `quota` (over the quota is
  // allowed: a file already on disk is counted, not refused).
  static StatusOr<std::shared_ptr<DiskFile>> Open(const std::string& path, Kind kind,
                                                  DiskQuota* quota);
  ~DiskFile();
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;

  const std::string& path() const { return file_.path(); }
  Kind kind() const { return kind_; }
  const store::disk::ObjectFile& file() const { return file_; }
  // Reads and verifies block i (see ObjectFile::ReadBlock). Thread-safe.
  Status ReadBlock(size_t i, uint8_t* out) const { return file_.ReadBlock(i, out); }
  // Spill only: block i is dead; its space goes back to the disk and the quota.
  void Release(size_t i);

 private:
  DiskFile(store::disk::ObjectFile f, Kind kind, DiskQuota* quota);
  store::disk::ObjectFile file_;
  Kind kind_;
  DiskQuota* quota_;
  std::atomic<uint64_t> charged_;
};

struct DiskCopy {
  std::shared_ptr<DiskFile> file;
  std::vector<uint32_t> blocks;  // file block of object block i
  bool durable() const { return file->kind() == DiskFile::Kind::kSaved; }
  ~DiskCopy();  // a spill copy's blocks are released (punched) with it
};

// The disk tier's budget (--disk-quota): bytes of saved and spill files Pion keeps. Lock-free.
class DiskQuota {
 public:
  explicit DiskQuota(uint64_t limit) : limit_(limit) {}
  uint64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  void set_limit(uint64_t l) { limit_.store(l, std::memory_order_relaxed); }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  // kOom naming the quota when `bytes` more would pass it (0 = no limit).
  Status Reserve(uint64_t bytes);
  void Charge(uint64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> limit_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace pion::residency
