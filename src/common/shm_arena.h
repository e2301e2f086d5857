// ShmArena: a BufferAllocator whose buffers live in memfd segments, so that a same-host client
// given a segment's file descriptor (SCM_RIGHTS over the Unix socket) can map it read-only and
// copy stored bytes straight into its own (pinned or GPU) memory — the data plane of issue 7.
//
// Segments are created on demand (memfd_create + ftruncate + one shared mapping) and never
// closed while the process runs, so a segment's fd is a stable identity for clients. Regions are
// carved first-fit by address from each segment's free list and coalesced on free; a request
// larger than the segment size gets a segment of its own. A freed region returns to the free list
// only when its last reference (a stored value, a reply in flight, a client lease) is gone, so a
// mapped region is never reused under a reader. Free space above `retain_bytes` is given back to
// the kernel with FALLOC_FL_PUNCH_HOLE (the mapping stays valid; the pages read as zero until
// reused). Thread-safe: one mutex, held for the free-list walk only.
//
// One arena holds the values of one tenant: a client mapping a segment sees only its tenant's
// bytes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/buffer.h"

namespace pion {

class ShmArena final : public BufferAllocator {
 public:
  // name: shown as memfd:<name> in /proc/<pid>/fd. segment_bytes: size of each segment (rounded
  // up to 2 MiB). retain_bytes: free bytes kept resident for reuse before holes are punched.
  ShmArena(std::string name, size_t segment_bytes, size_t retain_bytes = 256u << 20);
  ~ShmArena() override;
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  struct SegmentInfo {
    int fd;       // the segment's id (what Buffer::segment_fd() reports)
    int read_fd;  // a read-only descriptor of it: what clients are given
    size_t size;
  };
  std::vector<SegmentInfo> segments() const;
  // Bytes in live regions, bytes of all segments, bytes on the free lists.
  uint64_t used_bytes() const;
  uint64_t segment_bytes() const;
  uint64_t free_bytes() const;
  uint64_t cached_bytes() const override { return free_bytes(); }
  // Counts hole punches (free pages given back). A client that pinned a segment's pages
  // (cudaHostRegister) holds the old pages of a punched range, not the ones written later:
  // when this changes it must register the segment again.
  uint64_t punch_epoch() const { return punch_epoch_.load(std::memory_order_acquire); }

 protected:
  bool AllocateRegion(size_t size, Region* out) override;
  void FreeRegion(uint8_t* data, size_t length) override;

 private:
  struct Segment {
    int fd = -1;
    int read_fd = -1;
    uint8_t* base = nullptr;
    size_t size = 0;
    std::map<size_t, size_t> free;  // offset -> length, disjoint and coalesced
  };
  Segment* NewSegment(size_t size);  // mu_ held
  static bool Carve(Segment& s, size_t length, size_t align, size_t* offset);

  const std::string name_;
  const size_t segment_size_;
  const size_t retain_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Segment>> segments_;
  std::map<const uint8_t*, Segment*> by_base_;
  uint64_t used_ = 0;
  uint64_t free_ = 0;
  std::atomic<uint64_t> punch_epoch_{0};
  uint64_t mapped_ = 0;
};

}  // namespace pion
