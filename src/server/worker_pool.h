// WorkerPool: threads for work no event loop may do. The server has two: the I/O pool
// (--io-threads: fsync of a multi-gigabyte save, reading a prefix back from disk) and the compute
// pool (--compute-threads: attention queries), so a long save or query never stalls the
// connections a shard serves.
//
// Jobs (one per command) are admitted into a bounded queue: Submit() returns false when it is
// full and the caller answers -BUSY — backpressure instead of an unbounded backlog. A running job
// may split its work with ParallelFor (split-K across key ranges): the pieces go to a separate,
// unbounded helper queue that idle workers take first, and the caller runs whatever nobody has
// taken, so a job never waits on a queue that its own waiting could block (no deadlock even when
// every worker is inside a ParallelFor).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pion::server {

class WorkerPool {
 public:
  WorkerPool(int threads, size_t capacity);
  ~WorkerPool();  // runs what is queued, then joins
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Thread-safe. False when `capacity` jobs are already waiting (not counting running ones).
  bool Submit(std::function<void()> job);

  // Runs fn(i) for every i in [0, n) on up to n threads (the caller included) and returns when
  // all have finished. Callable from any thread, including a pool job.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

  int threads() const { return static_cast<int>(threads_.size()); }
  size_t capacity() const { return capacity_; }
  size_t queued() const;
  uint64_t completed() const { return completed_.load(std::memory_order_relaxed); }
  uint64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }
  int busy() const { return busy_.load(std::memory_order_relaxed); }

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;     // admitted commands (bounded)
  std::deque<std::function<void()>> helpers_;  // ParallelFor pieces (taken first)
  size_t capacity_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> completed_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<int> busy_{0};
};

}  // namespace pion::server
