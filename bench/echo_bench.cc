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

using Clock = pion::bench::Clock;
using Result = pion::bench::LoadResult;

struct Options : pion::bench::LoadOptions {
  uint64_t size = 4 << 20;
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
    if (pion::bench::ParseLoadOption(a, val, &o)) continue;
    if (a == "--size") {
      o.size = ParseSize("pion-echo-bench", val);
    } else if (a == "--seed") {
      o.seed = std::strtoull(val, nullptr, 10);
    } else {
      std::fprintf(stderr, "pion-echo-bench: unknown option '%.*s'\n", static_cast<int>(a.size()),
                   a.data());
      Usage(2);
    }
  }
  if (!pion::bench::LoadOptionsValid("pion-echo-bench", o)) Usage(2);
  return o;
}

// Shared, read-only after setup (but for the control block).
struct Shared : pion::bench::LoadControl {
  Options opt;
  std::vector<uint8_t> payload;
  std::string req_head;    // "*2\r\n$4\r\nECHO\r\n$<n>\r\n"
  std::string reply_head;  // "$<n>\r\n"
};

// Every request the same ECHO of the payload, sent from three pieces (header, payload, CRLF)
// without copying them together.
struct EchoTraffic {
  const Shared* sh;
  size_t RequestLen(uint64_t) const { return sh->req_head.size() + sh->opt.size + 2; }
  ssize_t Send(int fd, uint64_t, size_t off) const {
    static constexpr char kCrlf[] = "\r\n";
    const std::pair<const void*, size_t> parts[3] = {
        {sh->req_head.data(), sh->req_head.size()}, {sh->payload.data(), sh->opt.size}, {kCrlf, 2}};
    iovec iov[3];
    int n = 0;
    for (const auto& [p, len] : parts) {
      if (off >= len) {
        off -= len;
        continue;
      }
      iov[n].iov_base = const_cast<uint8_t*>(static_cast<const uint8_t*>(p) + off);
      iov[n].iov_len = len - off;
      off = 0;
      ++n;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    return sendmsg(fd, &msg, MSG_NOSIGNAL);
  }
  const std::string& ReplyHead(uint64_t) const { return sh->reply_head; }
  size_t PayloadLen(uint64_t) const { return sh->opt.size; }
  size_t MaxReply() const { return sh->reply_head.size() + sh->opt.size + 2; }
  const char* Mismatch(uint64_t, const uint8_t* p) const {
    return std::memcmp(p, sh->payload.data(), sh->opt.size) != 0 ? "payload mismatch" : nullptr;
  }
};

// One connection's send/receive loop. quota == 0: run until the shared deadline.
void RunConnection(Shared* sh, int fd, uint64_t quota, Result* out) {
  const EchoTraffic tr{sh};
  pion::bench::RunPipelined(sh, fd, quota, sh->opt.pipeline, sh->opt.verify_every, tr, out);
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

  const pion::bench::LoadTotals tot = pion::bench::RunLoad(
      &sh, o.connections, o.requests, o.warmup, o.seconds, false,
      [&](int c, uint64_t quota, Result* r) { RunConnection(&sh, fds[c], quota, r); });
  for (int fd : fds) close(fd);
  if (!tot.error.empty()) {
    std::fprintf(stderr, "pion-echo-bench: %s\n", tot.error.c_str());
    return 1;
  }
  const std::vector<uint32_t>& lat = tot.lat_us;
  const uint64_t requests = tot.requests, verified = tot.verified;
  const double secs = tot.seconds, mean = tot.mean_us;
  double rps = secs > 0 ? static_cast<double>(requests) / secs : 0.0;
  double gbps = rps * static_cast<double>(o.size) / 1e9;

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
