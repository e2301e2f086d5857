// Durable object files: the disk tier's unit of persistence.
//
// An object (a saved prefix, a sealed snapshot) is written as a new *version* file:
//   <dir>/<hex(name)>.<version>.pobj
// through a temporary file that is fsynced, renamed into place, and made durable with an
// fsync of the directory. WriteObject returns only after all of that, so an acknowledged save
// survives a crash at any later moment; a crash before the rename leaves a *.tmp file that
// ListObjects() ignores and removes. The previous version is deleted only after the new one is
// durable (never free the last good copy first — seed 004 §0x04A). Writers of different objects
// may run concurrently; one object's versions are written by its owning shard only.
//
// Layout (little-endian):
//   "PIONOBJ1" | u32 format=1 | u64 version | u32 meta_len | u32 n_blocks | meta bytes
//   | per block: u64 length, u64 xxh3_64(block) | u64 xxh3_64(everything above) | blocks...
//   | "PIONEND1"
// Opening validates the header checksum and the total length (a truncated or torn file is
// refused); each block is verified against its checksum when it is read.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pion::store::disk {

// The file that holds version `version` of object `name`.
std::string ObjectPath(const std::string& dir, std::string_view name, uint64_t version);

struct WriteOptions {
  // fsync the file before the rename and the directory after it (saved objects). Spill files
  // (residency demotions, which never outlive the process) skip both.
  bool durable = true;
  // Delete older versions of the object once the new one is in place.
  bool remove_older = true;
};

// Writes version `version` of object `name` (durably by default), then removes older versions
// of it. Every write and fsync passes the fault-injection points (common/faults.h) with the
// directory's last component as the target.
Status WriteObject(const std::string& dir, std::string_view name, uint64_t version,
                   std::string_view meta, const std::vector<std::span<const uint8_t>>& blocks,
                   WriteOptions options = {});

// Writes a whole object file as `bytes` (one another node wrote and sent: a replica's copy)
// as version `version` of `name`, durably (temp file, fsync, rename, directory fsync). Older
// versions stay: the caller removes them once the new one is validated and in use.
Status WriteObjectBytes(const std::string& dir, std::string_view name, uint64_t version,
                        std::string_view bytes);

// One block of an object being written: its bytes in memory (`data`), or produced on demand
// by `read` (e.g. a block of another object file, checked by its reader) — so a save can
// stream an object larger than memory. `hash` is the block's xxh3 when known (`hashed`), else
// computed from `data`.
struct BlockSource {
  uint64_t length = 0;
  const uint8_t* data = nullptr;
  std::function<Status(uint8_t* out)> read;
  uint64_t hash = 0;
  bool hashed = false;
};

// WriteObject from block sources: the header (with every block's length and hash) first,
// then each block, read into one scratch buffer at a time when it is not in memory.
Status WriteObjectFrom(const std::string& dir, std::string_view name, uint64_t version,
                       std::string_view meta, const std::vector<BlockSource>& blocks,
                       WriteOptions options = {});

// Whether a write failed because the file system is full (ENOSPC, EDQUOT): the kIo error
// WriteObject returns then, as opposed to a failing device.
bool IsNoSpace(const Status& s);

// The bytes WriteObject writes for these blocks and meta (disk quota accounting).
uint64_t ObjectFileBytes(std::string_view meta,
                         const std::vector<std::span<const uint8_t>>& blocks);

class ObjectFile {
 public:
  // Opens and validates the header, block table and length. kCorrupt on any mismatch, kIo
  // when the file cannot be read. `writable`: opened read-write so PunchBlock can free space.
  static StatusOr<ObjectFile> Open(const std::string& path, bool writable = false);

  ObjectFile(ObjectFile&& o) noexcept;
  ObjectFile& operator=(ObjectFile&& o) noexcept;
  ObjectFile(const ObjectFile&) = delete;
  ~ObjectFile();

  const std::string& path() const { return path_; }
  uint64_t version() const { return version_; }
  const std::string& meta() const { return meta_; }
  size_t block_count() const { return blocks_.size(); }
  uint64_t block_length(size_t i) const { return blocks_[i].length; }
  uint64_t block_hash(size_t i) const { return blocks_[i].hash; }
  uint64_t data_bytes() const;
  uint64_t file_bytes() const { return file_bytes_; }

  // Reads block i into out (block_length(i) bytes) and verifies its checksum (kCorrupt). A
  // mismatch is read once more before it is reported: a transient fault (a bad transfer)
  // heals, a corrupted file stays corrupt. Thread-safe (pread).
  Status ReadBlock(size_t i, uint8_t* out) const;
  // Frees block i's disk space (a hole; the file keeps its length). Needs a writable open.
  Status PunchBlock(size_t i) const;

 private:
  struct Block {
    uint64_t length;
    uint64_t hash;
    uint64_t offset;
  };
  ObjectFile() = default;

  std::string path_;
  std::string target_;  // the directory's last component: the fault-injection target
  int fd_ = -1;
  uint64_t version_ = 0;
  uint64_t file_bytes_ = 0;
  std::string meta_;
  std::vector<Block> blocks_;
};

struct ListedObject {
  std::string name;  // decoded object name
  uint64_t version;
  std::string path;
};

// The newest version file of every object in dir (creating dir if needed). Files that do not
// parse as object names (and *.tmp files) are ignored. Validation is the caller's
// (ObjectFile::Open).
StatusOr<std::vector<ListedObject>> ListObjects(const std::string& dir);

// Deletes *.tmp files left by writes interrupted by a crash (never acknowledged). Call at
// start-up only: at run time a *.tmp file may be another writer's save in progress.
Status RemoveLeftoverTemps(const std::string& dir);

// Deletes the given files of dir, then makes the deletion durable.
Status RemoveFiles(const std::string& dir, const std::vector<std::string>& paths);

// Removes every version of the object (KV.PREFIX.DROP deletes it everywhere).
Status RemoveObject(const std::string& dir, std::string_view name);

}  // namespace pion::store::disk
