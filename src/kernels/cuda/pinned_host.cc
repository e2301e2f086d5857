// PinnedHostAllocator: host memory the GPU reads and writes by DMA at link speed. Regions of
// 1 MiB and more are anonymous mappings (huge-page advised) registered with the driver
// (cudaHostRegister); freed ones are kept, still registered, for reuse up to kCacheLimit,
// because registering pins every page (about a millisecond per 100 MiB) and unregistering may
// synchronise the device. Small regions, and any the driver refuses to register, are plain
// memory: an upload of those goes through the pinned staging buffers instead.
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "common/buffer.h"
#include "kernels/cuda/gpu.h"

namespace pion::gpu {
namespace {

constexpr size_t kLarge = 1 << 20;
constexpr size_t kHugePage = 2 << 20;
constexpr size_t kCacheLimit = size_t{1} << 30;

class PinnedHost final : public BufferAllocator {
 public:
  uint64_t cached_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_;
  }

  bool Pinned(const void* p, size_t n) const {
    auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(a);
    if (it == live_.begin()) return false;
    --it;
    return it->second.pinned && a + n <= it->first + it->second.length;
  }

 protected:
  bool AllocateRegion(size_t size, Region* out) override {
    if (size < kLarge) {
      void* p = std::aligned_alloc(64, (size + 63) & ~size_t{63});
      if (p == nullptr && size > 0) return false;
      *out = Region{static_cast<uint8_t*>(p), size, -1, 0};
      return true;
    }
    const size_t length = (size + kHugePage - 1) & ~(kHugePage - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.lower_bound(length);
      if (it != cache_.end() && it->first <= length + length / 4) {
        *out = Region{it->second, it->first, -1, 0};
        cached_ -= it->first;
        cache_.erase(it);
        return true;
      }
    }
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    madvise(p, length, MADV_HUGEPAGE);
    bool pinned = false;
    if (Info().present) {
      pinned = cudaHostRegister(p, length, cudaHostRegisterDefault) == cudaSuccess;
      if (!pinned) cudaGetLastError();  // a plain mapping still works, through staging
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_[reinterpret_cast<uintptr_t>(p)] = Live{length, pinned};
    }
    *out = Region{static_cast<uint8_t*>(p), length, -1, 0};
    return true;
  }

  void FreeRegion(uint8_t* data, size_t length) override {
    if (length < kLarge) {
      std::free(data);
      return;
    }
    bool pinned = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + length <= kCacheLimit) {
        cache_.emplace(length, data);
        cached_ += length;
        return;
      }
      auto it = live_.find(reinterpret_cast<uintptr_t>(data));
      if (it != live_.end()) {
        pinned = it->second.pinned;
        live_.erase(it);
      }
    }
    if (pinned && cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
    munmap(data, length);
  }

 private:
  struct Live {
    size_t length;
    bool pinned;
  };
  mutable std::mutex mu_;
  std::map<uintptr_t, Live> live_;  // every large region handed out or cached, by address
  std::multimap<size_t, uint8_t*> cache_;
  size_t cached_ = 0;
};

PinnedHost* Instance() {
  static PinnedHost* a = new PinnedHost();  // never destroyed: buffers outlive main
  return a;
}

}  // namespace

BufferAllocator* PinnedHostAllocator() {
  return Info().present ? static_cast<BufferAllocator*>(Instance()) : BufferAllocator::Default();
}

bool IsPinned(const void* p, size_t n) { return Info().present && Instance()->Pinned(p, n); }

}  // namespace pion::gpu
