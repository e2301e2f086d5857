#include "residency/gpu_replica.h"

namespace pion::residency {

bool GpuBudget::TryReserve(uint64_t bytes) {
  const uint64_t limit = this->limit();
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (cur + bytes > limit || cur + bytes < cur) return false;
  } while (!used_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  return true;
}

GpuReplica::GpuReplica(gpu::DeviceMemory mem, std::vector<uint64_t> offsets, GpuBudget* budget,
                       uint64_t charged)
    : mem_(std::move(mem)), offsets_(std::move(offsets)), budget_(budget), charged_(charged) {}

GpuReplica::~GpuReplica() {
  mem_ = gpu::DeviceMemory();  // back to the pool first
  if (budget_ != nullptr) budget_->Release(charged_);
}

StatusOr<std::string> GpuReplica::IpcHandle() const {
  std::lock_guard<std::mutex> lock(ipc_mu_);
  if (ipc_handle_.empty()) {
    auto h = gpu::IpcHandle(mem_.data());
    if (!h.ok()) return h.status();
    ipc_handle_ = std::move(h).value();
  }
  return ipc_handle_;
}

}  // namespace pion::residency
