// The client side of the command fuzzer: a blocking RESP connection to the in-process server
// (TCP or the Unix socket) and a strict reader of its replies.
//
// The reader checks what a client relies on — every reply is well formed RESP2/RESP3 (type
// byte, decimal lengths, CRLF after every line and bulk, no CR or LF inside a line), so an
// argument echoed into an error line that would split the stream is caught — and closes the
// descriptors the Unix socket passes (SCM_RIGHTS) so that shared-memory leases never leak
// file descriptors into the fuzzer.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace pion::fuzz {

struct Reply {
  char type = 0;        // the RESP type byte
  bool null = false;    // $-1, *-1, _
  std::string text;     // line, bulk or verbatim payload
  int64_t integer = 0;  // ':' (and the length of an aggregate)
  std::vector<Reply> elems;
  bool error() const { return type == '-'; }
};

// Parses one reply from p[0, n). Returns the bytes it takes, 0 when more bytes are needed
// (*need: at least that many in all), or -1 with *why set when the bytes are not RESP.
inline long ParseReply(const char* p, size_t n, Reply* out, size_t* need, const char** why,
                       int depth = 0) {
  if (depth > 64) {
    *why = "nesting deeper than 64";
    return -1;
  }
  if (n < 1) {
    *need = 1;
    return 0;
  }
  // The line after the type byte.
  const char* end = static_cast<const char*>(std::memchr(p, '\n', n));
  if (end == nullptr) {
    *need = n + 1;
    return 0;
  }
  if (end == p || end[-1] != '\r') {
    *why = "LF without CR";
    return -1;
  }
  std::string_view line(p + 1, static_cast<size_t>(end - 1 - (p + 1)));
  if (line.find('\r') != std::string_view::npos) {
    *why = "CR inside a line";
    return -1;
  }
  const size_t head = static_cast<size_t>(end + 1 - p);
  auto parse_int = [&](int64_t* v) {
    if (line.empty() || line.size() > 20) return false;
    size_t i = line[0] == '-' ? 1 : 0;
    if (i == line.size()) return false;
    int64_t x = 0;
    for (; i < line.size(); ++i) {
      if (line[i] < '0' || line[i] > '9') return false;
      x = x * 10 + (line[i] - '0');
    }
    *v = line[0] == '-' ? -x : x;
    return true;
  };
  out->type = p[0];
  switch (p[0]) {
    case '+':
    case '-':
    case ',':
    case '(':
      out->text.assign(line);
      return static_cast<long>(head);
    case ':':
      if (!parse_int(&out->integer)) {
        *why = "integer reply is not a number";
        return -1;
      }
      return static_cast<long>(head);
    case '_':
      if (!line.empty()) {
        *why = "null with a payload";
        return -1;
      }
      out->null = true;
      return static_cast<long>(head);
    case '#':
      if (line != "t" && line != "f") {
        *why = "boolean is not t or f";
        return -1;
      }
      out->integer = line == "t";
      return static_cast<long>(head);
    case '$':
    case '=': {
      int64_t len = 0;
      if (!parse_int(&len) || len < -1 || (len == -1 && p[0] == '=')) {
        *why = "bad bulk length";
        return -1;
      }
      if (len == -1) {
        out->null = true;
        return static_cast<long>(head);
      }
      const size_t total = head + static_cast<size_t>(len) + 2;
      if (n < total) {
        *need = total;
        return 0;
      }
      if (p[total - 2] != '\r' || p[total - 1] != '\n') {
        *why = "bulk not followed by CRLF";
        return -1;
      }
      if (p[0] == '=' && (len < 4 || p[head + 3] != ':')) {
        *why = "verbatim string without its 3-byte format";
        return -1;
      }
      out->text.assign(p + head, static_cast<size_t>(len));
      return static_cast<long>(total);
    }
    case '*':
    case '%':
    case '~':
    case '>':
    case '|': {
      int64_t len = 0;
      if (!parse_int(&len) || len < -1 || (len == -1 && p[0] != '*')) {
        *why = "bad aggregate length";
        return -1;
      }
      if (len == -1) {
        out->null = true;
        return static_cast<long>(head);
      }
      const int64_t items = (p[0] == '%' || p[0] == '|') ? 2 * len : len;
      size_t off = head;
      out->integer = len;
      out->elems.resize(static_cast<size_t>(std::min<int64_t>(items, 1 << 20)));
      for (int64_t i = 0; i < items; ++i) {
        Reply scratch;
        Reply* e = i < static_cast<int64_t>(out->elems.size()) ? &out->elems[i] : &scratch;
        long used = ParseReply(p + off, n - off, e, need, why, depth + 1);
        if (used <= 0) {
          if (used == 0) *need += off;
          return used;
        }
        off += static_cast<size_t>(used);
      }
      if (p[0] == '|') {  // attributes precede the reply they describe
        Reply inner;
        long used = ParseReply(p + off, n - off, &inner, need, why, depth + 1);
        if (used <= 0) {
          if (used == 0) *need += off;
          return used;
        }
        *out = std::move(inner);
        off += static_cast<size_t>(used);
      }
      return static_cast<long>(off);
    }
    default:
      *why = "unknown type byte";
      return -1;
  }
}

class RespClient {
 public:
  RespClient() = default;
  RespClient(const RespClient&) = delete;
  RespClient& operator=(const RespClient&) = delete;
  ~RespClient() { Close(); }

