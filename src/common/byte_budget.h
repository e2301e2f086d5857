// ByteBudget: how a store charges the bytes it keeps against a tier's limit (the host memory
// limit per family, the GPU budget, the disk quota). reserve() may refuse (kOom); release() is
// thread-safe (bytes may be freed on any thread). Charge holds bytes of a budget for as long as
// it lives.
#pragma once

#include <cstdint>
#include <functional>

#include "common/status.h"

namespace pion {

struct ByteBudget {
  std::function<Status(uint64_t)> reserve;
  std::function<void(uint64_t)> release;
};

// Bytes charged to a budget until destroyed (released on any thread). The budget must outlive
// the charge.
class Charge {
 public:
  Charge(const ByteBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
  ~Charge() {
    if (budget_ != nullptr && budget_->release && bytes_ > 0) budget_->release(bytes_);
  }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;
  uint64_t bytes() const { return bytes_; }

 private:
  const ByteBudget* budget_;
  uint64_t bytes_;
};

}  // namespace pion

namespace pion::store {
using pion::ByteBudget;  // the stores' historical spelling
}
