// ByteBudget: how a store charges the bytes it keeps against the server's memory limit.
// reserve() may refuse (kOom); release() is thread-safe (chunks may be freed on any thread).
#pragma once

#include <cstdint>
#include <functional>

#include "common/status.h"

namespace pion::store {

struct ByteBudget {
  std::function<Status(uint64_t)> reserve;
  std::function<void(uint64_t)> release;
};

}  // namespace pion::store
