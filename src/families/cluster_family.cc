// CLUSTER (SLOTS, SHARDS, NODES, KEYSLOT, INFO, MYID, SETSLOT, HELP), ASKING, READONLY,
// READWRITE — Redis Cluster's client-facing commands, so redis-py's RedisCluster and
// `redis-cli -c` route by themselves — and the node-to-node commands CLUSTER.PUT, CLUSTER.DEL
// and CLUSTER.REFRESH. Also where cluster mode is set up: the node (families/cluster_node.h)
// is created, joins at start-up after every family found its saved objects, and leaves at
// shutdown.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cctype>

#include "cluster/key_slot.h"
#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/cluster_node.h"
#include "families/families.h"
#include "families/vstore_internal.h"
#include "net/connection.h"
#include "store/disk/object_file.h"

namespace pion::families {
namespace {

using cluster::SlotMap;
using cluster_sync::ClusterNode;
using cluster_sync::NodeOf;
using proto::CmdArgs;
using server::CommandContext;

constexpr const char* kDisabled =
    "ERR This instance has cluster support disabled (start it with --cluster etcd://host:port)";

std::pair<std::string, int64_t> HostPort(const std::string& addr) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return {addr, 0};
  return {addr.substr(0, colon), std::atoll(addr.c_str() + colon + 1)};
}

bool ParseSlot(std::string_view text, int* slot) {
  int64_t v = 0;
  if (!ParseInt64(text, &v) || v < 0 || v >= cluster::kSlots) return false;
  *slot = static_cast<int>(v);
  return true;
}

void NodeEntry(proto::ReplyBuilder& rb, const cluster::NodeInfo& n) {
  auto [host, port] = HostPort(n.addr);
  rb.Array(3);
  rb.Bulk(host);
  rb.Integer(port);
  rb.Bulk(n.id);
}

void Slots(CommandContext& ctx, const SlotMap& m) {
  std::vector<SlotMap::Range> ranges;
  for (const auto& r : m.Ranges()) {
    if (r.owner >= 0) ranges.push_back(r);
  }
  // Runs that differ only in a migration target are one range for clients.
  std::vector<SlotMap::Range> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && merged.back().owner == r.owner && merged.back().end + 1 == r.start) {
      merged.back().end = r.end;
    } else {
      merged.push_back(r);
    }
  }
  auto& rb = *ctx.rb;
  rb.Array(merged.size());
  for (const auto& r : merged) {
    const auto& reps = m.replicas[r.owner];
    rb.Array(3 + reps.size());
    rb.Integer(r.start);
    rb.Integer(r.end);
    NodeEntry(rb, m.nodes[r.owner]);
    for (int16_t rep : reps) NodeEntry(rb, m.nodes[rep]);
  }
}

void ShardNode(proto::ReplyBuilder& rb, const cluster::NodeInfo& n, bool primary) {
  auto [host, port] = HostPort(n.addr);
  rb.Map(7);
  rb.Bulk("id");
  rb.Bulk(n.id);
  rb.Bulk("port");
  rb.Integer(port);
  rb.Bulk("ip");
  rb.Bulk(host);
  rb.Bulk("endpoint");
  rb.Bulk(host);
  rb.Bulk("role");
  rb.Bulk(primary ? "master" : "replica");
  rb.Bulk("replication-offset");
  rb.Integer(0);
  rb.Bulk("health");
  rb.Bulk("online");
}

void Shards(CommandContext& ctx, const SlotMap& m) {
  std::vector<std::vector<std::pair<int, int>>> slots(m.nodes.size());
  for (const auto& r : m.Ranges()) {
    if (r.owner < 0) continue;
    auto& v = slots[r.owner];
    if (!v.empty() && v.back().second + 1 == r.start) {
      v.back().second = r.end;
    } else {
      v.emplace_back(r.start, r.end);
    }
  }
  auto& rb = *ctx.rb;
  rb.Array(m.nodes.size());
  for (size_t i = 0; i < m.nodes.size(); ++i) {
    rb.Map(2);
    rb.Bulk("slots");
    rb.Array(slots[i].size() * 2);
    for (auto [a, b] : slots[i]) {
      rb.Integer(a);
      rb.Integer(b);
    }
    rb.Bulk("nodes");
    rb.Array(1 + m.replicas[i].size());
    ShardNode(rb, m.nodes[i], true);
    for (int16_t r : m.replicas[i]) ShardNode(rb, m.nodes[r], false);
  }
}

