// GpuSlots: the GPU residency of ATTEND.PREFIX slots under --attention-backend cuda — one
// device copy of a slot's K and V per published slot, and one LRU across all shards under
// --gpu-memory.
//
// Place() is reserve → copy → validate: it charges the bytes (evicting least recently used
// copies that no query holds), allocates from the cudaMalloc pool, uploads through pinned
// staging on a copy stream and returns only after the copy's event completed and the
// allocation's id fence still matched — so the shard publishes a slot whose device copy is
// complete. Queries Acquire() a copy (it cannot be evicted while held; an evicted copy cannot be
// acquired), make their compute stream wait on its ready() event, and release it when their
// stream finished. An evicted copy's slot reads as gone: the shard unlinks it (LOOKUP misses).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "kernels/attention.h"
#include "kernels/cuda/gpu.h"

namespace pion::attention {

class GpuSlots;

class GpuCopy {
 public:
  ~GpuCopy();
  const void* k() const { return base(); }
  const void* v() const { return static_cast<const uint8_t*>(base()) + half_; }
  const gpu::Event& ready() const { return ready_; }
  uint64_t bytes() const { return bytes_; }
  bool evicted() const { return evicted_.load(std::memory_order_acquire); }
  // The CUDA IPC handle of this copy's allocation (ATTEND.PREFIX.EXPORT): asked of the driver
  // once, then reused — the allocation, and so its handle, stays the same for the copy's life.
  StatusOr<std::string> IpcHandle() const;

 private:
  friend class GpuSlots;
  const void* base() const { return mem_.data(); }
  GpuSlots* owner_ = nullptr;
  gpu::DeviceMemory mem_;  // K, then V at half_
  uint64_t half_ = 0;
  uint64_t bytes_ = 0;  // charged
  gpu::Event ready_;
  std::atomic<bool> evicted_{false};
  mutable std::mutex ipc_mu_;
  mutable std::string ipc_handle_;     // guarded by ipc_mu_; empty until first asked
  int readers_ = 0;                    // guarded by owner_->mu_
  std::list<GpuCopy*>::iterator lru_;  // guarded by owner_->mu_; valid while linked
  bool linked_ = false;
};

class GpuSlots {
 public:
  explicit GpuSlots(uint64_t limit) : limit_(limit) {}
  GpuSlots(const GpuSlots&) = delete;
  GpuSlots& operator=(const GpuSlots&) = delete;

  using Fill = std::function<void(uint8_t* staging, uint64_t offset, uint64_t n)>;
  // Device copy of K (bytes_each, produced by fill_k) and V (fill_v). kOom when the budget or
  // the device cannot hold it even after evicting every copy no query holds.
  StatusOr<std::shared_ptr<GpuCopy>> Place(uint64_t bytes_each, const Fill& fill_k,
                                           const Fill& fill_v);

  // Holds a copy for the duration of a query (released on destruction).
  class Pin {
   public:
    Pin() = default;
    explicit Pin(std::shared_ptr<GpuCopy> c) : copy_(std::move(c)) {}
    Pin(Pin&&) = default;
    Pin& operator=(Pin&& o) noexcept {
      if (this != &o) {
        Release();
        copy_ = std::move(o.copy_);
      }
      return *this;
    }
    ~Pin() { Release(); }
    const GpuCopy* operator->() const { return copy_.get(); }
    explicit operator bool() const { return copy_ != nullptr; }

   private:
    void Release();
    std::shared_ptr<GpuCopy> copy_;
  };
  // A pin on the copy, or an empty pin when it was evicted. Marks it recently used.
  Pin Acquire(const std::shared_ptr<GpuCopy>& copy);

  // Reserves `bytes` of the budget outside any slot (block summaries); false when no room even
  // after evictions. ReleaseExtra gives it back.
  bool ReserveExtra(uint64_t bytes);
  void ReleaseExtra(uint64_t bytes);

  void set_limit(uint64_t limit);
  struct Stats {
    uint64_t limit = 0, used = 0, copies = 0, evictions = 0, uploads = 0, upload_bytes = 0,
             failures = 0;
  };
  Stats stats() const;
  // Bumped by every eviction: shards sweep their gone slots when it moved.
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }

 private:
  friend class GpuCopy;
  // Under mu_: evicts LRU copies nobody holds until used_ + bytes <= limit_; false if it can't.
  bool MakeRoomLocked(uint64_t bytes);
  void Unlink(GpuCopy* c);

  mutable std::mutex mu_;
  uint64_t limit_;
  uint64_t used_ = 0;
  std::list<GpuCopy*> lru_;  // most recently used first
  std::atomic<uint64_t> evictions_{0};
  uint64_t uploads_ = 0, upload_bytes_ = 0, failures_ = 0;
};

}  // namespace pion::attention
