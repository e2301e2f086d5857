// Small POSIX socket helpers for the listeners.
#pragma once

#include <string>

#include "common/status.h"

namespace pion::net {

// Creates a non-blocking TCP listening socket bound to host:port (IPv4 or IPv6 literal,
// or "localhost"). Returns the fd.
StatusOr<int> ListenTcp(const std::string& host, int port, int backlog = 511);

// "127.0.0.1:52344" for a connected socket's peer (or local end when local is true).
std::string SocketAddress(int fd, bool local = false);

}  // namespace pion::net