std::string NodesText(const ClusterNode& node, const SlotMap& m) {
  std::string out;
  for (size_t i = 0; i < m.nodes.size(); ++i) {
    const auto& n = m.nodes[i];
    const int64_t port = HostPort(n.addr).second;
    out += n.id + " " + n.addr + "@" + std::to_string(port + 10000) + " ";
    out += n.id == node.node_id() ? "myself,master" : "master";
    out += " - 0 0 " + std::to_string(m.epoch) + " connected";
    for (const auto& r : m.Ranges()) {
      if (r.owner != static_cast<int>(i)) continue;
      out += ' ';
      out += std::to_string(r.start);
      if (r.end != r.start) {
        out += '-';
        out += std::to_string(r.end);
      }
    }
    for (int s = 0; s < cluster::kSlots; ++s) {
      if (m.owner[s] == static_cast<int>(i) && m.moving_from[s] >= 0) {
        out += " [" + std::to_string(s) + "-<-" + m.nodes[m.moving_from[s]].id + "]";
      }
    }
    out += "\n";
  }
  return out;
}

// A CLUSTER INFO value as clients parse it: one line, no ':' (redis-py splits each line on
// every ':'). An error's clauses ("unreachable: connection refused") are joined by "; ", a
// host's port (host:port) by '#'.
std::string InfoValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const char c = v[i];
    if (c == ':' && i + 1 < v.size() && v[i + 1] == ' ') {
      out += ';';
    } else if (c == ':') {
      out += '#';
    } else if (c == '\r' || c == '\n') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

std::string InfoText(ClusterNode& node, const SlotMap& m) {
  int assigned = 0, moving = 0;
  std::vector<char> has(m.nodes.size(), 0);
  for (int s = 0; s < cluster::kSlots; ++s) {
    if (m.owner[s] >= 0) {
      ++assigned;
      has[m.owner[s]] = 1;
    }
    if (m.moving_from[s] >= 0) ++moving;
  }
  int size = 0;
  for (char h : has) size += h;
  const int self = m.IndexOf(node.node_id());
  auto& mem = node.membership();
  auto& c = node.counters();
  std::string out;
  auto kv = [&out](const char* k, const std::string& v) {
    out += k;
    out += ':';
    out += InfoValue(v);
    out += "\r\n";
  };
  kv("cluster_state", assigned == cluster::kSlots ? "ok" : "fail");
  kv("cluster_slots_assigned", std::to_string(assigned));
  kv("cluster_slots_ok", std::to_string(assigned));
  kv("cluster_slots_pfail", "0");
  kv("cluster_slots_fail", std::to_string(cluster::kSlots - assigned));
  kv("cluster_known_nodes", std::to_string(m.nodes.size()));
  kv("cluster_size", std::to_string(size));
  kv("cluster_current_epoch", std::to_string(m.epoch));
  kv("cluster_my_epoch", std::to_string(m.epoch));
  kv("cluster_my_id", node.node_id());
  kv("cluster_my_slots", std::to_string(self >= 0 ? m.SlotsOf(self) : 0));
  kv("cluster_slots_migrating", std::to_string(moving));
  kv("cluster_replicas", std::to_string(self >= 0 ? m.replicas[self].size() : 0));
  kv("cluster_leader", mem.leader() ? "1" : "0");
  kv("cluster_incarnation", std::to_string(mem.incarnation()));
  kv("cluster_etcd", mem.etcd_up() ? "up" : "down");
  kv("cluster_etcd_last_error", mem.etcd_up() ? "" : mem.etcd_error());
  kv("cluster_copies_sent", std::to_string(c.pushed.load()));
  kv("cluster_copy_failures", std::to_string(c.push_failures.load()));
  kv("cluster_copies_received", std::to_string(c.received.load()));
  kv("cluster_moved_out", std::to_string(c.moved_out.load()));
  kv("cluster_discarded", std::to_string(c.discarded.load()));
  kv("cluster_replicas_pending", std::to_string(c.pending_syncs.load()));
  return out;
}

