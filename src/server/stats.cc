#include "server/stats.h"

namespace pion::server {

std::string_view RejectReasonName(RejectReason r) {
  switch (r) {
    case RejectReason::kUnknownCommand:
      return "unknown_command";
    case RejectReason::kArity:
      return "wrong_arity";
    case RejectReason::kNoAuth:
      return "noauth";
    case RejectReason::kWrongPass:
      return "wrongpass";
    case RejectReason::kProtocol:
      return "protocol_error";
    case RejectReason::kQueryBufferLimit:
      return "query_buffer_limit";
    case RejectReason::kOutputBufferLimit:
      return "output_buffer_limit";
    case RejectReason::kBusy:
      return "busy";
    case RejectReason::kOom:
      return "oom";
    case RejectReason::kMaxClients:
      return "maxclients";
    case RejectReason::kKvCacheDisabled:
      return "kvcache_disabled";
    case RejectReason::kTimeout:
      return "timeout";
    case RejectReason::kCount:
      break;
  }
  return "other";
}

void CommandStats::Record(uint64_t us, bool error) {
  Bump(calls);
  Bump(usec, us);
  if (error) Bump(failed);
  size_t b = 0;
  while (b < kLatencyBucketsUs.size() && us > kLatencyBucketsUs[b]) ++b;
  Bump(buckets[b]);
}

}  // namespace pion::server
