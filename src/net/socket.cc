#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

namespace pion::net {

StatusOr<int> ListenTcp(const std::string& host, int port, int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_str = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (rc != 0) {
    return Error("cannot resolve bind address '" + host + "': " + gai_strerror(rc));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    last_error = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(res);
  return Error("cannot listen on " + host + ":" + port_str + ": " + last_error);
}

StatusOr<int> ListenUnix(const std::string& path, unsigned perm, int backlog) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return Error("unix socket path must be 1 to " + std::to_string(sizeof(addr.sun_path) - 1) +
                 " bytes, got " + std::to_string(path.size()));
  }
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return Error("cannot listen on unix socket " + path +
                   ": a file that is not a socket is there");
    }
    unlink(path.c_str());  // a stale socket of an earlier run
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Error(std::string("socket(AF_UNIX): ") + std::strerror(errno));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), perm) != 0 || listen(fd, backlog) != 0) {
    std::string why = std::strerror(errno);
    close(fd);
    return Error("cannot listen on unix socket " + path + ": " + why);
  }
  return fd;
}

std::string SocketAddress(int fd, bool local) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  int rc = local ? getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len)
                 : getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  if (rc != 0) return "?:0";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  } else if (ss.ss_family == AF_UNIX) {
    // A client's end is unnamed: name the connection by the server's socket path.
    auto* a = reinterpret_cast<sockaddr_un*>(&ss);
    size_t n =
        len > offsetof(sockaddr_un, sun_path) ? strnlen(a->sun_path, sizeof(a->sun_path)) : 0;
    if (n == 0 && !local) return SocketAddress(fd, true);
    return std::string(a->sun_path, n) + ":0";
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace pion::net