// Runs `work` (blocking etcd calls) on the I/O pool, never on the shard, and answers OK or its
// error; kBusy when the pool's queue is full.
void AnswerFromIo(CommandContext& ctx, std::function<Status()> work) {
  auto answer = cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Ok(); });
  bool queued = ctx.server->io()->Submit([work = std::move(work), answer] { answer(work()); });
  if (!queued) answer(Status(ErrorKind::kBusy, "the I/O queue is full; retry later"));
}

// CLUSTER SETSLOT <slot> NODE <node-id>: gives the slot to that node (its keys follow from the
// old owner, -ASK meanwhile). Blocking etcd work runs on the I/O pool, never on the shard.
void SetSlot(CommandContext& ctx, CmdArgs& args, ClusterNode* node) {
  int slot = 0;
  if (args.size() != 5 || !EqualsIgnoreCase(args[3], "NODE")) {
    return ctx.rb->ErrorLine(
        "ERR CLUSTER SETSLOT takes <slot> NODE <node-id> (Pion moves the slot's keys itself)");
  }
  if (!ParseSlot(args[2], &slot)) {
    return ctx.rb->ErrorLine("ERR Invalid or out of range slot '" +
                             std::string(args[2].substr(0, 32)) + "': expected 0 to 16383");
  }
  const std::string id(args[4]);
  if (node->map()->IndexOf(id) < 0) {
    return ctx.rb->ErrorLine("ERR Unknown node " + id.substr(0, 64));
  }
  AnswerFromIo(ctx, [node, slot, id] {
    return node->membership().Change([&](SlotMap& m) {
      const int t = m.IndexOf(id);
      if (t < 0 || m.owner[slot] == t) return false;
      if (m.moving_from[slot] < 0) m.moving_from[slot] = m.owner[slot];
      m.owner[slot] = static_cast<int16_t>(t);
      if (m.moving_from[slot] == t) m.moving_from[slot] = -1;
      return true;
    });
  });
}

void Cluster(CommandContext& ctx, CmdArgs& args) {
  auto& rb = *ctx.rb;
  const std::string_view sub = args[1];
  if (EqualsIgnoreCase(sub, "HELP") && args.size() == 2) {
    static const char* kHelp[] = {"CLUSTER <subcommand> [<arg> ...]. Subcommands are:",
                                  "SLOTS",
                                  "    Slot ranges with their owner and replicas (host, port, id).",
                                  "SHARDS",
                                  "    Each node's slot ranges and nodes.",
                                  "NODES",
                                  "    The nodes, one line each, in Redis' format.",
                                  "KEYSLOT <key>",
                                  "    The hash slot of <key> (CRC16 of its {hash tag} or itself).",
                                  "INFO",
                                  "    The cluster's state.",
                                  "MYID",
                                  "    This node's id.",
                                  "SETSLOT <slot> NODE <node-id>",
                                  "    Moves the slot (and its keys) to that node.",
                                  "COUNTKEYSINSLOT <slot>",
                                  "    KV.PREFIX namespaces of the slot held here (copies too).",
                                  "HELP",
                                  "    Print this help."};
    rb.Array(std::size(kHelp));
    for (const char* l : kHelp) rb.SimpleString(l);
    return;
  }
  if (EqualsIgnoreCase(sub, "KEYSLOT")) {
    if (args.size() != 3) return ctx.WrongArity();
    return rb.Integer(cluster::KeySlot(args[2]));
  }
  ClusterNode* node = NodeOf(*ctx.server);
  if (node == nullptr) return rb.ErrorLine(kDisabled);
  auto m = node->map();
  if (EqualsIgnoreCase(sub, "SLOTS") && args.size() == 2) return Slots(ctx, *m);
  if (EqualsIgnoreCase(sub, "SHARDS") && args.size() == 2) return Shards(ctx, *m);
  if (EqualsIgnoreCase(sub, "NODES") && args.size() == 2) return rb.Bulk(NodesText(*node, *m));
  if (EqualsIgnoreCase(sub, "INFO") && args.size() == 2) return rb.Bulk(InfoText(*node, *m));
  if (EqualsIgnoreCase(sub, "MYID") && args.size() == 2) return rb.Bulk(node->node_id());
  if (EqualsIgnoreCase(sub, "SETSLOT")) return SetSlot(ctx, args, node);
  if (EqualsIgnoreCase(sub, "COUNTKEYSINSLOT")) {
    int slot = 0;
    if (args.size() != 3) return ctx.WrongArity();
    if (!ParseSlot(args[2], &slot)) {
      return rb.ErrorLine("ERR Invalid or out of range slot '" +
                          std::string(args[2].substr(0, 32)) + "': expected 0 to 16383");
    }
    const uint32_t tenant = ctx.tenant;
    ctx.server->FanOut(
        *ctx.shard, *ctx.conn,
        [slot, tenant](server::Shard& sh) {
          uint64_t n = 0;
          sh.store().prefixes.ForEach(tenant, [&](const store::TenantKey& k, const auto&) {
            n += cluster::KeySlot(k.name) == slot;
          });
          return std::to_string(n);
        },
        [](std::vector<std::string>& parts, proto::ReplyBuilder& out) {
          int64_t total = 0;
          for (const auto& p : parts) total += std::atoll(p.c_str());
          out.Integer(total);
        });
    return;
  }
  rb.ErrorLine(server::UnknownSubcommandError(sub, "cluster"));
}

