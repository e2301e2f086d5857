#include "cluster/etcd_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "cluster/json.h"

namespace pion::cluster {
namespace {

using Clock = std::chrono::steady_clock;

Status Down(const EtcdEndpoint& ep, const std::string& what) {
  return Status(ErrorKind::kClusterDown,
                "etcd at " + ep.host + ":" + std::to_string(ep.port) + " " + what);
}

int RemainingMs(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Connects with a deadline; returns the socket or -1 with *err set.
int Connect(const EtcdEndpoint& ep, Clock::time_point deadline, std::string* err) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(ep.port);
  if (int rc = getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    *err = std::string("cannot be resolved: ") + gai_strerror(rc);
    return -1;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    *err = std::string("socket: ") + strerror(errno);
    return -1;
  }
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    *err = std::string("is unreachable: ") + strerror(errno);
    close(fd);
    return -1;
  }
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, RemainingMs(deadline)) <= 0) {
      *err = "is unreachable: connect timed out";
      close(fd);
      return -1;
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      *err = std::string("is unreachable: ") + strerror(soerr);
      close(fd);
      return -1;
    }
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

bool SendAll(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, RemainingMs(deadline)) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

// Decodes a chunked transfer-encoded body.
StatusOr<std::string> Dechunk(std::string_view in) {
  std::string out;
  for (;;) {
    const size_t eol = in.find("\r\n");
    if (eol == std::string_view::npos) return Error("HTTP: truncated chunk header");
    const unsigned long n = std::strtoul(std::string(in.substr(0, eol)).c_str(), nullptr, 16);
    in.remove_prefix(eol + 2);
    if (n == 0) return out;
    if (in.size() < n + 2) return Error("HTTP: truncated chunk");
    out.append(in.substr(0, n));
    in.remove_prefix(n + 2);
  }
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

StatusOr<EtcdClient::Kv> KvOf(const Json& j) {
  EtcdClient::Kv kv;
  auto key = Base64Decode(j["key"].text);
  if (!key.ok()) return key.status();
  auto value = Base64Decode(j["value"].text);
  if (!value.ok()) return value.status();
  kv.key = std::move(key).value();
  kv.value = std::move(value).value();
  kv.create_revision = j["create_revision"].Int();
  kv.mod_revision = j["mod_revision"].Int();
  kv.lease = j["lease"].Int();
  return kv;
}

// The key just past every key with this prefix (etcd's range_end for a prefix).
std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char c = static_cast<unsigned char>(end.back());
    if (c < 0xff) {
      end.back() = static_cast<char>(c + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

}  // namespace

StatusOr<EtcdEndpoint> ParseEtcdUrl(std::string_view url) {
  std::string_view rest = url;
  for (std::string_view scheme : {"etcd://", "http://"}) {
    if (rest.substr(0, scheme.size()) == scheme) {
      rest.remove_prefix(scheme.size());
      break;
    }
  }
  if (rest.size() == url.size()) {
    return Error("--cluster must be etcd://host:port (e.g. etcd://127.0.0.1:2379), got '" +
                 std::string(url) + "'");
  }
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  EtcdEndpoint ep;
  const size_t colon = rest.rfind(':');
  ep.host = std::string(rest.substr(0, colon));
  if (colon != std::string_view::npos) {
    const std::string port(rest.substr(colon + 1));
    char* end = nullptr;
    const long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || p < 1 || p > 65535) {
      return Error("--cluster port must be in [1, 65535], got '" + port + "'");
    }
    ep.port = static_cast<int>(p);
  }
  if (ep.host.empty())
    return Error("--cluster needs a host: etcd://host:port, got '" + std::string(url) + "'");
  return ep;
}

EtcdClient::EtcdClient(EtcdEndpoint endpoint, int timeout_ms)
    : endpoint_(std::move(endpoint)), timeout_ms_(timeout_ms) {}

StatusOr<std::string> EtcdClient::Post(std::string_view path, const std::string& body) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  std::string err;
  const int fd = Connect(endpoint_, deadline, &err);
  if (fd < 0) return Down(endpoint_, err);
  std::string req = "POST " + std::string(path) + " HTTP/1.1\r\nHost: " + endpoint_.host + ":" +
                    std::to_string(endpoint_.port) +
                    "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
                    std::to_string(body.size()) + "\r\n\r\n" + body;
  if (!SendAll(fd, req, deadline)) {
    close(fd);
    return Down(endpoint_, "did not take the request " + std::string(path));
  }
  std::string resp;
  char buf[16384];
  size_t header_end = std::string::npos;
  size_t content_length = std::string::npos;
  for (;;) {
    if (header_end != std::string::npos && content_length != std::string::npos &&
        resp.size() >= header_end + 4 + content_length) {
      break;  // the whole body is in: no need to wait for the close
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, RemainingMs(deadline)) <= 0) {
      close(fd);
      return Down(endpoint_, "did not answer " + std::string(path) + " within " +
                                 std::to_string(timeout_ms_) + " ms");
    }
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
    if (header_end == std::string::npos) {
      header_end = resp.find("\r\n\r\n");
      if (header_end != std::string::npos) {
        const std::string head = Lower(std::string_view(resp).substr(0, header_end));
        const size_t cl = head.find("\r\ncontent-length:");
        if (cl != std::string::npos)
          content_length = std::strtoul(head.c_str() + cl + 17, nullptr, 10);
      }
    }
  }
  close(fd);
  if (header_end == std::string::npos) {
    return Down(endpoint_, "closed the connection before answering " + std::string(path));
  }
  const std::string head = Lower(std::string_view(resp).substr(0, header_end));
  std::string payload = resp.substr(header_end + 4);
  if (head.find("transfer-encoding: chunked") != std::string::npos) {
    auto d = Dechunk(payload);
    if (!d.ok()) return Down(endpoint_, d.status().message());
    payload = std::move(d).value();
  } else if (content_length != std::string::npos && payload.size() > content_length) {
    payload.resize(content_length);
  }
  const int code = resp.size() > 12 ? std::atoi(resp.c_str() + 9) : 0;
  if (code != 200) {
    std::string what = payload.substr(0, 300);
    auto j = ParseJson(payload);
    if (j.ok() && !j.value()["error"].text.empty()) what = j.value()["error"].text;
    if (j.ok() && !j.value()["message"].text.empty()) what = j.value()["message"].text;
    return Down(endpoint_,
                "refused " + std::string(path) + " (HTTP " + std::to_string(code) + "): " + what);
  }
  return payload;
}

