// A blocking RESP2 client for node-to-node calls (replicating saved objects, moving slots):
// one TCP connection to a peer's --announce address, bounded timeouts on every step. Runs on
// the cluster's replication thread, never on a shard's event loop.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pion::cluster {

struct Reply {
  enum class Type { kSimple, kError, kInteger, kBulk, kNull, kArray };
  Type type = Type::kNull;
  std::string text;  // simple, error (without '-') and bulk
  int64_t integer = 0;
  std::vector<Reply> items;
};

class NodeClient {
 public:
  NodeClient(std::string addr, int timeout_ms) : addr_(std::move(addr)), timeout_ms_(timeout_ms) {}
  ~NodeClient();
  NodeClient(const NodeClient&) = delete;
  NodeClient& operator=(const NodeClient&) = delete;

  // Sends one command and reads its reply; connects (and AUTHs with `password` when it is not
  // empty) first if needed. kIo when the peer cannot be reached or the connection breaks (the
  // connection is then closed; the next call reconnects). An error reply is a Reply of kError,
  // not a failed Status.
  StatusOr<Reply> Call(const std::vector<std::string_view>& args);

  void set_password(std::string p) { password_ = std::move(p); }
  const std::string& addr() const { return addr_; }

 private:
  Status Connect();
  Status SendAll(std::string_view data);
  StatusOr<Reply> Read(int depth);
  Status Fill();  // reads more bytes into in_
  StatusOr<std::string> Line();
  void Close();

  std::string addr_;
  int timeout_ms_;
  std::string password_;
  int fd_ = -1;
  std::string in_;
  size_t pos_ = 0;
};

}  // namespace pion::cluster
