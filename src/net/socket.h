// Small POSIX socket helpers for the listeners.
#pragma once

#include <string>

#include "common/status.h"

namespace pion::net {

// Creates a non-blocking TCP listening socket bound to host:port (IPv4 or IPv6 literal,
// or "localhost"). Returns the fd.
StatusOr<int> ListenTcp(const std::string& host, int port, int backlog = 511);

// Creates a non-blocking Unix-domain stream listening socket at path with permissions perm
// (e.g. 0700). A stale socket file at path is replaced; any other file there is an error.
StatusOr<int> ListenUnix(const std::string& path, unsigned perm, int backlog = 511);

// "127.0.0.1:52344" for a connected socket's peer (or local end when local is true).
// A Unix-domain socket reads "<socket path>:0" (as Redis prints it).
std::string SocketAddress(int fd, bool local = false);

}  // namespace pion::net