StatusOr<int64_t> EtcdClient::Grant(int ttl_s) {
  auto r = Post("/v3/lease/grant", "{\"TTL\":\"" + std::to_string(ttl_s) + "\"}");
  if (!r.ok()) return r.status();
  auto j = ParseJson(r.value());
  if (!j.ok()) return j.status();
  const int64_t id = j.value()["ID"].Int();
  if (id == 0) return Error("etcd granted no lease: " + r.value().substr(0, 200));
  return id;
}

Status EtcdClient::KeepAlive(int64_t lease) {
  auto r = Post("/v3/lease/keepalive", "{\"ID\":\"" + std::to_string(lease) + "\"}");
  if (!r.ok()) return r.status();
  // A stream of one message: {"result":{"ID":..,"TTL":..}}; TTL absent (0) = expired.
  std::string body = r.value();
  const size_t nl = body.find('\n');
  if (nl != std::string::npos) body.resize(nl);
  auto j = ParseJson(body);
  if (!j.ok()) return j.status();
  const Json& res = j.value()["result"];
  if (res["TTL"].Int() <= 0) {
    return Status(ErrorKind::kMiss, "lease " + std::to_string(lease) + " expired");
  }
  return Status::Ok();
}

Status EtcdClient::Revoke(int64_t lease) {
  auto r = Post("/v3/lease/revoke", "{\"ID\":\"" + std::to_string(lease) + "\"}");
  return r.ok() ? Status::Ok() : r.status();
}

StatusOr<EtcdClient::Kv> EtcdClient::Get(std::string_view key) {
  auto r = Post("/v3/kv/range", "{\"key\":\"" + Base64Encode(key) + "\"}");
  if (!r.ok()) return r.status();
  auto j = ParseJson(r.value());
  if (!j.ok()) return j.status();
  const Json& kvs = j.value()["kvs"];
  if (kvs.items.empty()) return Status(ErrorKind::kMiss, "no key " + std::string(key));
  return KvOf(kvs.items[0]);
}

