#include "server/io_pool.h"

namespace pion::server {

IoPool::IoPool(int threads, size_t capacity) : capacity_(capacity) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

IoPool::~IoPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool IoPool::Submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.size() >= capacity_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

size_t IoPool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

void IoPool::Run() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace pion::server
