// GpuReplica: an object's bytes in GPU memory — one pool allocation holding its blocks back to
// back — and GpuPin, which holds it against demotion while a kernel (or a CUDA IPC export) reads
// it. The bytes count against the GPU budget (--gpu-memory) until the replica is destroyed.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/gpu.h"

namespace pion::residency {

class GpuBudget;

class GpuReplica {
 public:
  GpuReplica(gpu::DeviceMemory mem, std::vector<uint64_t> offsets, GpuBudget* budget,
             uint64_t charged);
  ~GpuReplica();
  GpuReplica(const GpuReplica&) = delete;
  GpuReplica& operator=(const GpuReplica&) = delete;

  // Device address of block i.
  const void* block(size_t i) const {
    return static_cast<const uint8_t*>(mem_.data()) + offsets_[i];
  }
  // Recorded after the copy that filled it: a stream that reads it waits on this first.
  const gpu::Event& ready() const { return ready_; }
  gpu::Event& mutable_ready() { return ready_; }
  gpu::DeviceMemory& memory() { return mem_; }
  uint64_t bytes() const { return charged_; }
  int readers() const { return readers_.load(std::memory_order_acquire); }
  // The allocation's CUDA IPC handle (ATTEND.PREFIX.EXPORT), asked of the driver once.
  StatusOr<std::string> IpcHandle() const;

 private:
  friend class GpuPin;
  friend class Object;
  friend class Engine;
  gpu::DeviceMemory mem_;
  std::vector<uint64_t> offsets_;
  gpu::Event ready_;
  GpuBudget* budget_;
  uint64_t charged_;
  std::atomic<int> readers_{0};
  mutable std::mutex ipc_mu_;
  mutable std::string ipc_handle_;
};

// A reader's hold on a GPU replica: while any pin lives the replica is not demoted (its memory
// stays put). Empty when the object was not GPU-resident.
class GpuPin {
 public:
  GpuPin() = default;
  explicit GpuPin(std::shared_ptr<GpuReplica> r) : r_(std::move(r)) {
    if (r_) r_->readers_.fetch_add(1, std::memory_order_acq_rel);
  }
  GpuPin(GpuPin&& o) noexcept : r_(std::move(o.r_)) {}
  GpuPin& operator=(GpuPin&& o) noexcept {
    if (this != &o) {
      Reset();
      r_ = std::move(o.r_);
    }
    return *this;
  }
  GpuPin(const GpuPin&) = delete;
  GpuPin& operator=(const GpuPin&) = delete;
  ~GpuPin() { Reset(); }

  explicit operator bool() const { return r_ != nullptr; }
  const GpuReplica* operator->() const { return r_.get(); }
  const GpuReplica& operator*() const { return *r_; }
  void Reset() {
    if (r_) r_->readers_.fetch_sub(1, std::memory_order_acq_rel);
    r_.reset();
  }

 private:
  std::shared_ptr<GpuReplica> r_;
};

// The GPU tier's budget (--gpu-memory). Lock-free.
class GpuBudget {
 public:
  explicit GpuBudget(uint64_t limit) : limit_(limit) {}
  uint64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  void set_limit(uint64_t l) { limit_.store(l, std::memory_order_relaxed); }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t free() const {
    const uint64_t l = limit(), u = used();
    return u >= l ? 0 : l - u;
  }
  bool TryReserve(uint64_t bytes);
  void Release(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> limit_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace pion::residency
