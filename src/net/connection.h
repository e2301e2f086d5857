// Connection: one client socket served by one shard's event loop.
//
// It speaks RESP (port 1974, the Unix socket) or the 0xCA5E binary protocol (port 1975): a
// binary frame is parsed into the same command arguments, the reply is built in the typed
// binary encoding and sent in a reply frame (header, status, payload) — the pipeline between
// is shared.
//
// Bytes are received into the parser's ReadSpan (large bulk arguments land directly in their
// final Buffer), each complete command is handed to the ConnectionHost, and replies collect
// in a ReplyBuffer written with writev. A command the host forwards to another shard makes
// the connection wait (BeginAsync) and resume with CompleteAsync, so pipelined replies keep
// their order.
//
// Output is bounded: a new command is not started while pending output is at or above the
// client output limit (a fast reader of large pipelined replies is paced, not dropped), and a
// client that sits at its limit without reading for the output timeout is disconnected.
// All methods run on the owning shard's thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "net/event_loop.h"
#include "proto/binary_frame.h"
#include "proto/cmd_args.h"
#include "proto/reply_buffer.h"
#include "proto/reply_builder.h"
#include "proto/resp_parser.h"

namespace pion::net {

class Connection;

enum class CloseReason {
  kClient,
  kQuit,
  kKilled,
  kProtocol,
  kQueryLimit,
  kOutputLimit,
  kIoError,
  kShutdown
};

enum class Protocol { kResp, kBinary };

struct ConnectionLimits {
  proto::ParserLimits parser;
  uint64_t output_limit = 1ull << 30;
  int64_t output_timeout_ms = 30000;
};

class ConnectionHost {
 public:
  virtual ~ConnectionHost() = default;
  // Handles one complete command: writes the reply with conn.reply(), or calls
  // conn.BeginAsync() and later conn.CompleteAsync().
  virtual void Dispatch(Connection& conn, proto::CmdArgs& args) = 0;
  virtual ConnectionLimits LimitsFor(const Connection& conn) = 0;
  virtual void OnNetBytes(uint64_t in, uint64_t out) = 0;
  // The connection has closed its socket; the host destroys it after the current event.
  virtual void OnClosed(Connection& conn, CloseReason reason) = 0;
};

class Connection final : public EventHandler {
 public:
  using Clock = std::chrono::steady_clock;

  Connection(EventLoop* loop, ConnectionHost* host, int fd, uint64_t id,
             Protocol protocol = Protocol::kResp);
  ~Connection() override;

  bool Start();
  void OnEvent(uint32_t events) override;

  // Asynchronous completion of the command in flight (see class comment).
  void BeginAsync() { async_pending_ = true; }
  void CompleteAsync(proto::ReplyBuffer&& reply);

  // QUIT: close once the pending output is written.
  void CloseAfterReply() {
    close_after_flush_ = true;
    pending_close_reason_ = CloseReason::kQuit;
  }
  // Closes now (CLIENT KILL, shutdown, output stall).
  void Close(CloseReason reason);
  // Periodic check (the shard's tick): disconnects a client stalled at its output limit.
  void Tick(Clock::time_point now);

  proto::ReplyBuilder& reply() { return rb_; }

  // Identity and state, for the command layer and CLIENT LIST.
  uint64_t id() const { return id_; }
  int fd() const { return fd_; }
  bool closed() const { return closed_; }
  const std::string& peer() const { return peer_; }
  const std::string& local() const { return local_; }
  std::string name;
  std::string user = "default";
  uint32_t tenant = 0;
  bool authenticated = false;
  bool unix_socket = false;  // accepted on --unixsocket: a same-host client
  bool asking = false;       // cluster mode: the last command was ASKING (one command only)
  bool binary() const { return protocol_ == Protocol::kBinary; }
  std::string last_command;
  int resp_version() const { return resp_version_; }
  void set_resp_version(int v) {
    resp_version_ = v;
    rb_.set_resp_version(v);
  }
  Clock::time_point created() const { return created_; }
  Clock::time_point last_active() const { return last_active_; }
  size_t output_bytes() const { return output_.size(); }
  uint64_t query_buffer_bytes() const {
    return binary() ? frames_.buffered_bytes() : parser_.buffered_bytes();
  }
  size_t query_buffer_capacity() const {
    return binary() ? frames_.buffer_capacity() : parser_.buffer_capacity();
  }

 private:
  void ReadInput();
  // Runs buffered commands and writes replies until blocked on input, output or a forwarded
  // command; keeps going when a flush drains the output below the limit.
  void Pump();
  void ProcessInput();
  void ProcessFrames();
  // Queues the reply frame of the binary request in flight (frame_) around body: status 0 and
  // the typed reply, or the error's status and its text.
  void WriteReplyFrame(proto::ReplyBuffer&& body);
  void WriteErrorFrame(uint16_t status, std::string_view text);
  void AppendFrameHeader(uint16_t status, uint64_t payload_len);
  void Flush();
  void UpdateInterest();

  EventLoop* loop_;
  ConnectionHost* host_;
  int fd_;
  uint64_t id_;
  std::string peer_;
  std::string local_;
  Protocol protocol_;
  int resp_version_ = 2;
  proto::RespParser parser_;
  proto::binary::FrameParser frames_;
  proto::binary::FrameHeader frame_;  // the binary request being executed
  proto::CmdArgs args_;
  proto::ReplyBuffer output_;
  proto::ReplyBuilder rb_;
  ConnectionLimits limits_;
  bool async_pending_ = false;
  bool paced_ = false;  // stopped starting commands because output is at the limit
  bool close_after_flush_ = false;
  CloseReason pending_close_reason_ = CloseReason::kQuit;
  bool closed_ = false;
  uint32_t interest_ = 0;
  Clock::time_point created_;
  Clock::time_point last_active_;
  Clock::time_point last_write_progress_;
};

}  // namespace pion::net
