#include "proto/reply_builder.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace pion::proto {
namespace {
// Below this a bulk is copied: a reference chunk costs more than copying a few KiB.
constexpr size_t kRefThreshold = 16 * 1024;
}  // namespace

void ReplyBuilder::Header(char type, uint64_t n) {
  char buf[32];
  buf[0] = type;
  auto r = std::to_chars(buf + 1, buf + sizeof(buf) - 2, n);
  *r.ptr++ = '\r';
  *r.ptr++ = '\n';
  out_->Append(std::string_view(buf, r.ptr - buf));
}

void ReplyBuilder::SimpleString(std::string_view s) {
  out_->Append('+');
  out_->Append(s);
  out_->Append("\r\n");
}

void ReplyBuilder::Error(const Status& status) { ErrorLine(status.ToString()); }

void ReplyBuilder::ErrorLine(std::string_view line) {
  ++errors_;
  out_->Append('-');
  if (line.find_first_of("\r\n") == std::string_view::npos) {
    out_->Append(line);
  } else {
    std::string clean(line);
    for (char& c : clean) {
      if (c == '\r' || c == '\n') c = ' ';
    }
    out_->Append(clean);
  }
  out_->Append("\r\n");
}

void ReplyBuilder::Integer(int64_t v) {
  char buf[32];
  buf[0] = ':';
  auto r = std::to_chars(buf + 1, buf + sizeof(buf) - 2, v);
  *r.ptr++ = '\r';
  *r.ptr++ = '\n';
  out_->Append(std::string_view(buf, r.ptr - buf));
}

void ReplyBuilder::Double(double v) {
  char buf[64];
  int n;
  if (std::isinf(v)) {
    n = std::snprintf(buf, sizeof(buf), "%s", v > 0 ? "inf" : "-inf");
  } else {
    n = std::snprintf(buf, sizeof(buf), "%.17g", v);
  }
  if (resp3_) {
    out_->Append(',');
    out_->Append(std::string_view(buf, n));
    out_->Append("\r\n");
  } else {
    Bulk(std::string_view(buf, n));
  }
}

void ReplyBuilder::Bool(bool v) {
  if (resp3_) {
    out_->Append(v ? "#t\r\n" : "#f\r\n");
  } else {
    out_->Append(v ? ":1\r\n" : ":0\r\n");
  }
}

void ReplyBuilder::Bulk(std::string_view s) {
  Header('$', s.size());
  out_->Append(s);
  out_->Append("\r\n");
}

void ReplyBuilder::BulkRef(const BufferRef& buf, const uint8_t* p, size_t len) {
  if (len < kRefThreshold) {
    Bulk(std::string_view(reinterpret_cast<const char*>(p), len));
    return;
  }
  Header('$', len);
  out_->AppendRef(buf, p, len);
  out_->Append("\r\n");
}

void ReplyBuilder::BulkPiece(const BufferRef& buf, const uint8_t* p, size_t len) {
  if (len < kRefThreshold) {
    out_->Append(std::string_view(reinterpret_cast<const char*>(p), len));
  } else {
    out_->AppendRef(buf, p, len);
  }
}

void ReplyBuilder::Null() { out_->Append(resp3_ ? "_\r\n" : "$-1\r\n"); }
void ReplyBuilder::NullArray() { out_->Append(resp3_ ? "_\r\n" : "*-1\r\n"); }
void ReplyBuilder::Array(size_t n) { Header('*', n); }
void ReplyBuilder::Map(size_t n) {
  if (resp3_) {
    Header('%', n);
  } else {
    Header('*', 2 * n);
  }
}
void ReplyBuilder::Set(size_t n) { Header(resp3_ ? '~' : '*', n); }

void ReplyBuilder::Verbatim(std::string_view txt) {
  if (!resp3_) {
    Bulk(txt);
    return;
  }
  Header('=', txt.size() + 4);
  out_->Append("txt:");
  out_->Append(txt);
  out_->Append("\r\n");
}

}  // namespace pion::proto
