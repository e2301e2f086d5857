#include "server/shard.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "server/server.h"

namespace pion::server {
namespace {
thread_local Shard* tls_shard = nullptr;
constexpr int kTickMs = 100;
}  // namespace

Shard::Shard(Server* server, int id, int listen_fd, int unix_fd, int binary_fd, size_t n_commands,
             size_t queue_depth)
    : server_(server),
      id_(id),
      listen_fd_(listen_fd),
      unix_fd_(unix_fd),
      binary_fd_(binary_fd),
      stats_(n_commands),
      queue_depth_(queue_depth) {
  unix_listener_.shard = this;
  unix_listener_.kind = Listener::kUnix;
  binary_listener_.shard = this;
  binary_listener_.kind = Listener::kBinary;
}

Shard::~Shard() = default;

Shard* Shard::Current() { return tls_shard; }

void Shard::Start() {
  thread_ = std::thread([this] { Run(); });
}

void Shard::Stop() {
  stop_.store(true, std::memory_order_release);
  loop_.Wake();
}

void Shard::Join() {
  if (thread_.joinable()) thread_.join();
}

bool Shard::Post(Task task) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (inbox_.size() >= queue_depth_.load(std::memory_order_relaxed)) return false;
    inbox_.push_back(std::move(task));
    queued_.store(inbox_.size(), std::memory_order_relaxed);
  }
  loop_.Wake();
  return true;
}

void Shard::PostControl(Task task) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    control_.push_back(std::move(task));
  }
  loop_.Wake();
}

void Shard::DrainInbox() {
  std::vector<Task> tasks, control;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    tasks.swap(inbox_);
    control.swap(control_);
    queued_.store(0, std::memory_order_relaxed);
  }
  for (auto& t : tasks) t(*this);
  for (auto& t : control) t(*this);
}

void Shard::Run() {
  tls_shard = this;
  if (listen_fd_ >= 0) {
    // All shards wait on the one listening socket; EPOLLEXCLUSIVE wakes one of them per
    // connection, so accepts spread across shards without a thundering herd.
    loop_.Add(listen_fd_, EPOLLIN | EPOLLEXCLUSIVE, this);
  }
  if (unix_fd_ >= 0) loop_.Add(unix_fd_, EPOLLIN | EPOLLEXCLUSIVE, &unix_listener_);
  if (binary_fd_ >= 0) loop_.Add(binary_fd_, EPOLLIN | EPOLLEXCLUSIVE, &binary_listener_);
  last_tick_ = std::chrono::steady_clock::now();
  // Polling until `awake_until` (the last activity + --poll-us): the next request, a command
  // another shard forwards, or the reply to one this shard forwarded, is then picked up within
  // a microsecond instead of after a scheduler wake-up.
  auto awake_until = last_tick_;
  while (!stop_.load(std::memory_order_acquire)) {
    const int64_t poll_us = poll_us_.load(std::memory_order_relaxed);
    const bool polling = poll_us > 0 && loop_.now() < awake_until;
    loop_.RunOnce(polling ? 0 : kTickMs, [this] { DrainInbox(); });
    ReapClosed();
    auto now = loop_.now();
    if (loop_.last_events() > 0) awake_until = now + std::chrono::microseconds(poll_us);
    if (now - last_tick_ >= std::chrono::milliseconds(kTickMs)) {
      last_tick_ = now;
      Tick();
    }
  }
  DrainInbox();
  if (listen_fd_ >= 0) loop_.Remove(listen_fd_);
  if (unix_fd_ >= 0) loop_.Remove(unix_fd_);
  if (binary_fd_ >= 0) loop_.Remove(binary_fd_);
  for (auto& [id, c] : connections_) c->Close(net::CloseReason::kShutdown);
  ReapClosed();
  tls_shard = nullptr;
}

void Shard::Tick() {
  auto now = net::Connection::Clock::now();
  if (id_ == 0) server_->shm().Expire(now);
  uint64_t q = 0, o = 0, biggest = 0;
  for (auto& [id, c] : connections_) {
    c->Tick(now);
    q += c->query_buffer_capacity();
    o += c->output_bytes();
    if (c->output_bytes() > biggest) biggest = c->output_bytes();
  }
  client_query_bytes.store(q, std::memory_order_relaxed);
  client_output_bytes.store(o, std::memory_order_relaxed);
  client_biggest_output.store(biggest, std::memory_order_relaxed);
  ReapClosed();
}

