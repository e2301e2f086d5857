// Server: owns the shards, the command table, settings, users, memory accounting, the slow
// log and the metrics endpoint, and runs the command pipeline that every request goes
// through (lookup → auth → arity → feature gate → route to the owning shard → execute →
// stats/slowlog).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attention/counters.h"
#include "residency/engine.h"
#include "server/auth.h"
#include "server/cluster_routing.h"
#include "server/command.h"
#include "server/config.h"
#include "server/memory.h"
#include "server/shard.h"
#include "server/shm_plane.h"
#include "server/slowlog.h"
#include "server/worker_pool.h"
#include "store/semantic_cache.h"

namespace pion::server {

class MetricsHttp;

// pion-server's exit status, one per class of start-up error (docs/OPERATIONS.md § Exit codes).
enum ExitCode : int {
  kExitOk = 0,        // SHUTDOWN, SIGTERM/SIGINT, --help, --version
  kExitInternal = 1,  // anything not below
  kExitUsage = 2,     // a flag, the config file or the users file is wrong
  kExitLogFile = 3,   // --logfile cannot be opened
  kExitListen = 4,    // a port or the Unix socket cannot be listened on
  kExitGpu = 5,       // --attention-backend cuda without a usable CUDA device
  kExitDataDir = 6,   // --dir: the disk tier cannot be opened or its saved objects loaded
  kExitCluster = 7,   // --cluster: etcd cannot be reached or the node cannot join
};

class Server {
 public:
  explicit Server(Config config);
  ~Server();

  // Registers families, loads users, opens listeners. Must succeed before Run(); on failure
  // init_exit_code() is the class of the error (ExitCode).
  Status Init();
  int init_exit_code() const { return init_exit_; }
  // Starts shards and the metrics endpoint; blocks until SHUTDOWN or SIGINT/SIGTERM.
  // Returns the process exit code.
  int Run();
  // Thread-safe.
  void RequestShutdown();
  bool shutting_down() const { return shutdown_.load(std::memory_order_acquire); }

  const Config& config() const { return config_; }
  RuntimeSettings& settings() { return settings_; }
  CommandRegistry& registry() { return registry_; }
  MemoryAccountant& memory() { return memory_; }
  UserTable& users() { return users_; }
  SlowLog& slowlog() { return slowlog_; }
  int shard_count() const { return static_cast<int>(shards_.size()); }
  Shard& shard(int i) { return *shards_[i]; }
  int port() const { return bound_port_; }
  int binary_port() const { return bound_binary_port_; }
  size_t shard_queue_depth() const { return shards_.empty() ? 0 : shards_[0]->queue_depth(); }
  std::chrono::steady_clock::time_point start_time() const { return start_time_; }

  // The shard that owns `key` for `tenant`. A key containing "{tag}" is routed by the tag
  // alone (Redis hash tags), so related keys can be placed on one shard.
  int OwnerOf(uint32_t tenant, std::string_view key) const;

  // Blocking disk work (--io-threads). Null until Init().
  WorkerPool* io() { return io_.get(); }
  // The residency engine: every family's objects over the GPU, host and disk tiers. Null
  // until Init().
  residency::Engine* residency() { return engine_.get(); }
  // The MemoryAccountant family an engine family charges.
  static MemFamily MemFamilyOf(residency::Family f);
  // Attention queries (--compute-threads). Null until Init().
  WorkerPool* compute() { return compute_.get(); }
  attention::Counters& attention_counters() { return attention_counters_; }
  // --attention-backend as resolved by Init(): true when slots compute on the GPU (cuda); the
  // residency engine then has a GPU tier (--gpu-memory).
  bool gpu_attention() const { return gpu_attention_; }
  std::string_view attention_backend() const { return gpu_attention_ ? "cuda" : "cpu"; }
  // KV.STORE / KV.FETCH entries (set by their family at registration).
  store::SemanticCache* kv_cache() { return kv_cache_.get(); }
  void set_kv_cache(std::unique_ptr<store::SemanticCache> c) { kv_cache_ = std::move(c); }
  // Charges GPU bytes outside slots (block summaries) against --gpu-memory.
  const ByteBudget* gpu_budget() { return engine_->gpu_extra_budget(); }
  // The same-host data plane (enabled with --unixsocket).
  ShmPlane& shm() { return *shm_; }

  // Families add start-up work (loading the disk tier) that runs in Init() after the shards
  // exist and before any of them runs, on the main thread.
  // A failing hook stops the start with `exit_code`.
  void AddStartupHook(std::function<Status(Server&)> hook, int exit_code = kExitDataDir) {
    startup_.push_back({std::move(hook), exit_code});
  }
  // Work that runs in Run() once shutdown is requested, while the shards still run (stopping
  // threads that post to them), in the order added.
  void AddShutdownHook(std::function<void()> hook) { shutdown_hooks_.push_back(std::move(hook)); }
  // Work that runs in Run() after every shard stopped (their stores are quiet and may be read
  // from the main thread), before the worker pools go: e.g. the log of what the exit drops.
  void AddExitHook(std::function<void(Server&)> hook) { exit_hooks_.push_back(std::move(hook)); }

