// Shard: one thread, one event loop, and a partition of every keyspace.
//
// Pion is thread-per-core and shared-nothing: each shard serves the connections it accepted
// and owns the keys that hash to it (Server::OwnerOf). A command for a key another shard owns
// is posted to that shard's inbox as a task and its reply is posted back; there is no lock on
// the data path. The inbox is bounded: when it is full, Post() fails and the client gets -BUSY.
// Control messages (replies, CLIENT/INFO fan-outs) use PostControl, which is bounded by
// construction: each connection has at most one command in flight.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "attention/slot_store.h"
#include "net/connection.h"
#include "net/event_loop.h"
#include "server/stats.h"
#include "store/attn_index.h"
#include "store/prefix_registry.h"
#include "store/ssm_store.h"
#include "store/state_slots.h"
#include "store/vstore.h"

namespace pion::server {

class Server;

// The per-shard data of every family. Each member is touched only by its shard's thread.
struct ShardStore {
  store::StateSlots state;
  store::VStore vstore;
  store::SsmStore ssm;
  store::PrefixRegistry prefixes;
  attention::SlotStore attention;
  store::IndexStore index;  // ATTEND.* sessions (HNSW)
};

class Shard final : public net::ConnectionHost, public net::EventHandler {
 public:
  using Task = std::function<void(Shard&)>;

  // listen_fd: the TCP listener; unix_fd: the Unix-domain listener or -1; binary_fd: the
  // binary protocol's TCP listener or -1. All are shared by every shard.
  Shard(Server* server, int id, int listen_fd, int unix_fd, int binary_fd, size_t n_commands,
        size_t queue_depth);
  ~Shard() override;

  int id() const { return id_; }
  Server& server() { return *server_; }
  ShardStats& stats() { return stats_; }
  const ShardStats& stats() const { return stats_; }
  ShardStore& store() { return store_; }
  net::EventLoop& loop() { return loop_; }

  void Start();
  void Stop();  // thread-safe
  void Join();

  // Thread-safe. Queues a data-path task; false when the inbox is full (caller answers -BUSY).
  bool Post(Task task);
  // Thread-safe. Queues a control task (always accepted; see class comment).
  void PostControl(Task task);
  size_t queued() const { return queued_.load(std::memory_order_relaxed); }
  void set_queue_depth(size_t d) { queue_depth_.store(d, std::memory_order_relaxed); }
  // How long the loop keeps polling after activity before it sleeps (--poll-us; any thread).
  void set_poll_us(int64_t us) { poll_us_.store(us, std::memory_order_relaxed); }
  int64_t poll_us() const { return poll_us_.load(std::memory_order_relaxed); }
  size_t queue_depth() const { return queue_depth_.load(std::memory_order_relaxed); }

  // The shard whose thread is calling, or nullptr off-shard.
  static Shard* Current();

  // Runs on this shard.
  net::Connection* FindConnection(uint64_t id);
  template <typename F>
  void ForEachConnection(F&& f) {
    for (auto& [id, c] : connections_) {
      if (!c->closed()) f(*c);
    }
  }

  // ConnectionHost (runs on this shard).
  void Dispatch(net::Connection& conn, proto::CmdArgs& args) override;
  net::ConnectionLimits LimitsFor(const net::Connection& conn) override;
  void OnNetBytes(uint64_t in, uint64_t out) override;
  void OnClosed(net::Connection& conn, net::CloseReason reason) override;

  // TCP listener readiness (accept).
  void OnEvent(uint32_t events) override;

  // Gauges refreshed by the shard's tick, read by INFO/metrics from any thread.
  std::atomic<uint64_t> client_query_bytes{0};
  std::atomic<uint64_t> client_output_bytes{0};
  std::atomic<uint64_t> client_biggest_output{0};

 private:
  enum class Listener { kTcp, kUnix, kBinary };
  // The Unix-domain and binary listeners' readiness.
  struct ExtraListener final : net::EventHandler {
    Shard* shard = nullptr;
    Listener kind = Listener::kUnix;
    void OnEvent(uint32_t) override {
      shard->Accept(kind == Listener::kUnix ? shard->unix_fd_ : shard->binary_fd_, kind);
    }
  };

  void Accept(int listen_fd, Listener kind);
  void Run();
  void DrainInbox();
  void Tick();
  void ReapClosed();

  Server* server_;
  int id_;
  int listen_fd_;
  int unix_fd_;
  int binary_fd_;
  ExtraListener unix_listener_;
  ExtraListener binary_listener_;
  net::EventLoop loop_;
  ShardStats stats_;
  ShardStore store_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex inbox_mu_;  // per-shard inbox only; no lock is shared by all shards
  std::vector<Task> inbox_;
  std::vector<Task> control_;
  std::atomic<size_t> queued_{0};
  std::atomic<size_t> queue_depth_;
  std::atomic<int64_t> poll_us_{0};

  std::unordered_map<uint64_t, std::unique_ptr<net::Connection>> connections_;
  std::vector<uint64_t> closed_ids_;
  std::chrono::steady_clock::time_point last_tick_;
};

}  // namespace pion::server
