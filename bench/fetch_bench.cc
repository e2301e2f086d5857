// pion-fetch-bench: a minimal RESP load client for commands with large bulk replies
// (V.FETCH ... RANGE, GET of a big value, STATE.READ, ...).
//
// The requests are given pre-encoded: --command-file holds one or more RESP multibulk requests
// back to back (the exact bytes that are sent), or the words after `--` form one request. Each
// of --connections connections (one thread each) sends the requests in turn (connection c
// starts at request c mod N, so with several connections different requests are in flight),
// writing each from its preallocated bytes, and reads each whole reply
//   $<n>\r\n<payload>\r\n
// into a preallocated per-connection buffer with exact framing. With --pipeline P, up to P
// requests are in flight per connection (non-blocking sockets).
//
// Before the timed loop a probe sends every request once on the first connection and reads its
// reply: an error or non-bulk reply exits with status 1 and shows it; otherwise the reply
// header (hence the payload length) is learned per request, checked against --expect-size when
// given, the payload compared byte for byte with the request's --verify-file when given, and a
// 64-bit hash of it kept. In the timed loop every reply's header and CRLF are checked, and its
// payload hash compared with the probe's on each connection's first reply and every
// --verify-every'th reply after it (the server must keep returning the same bytes).
//
// Output: one JSON object on stdout (requests, seconds, req/s, GB/s of reply payload, latency
// percentiles). Exit status 1 on any connection, protocol or verify error. Two lines on stderr,
// "# measure start" (after the probe and --warmup) and "# measure end" (all replies in), let a
// driver sample CPU use over the measured window.
//
// Dependencies: libc and pthreads only (the server's libraries are deliberately not used, so
// the client is the same for every server it is pointed at).
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
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
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
  std::vector<std::string> command_files;
  std::vector<std::string> words;  // after --: one request
  std::vector<std::string> verify_files;
  uint64_t expect_size = 0;  // 0: any bulk length (learned by the probe)
  bool have_expect = false;
};

[[noreturn]] void Usage(int code) {
  std::fprintf(
      code == 0 ? stdout : stderr,
      "usage: pion-fetch-bench [--host H] [--port P] (--command-file F ... | -- WORD ...)\n"
      "                        [--connections C] [--seconds S | --requests N] [--pipeline P]\n"
      "                        [--warmup S] [--expect-size BYTES] [--verify-file F ...]\n"
      "                        [--verify-every N]\n"
      "  --command-file  file of one or more pre-encoded RESP multibulk requests, back to back;\n"
      "                  repeatable (the requests of all files are sent in turn)\n"
      "  -- WORD ...     one request made of these words (instead of --command-file)\n"
      "  --expect-size   every reply must be a bulk of exactly this many bytes (k/m/g suffixes)\n"
      "  --verify-file   expected payload of the i-th request (repeatable, in request order)\n"
      "  --connections   parallel connections, one thread each (default 1)\n"
      "  --seconds       measured duration (default 10), after --warmup seconds (default 0)\n"
      "  --requests      total requests over all connections (instead of --seconds)\n"
      "  --pipeline      requests in flight per connection (default 1)\n"
      "  --verify-every  compare the payload hash every N replies (default 64; first always)\n");
  std::exit(code);
}

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "pion-fetch-bench: %s\n", msg.c_str());
  std::exit(1);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--") {
      for (++i; i < argc; ++i) o.words.emplace_back(argv[i]);
      break;
    }
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
    if (a == "--command-file") {
      o.command_files.emplace_back(val);
    } else if (a == "--verify-file") {
      o.verify_files.emplace_back(val);
    } else if (a == "--expect-size") {
      o.expect_size = ParseSize("pion-fetch-bench", val);
      o.have_expect = true;
    } else {
      std::fprintf(stderr, "pion-fetch-bench: unknown option '%.*s'\n", static_cast<int>(a.size()),
                   a.data());
      Usage(2);
    }
  }
  if (!pion::bench::LoadOptionsValid("pion-fetch-bench", o)) Usage(2);
  if (o.command_files.empty() == o.words.empty()) {
    std::fprintf(stderr, "pion-fetch-bench: give --command-file or -- WORD ..., one of them\n");
    std::exit(2);
  }
  return o;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) Die("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Reads a decimal integer terminated by CRLF at s[*pos]; advances past the CRLF.
bool ParseLineInt(const std::string& s, size_t* pos, int64_t* out) {
  size_t end = s.find("\r\n", *pos);
  if (end == std::string::npos || end == *pos || end - *pos > 20) return false;
  char* e = nullptr;
  std::string num = s.substr(*pos, end - *pos);
  long long v = std::strtoll(num.c_str(), &e, 10);
  if (*e != '\0') return false;
  *out = v;
  *pos = end + 2;
  return true;
}

// Splits a file of back-to-back RESP multibulk requests into one string per request.
std::vector<std::string> SplitRequests(const std::string& data, const std::string& path) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < data.size()) {
    size_t begin = pos;
    int64_t n = 0;
    if (data[pos] != '*') Die(path + ": request at byte " + std::to_string(pos) + " is not '*'");
    ++pos;
    if (!ParseLineInt(data, &pos, &n) || n < 1) Die(path + ": bad multibulk count");
    for (int64_t i = 0; i < n; ++i) {
      int64_t len = 0;
      if (pos >= data.size() || data[pos] != '$') Die(path + ": argument is not '$'");
      ++pos;
      if (!ParseLineInt(data, &pos, &len) || len < 0) Die(path + ": bad bulk length");
      if (pos + static_cast<size_t>(len) + 2 > data.size() ||
          data.compare(pos + static_cast<size_t>(len), 2, "\r\n") != 0) {
        Die(path + ": truncated bulk argument");
      }
      pos += static_cast<size_t>(len) + 2;
    }
    out.push_back(data.substr(begin, pos - begin));
  }
  if (out.empty()) Die(path + ": no request in file");
  return out;
}