void Shard::ReapClosed() {
  for (uint64_t id : closed_ids_) connections_.erase(id);
  closed_ids_.clear();
}

void Shard::OnEvent(uint32_t) { Accept(listen_fd_, Listener::kTcp); }

void Shard::Accept(int listen_fd, Listener kind) {
  const bool unix_socket = kind == Listener::kUnix;
  for (int i = 0; i < 64; ++i) {
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("shard {}: accept failed: {}", id_, std::strerror(errno));
      }
      return;
    }
    Bump(stats_.connections_received);
    if (server_->connected_clients() >=
        static_cast<uint64_t>(server_->settings().maxclients.load())) {
      static constexpr char kMsg[] = "ERR max number of clients reached";
      std::string out;
      if (kind == Listener::kBinary) {  // an error frame for request id 0
        proto::binary::FrameHeader h;
        h.command = proto::binary::kReplyBit;
        h.status = static_cast<uint16_t>(ErrorKind::kErr);
        h.payload_len = sizeof(kMsg) - 1;
        out.resize(proto::binary::kHeaderSize);
        proto::binary::EncodeHeader(h, reinterpret_cast<uint8_t*>(out.data()));
        out += kMsg;
      } else {
        out = std::string("-") + kMsg + "\r\n";
      }
      ssize_t w = send(fd, out.data(), out.size(), MSG_NOSIGNAL);
      (void)w;
      close(fd);
      stats_.Reject(RejectReason::kMaxClients);
      continue;
    }
    if (!unix_socket) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    auto conn = std::make_unique<net::Connection>(
        &loop_, this, fd, server_->NextClientId(),
        kind == Listener::kBinary ? net::Protocol::kBinary : net::Protocol::kResp);
    conn->unix_socket = unix_socket;
    conn->authenticated = !server_->settings().auth_required.load(std::memory_order_relaxed);
    if (!conn->Start()) continue;
    Bump(stats_.connected_clients);
    connections_.emplace(conn->id(), std::move(conn));
  }
}

net::Connection* Shard::FindConnection(uint64_t id) {
  auto it = connections_.find(id);
  if (it == connections_.end() || it->second->closed()) return nullptr;
  return it->second.get();
}

void Shard::Dispatch(net::Connection& conn, proto::CmdArgs& args) {
  server_->Dispatch(*this, conn, args);
}

net::ConnectionLimits Shard::LimitsFor(const net::Connection& conn) {
  const auto& s = server_->settings();
  net::ConnectionLimits l;
  l.parser.max_bulk_len = s.proto_max_bulk_len.load(std::memory_order_relaxed);
  l.parser.max_multibulk_len = s.max_multibulk_len.load(std::memory_order_relaxed);
  l.parser.query_buffer_limit = s.client_query_buffer_limit.load(std::memory_order_relaxed);
  l.parser.authenticated = conn.authenticated;
  l.output_limit = s.client_output_buffer_limit.load(std::memory_order_relaxed);
  l.output_timeout_ms = s.client_output_buffer_timeout_ms.load(std::memory_order_relaxed);
  return l;
}

void Shard::OnNetBytes(uint64_t in, uint64_t out) {
  if (in) Bump(stats_.net_input_bytes, in);
  if (out) Bump(stats_.net_output_bytes, out);
}

void Shard::OnClosed(net::Connection& conn, net::CloseReason reason) {
  // A client that goes away releases its shared-memory leases.
  if (conn.unix_socket) server_->shm().ReleaseClient(conn.id());
  switch (reason) {
    case net::CloseReason::kProtocol:
      stats_.Reject(RejectReason::kProtocol);
      break;
    case net::CloseReason::kQueryLimit:
      stats_.Reject(RejectReason::kQueryBufferLimit);
      spdlog::warn("closing client {} ({}): query buffer limit reached", conn.id(), conn.peer());
      break;
    case net::CloseReason::kOutputLimit:
      stats_.Reject(RejectReason::kOutputBufferLimit);
      spdlog::warn(
          "closing client {} ({}): stopped reading at its output buffer limit "
          "({} bytes pending)",
          conn.id(), conn.peer(), conn.output_bytes());
      break;
    default:
      break;
  }
  stats_.connected_clients.store(Read(stats_.connected_clients) - 1, std::memory_order_relaxed);
  closed_ids_.push_back(conn.id());
}

}  // namespace pion::server