  // SHUTDOWN SAVE pauses writes while it saves (so what it saved is everything): commands
  // flagged `write` are refused with -BUSY meanwhile. Thread-safe.
  void PauseWrites(bool on) { writes_paused_.store(on, std::memory_order_release); }
  bool writes_paused() const { return writes_paused_.load(std::memory_order_acquire); }

  // Cluster mode (--cluster): the slot routing the dispatcher applies before a command runs
  // (-MOVED, -ASK, -CROSSSLOT). Null for a single node. Set at registration, before Init().
  ClusterRouting* cluster() { return cluster_.get(); }
  void set_cluster(std::unique_ptr<ClusterRouting> c) { cluster_ = std::move(c); }

  uint64_t NextClientId() { return next_client_id_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t connected_clients() const;

  // The command pipeline. Runs on the connection's shard.
  void Dispatch(Shard& shard, net::Connection& conn, proto::CmdArgs& args);

  // Runs `query` on every shard (as control tasks), then `done` with the per-shard results
  // on the connection's shard, which writes the reply. The connection waits meanwhile.
  using ShardQuery = std::function<std::string(Shard&)>;
  using FanOutDone = std::function<void(std::vector<std::string>&, proto::ReplyBuilder&)>;
  void FanOut(Shard& origin, net::Connection& conn, ShardQuery query, FanOutDone done);

  // Families call this while registering to set up their per-shard state (budgets, ...).
  // Hooks run in Init() once per shard, before the shard's thread starts.
  void AddShardInit(std::function<void(Shard&)> hook) { shard_inits_.push_back(std::move(hook)); }

  // Disk-tier counters for INFO persistence (any thread).
  struct DiskStats {
    std::atomic<uint64_t> objects_loaded{0};
    std::atomic<uint64_t> objects_corrupt{0};
    std::atomic<uint64_t> saves{0};
    std::atomic<uint64_t> save_failures{0};
    std::atomic<uint64_t> warms{0};
  };
  DiskStats& disk_stats() { return disk_stats_; }

  // Sum of a per-shard counter.
  uint64_t SumStat(const std::function<uint64_t(const ShardStats&)>& f) const;

 private:
  // Returns true when the handler deferred its reply (CommandContext::Defer).
  bool Execute(const CommandSpec& spec, Shard& shard, net::Connection* conn, uint32_t tenant,
               uint64_t client_id, int origin_shard, proto::CmdArgs& args, proto::ReplyBuilder& rb,
               std::string_view peer, std::string_view client_name, bool unix_socket);
  // Cluster mode: false with *error set (-CROSSSLOT, -MOVED, -CLUSTERDOWN) when the command
  // must not run here; *route is kCheckKey when its key decides (on the key's shard).
  bool ClusterCheck(const CommandSpec& spec, const proto::CmdArgs& args, bool asking, int* slot,
                    SlotRoute* route, std::string* error);
  // "Pion ready: RESP on 127.0.0.1:1974, ...": every address, the data dir, the budgets.
  std::string ReadyLine() const;
  // Init's failure of class `code` (ExitCode).
  Status Fail(int code, Status s) {
    init_exit_ = code;
    return s;
  }

  Config config_;
  RuntimeSettings settings_;
  CommandRegistry registry_;
  MemoryAccountant memory_;
  UserTable users_;
  SlowLog slowlog_;
  bool gpu_attention_ = false;
  // Outlives everything that holds buffers allocated from its arenas (declared first).
  std::unique_ptr<ShmPlane> shm_;
  std::unique_ptr<residency::Engine> engine_;  // outlives the shards (their objects)
  std::unique_ptr<store::SemanticCache> kv_cache_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::function<void(Shard&)>> shard_inits_;
  std::vector<std::pair<std::function<Status(Server&)>, int>> startup_;
  int init_exit_ = kExitInternal;
  std::vector<std::function<void()>> shutdown_hooks_;
  std::vector<std::function<void(Server&)>> exit_hooks_;
  std::unique_ptr<ClusterRouting> cluster_;
  std::unique_ptr<WorkerPool> io_;
  std::unique_ptr<WorkerPool> compute_;
  std::unique_ptr<WorkerPool> gpu_copy_;  // host <-> GPU copies of the residency engine
  attention::Counters attention_counters_;
  DiskStats disk_stats_;
  std::unique_ptr<MetricsHttp> metrics_;
  int listen_fd_ = -1;
  int unix_fd_ = -1;
  int binary_fd_ = -1;
  int bound_port_ = 0;
  int bound_binary_port_ = 0;
  std::atomic<bool> shutdown_{false};
  std::atomic<bool> writes_paused_{false};
  std::atomic<uint64_t> next_client_id_{1};
  std::chrono::steady_clock::time_point start_time_;
};

}  // namespace pion::server
