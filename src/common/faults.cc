#include "common/faults.h"

#include <atomic>
#include <chrono>
#include <thread>

namespace pion::faults {
namespace {
std::atomic<Injector*> g_injector{nullptr};
}  // namespace

void Install(Injector* injector) { g_injector.store(injector, std::memory_order_release); }

Fault Check(Point point, std::string_view target) {
  Injector* i = g_injector.load(std::memory_order_acquire);
  if (i == nullptr) [[likely]] {
    return {};
  }
  return i->Next(point, target);
}

Fault CheckAndDelay(Point point, std::string_view target) {
  Fault f = Check(point, target);
  if (f.action == Action::kSlow) {
    std::this_thread::sleep_for(std::chrono::milliseconds(f.delay_ms));
    return {};
  }
  return f;
}

}  // namespace pion::faults
