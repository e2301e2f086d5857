// Pieces shared by the load clients pion-echo-bench and pion-fetch-bench: size arguments, the
// TCP connection they open, a connection's pipelined send/receive loop, and latency percentiles.
// libc only, like the clients themselves.
#pragma once

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace pion::bench {

using Clock = std::chrono::steady_clock;

// "4mb", "512k", "1e6": a byte count; exits with status 2 (naming `prog`) when malformed.
inline uint64_t ParseSize(const char* prog, const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end == s || v < 0) {
    std::fprintf(stderr, "%s: bad size '%s'\n", prog, s);
    std::exit(2);
  }
  switch (*end) {
    case 'k':
    case 'K':
      v *= 1024.0;
      break;
    case 'm':
    case 'M':
      v *= 1024.0 * 1024;
      break;
    case 'g':
    case 'G':
      v *= 1024.0 * 1024 * 1024;
      break;
    case '\0':
      break;
    default:
      std::fprintf(stderr, "%s: bad size '%s'\n", prog, s);
      std::exit(2);
  }
  return static_cast<uint64_t>(v);
}

// The options both load clients take.
struct LoadOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int connections = 1;
  double seconds = 10.0;
  bool have_seconds = false;  // --seconds given
  uint64_t requests = 0;      // > 0: fixed request count instead of --seconds
  int pipeline = 1;
  double warmup = 0.0;
  uint64_t verify_every = 64;  // 0: verify only each connection's first reply
};

// Takes option `a` with its value when it is one of LoadOptions'; false when it is not.
inline bool ParseLoadOption(std::string_view a, const char* val, LoadOptions* o) {
  if (a == "--host") {
    o->host = val;
  } else if (a == "--port") {
    o->port = std::atoi(val);
  } else if (a == "--connections" || a == "-c") {
    o->connections = std::atoi(val);
  } else if (a == "--seconds") {
    o->seconds = std::atof(val);
    o->have_seconds = true;
  } else if (a == "--requests" || a == "-n") {
    o->requests = std::strtoull(val, nullptr, 10);
  } else if (a == "--pipeline" || a == "-P") {
    o->pipeline = std::atoi(val);
  } else if (a == "--warmup") {
    o->warmup = std::atof(val);
  } else if (a == "--verify-every") {
    o->verify_every = std::strtoull(val, nullptr, 10);
  } else {
    return false;
  }
  return true;
}

// Whether the load options are usable; both --seconds and --requests exit with status 2 and
// the reason (naming `prog`).
inline bool LoadOptionsValid(const char* prog, const LoadOptions& o) {
  if (o.requests > 0 && o.have_seconds) {
    std::fprintf(stderr, "%s: give --seconds or --requests, not both\n", prog);
    std::exit(2);
  }
  return o.connections >= 1 && o.pipeline >= 1 && o.port >= 1 && o.port <= 65535 &&
         (o.requests > 0 || o.seconds > 0);
}

