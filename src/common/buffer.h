// Buffer: one contiguous, immutable-after-publish allocation holding a stored value or a
// large request argument.
//
// Values in Pion are megabytes to gigabytes, so they are never copied between the socket,
// the store and the reply: the parser reads a large bulk argument straight into a Buffer,
// a family adopts that Buffer as the stored value, and a reply references it by BufferRef
// (writev from the stored bytes). Buffers come from a BufferAllocator so that a later
// allocator can place them in memfd-backed shared memory and hand a same-host client a
// mapping (segment fd + offset) instead of bytes; Buffer therefore exposes where it lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include "common/status.h"

namespace pion {

class BufferAllocator;

class Buffer {
 public:
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view view() const { return {reinterpret_cast<const char*>(data_), size_}; }

  // Shared-memory placement: the segment's fd (-1 for private heap memory) and the offset
  // of data() inside that segment. Heap buffers report {-1, 0}.
  int segment_fd() const { return segment_fd_; }
  uint64_t segment_offset() const { return segment_offset_; }

 private:
  friend class BufferAllocator;
  Buffer(BufferAllocator* owner, uint8_t* data, size_t size, size_t length, int fd, uint64_t off)
      : owner_(owner),
        data_(data),
        size_(size),
        length_(length),
        segment_fd_(fd),
        segment_offset_(off) {}

  BufferAllocator* owner_;
  uint8_t* data_;
  size_t size_;
  size_t length_;  // bytes actually reserved (>= size_), returned to the allocator on free
  int segment_fd_;
  uint64_t segment_offset_;
};

using BufferRef = std::shared_ptr<Buffer>;

// Where Buffers come from. Thread-safe: any shard may allocate, any thread may free.
class BufferAllocator {
 public:
  virtual ~BufferAllocator() = default;

  // Allocates size bytes, 64-byte aligned (SIMD kernels rely on it). The bytes are not
  // initialised. Returns kOom if the memory cannot be obtained.
  StatusOr<BufferRef> Allocate(size_t size);

  // The process-wide default allocator: private heap for small sizes; large sizes are
  // huge-page-advised anonymous mappings, and freed ones are kept in a bounded cache for
  // reuse (a fresh mapping costs a page fault per 4 KiB page on first touch).
  static BufferAllocator* Default();

  // Bytes of freed large regions held for reuse (resident, not counted as stored data).
  virtual uint64_t cached_bytes() const { return 0; }

 protected:
  struct Region {
    uint8_t* data;
    size_t length;  // bytes reserved, >= the size asked
    int fd;
    uint64_t offset;
  };
  virtual bool AllocateRegion(size_t size, Region* out) = 0;
  virtual void FreeRegion(uint8_t* data, size_t length) = 0;

 private:
  friend class Buffer;
};

// The default allocator's policy, for allocators that add to its mappings (e.g. page-locking
// them for the GPU): sizes under 1 MiB from the heap, larger ones anonymous huge-page-advised
// mappings, freed mappings kept for reuse up to cache_limit bytes (a region up to a quarter of
// that), reused for a request they fit with at most 25 % to spare. Mapped() runs once per new
// mapping, Unmapping() before one is returned to the OS.
class MappedAllocator : public BufferAllocator {
 public:
  explicit MappedAllocator(size_t cache_limit) : cache_limit_(cache_limit) {}
  uint64_t cached_bytes() const override;

 protected:
  virtual void Mapped(uint8_t* /*data*/, size_t /*length*/) {}
  virtual void Unmapping(uint8_t* /*data*/, size_t /*length*/) {}
  bool AllocateRegion(size_t size, Region* out) final;
  void FreeRegion(uint8_t* data, size_t length) final;

 private:
  const size_t cache_limit_;
  mutable std::mutex mu_;  // large (>= 1 MiB) allocations only
  std::multimap<size_t, uint8_t*> cache_;
  size_t cached_ = 0;
};

// Convenience: allocate and copy bytes in.
StatusOr<BufferRef> CopyToBuffer(std::string_view bytes,
                                 BufferAllocator* alloc = BufferAllocator::Default());

}  // namespace pion
