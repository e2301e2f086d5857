// A Pion node in cluster mode (--cluster): its membership in etcd (cluster/membership.h), the
// slot routing the dispatcher applies (server::ClusterRouting), and the replication thread
// that keeps other nodes' copies right as the slot map changes:
//  - every save of a saved object (each family's SavedKind, cluster_internal.h: KV.PREFIX,
//    STATE, SSM.PREFIX, ATTEND.PREFIX, sealed V snapshots) is sent to this node's replicas
//    before it is acknowledged, every drop of a saved object after;
//  - when a replica is new (or restarted: a new incarnation) it gets every saved object of
//    this node's slots, and when this node takes slots (fail-over, a move) its replicas get
//    theirs;
//  - a slot that moves belongs to its new owner at once; the old one sends it the slot's
//    objects key by key (saved if changed, sent as the key's current bytes, dropped here; a
//    client writing one in flight gets -TRYAGAIN), the new owner serves a key of the slot only
//    once those bytes arrived — a copy it held before (it was the old owner's replica) is of
//    an earlier save — and sends clients to the old one with -ASK for the others; when none
//    is left the old one ends the move in the map;
//  - what this node holds for slots that are neither its own, moving to it, nor its
//    replicas' duty is dropped (a node back from a fail-over holds stale generations).
// Not a public interface: cluster_family.cc (commands) and cluster_sync.cc implement it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cluster/membership.h"
#include "cluster/node_client.h"
#include "families/cluster_internal.h"
#include "server/cluster_routing.h"
#include "server/server.h"
#include "store/tenant_key.h"

namespace pion::families::cluster_sync {

class ClusterNode final : public server::ClusterRouting {
 public:
  ClusterNode(server::Server& srv, cluster::MembershipOptions options);
  ~ClusterNode() override;

  server::SlotRoute Route(int slot, bool asking) override;
  std::string CheckKey(server::Shard& shard, uint32_t tenant, const server::CommandSpec& spec,
                       std::string_view key, int slot, const server::SlotRoute& route) override;
  // Whether this node holds `key` (any family) for `tenant`. Runs on the key's shard.
  static bool KeyPresent(server::Shard& shard, uint32_t tenant, std::string_view key);

  // Start-up hook (main thread, shards not running yet): joins the cluster, drops what this
  // node must not serve, starts the keeper and the replication thread.
  Status Start();
  // Shutdown hook (shards still running): stops both threads and leaves the cluster.
  void Stop();

  cluster::Membership& membership() { return membership_; }
  std::shared_ptr<const cluster::SlotMap> map() const { return membership_.map(); }
  const std::string& node_id() const { return membership_.options().node_id; }

  // Queues work on the replication thread (in order).
  void Enqueue(std::function<void()> job);
  // Sends one command to the node at `addr` (replication thread only).
  StatusOr<cluster::Reply> Call(const std::string& addr, const std::vector<std::string_view>& args);

  // A key moved here from node `from` (CLUSTER.PUT ... FROM without MORE: its last object):
  // its current bytes are here — installed, or the copy held here was as new. Until then
  // CheckKey sends clients for it back to the slot's old owner, which still holds it. `slot`:
  // the key's hash slot. Runs on the key's shard.
  void NoteArrived(server::Shard& shard, const store::TenantKey& fence, const std::string& from,
                   int slot);

  // Replication thread only: whether every current replica (`replicas`: their ids and
  // incarnations) took version `version` of object `id` already (a save of something unchanged
  // then sends nothing), and noting that they did, or that the object was dropped.
  bool Replicated(const ObjectId& id, uint64_t version, const std::string& replicas) const;
  void NoteReplicated(const ObjectId& id, uint64_t version, const std::string& replicas);
  void ForgetReplicated(const ObjectId& id);

  struct Counters {
    std::atomic<uint64_t> pushed{0};         // object copies sent and taken
    std::atomic<uint64_t> push_failures{0};  // copies a replica or target did not take
    std::atomic<uint64_t> received{0};       // copies taken from other nodes
    std::atomic<uint64_t> moved_out{0};      // objects moved to another node
    std::atomic<uint64_t> discarded{0};      // objects dropped: their slot left this node
    std::atomic<uint64_t> pending_syncs{0};  // replicas not yet holding every saved object
  };
  Counters& counters() { return counters_; }

 private:
  void OnMap();  // keeper thread: a new map
  void Loop();   // the replication thread
  void Apply();  // replication thread: discard, sync, move (see the header comment)
  void Discard(const cluster::SlotMap& m, int self);
  // Forgets arrivals of slots whose move here ended by map `m`.
  void ForgetArrivals(const cluster::SlotMap& m, int self);
  bool SyncReplicas(const cluster::SlotMap& m, int self);
  bool MoveSlots(const cluster::SlotMap& m, int self);
  // Runs f on every shard (control tasks) and waits; from the replication thread only.
  void OnEveryShard(const std::function<void(server::Shard&)>& f);
  // Pushes one saved object's file to `addr`; Ok when taken (or already newer there). `more`:
  // other parts of its key follow.
  // `move`: a key moving there (FROM this node), `more` of its objects to follow.
  Status Push(const std::string& addr, const ObjectId& id, uint64_t version,
              const std::string& path, bool move = false, bool more = false);
  // One object of a slot being moved.
  struct Part {
    const SavedKind* kind;
    int shard;
    HeldObject obj;
  };
  // Moves every object clients reach by one key (a namespace and the sealed snapshots of its
  // sessions, the layers of an attention session) to `addr` as one: each saved if changed and
  // sent FROM this node, all but the last with MORE, and only then all dropped here (kept as
  // copies when this node is a replica of the new owner). Clients writing the key meanwhile
  // get -TRYAGAIN. Ok when every object moved.
  Status MoveKey(const std::string& addr, bool replica, const std::vector<Part>& parts);

  server::Server& srv_;
  cluster::Membership membership_;
  // Per shard (touched only on it): namespaces being sent to their slot's new owner.
  std::vector<std::set<store::TenantKey>> in_flight_;
  // Per shard (touched only on it): keys whose current bytes arrived here from a slot's old
  // owner during its move (CheckKey serves only these of an importing slot), with that node's
  // id, their slot and the map epoch when they arrived; forgotten once the slot's move ended.
  struct Arrival {
    std::string from;
    int slot = 0;
    uint64_t epoch = 0;
  };
  std::vector<std::map<store::TenantKey, Arrival>> arrived_;
  Counters counters_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool map_changed_ = false;
  bool stop_ = false;
  std::thread thread_;

  // Replication thread only.
  std::map<std::string, std::unique_ptr<cluster::NodeClient>> clients_;
  std::map<std::string, int64_t> synced_;  // replica id -> the incarnation that has everything
  // Object (kind, tenant, key, part) -> the version and the replica set that acknowledged it.
  std::map<std::string, std::pair<uint64_t, std::string>> replicated_;
  std::vector<bool> owned_;  // slots whose saves this node's replicas hold
  bool retry_ = false;       // something to try again later
};

// The node, or null in single-node mode.
ClusterNode* NodeOf(server::Server& srv);

}  // namespace pion::families::cluster_sync
