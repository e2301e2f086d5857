#include "common/shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>

namespace pion {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kSegmentAlign = 2u << 20;
// Large regions are page-aligned (a client can map or punch them page by page); small ones 64 B.
constexpr size_t kPageAlignFrom = 64u << 10;

size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

ShmArena::ShmArena(std::string name, size_t segment_bytes, size_t retain_bytes)
    : name_(std::move(name)),
      segment_size_(RoundUp(std::max<size_t>(segment_bytes, kSegmentAlign), kSegmentAlign)),
      retain_bytes_(retain_bytes) {}

ShmArena::~ShmArena() {
  for (auto& s : segments_) {
    munmap(s->base, s->size);
    close(s->fd);
    close(s->read_fd);
  }
}

ShmArena::Segment* ShmArena::NewSegment(size_t size) {
  int fd = memfd_create(name_.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return nullptr;
  // The size never changes: clients may map the whole segment safely.
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    close(fd);
    return nullptr;
  }
  // A second, read-only open of the same memfd: a client given it cannot map it writable.
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  int read_fd = open(self.c_str(), O_RDONLY | O_CLOEXEC);
  if (read_fd < 0) {
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    close(read_fd);
    return nullptr;
  }
  auto seg = std::make_unique<Segment>();
  seg->fd = fd;
  seg->read_fd = read_fd;
  seg->base = static_cast<uint8_t*>(p);
  seg->size = size;
  seg->free.emplace(0, size);
  Segment* raw = seg.get();
  by_base_.emplace(raw->base, raw);
  segments_.push_back(std::move(seg));
  free_ += size;
  mapped_ += size;
  return raw;
}

bool ShmArena::Carve(Segment& s, size_t length, size_t align, size_t* offset) {
  for (auto it = s.free.begin(); it != s.free.end(); ++it) {
    const size_t start = RoundUp(it->first, align);
    const size_t end = it->first + it->second;
    if (start + length > end) continue;
    const size_t head = start - it->first, tail = end - (start + length);
    const size_t free_off = it->first;
    s.free.erase(it);
    if (head > 0) s.free.emplace(free_off, head);
    if (tail > 0) s.free.emplace(start + length, tail);
    *offset = start;
    return true;
  }
  return false;
}

bool ShmArena::AllocateRegion(size_t size, Region* out) {
  const size_t align = size >= kPageAlignFrom ? kPage : 64;
  const size_t length = RoundUp(std::max<size_t>(size, 1), align);
  std::lock_guard<std::mutex> lock(mu_);
  size_t offset = 0;
  Segment* seg = nullptr;
  for (auto& s : segments_) {
    if (Carve(*s, length, align, &offset)) {
      seg = s.get();
      break;
    }
  }
  if (seg == nullptr) {
    seg = NewSegment(std::max(segment_size_, RoundUp(length, kSegmentAlign)));
    if (seg == nullptr || !Carve(*seg, length, align, &offset)) return false;
  }
  used_ += length;
  free_ -= length;
  *out = Region{seg->base + offset, length, seg->fd, offset};
  return true;
}

void ShmArena::FreeRegion(uint8_t* data, size_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::prev(by_base_.upper_bound(data));
  Segment& s = *it->second;
  size_t off = static_cast<size_t>(data - s.base);
  size_t len = length;
  // Coalesce with the free neighbours.
  auto next = s.free.lower_bound(off);
  if (next != s.free.end() && off + len == next->first) {
    len += next->second;
    next = s.free.erase(next);
  }
  if (next != s.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      s.free.erase(prev);
    }
  }
  s.free.emplace(off, len);
  used_ -= length;
  free_ += length;
  if (free_ > retain_bytes_) {
    // Give the whole pages of this free range back; the range stays allocatable.
    const size_t a = RoundUp(off, kPage), b = (off + len) / kPage * kPage;
    if (b > a) {
      fallocate(s.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, a, b - a);
      punch_epoch_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
}

std::vector<ShmArena::SegmentInfo> ShmArena::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SegmentInfo> out;
  for (const auto& s : segments_) out.push_back({s->fd, s->read_fd, s->size});
  return out;
}

uint64_t ShmArena::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}
uint64_t ShmArena::segment_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_;
}
uint64_t ShmArena::free_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_;
}

}  // namespace pion
