// A node's membership in a Pion cluster, kept in etcd: the node's lease (renewed every third of
// its TTL) and registration under /pion/<cluster>/nodes/<id>, the slot map at
// /pion/<cluster>/slots, and the leader lease at /pion/<cluster>/leader. The leader (whoever
// holds that key) applies Reconcile() to the map when membership changes; any node may write a
// change with Change() (compare-and-swap on the map's revision, so changes never interleave).
// When etcd cannot be reached the node keeps the last map it read — it keeps serving the slots
// it owns — and every change is refused with kClusterDown.
//
// Threads: Join() on the main thread at start-up; then a keeper thread reads etcd whenever a
// watch thread (POST /v3/watch on /pion/<cluster>/) sees a change, and at least every poll_ms,
// and calls on_change with each new map. map() is safe from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "cluster/etcd_client.h"
#include "cluster/slot_map.h"

namespace pion::cluster {

struct MembershipOptions {
  EtcdEndpoint etcd;
  std::string cluster_name = "pion";
  std::string node_id;
  std::string announce;  // host:port of this node's RESP listener
  int lease_ttl_s = 5;
  int replicas = 1;
  int poll_ms = 500;  // re-read at least this often; a watch on etcd wakes it at once
  int etcd_timeout_ms = 1000;
};

class Membership {
 public:
  using MapRef = std::shared_ptr<const SlotMap>;
  using OnChange = std::function<void(MapRef)>;

  explicit Membership(MembershipOptions options);
  ~Membership();

  // Grants the lease, registers the node (revoking the lease of its previous run, so that run's
  // registration and leadership end now), and reads the map — creating it, as leader, when the
  // cluster has none. kClusterDown when etcd cannot be reached.
  Status Join();
  // Starts the keeper thread.
  void Start(OnChange on_change);
  // Stops the keeper; with `leave`, revokes the lease (the node's slots fail over at once).
  void Stop(bool leave);

  // The newest map read (an empty one before Join). Any thread.
  MapRef map() const;
  // Bumped whenever map() changes: lets readers cache the pointer.
  uint64_t map_version() const { return map_version_.load(std::memory_order_acquire); }

  const MembershipOptions& options() const { return opts_; }
  int64_t incarnation() const { return lease_.load(); }
  bool leader() const { return leader_.load(); }
  bool etcd_up() const { return etcd_up_.load(); }
  std::string etcd_error() const;

  // Applies `edit` to the newest map in etcd and writes it (epoch + 1) by compare-and-swap,
  // retrying when another node changed it first; `edit` returns false when there is nothing to
  // change. kClusterDown when etcd cannot be reached: the map stays as it is. Blocking.
  // `before_publish`, when given, runs after the write and before this node uses the new map
  // (a slot's new owner is told first, so that no client is sent back and forth meanwhile).
  Status Change(const std::function<bool(SlotMap&)>& edit,
                const std::function<void(const SlotMap&)>& before_publish = nullptr);
  // Reads the map from etcd now (a peer said it changed). Blocking.
  Status RefreshNow();

 private:
  std::string Key(std::string_view rest) const;
  Status Register();
  Status Refresh();
  StatusOr<std::pair<SlotMap, int64_t>> ReadMap();
  void Publish(SlotMap m, int64_t revision);
  void Loop();
  void WatchLoop();  // wakes Loop() on every change under /pion/<cluster>/
  void NoteEtcd(const Status& s);

  MembershipOptions opts_;
  EtcdClient etcd_;
  std::atomic<int64_t> lease_{0};
  std::chrono::steady_clock::time_point joined_at_{};
  std::atomic<bool> leader_{false};
  std::atomic<bool> etcd_up_{false};
  std::atomic<uint64_t> map_version_{0};

  mutable std::mutex mu_;  // guards map_, map_revision_, etcd_error_
  MapRef map_;
  int64_t map_revision_ = -1;
  std::string etcd_error_;

  std::mutex change_mu_;  // one Change() or leader step at a time
  OnChange on_change_;
  std::thread thread_;
  std::thread watcher_;
  EtcdClient watch_etcd_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  bool wake_ = false;  // the watch saw a change: refresh now
};

}  // namespace pion::cluster
