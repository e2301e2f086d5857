#include "cluster/membership.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <sstream>

namespace pion::cluster {

Membership::Membership(MembershipOptions options)
    : opts_(std::move(options)),
      etcd_(opts_.etcd, opts_.etcd_timeout_ms),
      map_(std::make_shared<SlotMap>()),
      watch_etcd_(opts_.etcd, opts_.etcd_timeout_ms) {}

Membership::~Membership() { Stop(/*leave=*/false); }

std::string Membership::Key(std::string_view rest) const {
  return "/pion/" + opts_.cluster_name + "/" + std::string(rest);
}

std::string Membership::etcd_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return etcd_error_;
}

void Membership::NoteEtcd(const Status& s) {
  const bool down = !s.ok() && s.kind() == ErrorKind::kClusterDown;
  const bool was_up = etcd_up_.exchange(!down);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (down) etcd_error_ = s.message();
  }
  if (down && was_up) {
    spdlog::warn("cluster: {}; serving the slots this node owns, refusing map changes",
                 s.message());
  } else if (!down && !was_up && map_version_.load() > 0) {
    spdlog::info("cluster: etcd at {}:{} is reachable again", opts_.etcd.host, opts_.etcd.port);
  }
}

Membership::MapRef Membership::map() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_;
}

Status Membership::Register() {
  auto lease = etcd_.Grant(opts_.lease_ttl_s);
  if (!lease.ok()) return lease.status();
  // A previous run's registration (kill -9, restarted within its TTL): end its lease now.
  auto old = etcd_.Get(Key("nodes/" + opts_.node_id));
  if (old.ok() && old->lease != 0 && old->lease != lease.value()) {
    (void)etcd_.Revoke(old->lease);
  }
  Status s = etcd_.Put(Key("nodes/" + opts_.node_id),
                       opts_.announce + " " + std::to_string(lease.value()), lease.value());
  if (!s.ok()) return s;
  lease_.store(lease.value());
  joined_at_ = std::chrono::steady_clock::now();
  return Status::Ok();
}

Status Membership::Join() {
  Status s = Register();
  NoteEtcd(s);
  if (!s.ok()) return s;
  spdlog::info("cluster: node '{}' ({}) joined cluster '{}' at etcd {}:{} (lease {}, TTL {} s)",
               opts_.node_id, opts_.announce, opts_.cluster_name, opts_.etcd.host, opts_.etcd.port,
               lease_.load(), opts_.lease_ttl_s);
  s = Refresh();
  NoteEtcd(s);
  return s;
}

StatusOr<std::pair<SlotMap, int64_t>> Membership::ReadMap() {
  auto kv = etcd_.Get(Key("slots"));
  if (!kv.ok()) {
    if (kv.status().kind() == ErrorKind::kMiss) return std::make_pair(SlotMap{}, int64_t{0});
    return kv.status();
  }
  auto m = SlotMap::Decode(kv->value);
  if (!m.ok()) return m.status();
  return std::make_pair(std::move(m).value(), kv->mod_revision);
}

void Membership::Publish(SlotMap m, int64_t revision) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (revision == map_revision_) return;
    map_revision_ = revision;
    map_ = std::make_shared<const SlotMap>(std::move(m));
  }
  map_version_.fetch_add(1, std::memory_order_acq_rel);
  if (on_change_) on_change_(map());
}

Status Membership::Refresh() {
  std::lock_guard<std::mutex> change(change_mu_);
  auto listed = etcd_.List(Key("nodes/"));
  if (!listed.ok()) return listed.status();
  std::vector<NodeInfo> live;
  const std::string prefix = Key("nodes/");
  for (const auto& kv : listed.value()) {
    NodeInfo n;
    n.id = kv.key.substr(prefix.size());
    std::istringstream in(kv.value);
    in >> n.addr >> n.incarnation;
    if (!n.addr.empty()) live.push_back(std::move(n));
  }
  auto cur = ReadMap();
  if (!cur.ok()) return cur.status();

  // Leadership: the leader key lives on its holder's lease.
  auto lk = etcd_.Get(Key("leader"));
  bool leader = false;
  if (lk.ok()) {
    leader = lk->value == opts_.node_id && lk->lease == lease_.load();
  } else if (lk.status().kind() == ErrorKind::kMiss) {
    auto won = etcd_.PutIf(Key("leader"), opts_.node_id, 0, lease_.load());
    if (!won.ok()) return won.status();
    leader = won.value();
    if (leader) spdlog::info("cluster: node '{}' is the leader", opts_.node_id);
  } else {
    return lk.status();
  }
  leader_.store(leader);

  // A leader that has just started (a whole cluster restarting) gives the others one lease
  // TTL to register before it takes their slots away from them.
  bool others_may_come = false;
  if (leader &&
      std::chrono::steady_clock::now() - joined_at_ < std::chrono::seconds(opts_.lease_ttl_s)) {
    for (int16_t o : cur->first.owner) {
      if (o < 0) continue;
      const std::string& id = cur->first.nodes[o].id;
      bool is_live = false;
      for (const auto& n : live) is_live = is_live || n.id == id;
      if (!is_live) {
        others_may_come = true;
        break;
      }
    }
  }
  if (leader && !others_may_come) {
    std::vector<std::string> why;
    auto next = Reconcile(cur->first, live, opts_.replicas, &why);
    if (next) {
      auto ok = etcd_.PutIf(Key("slots"), next->Encode(), cur->second, 0);
      if (!ok.ok()) return ok.status();
      if (ok.value()) {
        for (const auto& w : why) spdlog::info("cluster: epoch {}: {}", next->epoch, w);
        cur = ReadMap();
        if (!cur.ok()) return cur.status();
      }
    }
  }
  Publish(std::move(cur->first), cur->second);
  return Status::Ok();
}

