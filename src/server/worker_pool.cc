#include "server/worker_pool.h"

#include <memory>

namespace pion::server {

WorkerPool::WorkerPool(int threads, size_t capacity) : capacity_(capacity) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool WorkerPool::Submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.size() >= capacity_) {
      rejected_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

size_t WorkerPool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

void WorkerPool::Run() {
  while (true) {
    std::function<void()> task;
    bool is_job = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !helpers_.empty() || !jobs_.empty(); });
      if (!helpers_.empty()) {
        task = std::move(helpers_.front());
        helpers_.pop_front();
      } else if (!jobs_.empty()) {
        task = std::move(jobs_.front());
        jobs_.pop_front();
        is_job = true;
      } else {
        return;  // stopping and drained
      }
    }
    busy_.fetch_add(1, std::memory_order_relaxed);
    task();
    busy_.fetch_sub(1, std::memory_order_relaxed);
    if (is_job) completed_.fetch_add(1, std::memory_order_relaxed);
  }
}

void WorkerPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1) return fn(0);
  // Pieces are claimed by index; whoever claims one runs it. The caller claims too, so all
  // pieces finish even if no worker is free.
  struct Group {
    std::atomic<size_t> next{0};
    std::atomic<size_t> done{0};
    size_t n = 0;
    const std::function<void(size_t)>* fn = nullptr;
    std::mutex mu;
    std::condition_variable cv;
    // Claims and runs pieces until none is left; returns how many it ran.
    void Drain() {
      for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        (*fn)(i);
        if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }
  };
  auto g = std::make_shared<Group>();
  g->n = n;
  g->fn = &fn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 1; i < n && i <= threads_.size(); ++i) {
      helpers_.push_back([g] { g->Drain(); });
    }
  }
  cv_.notify_all();
  g->Drain();
  std::unique_lock<std::mutex> lock(g->mu);
  g->cv.wait(lock, [&] { return g->done.load(std::memory_order_acquire) == n; });
}

}  // namespace pion::server
