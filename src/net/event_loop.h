// EventLoop: one epoll instance driven by one thread (a shard's), plus an eventfd that other
// threads use to wake it when they post work to that shard.
//
// Level-triggered epoll: a handler that stops reading early (fairness between clients) is
// called again on the next iteration without bookkeeping. epoll rather than io_uring: see
// docs/ARCHITECTURE.md ("Why epoll").
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

namespace pion::net {

class EventHandler {
 public:
  virtual ~EventHandler() = default;
  // Runs on the loop's thread. events is an EPOLL* mask.
  virtual void OnEvent(uint32_t events) = 0;
};

class EventLoop {
 public:
  EventLoop();
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Registers fd with the given EPOLL* mask. Returns false on failure (errno set).
  bool Add(int fd, uint32_t events, EventHandler* handler);
  bool Modify(int fd, uint32_t events, EventHandler* handler);
  void Remove(int fd);

  // Waits up to timeout_ms and dispatches ready handlers. on_wake runs when Wake() was
  // called since the last iteration. Returns false if epoll failed.
  bool RunOnce(int timeout_ms, const std::function<void()>& on_wake);
  // Ready events (sockets and wake-ups) the last RunOnce dispatched.
  int last_events() const { return last_events_; }

  // Thread-safe: interrupts a blocked RunOnce.
  void Wake();

  // The time when the current iteration's epoll_wait returned: one clock read per iteration
  // serves every connection's bookkeeping (idle time, write progress).
  std::chrono::steady_clock::time_point now() const { return now_; }
  // Counts socket I/O on this loop. Command timing reuses the previous command's end time as
  // the next one's start only while no I/O happened in between (pipelined batches).
  void NoteIo() { ++io_epoch_; }
  uint64_t io_epoch() const { return io_epoch_; }

 private:
  std::chrono::steady_clock::time_point now_ = std::chrono::steady_clock::now();
  uint64_t io_epoch_ = 0;
  int last_events_ = 0;
  int epoll_fd_;
  int wake_fd_;
};

}  // namespace pion::net
