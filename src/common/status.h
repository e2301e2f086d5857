// Status and StatusOr: the error currency of Pion's data path (no exceptions).
//
// Every error carries one ErrorKind that maps 1:1 to a RESP error prefix, so a family
// returns a Status and the reply layer turns it into "-<PREFIX> <message>" without
// knowing which family produced it.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace pion {

enum class ErrorKind : unsigned char {
  kOk = 0,
  kErr,          // -ERR: generic client error (bad argument, unknown session, ...)
  kWrongType,    // -WRONGTYPE
  kOom,          // -OOM: a write did not fit under --maxmemory
  kBusy,         // -BUSY: a bounded queue is full; retry later
  kNoAuth,       // -NOAUTH: command needs authentication
  kWrongPass,    // -WRONGPASS
  kMismatch,     // -MISMATCH: identity fence (model/layout/generation) refused
  kNoPerm,       // -NOPERM
  kProtocol,     // -ERR Protocol error: ...; the connection is closed after replying
  kIo,           // -IOERR: the disk tier failed
  kCorrupt,      // -CORRUPT: stored bytes failed validation and are not served
  kMiss,         // -MISS: the object a computation needs is not resident (store it first)
  kDevice,       // -DEVERR: the accelerator (CUDA) failed a copy or a kernel
  kTimeout,      // -TIMEOUT: the request's deadline cannot be (or was not) met; nothing changed
  kClusterDown,  // -CLUSTERDOWN: the cluster's slot map cannot be read or changed (etcd is down)
  kReadOnly,     // -READONLY: a published (immutable) object refused a write; nothing changed
  kLast = kReadOnly,
};

// The RESP prefix for an error kind, e.g. "ERR", "OOM".
std::string_view ErrorPrefix(ErrorKind kind);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorKind kind, std::string message) : kind_(kind), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return kind_ == ErrorKind::kOk; }
  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }

  // "OOM requested 10 bytes..." — the wire form without the leading '-'.
  std::string ToString() const;

 private:
  ErrorKind kind_ = ErrorKind::kOk;
  std::string message_;
};

inline Status Error(std::string message) { return Status(ErrorKind::kErr, std::move(message)); }

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  StatusOr(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace pion
