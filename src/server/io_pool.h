// IoPool: a few threads for blocking disk work (fsync of a multi-gigabyte save, reading a
// prefix back), so no shard's event loop ever waits on the disk. The queue is bounded:
// Submit() returns false when it is full and the caller answers -BUSY.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pion::server {

class IoPool {
 public:
  IoPool(int threads, size_t capacity);
  ~IoPool();  // runs what is queued, then joins

  // Thread-safe. False when `capacity` jobs are already waiting.
  bool Submit(std::function<void()> job);
  size_t queued() const;

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t capacity_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace pion::server
