#include "proto/binary_commands.h"

#include <cstring>

namespace pion::proto::binary {
namespace {

// Reads a request's fields in order; the first failure sticks and names the field.
class FieldReader {
 public:
  FieldReader(const BufferRef& big, std::string_view payload, uint64_t max_blob, CmdArgs* out)
      : big_(big), p_(payload), max_blob_(max_blob), out_(out) {}

  template <typename T>
  bool Fixed(const char* field, T* v) {
    if (!Need(field, sizeof(T))) return false;
    std::memcpy(v, p_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }

  // A uint16-length string, appended as an argument (when append) and returned.
  bool Str(const char* field, std::string_view* s, bool append = true) {
    uint16_t n = 0;
    if (!Fixed(field, &n) || !Need(field, n)) return false;
    *s = p_.substr(pos_, n);
    pos_ += n;
    if (append) out_->AppendSmall(*s);
    return true;
  }

  // n bytes appended as one argument: a slice of the payload Buffer, or a copy.
  bool Blob(const char* field, uint64_t n) {
    if (n > max_blob_) {
      return Fail(std::string(field) + " of " + std::to_string(n) +
                  " bytes exceeds proto-max-bulk-len (" + std::to_string(max_blob_) + ")");
    }
    if (!Need(field, n)) return false;
    if (big_) {
      const size_t off =
          static_cast<size_t>(reinterpret_cast<const uint8_t*>(p_.data()) + pos_ - big_->data());
      out_->AppendSlice(big_, off, n);
    } else {
      out_->AppendSmall(p_.substr(pos_, n));
    }
    pos_ += n;
    return true;
  }
  bool Rest(const char* field) { return Blob(field, p_.size() - pos_); }
  uint64_t left() const { return p_.size() - pos_; }

  // Every byte consumed: a payload longer than its fields is malformed, not ignored.
  bool End() {
    if (pos_ == p_.size()) return true;
    return Fail("payload has " + std::to_string(p_.size() - pos_) + " bytes after its fields");
  }

  bool Fail(std::string msg) {
    if (error_.empty()) error_ = std::move(msg);
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  bool Need(const char* field, uint64_t n) {
    if (p_.size() - pos_ >= n) return true;
    return Fail("payload truncated: field '" + std::string(field) + "' needs " + std::to_string(n) +
                " bytes at offset " + std::to_string(pos_) + ", payload has " +
                std::to_string(p_.size()));
  }

  const BufferRef& big_;
  std::string_view p_;
  uint64_t max_blob_;
  CmdArgs* out_;
  size_t pos_ = 0;
  std::string error_;
};

void AppendNumber(CmdArgs* out, int64_t v) { out->AppendSmall(std::to_string(v)); }

bool DecodeFields(uint8_t code, FieldReader& r, CmdArgs* out) {
  std::string_view sid, user, pass;
  uint32_t u1 = 0, u2 = 0, u3 = 0, u4 = 0;
  int64_t i1 = 0;
  uint64_t len = 0;
  uint8_t b = 0;
  switch (code) {
    case kLayerStore:
      out->AppendSmall("SSM.PREFIX.STORE");
      if (!r.Str("sid", &sid) || !r.Fixed("layer", &u1)) return false;
      AppendNumber(out, u1);
      return r.Rest("state");
    case kLayerFetch:
      out->AppendSmall("SSM.PREFIX.FETCH");
      if (!r.Str("sid", &sid) || !r.Fixed("layer", &u1)) return false;
      AppendNumber(out, u1);
      return r.End();
    case kLayerDrop:
      out->AppendSmall("SSM.PREFIX.DROP");
      if (!r.Str("sid", &sid) || !r.Fixed("layer", &i1)) return false;
      if (i1 < -1) return r.Fail("layer must be -1 (all layers) or a layer index");
      if (i1 >= 0) AppendNumber(out, i1);
      return r.End();
    case kPing:
      out->AppendSmall("PING");
      return r.left() == 0 || r.Rest("message");
    case kAuth:
      out->AppendSmall("AUTH");
      if (!r.Str("user", &user, false) || !r.Str("password", &pass, false)) return false;
      if (!user.empty()) out->AppendSmall(user);
      out->AppendSmall(pass);
      return r.End();
    case kAttendCreate:
      out->AppendSmall("ATTEND.CREATE");
      if (!r.Str("sid", &sid) || !r.Fixed("key_dim", &u1) || !r.Fixed("value_dim", &u2) ||
          !r.Fixed("m", &u3) || !r.Fixed("ef_construction", &u4) || !r.Fixed("metric", &b)) {
        return false;
      }
      AppendNumber(out, u1);
      AppendNumber(out, u2);
      if (u3 != 0) {
        out->AppendSmall("M");
        AppendNumber(out, u3);
      }
      if (u4 != 0) {
        out->AppendSmall("EF_CONSTRUCTION");
        AppendNumber(out, u4);
      }
      if (b > 2)
        return r.Fail("metric must be 0 (ip), 1 (l2) or 2 (cos), got " + std::to_string(b));
      out->AppendSmall("METRIC");
      out->AppendSmall(b == 0 ? "ip" : b == 1 ? "l2" : "cos");
      return r.End();
    case kAttendStore:
      out->AppendSmall("ATTEND.STORE");
      if (!r.Str("sid", &sid) || !r.Fixed("start_pos", &i1) || !r.Fixed("keys_len", &len) ||
          !r.Blob("keys", len) || !r.Rest("values")) {
        return false;
      }
      if (i1 < -1) return r.Fail("start_pos must be -1 (continue) or a position");
      if (i1 >= 0) AppendNumber(out, i1);
      return true;
    case kAttendFinalize:
    case kAttendDrop:
      out->AppendSmall(code == kAttendFinalize ? "ATTEND.FINALIZE" : "ATTEND.DROP");
      return r.Str("sid", &sid) && r.End();
    case kAttendInfo:
      out->AppendSmall("ATTEND.INFO");
      if (!r.Str("sid", &sid, false)) return false;
      if (!sid.empty()) out->AppendSmall(sid);
      return r.End();
    case kAttendQuery:
      out->AppendSmall("ATTEND.QUERY");
      if (!r.Str("sid", &sid) || !r.Fixed("k", &u1) || !r.Fixed("ef", &u2) ||
          !r.Fixed("options", &b)) {
        return false;
      }
      AppendNumber(out, u1);
      if (b & ~3u) return r.Fail("options has unknown bits set: " + std::to_string(b));
      if (!r.Rest("q")) return false;
      if (u2 != 0) {
        out->AppendSmall("EF");
        AppendNumber(out, u2);
      }
      if (b & 2u) out->AppendSmall("EXACT");
      if (b & 1u) out->AppendSmall("ATTEND");
      return true;
    default:
      return r.Fail("unknown command");
  }
}

}  // namespace

std::string_view CommandName(uint8_t code) {
  switch (code) {
    case kLayerStore:
      return "LAYER.STORE";
    case kLayerFetch:
      return "LAYER.FETCH";
    case kPing:
      return "PING";
    case kAuth:
      return "AUTH";
    case kLayerDrop:
      return "LAYER.DROP";
    case kAttendCreate:
      return "ATTEND.CREATE";
    case kAttendStore:
      return "ATTEND.STORE";
    case kAttendFinalize:
      return "ATTEND.FINALIZE";
    case kAttendQuery:
      return "ATTEND.QUERY";
    case kAttendInfo:
      return "ATTEND.INFO";
    case kAttendDrop:
      return "ATTEND.DROP";
    default:
      return {};
  }
}

std::string DecodeRequest(uint8_t code, const BufferRef& big, std::string_view payload,
                          uint64_t max_blob, CmdArgs* out) {
  FieldReader r(big, payload, max_blob, out);
  if (DecodeFields(code, r, out)) return {};
  out->Clear();
  return std::string(CommandName(code)) + ": " + r.error();
}

}  // namespace pion::proto::binary
