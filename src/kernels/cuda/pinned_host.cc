// PinnedHostAllocator: host memory the GPU reads and writes by DMA at link speed. It is the
// default allocator's policy (MappedAllocator) with every new large mapping registered with the
// driver (cudaHostRegister) and unregistered only when it goes back to the OS; freed mappings
// stay registered in the reuse cache (up to kCacheLimit), because registering pins every page
// and unregistering may synchronise the device. Small regions, and any mapping the driver
// refuses to register, are plain memory: an upload of those goes through the pinned staging.
#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "common/buffer.h"
#include "kernels/cuda/gpu.h"

namespace pion::gpu {
namespace {

constexpr size_t kCacheLimit = size_t{1} << 30;

class PinnedHost final : public MappedAllocator {
 public:
  PinnedHost() : MappedAllocator(kCacheLimit) {}

  bool Pinned(const void* p, size_t n) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.upper_bound(a);
    if (it == pinned_.begin()) return false;
    --it;
    return a + n <= it->first + it->second;
  }

 protected:
  void Mapped(uint8_t* data, size_t length) override {
    if (cudaHostRegister(data, length, cudaHostRegisterDefault) != cudaSuccess) {
      cudaGetLastError();  // a plain mapping still works, through staging
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    pinned_[reinterpret_cast<uintptr_t>(data)] = length;
  }
  void Unmapping(uint8_t* data, size_t) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pinned_.erase(reinterpret_cast<uintptr_t>(data)) == 0) return;
    }
    if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
  }

 private:
  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> pinned_;  // registered mappings (handed out or cached) by address
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
