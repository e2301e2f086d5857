#include "proto/binary_frame.h"

#include <bit>
#include <cstdio>
#include <cstring>

#include "common/status.h"
#include "proto/binary_commands.h"

namespace pion::proto::binary {
namespace {

static_assert(std::endian::native == std::endian::little, "frames are little-endian");

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string Hex(uint64_t v, int width) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%0*llX", width, static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

void EncodeHeader(const FrameHeader& h, uint8_t out[kHeaderSize]) {
  Put<uint16_t>(out, kMagic);
  out[2] = h.version;
  out[3] = h.command;
  Put<uint16_t>(out + 4, h.flags);
  Put<uint16_t>(out + 6, h.status);
  Put<uint64_t>(out + 8, h.request_id);
  Put<uint64_t>(out + 16, h.payload_len);
}

bool DecodeHeader(const uint8_t in[kHeaderSize], FrameHeader* h) {
  if (Get<uint16_t>(in) != kMagic) return false;
  h->version = in[2];
  h->command = in[3];
  h->flags = Get<uint16_t>(in + 4);
  h->status = Get<uint16_t>(in + 6);
  h->request_id = Get<uint64_t>(in + 8);
  h->payload_len = Get<uint64_t>(in + 16);
  return true;
}

uint16_t StatusOfError(std::string_view line) {
  const std::string_view prefix = line.substr(0, line.find(' '));
  for (int k = static_cast<int>(ErrorKind::kErr); k <= static_cast<int>(ErrorKind::kLast); ++k) {
    const auto kind = static_cast<ErrorKind>(k);
    if (kind != ErrorKind::kProtocol && ErrorPrefix(kind) == prefix)
      return static_cast<uint16_t>(k);
  }
  return static_cast<uint16_t>(ErrorKind::kErr);
}

FrameParser::FrameParser(BufferAllocator* alloc) : alloc_(alloc) {}

std::span<uint8_t> FrameParser::ReadSpan() {
  return in_.ReadSpan(state_ == State::kBig ? big_.get() : nullptr, &big_filled_);
}

void FrameParser::CommitRead(size_t n) { in_.CommitRead(n); }

FrameParser::Result FrameParser::Fail(FrameStatus status, std::string message) {
  status_ = static_cast<uint16_t>(status);
  error_ = std::move(message);
  big_.reset();
  return Result::kError;
}

FrameParser::Result FrameParser::Reject(uint16_t status, std::string message) {
  status_ = status;
  error_ = std::move(message);
  return Result::kReject;
}

FrameParser::Result FrameParser::Next(CmdArgs* out) {
  while (true) {
    switch (state_) {
      case State::kHeader: {
        if (in_.avail() < kHeaderSize) return Result::kNeedMore;
        const uint8_t* p = in_.data();
        if (!DecodeHeader(p, &header_)) {
          header_ = FrameHeader{};
          return Fail(FrameStatus::kBadFrame, "bad magic " + Hex(Get<uint16_t>(p), 4) +
                                                  " (frames start with 0xCA5E, bytes 5E CA)");
        }
        if (header_.version != kVersion) {
          return Fail(FrameStatus::kBadVersion,
                      "unsupported protocol version " + std::to_string(header_.version) +
                          " (this server speaks version " + std::to_string(kVersion) + ")");
        }
        const uint64_t limit =
            limits_.authenticated ? limits_.query_buffer_limit : limits_.unauth_max_bulk_len;
        if (header_.payload_len > limit) {
          return Fail(FrameStatus::kTooLarge,
                      "frame payload of " + std::to_string(header_.payload_len) +
                          " bytes exceeds " +
                          (limits_.authenticated
                               ? "the client query buffer limit of " + std::to_string(limit)
                               : "the limit of " + std::to_string(limit) + " before AUTH"));
        }
        in_.Consume(kHeaderSize);
        // A frame that cannot run is skipped without storing its payload.
        skip_status_ = 0;
        if (CommandName(header_.command).empty()) {
          skip_status_ = static_cast<uint16_t>(FrameStatus::kUnknownCommand);
          skip_error_ = "unknown command " + Hex(header_.command, 2);
        } else if (header_.flags != 0) {
          skip_status_ = static_cast<uint16_t>(FrameStatus::kBadFrame);
          skip_error_ = "flags must be 0 in protocol version 1, got " + Hex(header_.flags, 4);
        } else if (header_.status != 0) {
          skip_status_ = static_cast<uint16_t>(FrameStatus::kBadFrame);
          skip_error_ = "status must be 0 in a request, got " + std::to_string(header_.status);
        }
        if (skip_status_ != 0) {
          skip_left_ = header_.payload_len;
          state_ = State::kSkip;
          continue;
        }
        if (header_.payload_len < limits_.big_arg_threshold) {
          state_ = State::kSmall;
          continue;
        }
        auto b = alloc_->Allocate(header_.payload_len);
        if (!b.ok()) {
          return Fail(FrameStatus::kTooLarge, "cannot allocate " +
                                                  std::to_string(header_.payload_len) +
                                                  " bytes for a frame payload");
        }
        big_ = std::move(b).value();
        big_filled_ = std::min<uint64_t>(in_.avail(), header_.payload_len);
        std::memcpy(big_->data(), in_.data(), big_filled_);
        in_.Consume(big_filled_);
        state_ = State::kBig;
        continue;
      }
      case State::kSkip: {
        const uint64_t n = std::min<uint64_t>(in_.avail(), skip_left_);
        in_.Consume(n);
        skip_left_ -= n;
        if (skip_left_ > 0) return Result::kNeedMore;
        state_ = State::kHeader;
        return Reject(skip_status_, std::move(skip_error_));
      }
      case State::kSmall: {
        if (in_.avail() < header_.payload_len) return Result::kNeedMore;
        const uint8_t* p = in_.data();
        in_.Consume(header_.payload_len);
        state_ = State::kHeader;
        return Decode(nullptr, p, out);
      }
      case State::kBig: {
        if (big_filled_ < big_->size()) return Result::kNeedMore;
        BufferRef payload = std::move(big_);
        state_ = State::kHeader;
        return Decode(payload, payload->data(), out);
      }
    }
  }
}

FrameParser::Result FrameParser::Decode(const BufferRef& big, const uint8_t* payload,
                                        CmdArgs* out) {
  std::string err =
      DecodeRequest(header_.command, big,
                    std::string_view(reinterpret_cast<const char*>(payload), header_.payload_len),
                    limits_.max_bulk_len, out);
  if (!err.empty()) return Reject(static_cast<uint16_t>(FrameStatus::kBadFrame), std::move(err));
  status_ = 0;
  error_.clear();
  return Result::kCommand;
}

}  // namespace pion::proto::binary
