// Cluster mode's replication thread and slot routing (see cluster_node.h).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>
#include <future>
#include <set>
#include <sstream>
#include <tuple>

#include "cluster/key_slot.h"
#include "families/cluster_internal.h"
#include "families/cluster_node.h"
#include "families/vstore_internal.h"

namespace pion::families::cluster_sync {
namespace {

using cluster::Reply;
using cluster::SlotMap;

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(ErrorKind::kIo, "cannot open " + path + " to send it");
  std::ostringstream out;
  out << in.rdbuf();
  if (!in.good() && !in.eof()) return Status(ErrorKind::kIo, "cannot read " + path);
  return out.str();
}

bool InList(const std::vector<int16_t>& list, int i) {
  for (int16_t x : list) {
    if (x == i) return true;
  }
  return false;
}

}  // namespace

ClusterNode* NodeOf(server::Server& srv) { return static_cast<ClusterNode*>(srv.cluster()); }

bool Enabled(server::Server& srv) { return srv.cluster() != nullptr; }

namespace {
std::vector<SavedKind>& Registry() {
  static std::vector<SavedKind> kinds;
  return kinds;
}
}  // namespace

void AddSavedKind(SavedKind kind) {
  for (SavedKind& k : Registry()) {
    if (k.name == kind.name) return;
  }
  Registry().push_back(std::move(kind));
}

const std::vector<SavedKind>& SavedKinds() { return Registry(); }

