#include "cluster/node_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace pion::cluster {

NodeClient::~NodeClient() { Close(); }

void NodeClient::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  in_.clear();
  pos_ = 0;
}

Status NodeClient::Connect() {
  const size_t colon = addr_.rfind(':');
  if (colon == std::string::npos) return Error("node address '" + addr_ + "' has no port");
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::atoi(addr_.c_str() + colon + 1)));
  if (inet_pton(AF_INET, addr_.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
    return Error("node address '" + addr_ + "' is not an IPv4 host:port");
  }
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return Status(ErrorKind::kIo, std::string("socket: ") + strerror(errno));
  timeval tv{timeout_ms_ / 1000, (timeout_ms_ % 1000) * 1000};
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    Status s(ErrorKind::kIo, "node " + addr_ + " is unreachable: " + strerror(errno));
    Close();
    return s;
  }
  if (!password_.empty()) {
    std::string pw = password_;
    password_.clear();  // AUTH itself must not recurse into Connect
    auto r = Call({"AUTH", pw});
    password_ = pw;
    if (!r.ok()) return r.status();
    if (r->type == Reply::Type::kError) {
      Close();
      return Status(ErrorKind::kNoAuth, "node " + addr_ + " refused AUTH: " + r->text);
    }
  }
  return Status::Ok();
}

Status NodeClient::SendAll(std::string_view data) {
  while (!data.empty()) {
    ssize_t n = send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      Status s(ErrorKind::kIo,
               "sending to node " + addr_ + " failed: " + (n < 0 ? strerror(errno) : "closed"));
      Close();
      return s;
    }
  }
  return Status::Ok();
}

Status NodeClient::Fill() {
  if (pos_ > 0 && pos_ == in_.size()) {
    in_.clear();
    pos_ = 0;
  }
  char buf[65536];
  for (;;) {
    ssize_t n = recv(fd_, buf, sizeof buf, 0);
    if (n > 0) {
      in_.append(buf, static_cast<size_t>(n));
      return Status::Ok();
    }
    if (n < 0 && errno == EINTR) continue;
    Status s(ErrorKind::kIo, "node " + addr_ +
                                 (n == 0 ? " closed the connection"
                                         : std::string(" did not answer: ") + strerror(errno)));
    Close();
    return s;
  }
}

StatusOr<std::string> NodeClient::Line() {
  for (;;) {
    const size_t eol = in_.find("\r\n", pos_);
    if (eol != std::string::npos) {
      std::string line = in_.substr(pos_, eol - pos_);
      pos_ = eol + 2;
      return line;
    }
    Status s = Fill();
    if (!s.ok()) return s;
  }
}

StatusOr<Reply> NodeClient::Read(int depth) {
  auto line = Line();
  if (!line.ok()) return line.status();
  const std::string& l = line.value();
  if (l.empty()) return Status(ErrorKind::kIo, "node " + addr_ + " sent an empty line");
  Reply r;
  const std::string body = l.substr(1);
  switch (l[0]) {
    case '+':
      r.type = Reply::Type::kSimple;
      r.text = body;
      return r;
    case '-':
      r.type = Reply::Type::kError;
      r.text = body;
      return r;
    case ':':
      r.type = Reply::Type::kInteger;
      r.integer = std::strtoll(body.c_str(), nullptr, 10);
      return r;
    case '$': {
      const long long n = std::strtoll(body.c_str(), nullptr, 10);
      if (n < 0) return r;  // null
      while (in_.size() - pos_ < static_cast<size_t>(n) + 2) {
        Status s = Fill();
        if (!s.ok()) return s;
      }
      r.type = Reply::Type::kBulk;
      r.text = in_.substr(pos_, static_cast<size_t>(n));
      pos_ += static_cast<size_t>(n) + 2;
      return r;
    }
    case '*': {
      const long long n = std::strtoll(body.c_str(), nullptr, 10);
      if (n < 0) return r;
      if (depth > 8) return Status(ErrorKind::kIo, "node " + addr_ + ": reply nested too deep");
      r.type = Reply::Type::kArray;
      for (long long i = 0; i < n; ++i) {
        auto item = Read(depth + 1);
        if (!item.ok()) return item.status();
        r.items.push_back(std::move(item).value());
      }
      return r;
    }
    default:
      Close();
      return Status(ErrorKind::kIo, "node " + addr_ + " sent an unexpected reply type '" +
                                        std::string(1, l[0]) + "'");
  }
}

StatusOr<Reply> NodeClient::Call(const std::vector<std::string_view>& args) {
  if (fd_ < 0) {
    Status s = Connect();
    if (!s.ok()) return s;
  }
  std::string head = "*" + std::to_string(args.size()) + "\r\n";
  for (size_t i = 0; i < args.size(); ++i) {
    head += "$" + std::to_string(args[i].size()) + "\r\n";
    if (args[i].size() < 4096) {
      head.append(args[i]);
      head += "\r\n";
      continue;
    }
    // A large argument (an object file) is sent from where it is.
    Status s = SendAll(head);
    if (!s.ok()) return s;
    s = SendAll(args[i]);
    if (!s.ok()) return s;
    head = "\r\n";
  }
  Status s = SendAll(head);
  if (!s.ok()) return s;
  return Read(0);
}

}  // namespace pion::cluster
