// Pieces shared by the load clients pion-echo-bench and pion-fetch-bench: size arguments, the
// TCP connection they open, and latency percentiles. libc only, like the clients themselves.
#pragma once

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace pion::bench {

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

// The q-quantile (nearest rank) of sorted latencies; 0 when empty.
inline double Percentile(const std::vector<uint32_t>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  size_t idx = static_cast<size_t>(q * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(idx, sorted.size() - 1)];
}

}  // namespace pion::bench
