// Server configuration: command-line flags (CLI11) and an optional TOML file (toml++) that
// uses the same names. Flags given on the command line override the file.
//
// Settings that CONFIG SET may change at run time live in RuntimeSettings as atomics, so the
// data path reads them without a lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace pion::server {

struct Config {
  std::string bind = "127.0.0.1";
  int port = 1974;
  int binary_port = 1975;  // the 0xCA5E binary protocol; 0: disabled
  std::string unixsocket;  // empty: no Unix-domain listener
  unsigned unixsocketperm = 0700;
  // Same-host data plane (on with --unixsocket).
  uint64_t shm_segment_size = 256ull << 20;
  int64_t shm_lease_ttl_ms = 30000;
  int shm_max_leases = 4096;  // per client
  int workers = 0;            // 0: number of cores
  std::string dir = "./data";
  // Host memory for stored data (the host tier); beyond it the least recently used objects are
  // demoted to disk. "auto" (the default): 3/4 of the machine's (or the cgroup's) memory;
  // 0: no limit.
  uint64_t maxmemory = 0;
  bool maxmemory_auto = true;
  // Bytes of saved and spill files under --dir (the disk tier). "auto" (the default): what is
  // there at start plus 90 % of the file system's free space; 0: no limit.
  uint64_t disk_quota = 0;
  bool disk_quota_auto = true;
  uint64_t promotion_credits = 2ull << 30;  // bytes of promotions in flight before -BUSY
  int64_t default_deadline_ms = 0;          // deadline of requests that name none; 0: none
  int metrics_port = 9174;                  // 0: disabled
  std::string requirepass;
  std::string users_file;
  uint64_t proto_max_bulk_len = 2ull << 30;
  int64_t max_multibulk_len = 1024 * 1024;
  uint64_t client_query_buffer_limit = 4ull << 30;
  uint64_t client_output_buffer_limit = 1ull << 30;
  int64_t client_output_buffer_timeout_ms = 30000;
  int maxclients = 10000;
  int shard_queue_depth = 1024;
  // After any activity a shard keeps polling (epoll without sleeping) this long before it
  // blocks: a request forwarded between shards, or its reply, then finds the other shard
  // awake instead of waiting for the scheduler to wake it. 0: block at once; −1 (default):
  // 100 µs on machines with 8 or more cores, else 0 (polling shards would take the cores
  // clients need).
  int64_t poll_us = -1;
  int io_threads = 2;
  // Stage 2 attention (ATTEND.PREFIX.*).
  std::string attention_backend = "auto";  // cpu | cuda | auto (cuda when a GPU is present)
  bool attention_fp16 = false;             // store slots as fp16 (parity with fp16 engines)
  uint64_t attention_memory = 0;           // cap on resident slots; 0 = only --maxmemory
  uint64_t gpu_memory = 0;             // cuda: GPU bytes for slots; 0 = 90% of free device memory
  int compute_threads = 0;             // 0: number of cores
  int compute_queue_depth = 256;       // queries waiting for a compute thread; then -BUSY
  uint64_t kv_cache_capacity = 10000;  // KV.STORE entries per tenant (LRU beyond)
  bool kvcache = true;
  // V.FETCH ... HEADS / AS keeps the rows it shapes as a copy of the session that later reads
  // of those rows are served from (memory for speed; CONFIG SET fetch-copies).
  bool fetch_copies = true;
  std::string loglevel = "info";
  std::string logfile;  // empty: stderr
  int64_t slowlog_log_slower_than_us = 10000;
  int64_t slowlog_max_len = 128;
  std::string config_file;
  // Cluster mode (--cluster etcd://host:port): empty runs a single node, without etcd.
  std::string cluster;
  std::string cluster_name =
      "pion";                   // the etcd key prefix /pion/<name>/: several clusters per etcd
  std::string node_id;          // this node's name in the cluster (required with --cluster)
  std::string announce;         // host:port clients reach this node at; default bind:port
  int replicas = 1;             // nodes that keep a copy of each saved object, besides its owner
  int cluster_lease_ttl_s = 5;  // a node silent this long loses its slots to its replica
};

// Parses argv (and the --config file it names). On --help/--version prints and sets
// *exit_code. Returns an error for bad flags or an unreadable config file.
StatusOr<Config> ParseConfig(int argc, char** argv, int* exit_code, bool* should_exit);

// The subset of Config that CONFIG SET changes while running.
class RuntimeSettings {
 public:
  explicit RuntimeSettings(const Config& c);

  std::atomic<uint64_t> proto_max_bulk_len;
  std::atomic<int64_t> max_multibulk_len;
  std::atomic<uint64_t> client_query_buffer_limit;
  std::atomic<uint64_t> client_output_buffer_limit;
  std::atomic<int64_t> client_output_buffer_timeout_ms;
  std::atomic<int64_t> maxclients;
  std::atomic<int64_t> slowlog_log_slower_than_us;
  std::atomic<int64_t> slowlog_max_len;
  std::atomic<bool> auth_required;
  std::atomic<bool> fetch_copies;

  std::string requirepass() const;
  void set_requirepass(std::string p);

 private:
  mutable std::mutex mu_;  // guards requirepass_ (read only by AUTH, never on the data path)
  std::string requirepass_;
};

}  // namespace pion::server
