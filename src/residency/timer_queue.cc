#include "residency/timer_queue.h"

namespace pion::residency {

TimerQueue::TimerQueue() : thread_([this] { Run(); }) {}

TimerQueue::~TimerQueue() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t TimerQueue::Add(Deadline when, std::function<void()> fn) {
  std::lock_guard lock(mu_);
  const uint64_t id = next_id_++;
  auto it = timers_.emplace(when, std::make_pair(id, std::move(fn)));
  by_id_.emplace(id, it);
  if (it == timers_.begin()) cv_.notify_all();  // earlier than what the thread waits for
  return id;
}

bool TimerQueue::Cancel(uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return false;
  timers_.erase(it->second);
  by_id_.erase(it);
  return true;
}

void TimerQueue::Run() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    if (timers_.empty()) {
      cv_.wait(lock);
      continue;
    }
    auto first = timers_.begin();
    if (first->first > Clock::now()) {
      // A copy: wait_until reads its deadline after waking, and a Cancel while the lock is
      // released may free the node that holds the key.
      const Deadline next = first->first;
      cv_.wait_until(lock, next);
      continue;
    }
    auto fn = std::move(first->second.second);
    by_id_.erase(first->second.first);
    timers_.erase(first);
    lock.unlock();
    fn();
    lock.lock();
  }
}

}  // namespace pion::residency
