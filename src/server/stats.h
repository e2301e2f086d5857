// Counters for INFO and /metrics. Each shard owns its own ShardStats and is its only writer;
// readers on other threads (INFO, the metrics endpoint) sum them with relaxed loads.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>
#include <vector>

namespace pion::server {

// Single-writer counter: a relaxed load+store (no locked instruction on the hot path).
inline void Bump(std::atomic<uint64_t>& c, uint64_t n = 1) {
  c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}
inline uint64_t Read(const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); }

// Why a request or connection was refused. Bounded label set for metrics.
enum class RejectReason : int {
  kUnknownCommand,
  kArity,
  kNoAuth,
  kWrongPass,
  kProtocol,
  kQueryBufferLimit,
  kOutputBufferLimit,
  kBusy,
  kOom,
  kMaxClients,
  kKvCacheDisabled,
  kTimeout,  // a request's deadline could not be met
  kCount
};
std::string_view RejectReasonName(RejectReason r);

// What a KV.PREFIX.LOOKUP answered (the hit rate is hit / all).
enum class PrefixLookup : int { kHit, kMiss, kMismatch, kCount };
inline std::string_view PrefixLookupName(PrefixLookup r) {
  return r == PrefixLookup::kHit ? "hit" : r == PrefixLookup::kMiss ? "miss" : "mismatch";
}

// Latency histogram bucket upper bounds in microseconds (+Inf is the last bucket).
inline constexpr std::array<uint64_t, 19> kLatencyBucketsUs = {
    10,    25,    50,     100,    250,    500,     1000,    2500,    5000,    10000,
    25000, 50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000};

struct CommandStats {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> failed{0};    // replied with an error
  std::atomic<uint64_t> rejected{0};  // refused before running (arity, auth, busy, ...)
  std::atomic<uint64_t> usec{0};
  std::array<std::atomic<uint64_t>, kLatencyBucketsUs.size() + 1> buckets{};

  void Record(uint64_t us, bool error);
};

struct ShardStats {
  explicit ShardStats(size_t n_commands) : commands(n_commands) {}
  std::atomic<uint64_t> net_input_bytes{0};
  std::atomic<uint64_t> net_output_bytes{0};
  std::atomic<uint64_t> connections_received{0};
  std::atomic<uint64_t> connected_clients{0};
  std::atomic<uint64_t> commands_processed{0};
  std::atomic<uint64_t> forwarded_commands{0};  // handed to another shard
  std::array<std::atomic<uint64_t>, static_cast<int>(RejectReason::kCount)> rejected{};
  std::vector<CommandStats> commands;
  // KV.PREFIX.LOOKUP answers per tenant (a bounded label set: tenants past the first
  // kLookupTenants share the last row, "other"), by PrefixLookup.
  static constexpr size_t kLookupTenants = 64;
  std::array<std::array<std::atomic<uint64_t>, static_cast<int>(PrefixLookup::kCount)>,
             kLookupTenants + 1>
      prefix_lookups{};

  void Reject(RejectReason r) { Bump(rejected[static_cast<int>(r)]); }
  void CountLookup(uint32_t tenant, PrefixLookup r) {
    Bump(prefix_lookups[std::min<size_t>(tenant, kLookupTenants)][static_cast<int>(r)]);
  }
};

}  // namespace pion::server