void Asking(CommandContext& ctx, CmdArgs&) {
  if (ctx.server->cluster() == nullptr) return ctx.rb->ErrorLine(kDisabled);
  ctx.conn->asking = true;
  ctx.rb->Ok();
}

void ReadOnly(CommandContext& ctx, CmdArgs&) {
  if (ctx.server->cluster() == nullptr) return ctx.rb->ErrorLine(kDisabled);
  ctx.rb->ErrorLine(
      "ERR Pion replicas hold saved copies for fail-over, not live data: read from the slot's "
      "owner");
}

void ReadWrite(CommandContext& ctx, CmdArgs&) {
  if (ctx.server->cluster() == nullptr) return ctx.rb->ErrorLine(kDisabled);
  ctx.rb->Ok();
}

bool ParseVersion(std::string_view text, uint64_t* v) {
  int64_t x = 0;
  if (!ParseInt64(text, &x) || x < 1) return false;
  *v = static_cast<uint64_t>(x);
  return true;
}

// The kind named by argument 1, its part (argument `part_at`, if given) and version
// (argument 4); false with the error written when they are not valid.
bool ParseObject(CommandContext& ctx, CmdArgs& args, size_t argc, size_t part_at, const char* cmd,
                 const cluster_sync::SavedKind** kind, std::string* part, uint64_t* version) {
  std::string name(args[1].substr(0, 32));
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  *kind = cluster_sync::FindSavedKind(name);
  if (*kind == nullptr) {
    std::string names;
    for (const auto& k : cluster_sync::SavedKinds()) names += (names.empty() ? "" : ", ") + k.name;
    ctx.rb->ErrorLine(std::string("ERR ") + cmd + " takes kind " + names + ", got '" +
                      std::string(args[1].substr(0, 32)) + "'");
    return false;
  }
  if (argc > part_at + 1) {
    ctx.WrongArity();
    return false;
  }
  *part = argc > part_at ? std::string(args[part_at]) : std::string();
  if (!ParseVersion(args[4], version)) {
    ctx.rb->ErrorLine("ERR version must be a positive integer, got '" +
                      std::string(args[4].substr(0, 32)) + "'");
    return false;
  }
  return true;
}

