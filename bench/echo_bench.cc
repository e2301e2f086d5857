// pion-echo-bench: a minimal RESP load client for large-payload round trips.
//
// Each of --connections connections (one thread each) loops: send
//   *2\r\n$4\r\nECHO\r\n$<n>\r\n<payload>\r\n
// with writev straight from one preallocated random payload buffer, then read the whole reply
//   $<n>\r\n<payload>\r\n
// into a preallocated per-connection buffer. With --pipeline P, up to P requests are in flight
// per connection (sockets are non-blocking, so sending the next request and receiving the
// previous reply interleave without deadlock). Every reply's header and CRLF are checked; the
// payload bytes are compared on each connection's first reply and on every --verify-every'th
// reply after it.
//
// Output: one JSON object on stdout (requests, seconds, req/s, GB/s of payload bytes in each
// direction, latency percentiles). Exit status 1 on any connection, protocol or verify error.
//
// Dependencies: libc and pthreads only (the server's libraries are deliberately not used, so
// the client is the same for every server it is pointed at).
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "load_client.h"

namespace {

using pion::bench::ConnectTcp;
using pion::bench::ParseSize;
using pion::bench::Percentile;

using Clock = std::chrono::steady_clock;

struct Options {
  std::string host = "127.0.0.1";
  int port = 6379;
  uint64_t size = 4 << 20;
  int connections = 1;
  double seconds = 10.0;
  uint64_t requests = 0;  // > 0: fixed request count instead of --seconds
  int pipeline = 1;
  double warmup = 0.0;
  uint64_t verify_every = 64;  // 0: verify only each connection's first reply
  uint64_t seed = 0x5eed;
};

[[noreturn]] void Usage(int code) {
  std::fprintf(
      code == 0 ? stdout : stderr,
      "usage: pion-echo-bench [--host H] [--port P] [--size BYTES] [--connections C]\n"
      "                       [--seconds S | --requests N] [--pipeline P] [--warmup S]\n"
      "                       [--verify-every N] [--seed N]\n"
      "  --size         payload bytes per ECHO (default 4194304; k/m/g suffixes = KiB/MiB/GiB)\n"
      "  --connections  parallel connections, one thread each (default 1)\n"
      "  --seconds      measured duration (default 10), after --warmup seconds (default 0)\n"
      "  --requests     total requests over all connections (instead of --seconds)\n"
      "  --pipeline     requests in flight per connection (default 1)\n"
      "  --verify-every compare payload bytes every N replies (default 64; first always)\n");
  std::exit(code);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  bool have_seconds = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    std::string val_buf;
    const char* val = nullptr;
    if (a == "-h" || a == "--help") Usage(0);
    if (auto eq = a.find('='); eq != std::string_view::npos) {
      val_buf = std::string(a.substr(eq + 1));
      val = val_buf.c_str();
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= argc) Usage(2);
      val = argv[++i];
    }
    if (a == "--host")
      o.host = val;
    else if (a == "--port")
      o.port = std::atoi(val);
    else if (a == "--size")
      o.size = ParseSize("pion-echo-bench", val);
    else if (a == "--connections" || a == "-c")
      o.connections = std::atoi(val);
    else if (a == "--seconds") {
      o.seconds = std::atof(val);
      have_seconds = true;
    } else if (a == "--requests" || a == "-n")
      o.requests = std::strtoull(val, nullptr, 10);
    else if (a == "--pipeline" || a == "-P")
      o.pipeline = std::atoi(val);
    else if (a == "--warmup")
      o.warmup = std::atof(val);
    else if (a == "--verify-every")
      o.verify_every = std::strtoull(val, nullptr, 10);
    else if (a == "--seed")
      o.seed = std::strtoull(val, nullptr, 10);
    else {
      std::fprintf(stderr, "pion-echo-bench: unknown option '%.*s'\n", static_cast<int>(a.size()),
                   a.data());
      Usage(2);
    }
  }
  if (o.requests > 0 && have_seconds) {
    std::fprintf(stderr, "pion-echo-bench: give --seconds or --requests, not both\n");
    std::exit(2);
  }
  if (o.connections < 1 || o.pipeline < 1 || o.port < 1 || o.port > 65535 ||
      (o.requests == 0 && o.seconds <= 0)) {
    Usage(2);
  }
  return o;
}

