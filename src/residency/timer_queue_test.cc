// TimerQueue: timers fire at their deadlines, cancelled ones never do.
#include "residency/timer_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace pion::residency {
namespace {

using namespace std::chrono_literals;

bool WaitFor(const std::atomic<int>& v, int want) {
  for (int i = 0; i < 2000 && v.load() != want; ++i) std::this_thread::sleep_for(1ms);
  return v.load() == want;
}

TEST(TimerQueue, FiresInDeadlineOrder) {
  TimerQueue q;
  std::atomic<int> fired{0};
  std::atomic<int> order{0};
  q.Add(Clock::now() + 20ms, [&] {
    order = order * 10 + 2;
    ++fired;
  });
  q.Add(Clock::now() + 5ms, [&] {
    order = order * 10 + 1;
    ++fired;
  });
  ASSERT_TRUE(WaitFor(fired, 2));
  EXPECT_EQ(order.load(), 12);
}

// Found by fuzz/command_fuzz (ASan heap-use-after-free): the timer thread waited on a reference
// to the earliest timer's key, and a Cancel of that timer freed it while the thread waited.
TEST(TimerQueue, CancelTheTimerTheThreadWaitsFor) {
  TimerQueue q;
  std::atomic<int> fired{0};
  for (int round = 0; round < 20; ++round) {
    const uint64_t far = q.Add(Clock::now() + 50ms, [&] { fired += 100; });
    std::this_thread::sleep_for(2ms);  // the thread now waits until `far`'s deadline
    EXPECT_TRUE(q.Cancel(far));
    q.Add(Clock::now() + 1ms, [&] { ++fired; });  // wakes the thread, which re-reads its wait
    ASSERT_TRUE(WaitFor(fired, round + 1));
  }
  std::this_thread::sleep_for(60ms);
  EXPECT_EQ(fired.load(), 20);  // no cancelled timer ran
  EXPECT_FALSE(q.Cancel(12345));
}

}  // namespace
}  // namespace pion::residency