// CLUSTER.PUT <kind> <tenant> <key> <version> <object_file> [<part>] [FROM <node-id> [MORE]]:
// a copy of a saved object from the node that owns its slot (a replica's copy), or — FROM — of
// a key moving here from that node, the slot's old owner: its current bytes. Checked against
// what is held (never older), written durably, then installed on the key's shard. MORE: other
// objects of the key follow; once the last one is here (installed, or what is held was as new)
// this node serves the key, and until then sends clients for it to the old owner.
void Put(CommandContext& ctx, CmdArgs& args) {
  if (NodeOf(*ctx.server) == nullptr) return ctx.rb->ErrorLine(kDisabled);
  const cluster_sync::SavedKind* kind = nullptr;
  std::string part, from;
  uint64_t version = 0;
  size_t argc = args.size();
  const bool more = argc >= 7 && EqualsIgnoreCase(args[argc - 1], "MORE");
  if (more) --argc;
  if (argc >= 8 && EqualsIgnoreCase(args[argc - 2], "FROM")) {
    from = std::string(args[argc - 1]);
    argc -= 2;
  }
  if (more && from.empty()) {
    return ctx.rb->ErrorLine("ERR CLUSTER.PUT takes MORE only after FROM <node-id>");
  }
  if (!ParseObject(ctx, args, argc, 6, "CLUSTER.PUT", &kind, &part, &version)) return;
  server::Server* srv = ctx.server;
  const cluster_sync::ObjectId id{kind->name, std::string(args[2]), std::string(args[3]), part};
  const store::TenantKey key{srv->users().TenantId(id.tenant), id.key};
  auto bytes = args.TakeBuffer(5);
  if (!bytes.ok()) return ctx.Error(bytes.status());
  BufferRef file = std::move(bytes).value();
  const std::string_view route = cluster_sync::RouteKeyOf(*kind, key.name);
  const int owner = srv->OwnerOf(key.tenant, route);
  const int slot = cluster::KeySlot(route);
  auto answer = cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Ok(); });
  // Whether this node owns the object's slot: it then makes sure its own replicas have the
  // copy before the sender lets go of it (a slot moving here).
  auto owns = [srv, slot] {
    ClusterNode* node = NodeOf(*srv);
    auto m = node->map();
    const int self = m->IndexOf(node->node_id());
    return self >= 0 && m->owner[slot] == self;
  };
  const store::TenantKey fence{key.tenant, std::string(vstore::SessionRouteKey(key.name))};
  // The key's current bytes are here: served from here from now on.
  const bool last_of_move = !from.empty() && !more;
  srv->shard(owner).PostControl([=](server::Shard& sh) {
    Status ok = kind->check(*srv, sh, key, part, version);
    if (!ok.ok()) {
      // Held already (this node was a replica of the sender), as new as this copy.
      auto held = kind->find(*srv, sh, key, part);
      if (ok.kind() == ErrorKind::kMismatch && last_of_move) {
        NodeOf(*srv)->NoteArrived(sh, fence, from, slot);
      }
      if (ok.kind() == ErrorKind::kMismatch && held && held->version > 0 && owns()) {
        return cluster_sync::ReplicateSaved(
            *srv, id, held->version, held->path,
            [answer, ok](const Status& r) { answer(r.ok() ? ok : r); });
      }
      return answer(ok);
    }
    bool queued = srv->io()->Submit([=] {
      auto [dir, name] = kind->file_of(*srv, id);
      Status w = store::disk::WriteObjectBytes(
          dir, name, version,
          std::string_view(reinterpret_cast<const char*>(file->data()), file->size()));
      if (!w.ok()) return answer(w);
      const std::string path = store::disk::ObjectPath(dir, name, version);
      srv->shard(owner).PostControl([=](server::Shard& sh2) {
        Status in = kind->install(*srv, sh2, key, part, version, path);
        if (!in.ok()) return answer(in);
        NodeOf(*srv)->counters().received.fetch_add(1);
        if (last_of_move) NodeOf(*srv)->NoteArrived(sh2, fence, from, slot);
        if (!owns()) return answer(in);
        cluster_sync::ReplicateSaved(*srv, id, version, path, answer);
      });
    });
    if (!queued) answer(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
  });
}

// CLUSTER.DEL <kind> <tenant> <key> <version> [<part>]: the owner dropped the object.
void Del(CommandContext& ctx, CmdArgs& args) {
  if (NodeOf(*ctx.server) == nullptr) return ctx.rb->ErrorLine(kDisabled);
  const cluster_sync::SavedKind* kind = nullptr;
  std::string part;
  uint64_t version = 0;
  if (!ParseObject(ctx, args, args.size(), 5, "CLUSTER.DEL", &kind, &part, &version)) return;
  server::Server* srv = ctx.server;
  const store::TenantKey key{srv->users().TenantId(args[2]), std::string(args[3])};
  auto answer = cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Ok(); });
  const int owner = srv->OwnerOf(key.tenant, cluster_sync::RouteKeyOf(*kind, key.name));
  srv->shard(owner).PostControl(
      [=](server::Shard& sh) { answer(kind->discard(*srv, sh, key, part, version)); });
}