// Shared, read-only after setup.
struct Shared {
  Options opt;
  std::vector<uint8_t> payload;
  std::string req_head;    // "*2\r\n$4\r\nECHO\r\n$<n>\r\n"
  std::string reply_head;  // "$<n>\r\n"
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> failed{false};
  Clock::time_point start, measure_from, deadline;
};

struct Result {
  uint64_t requests = 0;  // replies completed inside the measured window
  uint64_t verified = 0;
  std::vector<uint32_t> lat_us;
  Clock::time_point finished;
  std::string error;
};

// One connection's send/receive loop. quota == 0: run until the shared deadline.
void RunConnection(Shared* sh, int fd, uint64_t quota, Result* out) {
  const Options& o = sh->opt;
  const size_t head_len = sh->req_head.size();
  const size_t req_len = head_len + o.size + 2;
  const size_t rhead_len = sh->reply_head.size();
  const size_t reply_len = rhead_len + o.size + 2;
  std::vector<uint8_t> rbuf(reply_len);  // whole reply: header, payload, CRLF
  std::vector<Clock::time_point> started(static_cast<size_t>(o.pipeline));
  if (quota == 0)
    out->lat_us.reserve(1 << 16);
  else
    out->lat_us.reserve(quota);

  uint64_t sent = 0, received = 0;  // fully sent requests / fully received replies
  bool sending = false;
  size_t send_off = 0, recv_off = 0;
  bool stop = false;
  static constexpr char kCrlf[] = "\r\n";

  auto fail = [&](std::string msg) {
    out->error = std::move(msg);
    sh->failed.store(true);
  };

  sh->ready.fetch_add(1);
  while (!sh->go.load(std::memory_order_acquire)) std::this_thread::yield();

  while (!sh->failed.load(std::memory_order_relaxed)) {
    if (!stop) {
      if (quota > 0)
        stop = sent >= quota && !sending;
      else
        stop = !sending && Clock::now() >= sh->deadline;
    }
    if (stop && !sending && received == sent) break;
    if (!sending && !stop && sent - received < static_cast<uint64_t>(o.pipeline) &&
        (quota == 0 || sent < quota)) {
      sending = true;
      send_off = 0;
      started[sent % started.size()] = Clock::now();
    }

    bool want_out = false, want_in = false, progress = false;
    if (sending) {
      iovec iov[3];
      int n = 0;
      size_t skip = send_off;
      const std::pair<const void*, size_t> parts[3] = {
          {sh->req_head.data(), head_len}, {sh->payload.data(), o.size}, {kCrlf, 2}};
      for (const auto& [p, len] : parts) {
        if (skip >= len) {
          skip -= len;
          continue;
        }
        iov[n].iov_base = const_cast<uint8_t*>(static_cast<const uint8_t*>(p) + skip);
        iov[n].iov_len = len - skip;
        skip = 0;
        ++n;
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<size_t>(n);
      ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL);
      if (w > 0) {
        send_off += static_cast<size_t>(w);
        progress = true;
        if (send_off == req_len) {
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
      ssize_t r = recv(fd, rbuf.data() + recv_off, reply_len - recv_off, 0);
      if (r > 0) {
        progress = true;
        size_t before = recv_off;
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
            std::memcmp(rbuf.data(), sh->reply_head.data(), rhead_len) != 0) {
          fail("unexpected reply header: " +
               std::string(reinterpret_cast<char*>(rbuf.data()), rhead_len));
          break;
        }
        if (recv_off == reply_len) {
          auto now = Clock::now();
          if (rbuf[reply_len - 2] != '\r' || rbuf[reply_len - 1] != '\n') {
            fail("reply not terminated by CRLF");
            break;
          }
          if (received == 0 || (o.verify_every > 0 && received % o.verify_every == 0)) {
            if (std::memcmp(rbuf.data() + rhead_len, sh->payload.data(), o.size) != 0) {
              fail("payload mismatch in reply " + std::to_string(received));
              break;
            }
            ++out->verified;
          }
          auto t0 = started[received % started.size()];
          if (now >= sh->measure_from) {
            auto us = std::chrono::duration_cast<std::chrono::microseconds>(now - t0).count();
            out->lat_us.push_back(static_cast<uint32_t>(std::min<int64_t>(us, UINT32_MAX)));
            ++out->requests;
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
      int pr = poll(&p, 1, 100);
      if (pr < 0 && errno != EINTR) {
        fail(std::string("poll: ") + std::strerror(errno));
        break;
      }
    }
  }
  out->finished = Clock::now();
}

}  // namespace

int main(int argc, char** argv) {
  Shared sh;
  sh.opt = ParseArgs(argc, argv);
  const Options& o = sh.opt;

  // Random payload (xorshift64*): incompressible, and any misplaced byte shows in a compare.
  sh.payload.resize(o.size);
  uint64_t x = o.seed | 1;
  for (size_t i = 0; i < o.size; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(sh.payload.data() + i, &v, std::min<size_t>(8, o.size - i));
  }
  sh.req_head = "*2\r\n$4\r\nECHO\r\n$" + std::to_string(o.size) + "\r\n";
  sh.reply_head = "$" + std::to_string(o.size) + "\r\n";

  std::vector<int> fds;
  for (int c = 0; c < o.connections; ++c) {
    std::string err;
    int fd = ConnectTcp(o.host, o.port, &err);
    if (fd < 0) {
      std::fprintf(stderr, "pion-echo-bench: %s:%d: %s\n", o.host.c_str(), o.port, err.c_str());
      return 1;
    }
    fds.push_back(fd);
  }

  std::vector<Result> results(static_cast<size_t>(o.connections));
  std::vector<std::thread> threads;
  for (int c = 0; c < o.connections; ++c) {
    uint64_t quota = 0;
    if (o.requests > 0) {
      quota = o.requests / o.connections + (static_cast<uint64_t>(c) < o.requests % o.connections);
      if (quota == 0) continue;
    }
    threads.emplace_back(RunConnection, &sh, fds[c], quota, &results[c]);
  }
  while (sh.ready.load() < static_cast<int>(threads.size())) std::this_thread::yield();
  sh.start = Clock::now();
  sh.measure_from = sh.start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(o.warmup));
  sh.deadline = sh.measure_from + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(o.seconds));
  sh.go.store(true, std::memory_order_release);
  for (auto& t : threads) t.join();
  for (int fd : fds) close(fd);

  uint64_t requests = 0, verified = 0;
  Clock::time_point end = sh.measure_from;
  std::vector<uint32_t> lat;
  for (auto& r : results) {
    if (!r.error.empty()) {
      std::fprintf(stderr, "pion-echo-bench: %s\n", r.error.c_str());
      return 1;
    }
    requests += r.requests;
    verified += r.verified;
    end = std::max(end, r.finished);
    lat.insert(lat.end(), r.lat_us.begin(), r.lat_us.end());
  }
  std::sort(lat.begin(), lat.end());
  double secs = std::chrono::duration<double>(end - sh.measure_from).count();
  double rps = secs > 0 ? static_cast<double>(requests) / secs : 0.0;
  double gbps = rps * static_cast<double>(o.size) / 1e9;
  double mean = 0;
  for (uint32_t v : lat) mean += v;
  if (!lat.empty()) mean /= static_cast<double>(lat.size());

  std::printf("{\"host\": \"%s\", \"port\": %d, \"size\": %" PRIu64
              ", \"connections\": %d, "
              "\"pipeline\": %d, \"requests\": %" PRIu64
              ", \"seconds\": %.4f, \"req_per_s\": %.2f, "
              "\"gb_per_s\": %.4f, \"gib_per_s\": %.4f, \"p50_us\": %.0f, \"p99_us\": %.0f, "
              "\"max_us\": %.0f, \"mean_us\": %.1f, \"verified\": %" PRIu64 "}\n",
              o.host.c_str(), o.port, o.size, o.connections, o.pipeline, requests, secs, rps, gbps,
              rps * static_cast<double>(o.size) / (1024.0 * 1024 * 1024), Percentile(lat, 0.50),
              Percentile(lat, 0.99), lat.empty() ? 0.0 : lat.back(), mean, verified);
  return 0;
}