std::string Encode(const std::vector<std::string>& words) {
  // Appends only (GCC 12 warns, falsely, about "literal" + std::string temporaries here).
  std::string r;
  r.append("*").append(std::to_string(words.size())).append("\r\n");
  for (const auto& w : words) {
    r.append("$").append(std::to_string(w.size())).append("\r\n").append(w).append("\r\n");
  }
  return r;
}

// A fast 64-bit hash (four independent multiply lanes); only used to detect changed bytes.
uint64_t Hash(const uint8_t* p, size_t n) {
  uint64_t h[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                   0x27D4EB2F165667C5ull};
  constexpr uint64_t kMul = 0x9FB21C651E98DF25ull;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      h[k] = (h[k] ^ w) * kMul;
      h[k] ^= h[k] >> 29;
    }
  }
  uint64_t r = n;
  for (; i < n; ++i) r = (r ^ p[i]) * kMul;
  for (int k = 0; k < 4; ++k) r = (r ^ h[k]) * kMul, r ^= r >> 31;
  return r;
}

struct Request {
  std::string bytes;       // the whole encoded request
  std::string reply_head;  // "$<n>\r\n", learned by the probe
  uint64_t size = 0;       // payload bytes of the reply
  uint64_t hash = 0;       // of the probe's payload
};

// Shared, read-only after setup (but for the control block).
struct Shared : pion::bench::LoadControl {
  Options opt;
  std::vector<Request> reqs;
  size_t max_reply = 0;
};

// Blocking helpers on a non-blocking socket, for the probe.
void SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd pf{fd, POLLOUT, 0};
      poll(&pf, 1, 1000);
    } else {
      Die(std::string("probe send: ") + std::strerror(errno));
    }
  }
}

void RecvAll(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t r = recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      Die("probe: server closed the connection");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      pollfd pf{fd, POLLIN, 0};
      poll(&pf, 1, 1000);
    } else {
      Die(std::string("probe recv: ") + std::strerror(errno));
    }
  }
}

// Sends each request once, learns its reply header and payload hash, checks --expect-size and
// --verify-file.
void Probe(Shared* sh, int fd) {
  const Options& o = sh->opt;
  std::vector<uint8_t> payload;
  for (size_t i = 0; i < sh->reqs.size(); ++i) {
    Request& rq = sh->reqs[i];
    SendAll(fd, rq.bytes.data(), rq.bytes.size());
    std::string line;  // the first reply line, read byte by byte (short)
    while (line.size() < 2 || line.compare(line.size() - 2, 2, "\r\n") != 0) {
      uint8_t c;
      RecvAll(fd, &c, 1);
      line.push_back(static_cast<char>(c));
      if (line.size() > 4096) break;
    }
    std::string shown = line.substr(0, std::min<size_t>(line.find("\r\n"), 300));
    if (line[0] != '$') Die("request " + std::to_string(i) + ": reply is not a bulk: " + shown);
    char* e = nullptr;
    long long len = std::strtoll(line.c_str() + 1, &e, 10);
    if (*e != '\r') Die("request " + std::to_string(i) + ": bad reply header " + shown);
    if (len < 0) Die("request " + std::to_string(i) + ": reply is a null bulk (" + shown + ")");
    if (o.have_expect && static_cast<uint64_t>(len) != o.expect_size) {
      Die("request " + std::to_string(i) + ": reply has " + std::to_string(len) +
          " bytes, expected " + std::to_string(o.expect_size));
    }
    rq.reply_head = line;
    rq.size = static_cast<uint64_t>(len);
    payload.resize(rq.size + 2);
    RecvAll(fd, payload.data(), payload.size());
    if (payload[rq.size] != '\r' || payload[rq.size + 1] != '\n') {
      Die("request " + std::to_string(i) + ": reply not terminated by CRLF");
    }
    rq.hash = Hash(payload.data(), rq.size);
    if (i < o.verify_files.size()) {
      std::string want = ReadFile(o.verify_files[i]);
      if (want.size() != rq.size) {
        Die("request " + std::to_string(i) + ": reply has " + std::to_string(rq.size) + " bytes, " +
            o.verify_files[i] + " has " + std::to_string(want.size()));
      }
      if (std::memcmp(want.data(), payload.data(), rq.size) != 0) {
        Die("request " + std::to_string(i) + ": reply differs from " + o.verify_files[i]);
      }
    }
    sh->max_reply = std::max(sh->max_reply, rq.reply_head.size() + rq.size + 2);
  }
}