const SavedKind* FindSavedKind(std::string_view name) {
  for (const SavedKind& k : Registry()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

std::string_view RouteKeyOf(const SavedKind& kind, std::string_view key) {
  return kind.route_key ? kind.route_key(key) : key;
}

std::function<void(const Status&)> AnswerWith(
    std::function<void(server::CommandContext::ReplyWriter)> reply,
    server::CommandContext::ReplyWriter ok) {
  return [reply = std::move(reply), ok = std::move(ok)](const Status& s) {
    if (s.ok()) return reply(ok);
    reply([s](proto::ReplyBuilder& rb) { rb.Error(s); });
  };
}

std::function<void(const Status&)> Gather(size_t n, std::function<void(const Status&)> all) {
  struct State {
    std::mutex mu;
    size_t left;
    Status first;
    std::function<void(const Status&)> all;
  };
  auto st = std::make_shared<State>();
  st->left = n;
  st->all = std::move(all);
  return [st](const Status& s) {
    Status result;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      if (!s.ok() && st->first.ok()) st->first = s;
      if (--st->left != 0) return;
      result = st->first;
    }
    st->all(result);
  };
}

namespace {
// The wire arguments naming `id` at `version` (the part last, when there is one).
std::vector<std::string_view> ObjectArgs(std::string_view cmd, const ObjectId& id,
                                         const std::string& version) {
  return {cmd, id.kind, id.tenant, id.key, version};
}

void AddPart(std::vector<std::string_view>* args, const ObjectId& id) {
  if (!id.part.empty()) args->push_back(id.part);
}
}  // namespace

ClusterNode::ClusterNode(server::Server& srv, cluster::MembershipOptions options)
    : srv_(srv),
      membership_(std::move(options)),
      in_flight_(static_cast<size_t>(srv.shard_count())),
      arrived_(static_cast<size_t>(srv.shard_count())),
      owned_(cluster::kSlots, false) {}

ClusterNode::~ClusterNode() { Stop(); }

server::SlotRoute ClusterNode::Route(int slot, bool asking) {
  // Each thread keeps the map it last read until the version moves: no lock per command.
  struct Cache {
    const ClusterNode* node = nullptr;
    uint64_t version = 0;
    std::shared_ptr<const SlotMap> map;
    int self = -1;
  };
  thread_local Cache cache;
  const uint64_t v = membership_.map_version();
  if (cache.node != this || cache.version != v || !cache.map) {
    cache.map = membership_.map();
    cache.version = v;
    cache.node = this;
    cache.self = cache.map->IndexOf(node_id());
  }
  const SlotMap& m = *cache.map;
  const int owner = m.owner[slot];
  const int from = m.moving_from[slot];
  server::SlotRoute r;
  if (owner < 0) {
    r.kind = server::SlotRoute::Kind::kUnassigned;
  } else if (owner == cache.self) {
    // Keys of the slot still coming from `from`: one that is not here is asked there (unless
    // the old owner just sent the client here with -ASK: then it is nowhere else).
    if (from >= 0 && !asking) {
      r.kind = server::SlotRoute::Kind::kCheckKey;
      r.importing = true;
      r.addr = m.nodes[from].addr;
      r.from_id = m.nodes[from].id;
    }
  } else if (asking && from == cache.self) {
    r.kind = server::SlotRoute::Kind::kCheckKey;  // here if not sent yet, else at the owner
    r.addr = m.nodes[owner].addr;
  } else {
    r.kind = server::SlotRoute::Kind::kMoved;
    r.addr = m.nodes[owner].addr;
  }
  return r;
}

bool ClusterNode::KeyPresent(server::Shard& shard, uint32_t tenant, std::string_view key) {
  server::ShardStore& st = shard.store();
  const store::TenantKey k{tenant, std::string(key)};
  if (st.prefixes.Find(k) != nullptr) return true;
  const std::string_view ns = vstore::SessionRouteKey(key);
  if (ns.size() != key.size() && st.prefixes.Find({tenant, std::string(ns)}) != nullptr)
    return true;
  if (st.vstore.Find(k) != nullptr) return true;
  if (st.state.Find(k).ok()) return true;
  if (st.ssm.Find(k) != nullptr) return true;
  if (st.vstore.SealedCount(k) > 0) return true;
  if (!st.attention.Layers(k).empty()) return true;
  return st.index.Find(k) != nullptr;
}

std::string ClusterNode::CheckKey(server::Shard& shard, uint32_t tenant,
                                  const server::CommandSpec& spec, std::string_view key, int slot,
                                  const server::SlotRoute& route) {
  if (route.importing) {
    // The slot is moving here: a key is served here once its current bytes arrived from the
    // old owner (whole: every object of it). Until then the old owner has them, even where
    // this node holds a copy — it was the old owner's replica, and the copy is of the last
    // save, older than what clients wrote since. (A key the old owner does not have comes back
    // here with -ASK, and ASKING serves it.)
    const auto& arrived = arrived_[static_cast<size_t>(shard.id())];
    auto it = arrived.find({tenant, std::string(vstore::SessionRouteKey(key))});
    if (it != arrived.end() && it->second.from == route.from_id) return "";
    return "ASK " + std::to_string(slot) + " " + route.addr;
  }
  // A namespace in flight is still whole here: reads go on, writes wait for it to arrive.
  const auto& moving = in_flight_[static_cast<size_t>(shard.id())];
  if (!moving.empty() && (spec.flags & server::kCmdWrite) &&
      moving.count({tenant, std::string(vstore::SessionRouteKey(key))}) != 0) {
    return "TRYAGAIN namespace '" + std::string(vstore::SessionRouteKey(key)).substr(0, 64) +
           "' is being moved to slot " + std::to_string(slot) + "'s new owner";
  }
  if (KeyPresent(shard, tenant, key)) return "";
  return "ASK " + std::to_string(slot) + " " + route.addr;
}

Status ClusterNode::Start() {
  Status s = membership_.Join();
  if (!s.ok()) {
    return Status(s.kind(), "cannot join the cluster: " + s.message() +
                                " (a node starts only with etcd reachable)");
  }
  auto m = membership_.map();
  const int self = m->IndexOf(node_id());
  // What the disk held at start-up for slots that are not this node's any more is stale, and
  // copies for other nodes' slots may have missed drops while this node was down: keep only
  // this node's own slots, and of those not the ones it is importing (the map may already give
  // a slot that failed over back to it: the node it comes from holds the current objects, a
  // namespace dropped there meanwhile must not come back from here); owners send their
  // replicas everything again.
  struct Stale {
    const SavedKind* kind;
    int shard;
    HeldObject obj;
  };
  std::vector<Stale> drop;
  for (const SavedKind& kind : SavedKinds()) {
    for (int i = 0; i < srv_.shard_count(); ++i) {
      for (auto& o : kind.held(srv_, srv_.shard(i))) {
        const int slot = cluster::KeySlot(RouteKeyOf(kind, o.key.name));
        const bool own = m->owner[slot] == self && m->moving_from[slot] < 0;
        if (self < 0 || (!own && m->moving_from[slot] != self)) {
          drop.push_back({&kind, i, std::move(o)});
        }
      }
    }
  }
  for (const Stale& d : drop) {
    Status st = d.kind->discard(srv_, srv_.shard(d.shard), d.obj.key, d.obj.part, 0);
    if (!st.ok()) {
      spdlog::warn("cluster: could not drop {} '{}': {}", d.kind->name, d.obj.key.name,
                   st.message());
    }
  }
  if (!drop.empty()) {
    spdlog::info("cluster: dropped {} saved object(s) of slots this node no longer owns",
                 drop.size());
    counters_.discarded.fetch_add(drop.size());
  }
  for (int slot = 0; slot < cluster::kSlots; ++slot)
    owned_[slot] = self >= 0 && m->owner[slot] == self;
  thread_ = std::thread([this] { Loop(); });
  membership_.Start([this](std::shared_ptr<const SlotMap>) { OnMap(); });
  return Status::Ok();
}

void ClusterNode::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  membership_.Stop(/*leave=*/true);
  // Jobs never run (a save waiting for its replicas) still get their answer.
  std::deque<std::function<void()>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(jobs_);
  }
  for (auto& j : left) j();
}

