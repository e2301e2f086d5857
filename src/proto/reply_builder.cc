#include "proto/reply_builder.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace pion::proto {
namespace {
// Below this a bulk is copied: a reference chunk costs more than copying a few KiB.
constexpr size_t kRefThreshold = 16 * 1024;

// Binary encoding: a type byte and an 8-byte little-endian value (x86-64 and AArch64 are
// little-endian; the static_assert keeps it honest).
static_assert(std::endian::native == std::endian::little, "binary replies assume little-endian");
void AppendTyped(ReplyBuffer* out, char type, const void* v8) {
  char buf[9];
  buf[0] = type;
  std::memcpy(buf + 1, v8, 8);
  out->Append(std::string_view(buf, 9));
}
}  // namespace

void ReplyBuilder::Header(char type, uint64_t n) {
  if (binary_) {
    AppendTyped(out_, type, &n);
    return;
  }
  char buf[32];
  buf[0] = type;
  auto r = std::to_chars(buf + 1, buf + sizeof(buf) - 2, n);
  *r.ptr++ = '\r';
  *r.ptr++ = '\n';
  out_->Append(std::string_view(buf, r.ptr - buf));
}

void ReplyBuilder::SimpleString(std::string_view s) {
  if (binary_) {
    Header('+', s.size());
  } else {
    out_->Append('+');
  }
  out_->Append(s);
  End();
}

void ReplyBuilder::Error(const Status& status) { ErrorLine(status.ToString()); }

void ReplyBuilder::ErrorLine(std::string_view line) {
  ++errors_;
  if (binary_) {  // length-prefixed: any byte may travel
    Header('-', line.size());
    out_->Append(line);
    return;
  }
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
  if (binary_) {
    AppendTyped(out_, ':', &v);
    return;
  }
  char buf[32];
  buf[0] = ':';
  auto r = std::to_chars(buf + 1, buf + sizeof(buf) - 2, v);
  *r.ptr++ = '\r';
  *r.ptr++ = '\n';
  out_->Append(std::string_view(buf, r.ptr - buf));
}

void ReplyBuilder::Double(double v) { Double(v, -1); }

void ReplyBuilder::Double(double v, int decimals) {
  if (binary_) {
    if (decimals >= 0 && std::isfinite(v)) {
      const double scale = std::pow(10.0, decimals);
      v = std::round(v * scale) / scale;
    }
    AppendTyped(out_, ',', &v);
    return;
  }
  char buf[400];
  int n;
  if (std::isinf(v)) {
    n = std::snprintf(buf, sizeof(buf), "%s", v > 0 ? "inf" : "-inf");
  } else if (decimals < 0 || std::isnan(v) || std::fabs(v) >= 1e18) {
    n = std::snprintf(buf, sizeof(buf), "%.17g", v);
  } else {
    n = std::snprintf(buf, sizeof(buf), "%.*f", std::min(decimals, 12), v);
    if (std::memchr(buf, '.', static_cast<size_t>(n)) != nullptr) {
      while (n > 1 && buf[n - 1] == '0') --n;
      if (buf[n - 1] == '.') --n;
    }
    if (n == 2 && buf[0] == '-' && buf[1] == '0') {  // a tiny negative rounds to 0, not -0
      buf[0] = '0';
      n = 1;
    }
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
  if (binary_) {
    out_->Append(v ? std::string_view("#\x01", 2) : std::string_view("#\x00", 2));
  } else if (resp3_) {
    out_->Append(v ? "#t\r\n" : "#f\r\n");
  } else {
    out_->Append(v ? ":1\r\n" : ":0\r\n");
  }
}

void ReplyBuilder::Bulk(std::string_view s) {
  Header('$', s.size());
  out_->Append(s);
  End();
}

void ReplyBuilder::BulkRef(const BufferRef& buf, const uint8_t* p, size_t len) {
  if (len < kRefThreshold) {
    Bulk(std::string_view(reinterpret_cast<const char*>(p), len));
    return;
  }
  Header('$', len);
  out_->AppendRef(buf, p, len);
  End();
}

void ReplyBuilder::BulkPiece(const BufferRef& buf, const uint8_t* p, size_t len) {
  if (len < kRefThreshold) {
    out_->Append(std::string_view(reinterpret_cast<const char*>(p), len));
  } else {
    out_->AppendRef(buf, p, len);
  }
}

void ReplyBuilder::Null() {
  if (binary_) {
    out_->Append('_');
  } else {
    out_->Append(resp3_ ? "_\r\n" : "$-1\r\n");
  }
}
void ReplyBuilder::NullArray() {
  if (binary_) {
    out_->Append('_');
  } else {
    out_->Append(resp3_ ? "_\r\n" : "*-1\r\n");
  }
}
void ReplyBuilder::Array(size_t n) { Header('*', n); }
void ReplyBuilder::Map(size_t n) {
  if (resp3_ || binary_) {
    Header('%', n);
  } else {
    Header('*', 2 * n);
  }
}
void ReplyBuilder::Set(size_t n) { Header(resp3_ || binary_ ? '~' : '*', n); }

void ReplyBuilder::Verbatim(std::string_view txt) {
  if (!resp3_) {  // RESP2 and binary: a bulk
    Bulk(txt);
    return;
  }
  Header('=', txt.size() + 4);
  out_->Append("txt:");
  out_->Append(txt);
  out_->Append("\r\n");
}

}  // namespace pion::proto
