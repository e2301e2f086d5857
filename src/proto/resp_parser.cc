#include "proto/resp_parser.h"

#include <cstring>

#include "common/bytes.h"

namespace pion::proto {
namespace {

bool IsHex(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }
int HexVal(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return c - 'A' + 10;
}
bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

}  // namespace

RespParser::RespParser(BufferAllocator* alloc) : alloc_(alloc) {}

std::span<uint8_t> RespParser::ReadSpan() {
  return in_.ReadSpan(state_ == State::kBigBulk ? big_.get() : nullptr, &big_filled_);
}

void RespParser::CommitRead(size_t n) { in_.CommitRead(n); }

uint64_t RespParser::buffered_bytes() const {
  uint64_t n = in_.avail() + pending_.bytes();
  if (big_) n += big_->size();
  return n;
}

RespParser::Result RespParser::Fail(ErrorReason reason, std::string message) {
  reason_ = reason;
  error_ = std::move(message);
  return Result::kError;
}

int64_t RespParser::FindLine() const {
  const void* cr = std::memchr(in_.chars(), '\r', in_.avail());
  if (cr == nullptr) return -1;
  size_t len = static_cast<const char*>(cr) - in_.chars();
  if (len + 1 >= in_.avail()) return -1;  // '\n' not yet received
  return static_cast<int64_t>(len);
}

bool RespParser::SplitInline(std::string_view line, CmdArgs* out) {
  size_t i = 0;
  const size_t n = line.size();
  std::string cur;
  while (true) {
    while (i < n && IsSpace(line[i])) ++i;
    if (i >= n) return true;
    cur.clear();
    bool in_dq = false, in_sq = false, done = false;
    while (!done) {
      if (in_dq) {
        if (i >= n) return false;
        char c = line[i];
        if (c == '\\' && i + 3 < n && line[i + 1] == 'x' && IsHex(line[i + 2]) &&
            IsHex(line[i + 3])) {
          cur += static_cast<char>(HexVal(line[i + 2]) * 16 + HexVal(line[i + 3]));
          i += 3;
        } else if (c == '\\' && i + 1 < n) {
          char e = line[++i];
          switch (e) {
            case 'n':
              cur += '\n';
              break;
            case 'r':
              cur += '\r';
              break;
            case 't':
              cur += '\t';
              break;
            case 'b':
              cur += '\b';
              break;
            case 'a':
              cur += '\a';
              break;
            default:
              cur += e;
              break;
          }
        } else if (c == '"') {
          // A closing quote must be followed by a space or the end.
          if (i + 1 < n && !IsSpace(line[i + 1])) return false;
          done = true;
        } else {
          cur += c;
        }
      } else if (in_sq) {
        if (i >= n) return false;
        char c = line[i];
        if (c == '\\' && i + 1 < n && line[i + 1] == '\'') {
          cur += '\'';
          ++i;
        } else if (c == '\'') {
          if (i + 1 < n && !IsSpace(line[i + 1])) return false;
          done = true;
        } else {
          cur += c;
        }
      } else {
        if (i >= n) {
          done = true;
          break;
        }
        char c = line[i];
        if (IsSpace(c)) {
          done = true;
        } else if (c == '"') {
          in_dq = true;
        } else if (c == '\'') {
          in_sq = true;
        } else {
          cur += c;
        }
      }
      if (i < n) ++i;
    }
    out->AppendSmall(cur);
  }
}

RespParser::Result RespParser::Next(CmdArgs* out) {
  if (reason_ != ErrorReason::kNone) return Result::kError;
  while (true) {
    switch (state_) {
      case State::kIdle: {
        if (in_.avail() == 0) {
          in_.Reset();
          return Result::kNeedMore;
        }
        if (*in_.chars() == '*') {
          int64_t len = FindLine();
          if (len < 0) {
            if (in_.avail() > limits_.max_inline_len) {
              return Fail(ErrorReason::kProtocol, "too big mbulk count string");
            }
            return Result::kNeedMore;
          }
          int64_t count = 0;
          if (!ParseInt64(std::string_view(in_.chars() + 1, len - 1), &count) ||
              count > limits_.max_multibulk_len) {
            return Fail(ErrorReason::kProtocol, "invalid multibulk length");
          }
          if (!limits_.authenticated && count > limits_.unauth_max_multibulk_len) {
            return Fail(ErrorReason::kProtocol, "unauthenticated multibulk length");
          }
          in_.Consume(len + 2);
          if (count <= 0) continue;  // "*0" and "*-1" are empty requests, skipped
          pending_.Clear();
          pending_.Reserve(static_cast<size_t>(count < 64 ? count : 64));
          args_left_ = count;
          state_ = State::kArgHeader;
          continue;
        }
        // Inline command: one line terminated by '\n'.
        const void* nl = std::memchr(in_.chars(), '\n', in_.avail());
        if (nl == nullptr) {
          if (in_.avail() > limits_.max_inline_len) {
            return Fail(ErrorReason::kProtocol, "too big inline request");
          }
          return Result::kNeedMore;
        }
        size_t len = static_cast<const char*>(nl) - in_.chars();
        if (len > limits_.max_inline_len) {
          return Fail(ErrorReason::kProtocol, "too big inline request");
        }
        std::string_view line(in_.chars(), len);
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        out->Clear();
        if (!SplitInline(line, out)) {
          return Fail(ErrorReason::kProtocol, "unbalanced quotes in request");
        }
        in_.Consume(len + 1);
        if (!limits_.authenticated &&
            static_cast<int64_t>(out->size()) > limits_.unauth_max_multibulk_len) {
          return Fail(ErrorReason::kProtocol, "unauthenticated multibulk length");
        }
        if (out->empty()) continue;  // blank line
        return Result::kCommand;
      }
      case State::kArgHeader: {
        if (in_.avail() == 0) return Result::kNeedMore;
        if (*in_.chars() != '$') {
          char c = *in_.chars();
          return Fail(ErrorReason::kProtocol, std::string("expected '$', got '") + c + "'");
        }
        int64_t len = FindLine();
        if (len < 0) {
          if (in_.avail() > limits_.max_inline_len) {
            return Fail(ErrorReason::kProtocol, "too big bulk count string");
          }
          return Result::kNeedMore;
        }
        int64_t blen = 0;
        if (!ParseInt64(std::string_view(in_.chars() + 1, len - 1), &blen) || blen < 0 ||
            static_cast<uint64_t>(blen) > limits_.max_bulk_len) {
          return Fail(ErrorReason::kProtocol, "invalid bulk length");
        }
        if (!limits_.authenticated && static_cast<uint64_t>(blen) > limits_.unauth_max_bulk_len) {
          return Fail(ErrorReason::kProtocol, "unauthenticated bulk length");
        }
        in_.Consume(len + 2);
        bulk_len_ = static_cast<uint64_t>(blen);
        // The command's arguments so far plus this one (bytes already buffered for this bulk
        // are part of bulk_len_; bytes after it belong to later commands).
        if (pending_.bytes() + bulk_len_ > limits_.query_buffer_limit) {
          return Fail(ErrorReason::kQueryBufferLimit,
                      "query buffer limit of " + std::to_string(limits_.query_buffer_limit) +
                          " bytes exceeded (" + std::to_string(pending_.bytes() + bulk_len_) +
                          " bytes in command)");
        }
        if (bulk_len_ >= limits_.big_arg_threshold) {
          auto buf = alloc_->Allocate(bulk_len_);
          if (!buf.ok()) return Fail(ErrorReason::kOutOfMemory, buf.status().message());
          big_ = std::move(buf).value();
          big_filled_ = 0;
          state_ = State::kBigBulk;
        } else {
          state_ = State::kSmallBulk;
        }
        continue;
      }
      case State::kSmallBulk: {
        if (in_.avail() < bulk_len_ + 2) return Result::kNeedMore;
        if (in_.chars()[bulk_len_] != '\r' || in_.chars()[bulk_len_ + 1] != '\n') {
          return Fail(ErrorReason::kProtocol, "expected CRLF after bulk data");
        }
        pending_.AppendSmall(std::string_view(in_.chars(), bulk_len_));
        in_.Consume(bulk_len_ + 2);
        break;  // argument complete
      }
      case State::kBigBulk: {
        uint64_t want = big_->size() - big_filled_;
        uint64_t take = want < in_.avail() ? want : in_.avail();
        if (take > 0) {
          std::memcpy(big_->data() + big_filled_, in_.chars(), take);
          big_filled_ += take;
          in_.Consume(take);
        }
        if (big_filled_ < big_->size()) return Result::kNeedMore;
        state_ = State::kBigBulkCrlf;
        continue;
      }
      case State::kBigBulkCrlf: {
        if (in_.avail() < 2) return Result::kNeedMore;
        if (in_.chars()[0] != '\r' || in_.chars()[1] != '\n') {
          return Fail(ErrorReason::kProtocol, "expected CRLF after bulk data");
        }
        in_.Consume(2);
        pending_.AppendBuffer(std::move(big_));
        big_.reset();
        break;  // argument complete
      }
    }
    // An argument completed.
    if (--args_left_ > 0) {
      state_ = State::kArgHeader;
      continue;
    }
    state_ = State::kIdle;
    std::swap(*out, pending_);
    pending_.Clear();
    return Result::kCommand;
  }
}

}  // namespace pion::proto
