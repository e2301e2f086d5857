#include "net/event_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

namespace pion::net {

EventLoop::EventLoop() {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // nullptr marks the wake fd
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
}

EventLoop::~EventLoop() {
  close(wake_fd_);
  close(epoll_fd_);
}

bool EventLoop::Add(int fd, uint32_t events, EventHandler* handler) {
  epoll_event ev{};
  ev.events = events;
  ev.data.ptr = handler;
  return epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) == 0;
}

bool EventLoop::Modify(int fd, uint32_t events, EventHandler* handler) {
  epoll_event ev{};
  ev.events = events;
  ev.data.ptr = handler;
  return epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev) == 0;
}

void EventLoop::Remove(int fd) { epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr); }

bool EventLoop::RunOnce(int timeout_ms, const std::function<void()>& on_wake) {
  constexpr int kMaxEvents = 256;
  epoll_event events[kMaxEvents];
  int n = epoll_wait(epoll_fd_, events, kMaxEvents, timeout_ms);
  now_ = std::chrono::steady_clock::now();
  last_events_ = n > 0 ? n : 0;
  ++io_epoch_;
  if (n < 0) return errno == EINTR;
  bool woken = false;
  for (int i = 0; i < n; ++i) {
    if (events[i].data.ptr == nullptr) {
      uint64_t v;
      while (read(wake_fd_, &v, sizeof(v)) == sizeof(v)) {
      }
      woken = true;
      continue;
    }
    static_cast<EventHandler*>(events[i].data.ptr)->OnEvent(events[i].events);
  }
  if (woken) on_wake();
  return true;
}

void EventLoop::Wake() {
  uint64_t one = 1;
  ssize_t r = write(wake_fd_, &one, sizeof(one));
  (void)r;  // EAGAIN means the counter is already non-zero: the loop will wake anyway
}

}  // namespace pion::net
