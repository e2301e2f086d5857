#include "server/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>

namespace pion::server {
namespace {

TEST(WorkerPool, NestedParallelForNeverDeadlocks) {
  WorkerPool pool(2, 64);
  std::atomic<int> sum{0};
  std::atomic<int> jobs_done{0};
  for (int j = 0; j < 16; ++j) {
    ASSERT_TRUE(pool.Submit([&] {
      // Every worker may be inside a ParallelFor at once: callers run unclaimed pieces.
      pool.ParallelFor(8, [&](size_t i) { sum.fetch_add(static_cast<int>(i) + 1); });
      jobs_done.fetch_add(1);
    }));
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (jobs_done.load() < 16 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(jobs_done.load(), 16);
  EXPECT_EQ(sum.load(), 16 * 36);
}

TEST(WorkerPool, SubmitRefusesBeyondCapacity) {
  WorkerPool pool(1, 2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, started = false;
  ASSERT_TRUE(pool.Submit([&] {
    std::unique_lock<std::mutex> lock(mu);
    started = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  }));
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return started; });  // the worker holds the first job
  }
  EXPECT_TRUE(pool.Submit([] {}));
  EXPECT_TRUE(pool.Submit([] {}));
  EXPECT_FALSE(pool.Submit([] {}));  // two waiting: full
  EXPECT_EQ(pool.rejected(), 1u);
  EXPECT_EQ(pool.queued(), 2u);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
}

TEST(WorkerPool, ParallelForFromOutsideThePool) {
  WorkerPool pool(3, 4);
  std::vector<int> hits(100, 0);
  pool.ParallelFor(100, [&](size_t i) { hits[i] += 1; });
  for (int h : hits) EXPECT_EQ(h, 1);
}

}  // namespace
}  // namespace pion::server
