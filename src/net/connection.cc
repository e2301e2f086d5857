#include "net/connection.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "net/socket.h"

namespace pion::net {
namespace {
constexpr int kMaxReadsPerEvent = 8;  // fairness between clients of one shard
constexpr size_t kEagerFlushBytes = 256 * 1024;
constexpr size_t kMaxPassedFds = 250;  // SCM_MAX_FD is 253
}  // namespace

Connection::Connection(EventLoop* loop, ConnectionHost* host, int fd, uint64_t id,
                       Protocol protocol)
    : loop_(loop),
      host_(host),
      fd_(fd),
      id_(id),
      peer_(SocketAddress(fd)),
      local_(SocketAddress(fd, true)),
      protocol_(protocol),
      resp_version_(protocol == Protocol::kBinary ? proto::kBinaryReplies : 2),
      rb_(&output_, resp_version_),
      created_(Clock::now()),
      last_active_(created_),
      last_write_progress_(created_) {}

Connection::~Connection() {
  if (fd_ >= 0) close(fd_);
}

bool Connection::Start() {
  interest_ = EPOLLIN;
  return loop_->Add(fd_, interest_, this);
}

void Connection::OnEvent(uint32_t events) {
  if (closed_) return;
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) ReadInput();
  if (!closed_ && (events & EPOLLOUT)) Pump();
  if (!closed_) UpdateInterest();
}

void Connection::ReadInput() {
  for (int i = 0; i < kMaxReadsPerEvent && !closed_; ++i) {
    if (async_pending_ || close_after_flush_ || paced_) break;
    auto span = binary() ? frames_.ReadSpan() : parser_.ReadSpan();
    ssize_t n = recv(fd_, span.data(), span.size(), 0);
    loop_->NoteIo();
    if (n > 0) {
      if (binary()) {
        frames_.CommitRead(static_cast<size_t>(n));
      } else {
        parser_.CommitRead(static_cast<size_t>(n));
      }
      host_->OnNetBytes(static_cast<uint64_t>(n), 0);
      last_active_ = loop_->now();
      Pump();
      if (static_cast<size_t>(n) < span.size()) break;  // socket drained
      continue;
    }
    if (n == 0) {
      Close(CloseReason::kClient);
      return;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) Close(CloseReason::kIoError);
    break;
  }
  if (!closed_) Flush();
}

void Connection::Pump() {
  while (!closed_) {
    ProcessInput();
    if (closed_) return;
    Flush();
    // Paced, but the socket took enough to go below the limit: run what is buffered.
    if (closed_ || !paced_ || output_.size() >= limits_.output_limit) return;
  }
}

void Connection::ProcessInput() {
  if (binary()) {
    ProcessFrames();
    return;
  }
  limits_ = host_->LimitsFor(*this);
  paced_ = false;
  while (!async_pending_ && !close_after_flush_ && !closed_) {
    if (output_.size() >= limits_.output_limit) {
      paced_ = true;  // resumes from Pump() once the output drains
      break;
    }
    parser_.set_limits(limits_.parser);
    auto r = parser_.Next(&args_);
    if (r == proto::RespParser::Result::kNeedMore) break;
    if (r == proto::RespParser::Result::kError) {
      rb_.ErrorLine("ERR Protocol error: " + parser_.error());
      close_after_flush_ = true;
      pending_close_reason_ = parser_.reason() == proto::RespParser::ErrorReason::kQueryBufferLimit
                                  ? CloseReason::kQueryLimit
                                  : CloseReason::kProtocol;
      break;
    }
    host_->Dispatch(*this, args_);
    args_.Clear();
    if (output_.size() >= kEagerFlushBytes) Flush();
    // AUTH may have changed the parser's pre-auth caps.
    limits_ = host_->LimitsFor(*this);
  }
}