// A non-blocking TCP connection with TCP_NODELAY, or -1 with *err set.
inline int ConnectTcp(const std::string& host, int port_number, std::string* err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string port = std::to_string(port_number);
  int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    *err = std::string("getaddrinfo: ") + gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
    *err = std::string("connect: ") + std::strerror(errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    if (err->empty()) *err = "connect failed";
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

// What a client's connection threads share: the start barrier, the failure flag and the
// measured window (replies completing from measure_from count; with no request quota a
// connection stops sending at deadline).
struct LoadControl {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> failed{false};
  Clock::time_point start, measure_from, deadline;
};

// One connection's counts.
struct LoadResult {
  uint64_t requests = 0;       // replies completed inside the measured window
  uint64_t payload_bytes = 0;  // their payloads
  uint64_t verified = 0;
  std::vector<uint32_t> lat_us;
  Clock::time_point finished;
  std::string error;
};

// One connection's send/receive loop on a non-blocking socket: up to `pipeline` requests in
// flight, `quota` requests in all (0: until ctl->deadline). Every reply must be a RESP bulk string
// with the expected header and a CRLF after the payload; the first payload and every
// verify_every-th one (0: only the first) are checked. Traffic describes request k of this
// connection (k = 0, 1, ...):
//   size_t RequestLen(uint64_t k) const;
//   ssize_t Send(int fd, uint64_t k, size_t off) const;  // send()'s result, from byte off
//   const std::string& ReplyHead(uint64_t k) const;      // "$<n>\r\n"
//   size_t PayloadLen(uint64_t k) const;
//   size_t MaxReply() const;                             // the longest whole reply
//   const char* Mismatch(uint64_t k, const uint8_t* payload) const;  // nullptr: as expected
template <typename Traffic>
void RunPipelined(LoadControl* ctl, int fd, uint64_t quota, int pipeline, uint64_t verify_every,
                  const Traffic& tr, LoadResult* out) {
  std::vector<uint8_t> rbuf(tr.MaxReply());  // whole reply: header, payload, CRLF
  std::memset(rbuf.data(), 0, rbuf.size());  // fault the pages in before timing
  std::vector<Clock::time_point> started(static_cast<size_t>(pipeline));
  out->lat_us.reserve(quota == 0 ? 1 << 16 : quota);

  uint64_t sent = 0, received = 0;  // fully sent requests / fully received replies
  bool sending = false;
  size_t send_off = 0, recv_off = 0;
  bool stop = false;

  auto fail = [&](std::string msg) {
    out->error = std::move(msg);
    ctl->failed.store(true);
  };

  ctl->ready.fetch_add(1);
  while (!ctl->go.load(std::memory_order_acquire)) std::this_thread::yield();

  while (!ctl->failed.load(std::memory_order_relaxed)) {
    if (!stop) {
      if (quota > 0)
        stop = sent >= quota && !sending;
      else
        stop = !sending && Clock::now() >= ctl->deadline;
    }
    if (stop && !sending && received == sent) break;
    if (!sending && !stop && sent - received < static_cast<uint64_t>(pipeline) &&
        (quota == 0 || sent < quota)) {
      sending = true;
      send_off = 0;
      started[sent % started.size()] = Clock::now();
    }

    bool want_out = false, want_in = false, progress = false;
    if (sending) {
      const ssize_t w = tr.Send(fd, sent, send_off);
      if (w > 0) {
        send_off += static_cast<size_t>(w);
        progress = true;
        if (send_off == tr.RequestLen(sent)) {
          sending = false;
          ++sent;
        }
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        want_out = true;
      } else if (w < 0 && errno == EINTR) {
        progress = true;
      } else {
        fail(std::string("send: ") + std::strerror(errno));
        break;
      }
    }

    if (received < sent) {
      const std::string& head = tr.ReplyHead(received);
      const size_t rhead_len = head.size(), size = tr.PayloadLen(received);
      const size_t reply_len = rhead_len + size + 2;
      const ssize_t r = recv(fd, rbuf.data() + recv_off, reply_len - recv_off, 0);
      if (r > 0) {
        progress = true;
        const size_t before = recv_off;
        recv_off += static_cast<size_t>(r);
        if (before == 0 && rbuf[0] != '$') {
          // An error or unexpected reply: show what we got (up to the first line).
          size_t len = recv_off;
          for (size_t i = 0; i < recv_off; ++i) {
            if (rbuf[i] == '\r' || rbuf[i] == '\n') {
              len = i;
              break;
            }
          }
          fail("unexpected reply: " +
               std::string(reinterpret_cast<char*>(rbuf.data()), std::min<size_t>(len, 200)));
          break;
        }
        if (before < rhead_len && recv_off >= rhead_len &&
            std::memcmp(rbuf.data(), head.data(), rhead_len) != 0) {
          fail("unexpected reply header: " +
               std::string(reinterpret_cast<char*>(rbuf.data()), rhead_len));
          break;
        }
        if (recv_off == reply_len) {
          const auto now = Clock::now();
          if (rbuf[reply_len - 2] != '\r' || rbuf[reply_len - 1] != '\n') {
            fail("reply not terminated by CRLF");
            break;
          }
          if (received == 0 || (verify_every > 0 && received % verify_every == 0)) {
            if (const char* why = tr.Mismatch(received, rbuf.data() + rhead_len)) {
              fail(std::string(why) + " in reply " + std::to_string(received));
              break;
            }
            ++out->verified;
          }
          if (now >= ctl->measure_from) {
            const auto t0 = started[received % started.size()];
            const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now - t0).count();
            out->lat_us.push_back(static_cast<uint32_t>(std::min<int64_t>(us, UINT32_MAX)));
            ++out->requests;
            out->payload_bytes += size;
          }
          ++received;
          recv_off = 0;
        }
      } else if (r == 0) {
        fail("server closed the connection");
        break;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        want_in = true;
      } else if (errno == EINTR) {
        progress = true;
      } else {
        fail(std::string("recv: ") + std::strerror(errno));
        break;
      }
    }

    if (!progress && (want_in || want_out)) {
      pollfd p{fd, static_cast<short>((want_in ? POLLIN : 0) | (want_out ? POLLOUT : 0)), 0};
      // A bounded wait so a --seconds run notices the deadline and a failure elsewhere.
      const int pr = poll(&p, 1, 100);
      if (pr < 0 && errno != EINTR) {
        fail(std::string("poll: ") + std::strerror(errno));
        break;
      }
    }
  }
  out->finished = Clock::now();
}

// A whole run's counts.
struct LoadTotals {
  uint64_t requests = 0, verified = 0, payload_bytes = 0;
  double seconds = 0;            // from measure_from to the last connection's end
  std::vector<uint32_t> lat_us;  // sorted
  double mean_us = 0;
  std::string error;  // the first failed connection's
};

// Runs connections 0..connections-1 on a thread each, run(c, quota, result): `requests` split
// evenly over them (0: every connection runs until the deadline; one left without a share does not
// start). Once every thread is ready the window opens — `warmup` seconds unmeasured, then
// `seconds` — and at the end the connections' counts are summed. `marks`: "# measure start" /
// "# measure end" on stderr around the measured window, for a driver sampling CPU use there.
template <typename Run>
LoadTotals RunLoad(LoadControl* ctl, int connections, uint64_t requests, double warmup,
                   double seconds, bool marks, Run&& run) {
  std::vector<LoadResult> results(static_cast<size_t>(connections));
  std::vector<std::thread> threads;
  for (int c = 0; c < connections; ++c) {
    uint64_t quota = 0;
    if (requests > 0) {
      quota = requests / connections + (static_cast<uint64_t>(c) < requests % connections);
      if (quota == 0) continue;
    }
    threads.emplace_back([&run, &results, c, quota] { run(c, quota, &results[c]); });
  }
  while (ctl->ready.load() < static_cast<int>(threads.size())) std::this_thread::yield();
  auto span = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  ctl->start = Clock::now();
  ctl->measure_from = ctl->start + span(warmup);
  ctl->deadline = ctl->measure_from + span(seconds);
  ctl->go.store(true, std::memory_order_release);
  if (marks) {
    std::this_thread::sleep_until(ctl->measure_from);
    if (!ctl->failed.load()) {
      std::fprintf(stderr, "# measure start\n");
      std::fflush(stderr);
    }
  }
  for (auto& t : threads) t.join();
  if (marks) {
    std::fprintf(stderr, "# measure end\n");
    std::fflush(stderr);
  }

  LoadTotals tot;
  Clock::time_point end = ctl->measure_from;
  for (auto& r : results) {
    if (!r.error.empty() && tot.error.empty()) tot.error = r.error;
    tot.requests += r.requests;
    tot.payload_bytes += r.payload_bytes;
    tot.verified += r.verified;
    end = std::max(end, r.finished);
    tot.lat_us.insert(tot.lat_us.end(), r.lat_us.begin(), r.lat_us.end());
  }
  std::sort(tot.lat_us.begin(), tot.lat_us.end());
  tot.seconds = std::chrono::duration<double>(end - ctl->measure_from).count();
  for (uint32_t v : tot.lat_us) tot.mean_us += v;
  if (!tot.lat_us.empty()) tot.mean_us /= static_cast<double>(tot.lat_us.size());
  return tot;
}

// The q-quantile (nearest rank) of sorted latencies; 0 when empty.
inline double Percentile(const std::vector<uint32_t>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  size_t idx = static_cast<size_t>(q * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(idx, sorted.size() - 1)];
}

}  // namespace pion::bench
