#include "attention/gpu_slots.h"

namespace pion::attention {

StatusOr<std::string> GpuCopy::IpcHandle() const {
  std::lock_guard<std::mutex> lock(ipc_mu_);
  if (ipc_handle_.empty()) {
    auto h = gpu::IpcHandle(base());
    if (!h.ok()) return h.status();
    ipc_handle_ = std::move(h).value();
  }
  return ipc_handle_;
}

GpuCopy::~GpuCopy() {
  if (owner_ != nullptr) owner_->Unlink(this);
}

void GpuSlots::Unlink(GpuCopy* c) {
  std::lock_guard lock(mu_);
  if (!c->linked_) return;
  lru_.erase(c->lru_);
  c->linked_ = false;
  used_ -= c->bytes_;
}

bool GpuSlots::MakeRoomLocked(uint64_t bytes) {
  auto it = lru_.end();
  while (used_ + bytes > limit_ && it != lru_.begin()) {
    --it;
    GpuCopy* c = *it;
    if (c->readers_ > 0) continue;  // a running query holds it
    it = lru_.erase(it);
    c->linked_ = false;
    used_ -= c->bytes_;
    c->evicted_.store(true, std::memory_order_release);
    c->mem_ = gpu::DeviceMemory();  // back to the pool: nobody can acquire it any more
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
  return used_ + bytes <= limit_;
}

StatusOr<std::shared_ptr<GpuCopy>> GpuSlots::Place(uint64_t bytes_each, const Fill& fill_k,
                                                   const Fill& fill_v) {
  const uint64_t total = 2 * bytes_each;
  auto copy = std::make_shared<GpuCopy>();
  {
    std::lock_guard lock(mu_);
    if (total > limit_ || !MakeRoomLocked(total)) {
      ++failures_;
      return Status(ErrorKind::kOom, "GPU attention memory full: the slot needs " +
                                         std::to_string(total) + " bytes, --gpu-memory is " +
                                         std::to_string(limit_) + " with " + std::to_string(used_) +
                                         " in use by slots queries hold");
    }
    used_ += total;  // reserved; linked into the LRU once the copy is valid
  }
  auto release = [&] {
    std::lock_guard lock(mu_);
    used_ -= total;
    ++failures_;
  };
  auto mem = gpu::Allocate(total);
  if (!mem.ok()) {
    release();
    return mem.status();
  }
  copy->mem_ = std::move(mem).value();
  copy->half_ = bytes_each;
  const uint64_t fence = copy->mem_.id();
  gpu::DeviceMemory& dst = copy->mem_;
  // K and V in one upload: offsets below bytes_each are K, the rest V.
  Status s = gpu::Upload(
      dst, total,
      [&](uint8_t* staging, uint64_t off, uint64_t n) {
        while (n > 0) {
          if (off < bytes_each) {
            const uint64_t take = std::min(n, bytes_each - off);
            fill_k(staging, off, take);
            staging += take, off += take, n -= take;
          } else {
            fill_v(staging, off - bytes_each, n);
            n = 0;
          }
        }
      },
      &copy->ready_);
  // Validate: the copy completed without a device error and into the allocation it was issued
  // for.
  if (s.ok() && copy->mem_.id() != fence) {
    s = Status(ErrorKind::kDevice, "GPU copy completed into a reused allocation");
  }
  if (!s.ok()) {
    copy->mem_ = gpu::DeviceMemory();
    release();
    return s;
  }
  std::lock_guard lock(mu_);
  copy->owner_ = this;
  copy->bytes_ = total;
  lru_.push_front(copy.get());
  copy->lru_ = lru_.begin();
  copy->linked_ = true;
  ++uploads_;
  upload_bytes_ += total;
  return copy;
}

GpuSlots::Pin GpuSlots::Acquire(const std::shared_ptr<GpuCopy>& copy) {
  std::lock_guard lock(mu_);
  if (copy->evicted() || !copy->linked_) return Pin();
  ++copy->readers_;
  lru_.splice(lru_.begin(), lru_, copy->lru_);
  return Pin(copy);
}

void GpuSlots::Pin::Release() {
  if (!copy_) return;
  {
    std::lock_guard lock(copy_->owner_->mu_);
    --copy_->readers_;
  }
  copy_.reset();
}

bool GpuSlots::ReserveExtra(uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (!MakeRoomLocked(bytes)) return false;
  used_ += bytes;
  return true;
}

void GpuSlots::ReleaseExtra(uint64_t bytes) {
  std::lock_guard lock(mu_);
  used_ -= bytes;
}

void GpuSlots::set_limit(uint64_t limit) {
  std::lock_guard lock(mu_);
  limit_ = limit;
  MakeRoomLocked(0);
}

GpuSlots::Stats GpuSlots::stats() const {
  std::lock_guard lock(mu_);
  return {limit_, used_, lru_.size(), evictions_.load(), uploads_, upload_bytes_, failures_};
}

}  // namespace pion::attention