StatusOr<std::vector<EtcdClient::Kv>> EtcdClient::List(std::string_view prefix) {
  auto r = Post("/v3/kv/range", "{\"key\":\"" + Base64Encode(prefix) + "\",\"range_end\":\"" +
                                    Base64Encode(PrefixEnd(prefix)) + "\"}");
  if (!r.ok()) return r.status();
  auto j = ParseJson(r.value());
  if (!j.ok()) return j.status();
  std::vector<Kv> out;
  for (const Json& item : j.value()["kvs"].items) {
    auto kv = KvOf(item);
    if (!kv.ok()) return kv.status();
    out.push_back(std::move(kv).value());
  }
  return out;
}

Status EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease) {
  std::string body =
      "{\"key\":\"" + Base64Encode(key) + "\",\"value\":\"" + Base64Encode(value) + "\"";
  if (lease != 0) body += ",\"lease\":\"" + std::to_string(lease) + "\"";
  body += "}";
  auto r = Post("/v3/kv/put", body);
  return r.ok() ? Status::Ok() : r.status();
}

StatusOr<bool> EtcdClient::PutIf(std::string_view key, std::string_view value,
                                 int64_t expect_mod_revision, int64_t lease) {
  const std::string k = Base64Encode(key);
  std::string compare = expect_mod_revision == 0
                            ? "{\"target\":\"CREATE\",\"result\":\"EQUAL\",\"key\":\"" + k +
                                  "\",\"create_revision\":\"0\"}"
                            : "{\"target\":\"MOD\",\"result\":\"EQUAL\",\"key\":\"" + k +
                                  "\",\"mod_revision\":\"" + std::to_string(expect_mod_revision) +
                                  "\"}";
  std::string put =
      "{\"request_put\":{\"key\":\"" + k + "\",\"value\":\"" + Base64Encode(value) + "\"";
  if (lease != 0) put += ",\"lease\":\"" + std::to_string(lease) + "\"";
  put += "}}";
  auto r = Post("/v3/kv/txn", "{\"compare\":[" + compare + "],\"success\":[" + put + "]}");
  if (!r.ok()) return r.status();
  auto j = ParseJson(r.value());
  if (!j.ok()) return j.status();
  return j.value()["succeeded"].boolean;
}

Status EtcdClient::Watch(std::string_view prefix, const std::function<bool()>& keep_going,
                         const std::function<void()>& on_event) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  std::string err;
  const int fd = Connect(endpoint_, deadline, &err);
  if (fd < 0) return Down(endpoint_, err);
  const std::string body = "{\"create_request\":{\"key\":\"" + Base64Encode(prefix) +
                           "\",\"range_end\":\"" + Base64Encode(PrefixEnd(prefix)) + "\"}}";
  const std::string req =
      "POST /v3/watch HTTP/1.1\r\nHost: " + endpoint_.host + ":" + std::to_string(endpoint_.port) +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\n\r\n" + body;
  if (!SendAll(fd, req, deadline)) {
    close(fd);
    return Down(endpoint_, "did not take the watch request");
  }
  char buf[16384];
  bool header = false;
  std::string head;
  while (keep_going()) {
    pollfd p{fd, POLLIN, 0};
    const int rc = poll(&p, 1, 200);
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      close(fd);
      return Down(endpoint_, "ended the watch stream");
    }
    if (!header) {
      head.append(buf, static_cast<size_t>(n));
      const size_t end = head.find("\r\n\r\n");
      if (end == std::string::npos) continue;
      header = true;
      if (head.size() < 12 || std::atoi(head.c_str() + 9) != 200) {
        close(fd);
        return Down(endpoint_, "refused the watch: " + head.substr(0, head.find("\r\n")));
      }
    }
    on_event();  // any message of the stream: the caller re-reads what it watches
  }
  close(fd);
  return Status::Ok();
}

Status EtcdClient::Delete(std::string_view key) {
  auto r = Post("/v3/kv/deleterange", "{\"key\":\"" + Base64Encode(key) + "\"}");
  return r.ok() ? Status::Ok() : r.status();
}

}  // namespace pion::cluster
