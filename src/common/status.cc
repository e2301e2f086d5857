#include "common/status.h"

namespace pion {

std::string_view ErrorPrefix(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kOk:
      return "";
    case ErrorKind::kErr:
      return "ERR";
    case ErrorKind::kWrongType:
      return "WRONGTYPE";
    case ErrorKind::kOom:
      return "OOM";
    case ErrorKind::kBusy:
      return "BUSY";
    case ErrorKind::kNoAuth:
      return "NOAUTH";
    case ErrorKind::kWrongPass:
      return "WRONGPASS";
    case ErrorKind::kMismatch:
      return "MISMATCH";
    case ErrorKind::kNoPerm:
      return "NOPERM";
    case ErrorKind::kProtocol:
      return "ERR";
    case ErrorKind::kIo:
      return "IOERR";
    case ErrorKind::kCorrupt:
      return "CORRUPT";
    case ErrorKind::kMiss:
      return "MISS";
    case ErrorKind::kDevice:
      return "DEVERR";
    case ErrorKind::kTimeout:
      return "TIMEOUT";
    case ErrorKind::kClusterDown:
      return "CLUSTERDOWN";
    case ErrorKind::kReadOnly:
      return "READONLY";
  }
  return "ERR";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(ErrorPrefix(kind_));
  out += ' ';
  if (kind_ == ErrorKind::kProtocol) out += "Protocol error: ";
  out += message_;
  return out;
}

}  // namespace pion