Status Membership::RefreshNow() {
  auto cur = [this] {
    std::lock_guard<std::mutex> change(change_mu_);
    return ReadMap();
  }();
  NoteEtcd(cur.status());
  if (!cur.ok()) return cur.status();
  std::lock_guard<std::mutex> change(change_mu_);
  Publish(std::move(cur->first), cur->second);
  return Status::Ok();
}

Status Membership::Change(const std::function<bool(SlotMap&)>& edit,
                          const std::function<void(const SlotMap&)>& before_publish) {
  std::lock_guard<std::mutex> change(change_mu_);
  for (int attempt = 0; attempt < 20; ++attempt) {
    auto cur = ReadMap();
    NoteEtcd(cur.status());
    if (!cur.ok()) {
      if (cur.status().kind() == ErrorKind::kClusterDown) {
        return Status(ErrorKind::kClusterDown,
                      cur.status().message() + ": the slot map cannot be changed now");
      }
      return cur.status();
    }
    SlotMap next = cur->first;
    if (!edit(next)) {
      Publish(std::move(cur->first), cur->second);
      return Status::Ok();
    }
    next.epoch = cur->first.epoch + 1;
    auto ok = etcd_.PutIf(Key("slots"), next.Encode(), cur->second, 0);
    NoteEtcd(ok.status());
    if (!ok.ok()) {
      return Status(ok.status().kind(), ok.status().message() + ": the slot map was not changed");
    }
    if (ok.value()) {
      if (before_publish) before_publish(next);
      auto now = ReadMap();
      if (now.ok()) Publish(std::move(now->first), now->second);
      return Status::Ok();
    }
  }
  return Status(ErrorKind::kBusy, "the slot map kept changing under 20 attempts; retry later");
}

void Membership::Start(OnChange on_change) {
  on_change_ = std::move(on_change);
  if (on_change_) on_change_(map());
  thread_ = std::thread([this] { Loop(); });
  watcher_ = std::thread([this] { WatchLoop(); });
}

void Membership::Stop(bool leave) {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (stop_ && !thread_.joinable() && !watcher_.joinable()) return;
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (watcher_.joinable()) watcher_.join();
  if (leave && lease_.load() != 0) {
    Status s = etcd_.Revoke(lease_.load());
    if (s.ok()) {
      spdlog::info("cluster: node '{}' left (lease revoked)", opts_.node_id);
    } else {
      spdlog::warn("cluster: could not revoke the lease on leaving: {}", s.message());
    }
    lease_.store(0);
  }
}

void Membership::WatchLoop() {
  auto keep_going = [this] {
    std::lock_guard<std::mutex> lock(stop_mu_);
    return !stop_;
  };
  auto wake = [this] {
    {
      std::lock_guard<std::mutex> lock(stop_mu_);
      wake_ = true;
    }
    stop_cv_.notify_all();
  };
  while (keep_going()) {
    Status s = watch_etcd_.Watch(Key(""), keep_going, wake);
    if (!s.ok()) {
      // etcd away: the keeper's own reads notice and report it; try again shortly.
      std::unique_lock<std::mutex> lock(stop_mu_);
      stop_cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stop_; });
    }
  }
}

void Membership::Loop() {
  using Clock = std::chrono::steady_clock;
  const auto keepalive_every = std::chrono::milliseconds(opts_.lease_ttl_s * 1000 / 3);
  auto next_keepalive = Clock::now() + keepalive_every;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(stop_mu_);
      stop_cv_.wait_for(lock, std::chrono::milliseconds(opts_.poll_ms),
                        [this] { return stop_ || wake_; });
      if (stop_) return;
      wake_ = false;
    }
    if (Clock::now() >= next_keepalive) {
      Status s = etcd_.KeepAlive(lease_.load());
      if (s.kind() == ErrorKind::kMiss) {
        spdlog::warn("cluster: node '{}' lost its lease ({}); registering again", opts_.node_id,
                     s.message());
        s = Register();
      }
      NoteEtcd(s);
      next_keepalive = Clock::now() + (s.ok() ? keepalive_every : std::chrono::milliseconds(200));
    }
    NoteEtcd(Refresh());
  }
}

}  // namespace pion::cluster