void ClusterNode::OnMap() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    map_changed_ = true;
  }
  cv_.notify_all();
}

void ClusterNode::Enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void ClusterNode::Loop() {
  for (;;) {
    std::function<void()> job;
    bool apply = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(500),
                   [this] { return stop_ || map_changed_ || !jobs_.empty(); });
      if (stop_) return;
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      } else if (map_changed_ || retry_) {
        map_changed_ = false;
        apply = true;
      }
    }
    if (job) job();
    if (apply) Apply();
  }
}

StatusOr<Reply> ClusterNode::Call(const std::string& addr,
                                  const std::vector<std::string_view>& args) {
  auto& c = clients_[addr];
  if (!c) {
    c = std::make_unique<cluster::NodeClient>(addr, 5000);
    c->set_password(srv_.settings().requirepass());
  }
  return c->Call(args);
}

void ClusterNode::OnEveryShard(const std::function<void(server::Shard&)>& f) {
  // Shared with the tasks: a node stopped before its shards ever ran (a start-up that failed
  // later) must not wait for them, nor leave them pointing at this frame.
  struct Pending {
    std::function<void(server::Shard&)> f;
    std::mutex mu;
    std::condition_variable cv;
    int left = 0;
  };
  auto p = std::make_shared<Pending>();
  p->f = f;
  p->left = srv_.shard_count();
  for (int i = 0; i < srv_.shard_count(); ++i) {
    srv_.shard(i).PostControl([p](server::Shard& sh) {
      p->f(sh);
      std::lock_guard<std::mutex> lock(p->mu);
      if (--p->left == 0) p->cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(p->mu);
  while (p->left > 0) {
    p->cv.wait_for(lock, std::chrono::milliseconds(100));
    // Only when the shards never ran (Run() sets the start time before starting them) is
    // there nothing to wait for: otherwise the tasks reference the caller's frame.
    std::lock_guard<std::mutex> stop(mu_);
    if (stop_ && srv_.start_time() == std::chrono::steady_clock::time_point{}) return;
  }
}

namespace {
std::string ObjectKey(const ObjectId& id) {
  std::string k = id.kind;
  for (const std::string* part : {&id.tenant, &id.key, &id.part}) {
    k.push_back('\0');
    k += *part;
  }
  return k;
}

// The replica set of node `self` in `m`, as Replicated() compares it.
std::string ReplicaSet(const SlotMap& m, int self) {
  std::string out;
  for (int16_t r : m.replicas[self]) {
    out += m.nodes[r].id + "@" + std::to_string(m.nodes[r].incarnation) + ",";
  }
  return out;
}
}  // namespace

bool ClusterNode::Replicated(const ObjectId& id, uint64_t version,
                             const std::string& replicas) const {
  auto it = replicated_.find(ObjectKey(id));
  return it != replicated_.end() && it->second.first == version && it->second.second == replicas;
}

void ClusterNode::NoteReplicated(const ObjectId& id, uint64_t version,
                                 const std::string& replicas) {
  replicated_[ObjectKey(id)] = {version, replicas};
}

void ClusterNode::ForgetReplicated(const ObjectId& id) { replicated_.erase(ObjectKey(id)); }

void ClusterNode::NoteArrived(server::Shard& shard, const store::TenantKey& fence,
                              const std::string& from, int slot) {
  arrived_[static_cast<size_t>(shard.id())][fence] = {from, slot, map()->epoch};
}

void ClusterNode::ForgetArrivals(const SlotMap& m, int self) {
  // Only maps newer than an arrival: a key may arrive before this node has read the map that
  // moves its slot here.
  OnEveryShard([&](server::Shard& sh) {
    auto& arrived = arrived_[static_cast<size_t>(sh.id())];
    for (auto it = arrived.begin(); it != arrived.end();) {
      const int s = it->second.slot;
      const bool importing = self >= 0 && m.owner[s] == self && m.moving_from[s] >= 0;
      if (!importing && m.epoch > it->second.epoch) {
        it = arrived.erase(it);
      } else {
        ++it;
      }
    }
  });
}

Status ClusterNode::Push(const std::string& addr, const ObjectId& id, uint64_t version,
                         const std::string& path, bool move, bool more) {
  auto bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  const std::string v = std::to_string(version);
  auto args = ObjectArgs("CLUSTER.PUT", id, v);
  args.push_back(bytes.value());
  AddPart(&args, id);
  if (move) {
    args.push_back("FROM");
    args.push_back(node_id());
    if (more) args.push_back("MORE");
  }
  auto r = Call(addr, args);
  if (!r.ok()) {
    counters_.push_failures.fetch_add(1);
    return r.status();
  }
  if (r->type == Reply::Type::kError && r->text.rfind("MISMATCH stale", 0) != 0) {
    counters_.push_failures.fetch_add(1);
    return Status(ErrorKind::kIo, "node " + addr + " refused the copy: " + r->text);
  }
  counters_.pushed.fetch_add(1);
  return Status::Ok();
}

void ClusterNode::Apply() {
  auto m = membership_.map();
  const int self = m->IndexOf(node_id());
  retry_ = false;
  // Who holds which copy may have changed with the map (objects moved away and back, copies
  // discarded): saves of unchanged objects send their copies again.
  replicated_.clear();
  Discard(*m, self);
  ForgetArrivals(*m, self);
  if (self < 0) return;
  if (!SyncReplicas(*m, self)) retry_ = true;
  if (!MoveSlots(*m, self)) retry_ = true;
}

void ClusterNode::Discard(const SlotMap& m, int self) {
  // Keep: own slots, slots whose keys this node still sends to their new owner, and saved
  // copies of the slots whose owner lists this node as a replica. An open (client-written)
  // namespace is kept only in the first two.
  std::vector<char> keep(cluster::kSlots, 0), own(cluster::kSlots, 0);
  for (int s = 0; s < cluster::kSlots; ++s) {
    const int o = m.owner[s];
    own[s] = self >= 0 && (o == self || m.moving_from[s] == self);
    keep[s] = own[s] || (self >= 0 && o >= 0 && InList(m.replicas[o], self));
  }
  std::atomic<uint64_t> dropped{0};
  OnEveryShard([&](server::Shard& sh) {
    for (const SavedKind& kind : SavedKinds()) {
      for (const auto& o : kind.held(srv_, sh)) {
        const int slot = cluster::KeySlot(RouteKeyOf(kind, o.key.name));
        if (own[slot] || (keep[slot] && !o.live)) continue;
        Status s = kind.discard(srv_, sh, o.key, o.part, 0);
        if (s.ok()) {
          dropped.fetch_add(1);
        } else {
          spdlog::warn("cluster: could not drop {} '{}' (slot {}): {}", kind.name, o.key.name, slot,
                       s.message());
        }
      }
    }
  });
  if (dropped.load() > 0) {
    counters_.discarded.fetch_add(dropped.load());
    spdlog::info("cluster: dropped {} object(s) of slots that left this node", dropped.load());
  }
}

bool ClusterNode::SyncReplicas(const SlotMap& m, int self) {
  struct Saved {
    ObjectId id;
    std::string path;
    uint64_t version;
    int slot;
  };
  std::vector<std::string> need_all;  // replica addrs that need every saved namespace
  std::set<int> new_slots;            // slots newly this node's: their saves go to every replica
  for (int16_t r : m.replicas[self]) {
    auto it = synced_.find(m.nodes[r].id);
    if (it == synced_.end() || it->second != m.nodes[r].incarnation)
      need_all.push_back(m.nodes[r].addr);
  }
  for (int s = 0; s < cluster::kSlots; ++s) {
    if (m.owner[s] == self && !owned_[s]) new_slots.insert(s);
  }
  if (need_all.empty() && new_slots.empty()) {
    counters_.pending_syncs.store(0);
    return true;
  }
  std::vector<Saved> saved;
  std::mutex mu;
  OnEveryShard([&](server::Shard& sh) {
    for (const SavedKind& kind : SavedKinds()) {
      for (auto& o : kind.held(srv_, sh)) {
        const int slot = cluster::KeySlot(RouteKeyOf(kind, o.key.name));
        if (m.owner[slot] != self || o.version == 0 || o.corrupt) continue;
        std::lock_guard<std::mutex> lock(mu);
        saved.push_back({{kind.name, o.tenant, o.key.name, o.part}, o.path, o.version, slot});
      }
    }
  });
  bool all_ok = true;
  for (int16_t r : m.replicas[self]) {
    const cluster::NodeInfo& node = m.nodes[r];
    const bool whole = std::find(need_all.begin(), need_all.end(), node.addr) != need_all.end();
    bool ok = true;
    size_t sent = 0;
    for (const Saved& s : saved) {
      if (!whole && new_slots.count(s.slot) == 0) continue;
      Status st = Push(node.addr, s.id, s.version, s.path);
      if (!st.ok() && st.kind() == ErrorKind::kIo && st.message().find("cannot open") == 0) {
        continue;  // saved again meanwhile: that save sends its own copy
      }
      if (!st.ok()) {
        spdlog::warn("cluster: copying saved objects to replica '{}' ({}): {}", node.id, node.addr,
                     st.message());
        ok = false;
        break;
      }
      ++sent;
    }
    if (ok && whole) {
      synced_[node.id] = node.incarnation;
      spdlog::info("cluster: replica '{}' holds this node's {} saved object(s)", node.id, sent);
    }
    all_ok = all_ok && ok;
  }
  if (all_ok) {
    for (int s : new_slots) owned_[s] = true;
  }
  for (int s = 0; s < cluster::kSlots; ++s) {
    if (m.owner[s] != self) owned_[s] = false;
  }
  counters_.pending_syncs.store(all_ok ? 0 : 1);
  return all_ok;
}

Status ClusterNode::MoveKey(const std::string& addr, bool replica, const std::vector<Part>& parts) {
  const store::TenantKey& key = parts.front().obj.key;
  // What clients name while it is in flight (V sessions by their namespace): every part's.
  const store::TenantKey fence{key.tenant, std::string(vstore::SessionRouteKey(key.name))};
  server::Shard& sh = srv_.shard(parts.front().shard);
  // Held in flight (clients writing it get -TRYAGAIN) from its first snapshot until it is
  // dropped here, so no write lands between the copies and the drop.
  std::vector<uint64_t> versions(parts.size(), 0);  // 0: gone meanwhile, nothing sent
  Status st;
  for (size_t k = 0; k < parts.size() && st.ok(); ++k) {
    const Part p = parts[k];
    std::promise<StatusOr<std::pair<std::string, uint64_t>>> saved;
    sh.PostControl([this, &saved, p, fence, k](server::Shard& s) {
      if (k == 0) in_flight_[static_cast<size_t>(s.id())].insert(fence);
      p.kind->save_for_move(srv_, s, p.obj.key, p.obj.part,
                            [&saved](auto r) { saved.set_value(std::move(r)); });
    });
    auto file = saved.get_future().get();
    if (!file.ok()) {
      if (file.status().kind() != ErrorKind::kMiss) st = file.status();
      continue;
    }
    const ObjectId id{p.kind->name, p.obj.tenant, p.obj.key.name, p.obj.part};
    st = Push(addr, id, file->second, file->first, /*move=*/true, /*more=*/k + 1 < parts.size());
    if (st.ok()) versions[k] = file->second;
  }
  // A replica of the new owner keeps the files as its copies; others let go of them.
  std::promise<Status> dropped;
  sh.PostControl([this, &dropped, &parts, &versions, fence, st, replica](server::Shard& s) {
    Status d = st;
    for (size_t k = 0; k < parts.size() && st.ok(); ++k) {
      const Part& p = parts[k];
      Status one = replica && versions[k] > 0 && p.kind->keep_copy
                       ? p.kind->keep_copy(srv_, s, p.obj.key, p.obj.part, versions[k])
                   : replica && versions[k] > 0
                       ? Status::Ok()
                       : p.kind->discard(srv_, s, p.obj.key, p.obj.part, 0);
      if (!one.ok() && d.ok()) d = one;
    }
    in_flight_[static_cast<size_t>(s.id())].erase(fence);
    if (st.ok()) arrived_[static_cast<size_t>(s.id())].erase(fence);  // it is not ours any more
    dropped.set_value(d);
  });
  return dropped.get_future().get();
}

bool ClusterNode::MoveSlots(const SlotMap& m, int self) {
  std::map<int, std::vector<int>> by_owner;
  for (int s = 0; s < cluster::kSlots; ++s) {
    if (m.moving_from[s] == self && m.owner[s] >= 0 && m.owner[s] != self) {
      by_owner[m.owner[s]].push_back(s);
    }
  }
  if (by_owner.empty()) return true;
  bool all_done = true;
  for (const auto& entry : by_owner) {
    // Named copies: lambdas below capture them (clang 14 cannot capture structured bindings).
    const int target = entry.first;
    const std::vector<int>& slots = entry.second;
    const cluster::NodeInfo& to = m.nodes[target];
    std::vector<char> in_batch(cluster::kSlots, 0);
    for (int s : slots) in_batch[s] = 1;
    bool done = true;
    size_t moved = 0;
    // Objects moved by an earlier pass: what is held of them now is a copy kept for the new
    // owner (this node is its replica), not to be sent again.
    std::set<std::tuple<const SavedKind*, uint32_t, std::string, std::string>> sent;
    // Passes until none is left: a client sent here with -ASK may have created one meanwhile
    // only before the owner had the slot (after that, new keys are the owner's).
    for (int pass = 0; pass < 3; ++pass) {
      std::vector<Part> objs;
      std::mutex mu;
      OnEveryShard([&](server::Shard& sh) {
        for (const SavedKind& kind : SavedKinds()) {
          for (auto& o : kind.held(srv_, sh)) {
            if (!in_batch[cluster::KeySlot(RouteKeyOf(kind, o.key.name))]) continue;
            if (sent.count({&kind, o.key.tenant, o.key.name, o.part}) != 0) continue;
            std::lock_guard<std::mutex> lock(mu);
            objs.push_back({&kind, sh.id(), std::move(o)});
          }
        }
      });
      if (objs.empty()) break;
      // What clients reach by one key goes together, in one MoveKey: a key's parts, and a
      // namespace with the sealed snapshots of its sessions (V sessions route by it).
      auto fence_of = [](const Part& p) { return vstore::SessionRouteKey(p.obj.key.name); };
      auto same_key = [&](const Part& a, const Part& b) {
        return a.shard == b.shard && a.obj.key.tenant == b.obj.key.tenant &&
               fence_of(a) == fence_of(b);
      };
      std::stable_sort(objs.begin(), objs.end(), [&](const Part& a, const Part& b) {
        return std::make_tuple(a.shard, a.obj.key.tenant, fence_of(a), a.kind, a.obj.key.name) <
               std::make_tuple(b.shard, b.obj.key.tenant, fence_of(b), b.kind, b.obj.key.name);
      });
      const bool replica = InList(m.replicas[target], self);
      for (size_t i = 0; i < objs.size() && done;) {
        size_t j = i + 1;
        while (j < objs.size() && same_key(objs[i], objs[j])) ++j;
        std::vector<Part> parts(objs.begin() + i, objs.begin() + j);
        Status d = MoveKey(to.addr, replica, parts);
        if (d.ok()) {
          moved += parts.size();
          for (const Part& p : parts)
            sent.insert({p.kind, p.obj.key.tenant, p.obj.key.name, p.obj.part});
        } else {
          spdlog::warn("cluster: moving {} '{}' to '{}': {}", objs[i].kind->name,
                       objs[i].obj.key.name, to.id, d.message());
          done = false;
        }
        i = j;
      }
      if (!done) break;
    }
    counters_.moved_out.fetch_add(moved);
    if (!done) {
      all_done = false;
      continue;
    }
    const std::string to_addr = to.addr, to_id = to.id;
    Status c = membership_.Change(
        [&](SlotMap& next) {
          const int me = next.IndexOf(node_id());
          bool any = false;
          for (int s : slots) {
            if (next.moving_from[s] == me && me >= 0) {
              next.moving_from[s] = -1;
              any = true;
            }
          }
          return any;
        },
        [&](const SlotMap&) { (void)Call(to_addr, {"CLUSTER.REFRESH"}); });
    if (c.ok()) {
      spdlog::info("cluster: {} slot(s) handed to '{}' with {} namespace(s)", slots.size(), to_id,
                   moved);
    } else {
      spdlog::warn("cluster: could not finish moving {} slot(s) to '{}': {}", slots.size(), to_id,
                   c.message());
      all_done = false;
    }
  }
  return all_done;
}

void ReplicateSaved(server::Server& srv, ObjectId id, uint64_t version, std::string path,
                    std::function<void(const Status&)> done) {
  ClusterNode* node = NodeOf(srv);
  node->Enqueue(
      [node, id = std::move(id), version, path = std::move(path), done = std::move(done)]() {
        auto m = node->map();
        const int self = m->IndexOf(node->node_id());
        if (self < 0) return done(Status::Ok());
        const std::string replicas = ReplicaSet(*m, self);
        if (node->Replicated(id, version, replicas)) return done(Status::Ok());  // unchanged
        for (int16_t r : m->replicas[self]) {
          const cluster::NodeInfo& rep = m->nodes[r];
          auto bytes = ReadFile(path);
          if (!bytes.ok())
            return done(Status::Ok());  // a newer save replaced it: that one replicates
          const std::string v = std::to_string(version);
          auto args = ObjectArgs("CLUSTER.PUT", id, v);
          args.push_back(bytes.value());
          AddPart(&args, id);
          auto reply = node->Call(rep.addr, args);
          Status st = reply.ok() ? Status::Ok() : reply.status();
          if (st.ok() && reply->type == Reply::Type::kError &&
              reply->text.rfind("MISMATCH stale", 0) != 0) {
            st = Status(ErrorKind::kIo, reply->text);
          }
          if (!st.ok()) {
            node->counters().push_failures.fetch_add(1);
            return done(Status(ErrorKind::kIo, "saved on this node, but its copy to replica '" +
                                                   rep.id + "' (" + rep.addr +
                                                   ") failed: " + st.message()));
          }
          node->counters().pushed.fetch_add(1);
        }
        node->NoteReplicated(id, version, replicas);
        done(Status::Ok());
      });
}

void ReplicateDrop(server::Server& srv, ObjectId id, uint64_t version,
                   std::function<void(const Status&)> done) {
  ClusterNode* node = NodeOf(srv);
  node->Enqueue([node, id = std::move(id), version, done = std::move(done)]() {
    auto m = node->map();
    const int self = m->IndexOf(node->node_id());
    if (self < 0) return done(Status::Ok());
    const std::string v = std::to_string(version);
    node->ForgetReplicated(id);
    for (int16_t r : m->replicas[self]) {
      const cluster::NodeInfo& rep = m->nodes[r];
      auto args = ObjectArgs("CLUSTER.DEL", id, v);
      AddPart(&args, id);
      auto reply = node->Call(rep.addr, args);
      if (!reply.ok() || reply->type == Reply::Type::kError) {
        return done(
            Status(ErrorKind::kIo, "dropped on this node, but replica '" + rep.id + "' (" +
                                       rep.addr + ") did not drop its copy: " +
                                       (reply.ok() ? reply->text : reply.status().message())));
      }
    }
    done(Status::Ok());
  });
}

}  // namespace pion::families::cluster_sync
