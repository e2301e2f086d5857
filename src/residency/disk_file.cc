#include "residency/disk_file.h"

#include <unistd.h>

#include "common/bytes.h"

namespace pion::residency {

Status DiskQuota::Reserve(uint64_t bytes) {
  const uint64_t limit = this->limit();
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (limit != 0 && (cur + bytes > limit || cur + bytes < cur)) {
      return Status(ErrorKind::kOom, "tier=disk: " + std::to_string(bytes) +
                                         " bytes do not fit in --disk-quota " +
                                         std::to_string(limit) + " (" + HumanBytes(limit) + "), " +
                                         std::to_string(cur) + " in use");
    }
  } while (!used_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  return Status::Ok();
}

DiskFile::DiskFile(store::disk::ObjectFile f, Kind kind, DiskQuota* quota)
    : file_(std::move(f)), kind_(kind), quota_(quota), charged_(file_.file_bytes()) {}

StatusOr<std::shared_ptr<DiskFile>> DiskFile::Open(const std::string& path, Kind kind,
                                                   DiskQuota* quota) {
  auto f = store::disk::ObjectFile::Open(path, /*writable=*/kind == Kind::kSpill);
  if (!f.ok()) return f.status();
  std::shared_ptr<DiskFile> d(new DiskFile(std::move(f).value(), kind, quota));
  if (quota != nullptr) quota->Charge(d->charged_.load());
  return d;
}

DiskFile::~DiskFile() {
  if (kind_ == Kind::kSpill) unlink(file_.path().c_str());
  if (quota_ != nullptr) quota_->Release(charged_.load());
}

void DiskFile::Release(size_t i) {
  if (kind_ != Kind::kSpill) return;
  const uint64_t n = file_.block_length(i);
  if (n == 0 || !file_.PunchBlock(i).ok()) return;  // a hole we cannot punch stays charged
  charged_.fetch_sub(n, std::memory_order_relaxed);
  if (quota_ != nullptr) quota_->Release(n);
}

DiskCopy::~DiskCopy() {
  if (file && !durable()) {
    for (uint32_t b : blocks) file->Release(b);
  }
}

}  // namespace pion::residency
