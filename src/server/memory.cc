#include "server/memory.h"

#include "common/bytes.h"

namespace pion::server {

std::string_view MemFamilyName(MemFamily f) {
  switch (f) {
    case MemFamily::kState:
      return "state";
    case MemFamily::kSsm:
      return "ssm";
    case MemFamily::kVStore:
      return "vstore";
    case MemFamily::kAttention:
      return "attention";
    case MemFamily::kIndex:
      return "index";
    case MemFamily::kCount:
      break;
  }
  return "other";
}

uint64_t MemoryAccountant::free_bytes() const {
  uint64_t max = maxmemory(), u = used();
  if (max == 0) return UINT64_MAX;
  return u >= max ? 0 : max - u;
}

bool MemoryAccountant::TryAdd(MemFamily f, uint64_t bytes) {
  uint64_t max = maxmemory();
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (max != 0 && (cur + bytes > max || cur + bytes < cur)) return false;
  } while (!used_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  by_family_[static_cast<int>(f)].fetch_add(bytes, std::memory_order_relaxed);
  return true;
}

Status MemoryAccountant::Reserve(MemFamily f, uint64_t bytes) {
  if (TryAdd(f, bytes)) return Status::Ok();
  const auto& reclaim = reclaimers_[static_cast<int>(f)];
  if (reclaim) {
    uint64_t max = maxmemory(), u = used();
    uint64_t need = (u + bytes > max) ? u + bytes - max : bytes;
    reclaim(need);
    if (TryAdd(f, bytes)) return Status::Ok();
  }
  oom_rejections_.fetch_add(1, std::memory_order_relaxed);
  uint64_t free = free_bytes();
  return Status(ErrorKind::kOom, "command not allowed when used memory > 'maxmemory': " +
                                     std::string(MemFamilyName(f)) + " write of " +
                                     std::to_string(bytes) + " bytes, " + std::to_string(free) +
                                     " bytes free of maxmemory " + std::to_string(maxmemory()) +
                                     " (" + HumanBytes(maxmemory()) + ")");
}

void MemoryAccountant::Charge(MemFamily f, uint64_t bytes) {
  used_.fetch_add(bytes, std::memory_order_relaxed);
  by_family_[static_cast<int>(f)].fetch_add(bytes, std::memory_order_relaxed);
}

void MemoryAccountant::Release(MemFamily f, uint64_t bytes) {
  used_.fetch_sub(bytes, std::memory_order_relaxed);
  by_family_[static_cast<int>(f)].fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace pion::server