// CLUSTER.REFRESH: re-read the slot map now (a slot was just handed to this node).
void Refresh(CommandContext& ctx, CmdArgs&) {
  ClusterNode* node = NodeOf(*ctx.server);
  if (node == nullptr) return ctx.rb->ErrorLine(kDisabled);
  AnswerFromIo(ctx, [node] { return node->membership().RefreshNow(); });
}

// ATTEND.PREFIX.STORE <sid> <layer> FROM <ns>: <ns> is a key too.
void StoreFromKeys(const CmdArgs& args, std::vector<std::string_view>* keys) {
  if (args.size() >= 5 && EqualsIgnoreCase(args[3], "FROM")) keys->push_back(args[4]);
}

}  // namespace

void RegisterClusterFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  r.Register(
      {"CLUSTER", -2, kCmdConnection, 0, 0, 0, Cluster, "cluster",
       "Redis Cluster's view of this Pion cluster: slots, shards, nodes, key slots, state.",
       "SLOTS|SHARDS|NODES|INFO|MYID|HELP|KEYSLOT <key>|COUNTKEYSINSLOT <slot>|SETSLOT <slot> NODE "
       "<node-id>"});
  r.Register({"ASKING", 1, kCmdFast | kCmdConnection, 0, 0, 0, Asking, "cluster",
              "The next command may use a slot this node is importing (after -ASK).", ""});
  r.Register({"READONLY", 1, kCmdFast | kCmdConnection, 0, 0, 0, ReadOnly, "cluster",
              "Refused: replicas hold saved copies, not live data.", ""});
  r.Register({"READWRITE", 1, kCmdFast | kCmdConnection, 0, 0, 0, ReadWrite, "cluster",
              "Reads and writes go to slot owners (the only mode).", ""});
  r.Register({"CLUSTER.PUT", -6, kCmdAdmin | kCmdWrite, 0, 0, 0, Put, "cluster",
              "Node to node: a copy of a saved object (replica, or a slot moving here).",
              "PREFIX|STATE|SSM|ATTENTION|VSNAP <tenant> <key> <version> <object_file> [<part>] "
              "[FROM <node-id> [MORE]]"});
  r.Register({"CLUSTER.DEL", -5, kCmdAdmin | kCmdWrite, 0, 0, 0, Del, "cluster",
              "Node to node: drop the copy of an object its owner dropped.",
              "PREFIX|STATE|SSM|ATTENTION|VSNAP <tenant> <key> <version> [<part>]"});
  r.Register({"CLUSTER.REFRESH", 1, kCmdAdmin, 0, 0, 0, Refresh, "cluster",
              "Node to node: read the slot map from etcd now.", ""});
  if (CommandSpec* store_from = r.FindMutable("ATTEND.PREFIX.STORE")) {
    store_from->more_keys = StoreFromKeys;
  }

  const Config& c = srv.config();
  if (c.cluster.empty()) return;
  srv.AddStartupHook(
      [](Server& s) -> Status {
        const Config& cfg = s.config();
        auto ep = cluster::ParseEtcdUrl(cfg.cluster);
        if (!ep.ok()) return ep.status();
        cluster::MembershipOptions o;
        o.etcd = ep.value();
        o.cluster_name = cfg.cluster_name;
        o.node_id = cfg.node_id;
        o.announce =
            cfg.announce.empty() ? cfg.bind + ":" + std::to_string(s.port()) : cfg.announce;
        o.replicas = cfg.replicas;
        o.lease_ttl_s = cfg.cluster_lease_ttl_s;
        auto node = std::make_unique<ClusterNode>(s, o);
        Status st = node->Start();
        if (!st.ok()) return st;
        ClusterNode* raw = node.get();
        s.set_cluster(std::move(node));
        s.AddShutdownHook([raw] { raw->Stop(); });
        return Status::Ok();
      },
      kExitCluster);
}

}  // namespace pion::families
