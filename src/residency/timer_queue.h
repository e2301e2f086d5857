// TimerQueue: runs callbacks at deadlines on one thread of its own — how a request waiting for
// a promotion or for room is answered -TIMEOUT at its deadline while the transfer goes on for
// whoever else waits on it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "residency/tier.h"

namespace pion::residency {

class TimerQueue {
 public:
  TimerQueue();
  ~TimerQueue();  // drops timers that have not fired
  TimerQueue(const TimerQueue&) = delete;
  TimerQueue& operator=(const TimerQueue&) = delete;

  // Thread-safe. Runs fn on the timer thread at `when` (at once when it has passed); returns an
  // id for Cancel. A callback must not block.
  uint64_t Add(Deadline when, std::function<void()> fn);
  // Thread-safe. True when the timer was removed before it ran.
  bool Cancel(uint64_t id);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<Deadline, std::pair<uint64_t, std::function<void()>>> timers_;
  std::map<uint64_t, std::multimap<Deadline, std::pair<uint64_t, std::function<void()>>>::iterator>
      by_id_;
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace pion::residency
