#include "common/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace pion {
namespace {

// Above this size a buffer gets its own anonymous mapping: its pages return to the OS on
// free instead of fragmenting the malloc heap, and untouched pages are never committed.
constexpr size_t kMmapThreshold = 1 << 20;

class HeapAllocator final : public BufferAllocator {
 protected:
  bool AllocateRegion(size_t size, Region* out) override {
    void* p = nullptr;
    if (size >= kMmapThreshold) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return false;
    } else {
      p = std::aligned_alloc(64, (size + 63) & ~size_t{63});
      if (p == nullptr && size > 0) return false;
    }
    *out = Region{static_cast<uint8_t*>(p), -1, 0};
    return true;
  }
  void FreeRegion(uint8_t* data, size_t size) override {
    if (size >= kMmapThreshold) {
      munmap(data, size);
    } else {
      std::free(data);
    }
  }
};

}  // namespace

Buffer::~Buffer() { owner_->FreeRegion(data_, size_); }

StatusOr<BufferRef> BufferAllocator::Allocate(size_t size) {
  Region region{};
  if (!AllocateRegion(size, &region)) {
    return Status(ErrorKind::kOom, "cannot allocate " + std::to_string(size) + " bytes");
  }
  return BufferRef(new (std::nothrow) Buffer(this, region.data, size, region.fd, region.offset));
}

BufferAllocator* BufferAllocator::Default() {
  static HeapAllocator* heap = new HeapAllocator();  // never destroyed: buffers outlive main
  return heap;
}

StatusOr<BufferRef> CopyToBuffer(std::string_view bytes, BufferAllocator* alloc) {
  auto buf = alloc->Allocate(bytes.size());
  if (!buf.ok()) return buf.status();
  if (!bytes.empty()) std::memcpy(buf.value()->data(), bytes.data(), bytes.size());
  return buf;
}

}  // namespace pion