void Connection::ProcessFrames() {
  using proto::binary::FrameParser;
  limits_ = host_->LimitsFor(*this);
  paced_ = false;
  while (!async_pending_ && !close_after_flush_ && !closed_) {
    if (output_.size() >= limits_.output_limit) {
      paced_ = true;
      break;
    }
    frames_.set_limits(limits_.parser);
    auto r = frames_.Next(&args_);
    if (r == FrameParser::Result::kNeedMore) break;
    frame_ = frames_.header();
    if (r == FrameParser::Result::kError) {  // the stream cannot be trusted past this frame
      WriteErrorFrame(frames_.status(), frames_.error());
      close_after_flush_ = true;
      pending_close_reason_ =
          frames_.query_limit_hit() ? CloseReason::kQueryLimit : CloseReason::kProtocol;
      break;
    }
    if (r == FrameParser::Result::kReject) {
      WriteErrorFrame(frames_.status(), frames_.error());
      continue;
    }
    proto::ReplyBuffer body;
    rb_.set_buffer(&body);
    host_->Dispatch(*this, args_);
    rb_.set_buffer(&output_);
    args_.Clear();
    if (!async_pending_) WriteReplyFrame(std::move(body));
    if (output_.size() >= kEagerFlushBytes) Flush();
    limits_ = host_->LimitsFor(*this);  // AUTH may have lifted the pre-auth cap
  }
}

void Connection::AppendFrameHeader(uint16_t status, uint64_t payload_len) {
  proto::binary::FrameHeader h;
  h.command = static_cast<uint8_t>(frame_.command | proto::binary::kReplyBit);
  h.status = status;
  h.request_id = frame_.request_id;
  h.payload_len = payload_len;
  uint8_t hdr[proto::binary::kHeaderSize];
  proto::binary::EncodeHeader(h, hdr);
  output_.Append(std::string_view(reinterpret_cast<const char*>(hdr), sizeof(hdr)));
}

void Connection::WriteErrorFrame(uint16_t status, std::string_view text) {
  AppendFrameHeader(status, text.size());
  output_.Append(text);
}

void Connection::WriteReplyFrame(proto::ReplyBuffer&& body) {
  // An error reply is '-', a uint64 length and the text (ReplyBuilder, binary): the frame
  // carries the text alone, under the status its prefix names.
  uint16_t status = 0;
  char head[9 + 64];
  const size_t got = body.Peek(head, sizeof(head));
  if (got >= 9 && head[0] == '-') {
    uint64_t len;
    std::memcpy(&len, head + 1, 8);
    status =
        proto::binary::StatusOfError(std::string_view(head + 9, std::min<uint64_t>(len, got - 9)));
    body.Consume(9);
  }
  AppendFrameHeader(status, body.size());
  output_.Splice(std::move(body));
}

void Connection::CompleteAsync(proto::ReplyBuffer&& reply) {
  if (closed_) return;
  async_pending_ = false;
  if (binary()) {
    WriteReplyFrame(std::move(reply));
  } else {
    output_.Splice(std::move(reply));
  }
  Pump();
  if (!closed_) UpdateInterest();
}

void Connection::Flush() {
  while (!output_.empty()) {
    constexpr int kMaxIov = 64;
    iovec iov[kMaxIov];
    std::vector<int> fds;
    int cnt = output_.FillIovec(iov, kMaxIov, &fds);
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(cnt);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
    if (!fds.empty()) {
      // File descriptors for the client (shared-memory segments), with these bytes.
      const size_t nfds = std::min(fds.size(), kMaxPassedFds);
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      cmsghdr* cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * nfds);
    }
    ssize_t n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    loop_->NoteIo();
    if (n > 0) {
      output_.Consume(static_cast<size_t>(n));
      host_->OnNetBytes(0, static_cast<uint64_t>(n));
      last_write_progress_ = loop_->now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    Close(CloseReason::kIoError);
    return;
  }
  last_write_progress_ = loop_->now();
  if (close_after_flush_) Close(pending_close_reason_);
}

void Connection::UpdateInterest() {
  if (closed_) return;
  uint32_t want = 0;
  if (!async_pending_ && !close_after_flush_ && !paced_) want |= EPOLLIN;
  if (!output_.empty()) want |= EPOLLOUT;
  if (want != interest_) {
    interest_ = want;
    loop_->Modify(fd_, want, this);
  }
}

void Connection::Tick(Clock::time_point now) {
  if (closed_ || output_.empty()) return;
  // A client at its output limit, or one being closed, must read to make progress.
  if (output_.size() < limits_.output_limit && !close_after_flush_) return;
  auto stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_write_progress_);
  if (stalled.count() >= limits_.output_timeout_ms) {
    Close(close_after_flush_ ? pending_close_reason_ : CloseReason::kOutputLimit);
  }
}

void Connection::Close(CloseReason reason) {
  if (closed_) return;
  closed_ = true;
  loop_->Remove(fd_);
  shutdown(fd_, SHUT_RDWR);
  output_.Clear();
  host_->OnClosed(*this, reason);
}

}  // namespace pion::net