  // Connects to the Unix socket `path`, or to 127.0.0.1:`port` when path is empty.
  bool Connect(const std::string& path, int port) {
    Close();
    if (!path.empty()) {
      fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
      if (fd_ < 0 || !ConnectFd(reinterpret_cast<sockaddr*>(&a), sizeof(a))) return Fail();
    } else {
      fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (fd_ < 0 || !ConnectFd(reinterpret_cast<sockaddr*>(&a), sizeof(a))) return Fail();
    }
    in_.clear();
    pos_ = 0;
    eof_ = false;
    write_closed_ = false;
    return true;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  // strerror of the last failed connect, read or write.
  const char* LastError() const { return std::strerror(errno_); }
  bool connected() const { return fd_ >= 0 && !eof_ && !write_closed_; }

  // Appends one command in RESP to the send buffer.
  void Append(const std::vector<std::string>& args) {
    out_ += '*' + std::to_string(args.size()) + "\r\n";
    for (const auto& a : args) {
      out_ += '$' + std::to_string(a.size()) + "\r\n";
      out_ += a;
      out_ += "\r\n";
    }
  }
  // Sends what was appended. False when the server has closed the connection; the replies it
  // sent before closing can still be read. Reads replies meanwhile (into the input buffer) so
  // a large pipeline cannot deadlock on full buffers.
  bool Flush(int timeout_ms) {
    size_t off = 0;
    while (off < out_.size()) {
      pollfd pfd{fd_, POLLOUT | POLLIN, 0};
      int r = poll(&pfd, 1, timeout_ms);
      if (r == 0) return Timeout("send");
      if (r < 0) {
        if (errno == EINTR) continue;
        return Fail();
      }
      if (pfd.revents & POLLIN) {
        if (!ReadSome()) break;
      }
      if (pfd.revents & (POLLOUT | POLLERR | POLLHUP)) {
        ssize_t w = send(fd_, out_.data() + off, out_.size() - off, MSG_NOSIGNAL);
        if (w < 0) {
          if (errno == EINTR || errno == EAGAIN) continue;
          out_.clear();
          write_closed_ = true;
          return false;
        }
        off += static_cast<size_t>(w);
      }
    }
    out_.clear();
    return !eof_ && !write_closed_;
  }

  // Reads the next reply. Returns 1 with *r, 0 when the server closed the connection first,
  // and aborts the process (a fuzzer finding) on malformed bytes or no reply within
  // timeout_ms.
  int Read(Reply* r, int timeout_ms, const std::string& what) {
    size_t need = 1;
    while (true) {
      if (in_.size() - pos_ >= need) {
        const char* why = nullptr;
        *r = Reply();
        long used = ParseReply(in_.data() + pos_, in_.size() - pos_, r, &need, &why);
        if (used < 0) {
          std::fprintf(stderr, "command_fuzz: malformed reply to %s: %s; bytes: %s\n", what.c_str(),
                       why, Escape(std::string_view(in_).substr(pos_, 200)).c_str());
          std::abort();
        }
        if (used > 0) {
          pos_ += static_cast<size_t>(used);
          if (pos_ == in_.size()) {
            in_.clear();
            pos_ = 0;
          }
          return 1;
        }
      }
      if (eof_) {
        if (in_.size() > pos_) {
          std::fprintf(stderr, "command_fuzz: connection closed inside a reply to %s: %s\n",
                       what.c_str(), Escape(std::string_view(in_).substr(pos_, 200)).c_str());
          std::abort();
        }
        return 0;
      }
      pollfd pfd{fd_, POLLIN, 0};
      int pr = poll(&pfd, 1, timeout_ms);
      if (pr == 0) {
        std::fprintf(stderr, "command_fuzz: no reply to %s within %d ms (hang)\n", what.c_str(),
                     timeout_ms);
        std::abort();
      }
      if (pr < 0 && errno != EINTR) std::abort();
      ReadSome();
    }
  }

  static std::string Escape(std::string_view s) {
    std::string o;
    for (unsigned char c : s) {
      if (c >= 0x20 && c < 0x7f && c != '\\') {
        o += static_cast<char>(c);
      } else {
        char b[8];
        std::snprintf(b, sizeof(b), "\\x%02x", c);
        o += b;
      }
    }
    return o;
  }

 private:
  // connect(2) on fd_. A signal (libFuzzer's -timeout alarm fires every second) may interrupt
  // it: the connection then goes on, and its outcome is SO_ERROR once the socket is writable.
  bool ConnectFd(const sockaddr* a, socklen_t n) {
    if (connect(fd_, a, n) == 0) return true;
    if (errno != EINTR) return false;
    pollfd p{fd_, POLLOUT, 0};
    int pr;
    while ((pr = poll(&p, 1, 10000)) < 0) {
      if (errno != EINTR) return false;
    }
    if (pr == 0) {
      errno = ETIMEDOUT;
      return false;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return false;
    errno = err;
    return err == 0;
  }
  bool Fail() {
    errno_ = errno;
    Close();
    return false;
  }
  bool Timeout(const char* what) {
    std::fprintf(stderr, "command_fuzz: server stopped reading (%s blocked)\n", what);
    std::abort();
  }
  // One recvmsg; closes passed descriptors. False at EOF.
  bool ReadSome() {
    if (pos_ > 0 && pos_ == in_.size()) {
      in_.clear();
      pos_ = 0;
    }
    const size_t old = in_.size();
    in_.resize(old + 65536);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 64)];
    iovec iov{in_.data() + old, 65536};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t r = recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); r >= 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          close(fd);
        }
      }
    }
    if (r < 0) {
      in_.resize(old);
      if (errno == EINTR || errno == EAGAIN) return true;
      eof_ = true;  // ECONNRESET: the server closed with unread input
      return false;
    }
    in_.resize(old + static_cast<size_t>(r));
    if (r == 0) eof_ = true;
    return r > 0;
  }

  int fd_ = -1;
  int errno_ = 0;  // of the last failed connect, read or write
  bool eof_ = false;
  bool write_closed_ = false;
  std::string in_;
  size_t pos_ = 0;
  std::string out_;
};

}  // namespace pion::fuzz