// Connection `conn` sends the requests in turn from the conn-th one, each checked against the
// probe's reply.
struct FetchTraffic {
  const Shared* sh;
  int conn;
  const Request& Of(uint64_t k) const {
    return sh->reqs[(static_cast<uint64_t>(conn) + k) % sh->reqs.size()];
  }
  size_t RequestLen(uint64_t k) const { return Of(k).bytes.size(); }
  ssize_t Send(int fd, uint64_t k, size_t off) const {
    const std::string& b = Of(k).bytes;
    return send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
  }
  const std::string& ReplyHead(uint64_t k) const { return Of(k).reply_head; }
  size_t PayloadLen(uint64_t k) const { return Of(k).size; }
  size_t MaxReply() const { return sh->max_reply; }
  const char* Mismatch(uint64_t k, const uint8_t* p) const {
    return Hash(p, Of(k).size) != Of(k).hash ? "payload differs from the probe's" : nullptr;
  }
};

// One connection's send/receive loop. quota == 0: run until the shared deadline.
void RunConnection(Shared* sh, int conn, int fd, uint64_t quota, Result* out) {
  const FetchTraffic tr{sh, conn};
  pion::bench::RunPipelined(sh, fd, quota, sh->opt.pipeline, sh->opt.verify_every, tr, out);
}

}  // namespace

int main(int argc, char** argv) {
  Shared sh;
  sh.opt = ParseArgs(argc, argv);
  const Options& o = sh.opt;

  if (!o.words.empty()) {
    sh.reqs.push_back({Encode(o.words), "", 0, 0});
  } else {
    for (const auto& path : o.command_files) {
      for (auto& r : SplitRequests(ReadFile(path), path))
        sh.reqs.push_back({std::move(r), "", 0, 0});
    }
  }
  if (o.verify_files.size() > sh.reqs.size()) {
    Die(std::to_string(o.verify_files.size()) + " --verify-file for " +
        std::to_string(sh.reqs.size()) + " requests");
  }

  std::vector<int> fds;
  for (int c = 0; c < o.connections; ++c) {
    std::string err;
    int fd = ConnectTcp(o.host, o.port, &err);
    if (fd < 0) Die(o.host + ":" + std::to_string(o.port) + ": " + err);
    fds.push_back(fd);
  }
  Probe(&sh, fds[0]);

  const pion::bench::LoadTotals tot = pion::bench::RunLoad(
      &sh, o.connections, o.requests, o.warmup, o.seconds, true,
      [&](int c, uint64_t quota, Result* r) { RunConnection(&sh, c, fds[c], quota, r); });
  for (int fd : fds) close(fd);
  if (!tot.error.empty()) Die(tot.error);
  const std::vector<uint32_t>& lat = tot.lat_us;
  const uint64_t requests = tot.requests, verified = tot.verified, payload = tot.payload_bytes;
  const double secs = tot.seconds, mean = tot.mean_us;
  double rps = secs > 0 ? static_cast<double>(requests) / secs : 0.0;
  double bps = secs > 0 ? static_cast<double>(payload) / secs : 0.0;
  uint64_t min_size = UINT64_MAX, max_size = 0;
  for (const auto& r : sh.reqs) {
    min_size = std::min(min_size, r.size);
    max_size = std::max(max_size, r.size);
  }

  std::printf("{\"host\": \"%s\", \"port\": %d, \"commands\": %zu, \"reply_bytes_min\": %" PRIu64
              ", \"reply_bytes_max\": %" PRIu64
              ", \"connections\": %d, \"pipeline\": %d, \"requests\": %" PRIu64
              ", \"payload_bytes\": %" PRIu64
              ", \"seconds\": %.4f, \"req_per_s\": %.2f, \"gb_per_s\": %.4f, \"gib_per_s\": %.4f, "
              "\"p50_us\": %.0f, \"p99_us\": %.0f, \"max_us\": %.0f, \"mean_us\": %.1f, "
              "\"verified\": %" PRIu64 "}\n",
              o.host.c_str(), o.port, sh.reqs.size(), min_size, max_size, o.connections, o.pipeline,
              requests, payload, secs, rps, bps / 1e9, bps / (1024.0 * 1024 * 1024),
              Percentile(lat, 0.50), Percentile(lat, 0.99), lat.empty() ? 0.0 : lat.back(), mean,
              verified);
  return 0;
}
