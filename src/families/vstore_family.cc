// V.* — token-indexed value sessions (seed 000): V.CREATE, V.STOREBATCH, V.FETCH, V.INFO,
// V.DROP, V.SNAPSHOT, V.RESTORE. Rows arrive as little-endian fp32 and are quantized to the
// session's codec on store; V.FETCH decodes to fp32, or with RAW sends the stored encoding
// (layout: src/store/codec/README.md) straight from the stored chunks.
//
// A session id "<ns>_pk" / "<ns>_pv" / "<ns>_pl" is routed like "<ns>", so a KV.PREFIX
// namespace and its sessions live on one shard.
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/families.h"
#include "families/kvprefix_internal.h"
#include "families/shard_sum.h"
#include "families/vstore_internal.h"
#include "net/connection.h"
#include "server/server.h"
#include "store/disk/object_file.h"

namespace pion::families {
namespace vstore {

store::PrefixEntry* PrefixOf(server::CommandContext& ctx, std::string_view sid) {
  std::string_view ns = SessionRouteKey(sid);
  if (ns.size() == sid.size()) return nullptr;
  return ctx.shard->store().prefixes.Find(ctx.Key(ns));
}

std::string_view SessionRouteKey(std::string_view sid) {
  if (sid.size() > 3 && (sid.ends_with("_pk") || sid.ends_with("_pv") || sid.ends_with("_pl"))) {
    return sid.substr(0, sid.size() - 3);
  }
  return sid;
}

}  // namespace vstore

namespace {

using vstore::PrefixOf;
using vstore::SessionRouteKey;

using proto::CmdArgs;
using server::CommandContext;

// Views a little-endian blob as T elements; copies into `scratch` when it is not aligned.
template <typename T>
const T* BlobAs(std::string_view blob, std::vector<T>* scratch) {
  if (reinterpret_cast<uintptr_t>(blob.data()) % alignof(T) == 0) {
    return reinterpret_cast<const T*>(blob.data());
  }
  scratch->resize(blob.size() / sizeof(T));
  std::memcpy(scratch->data(), blob.data(), scratch->size() * sizeof(T));
  return scratch->data();
}

void Create(CommandContext& ctx, CmdArgs& args) {
  uint64_t dim = 0, block = 0;
  Status s = ParseUint(args[2], "dim", &dim);
  if (!s.ok()) return ctx.Error(s);
  auto format = codec::ParseFormat(args[3]);
  if (!format) {
    return ctx.Error(Error("format must be one of " + std::string(codec::FormatChoices()) +
                           ", got '" + std::string(args[3].substr(0, 32)) + "'"));
  }
  if (args.size() == 6 && EqualsIgnoreCase(args[4], "BLOCK")) {
    s = ParseUint(args[5], "BLOCK", &block);
    if (!s.ok()) return ctx.Error(s);
  } else if (args.size() != 4) {
    return ctx.Error(Error("syntax: V.CREATE <sid> <dim> <format> [BLOCK <n>]"));
  }
  if (dim == 0 || dim > codec::RowCodec::kMaxDim || block > codec::RowCodec::kMaxTurboBlock) {
    return ctx.Error(Error("dim must be in [1, " + std::to_string(codec::RowCodec::kMaxDim) +
                           "], got " + std::to_string(dim)));
  }
  auto codec =
      codec::RowCodec::Create(*format, static_cast<uint32_t>(dim), static_cast<uint32_t>(block));
  if (!codec.ok()) return ctx.Error(codec.status());
  s = ctx.shard->store().vstore.Create(ctx.Key(args[1]), codec.value());
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Ok();
}

// Before a store: every written chunk it touches is pinned in memory (brought back first, as
// for a read: making room for the new bytes must not drop one of them), and its new bytes
// fit (demotions make room). False when the command was parked or refused (the reply is
// written).
bool ReadyToStore(CommandContext& ctx, const std::vector<residency::ObjectRef>& touched,
                  uint64_t bytes) {
  if (!touched.empty() && !ctx.Resident(touched, residency::Tier::kHost)) return false;
  server::MemoryAccountant& mem = ctx.server->memory();
  const uint64_t max = mem.maxmemory(), free = mem.Headroom(server::MemFamily::kVStore);
  if (free >= bytes) return true;
  if (max != 0 && bytes > max) {
    ctx.Error(Status(ErrorKind::kOom,
                     "command not allowed when used memory > 'maxmemory': vstore write of " +
                         std::to_string(bytes) + " bytes is more than all of maxmemory " +
                         std::to_string(max) + " (" + HumanBytes(max) + "); store it in parts"));
    return false;
  }
  return ctx.Room(residency::Tier::kHost, residency::Family::kVStore, bytes);
}

void StoreBatch(CommandContext& ctx, CmdArgs& args) {
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(args[1]);
  store::PrefixEntry* prefix = PrefixOf(ctx, args[1]);
  if (prefix != nullptr) {
    Status layout = kvprefix::CheckLayoutSession(args[1], prefix->manifest);
    if (!layout.ok()) return ctx.Error(layout);
  }
  if (prefix != nullptr &&
      kvprefix::ParkUntilOpen(ctx, {ctx.tenant, std::string(SessionRouteKey(args[1]))})) {
    return;  // a namespace found on disk: its sessions first
  }
  auto entry = vs.Get(key);
  if (!entry.ok()) return ctx.Error(entry.status());
  store::VSession& session = *entry.value()->session;
  const size_t row_floats_bytes = size_t{4} * session.dim();
  const uint64_t rows_before = session.rows();
  // A KV.PREFIX session: never into a published namespace, only rows of its manifest.
  const std::string_view ns = SessionRouteKey(args[1]);
  auto refused_by_prefix = [&](int64_t lo, int64_t hi) {
    if (prefix == nullptr) return false;
    Status st = kvprefix::Published(*ctx.shard, ctx.tenant, ns, prefix)
                    ? kvprefix::PublishedRefusal(ns, *prefix,
                                                 "V.STOREBATCH into '" + std::string(args[1]) + "'")
                    : kvprefix::CheckRows(ns, prefix->manifest, lo, hi);
    if (st.ok()) return false;
    ctx.Error(st);
    return true;
  };
  std::vector<float> fscratch;
  std::vector<residency::ObjectRef> touched;
  Status s;
  if (EqualsIgnoreCase(args[2], "IDS")) {
    if (args.size() != 5)
      return ctx.Error(
          Error("syntax: V.STOREBATCH <sid> IDS <int64_ids_blob> <fp32_blob> [DEADLINE <ms>]"));
    std::string_view ids_blob = args[3], data = args[4];
    if (ids_blob.size() % 8 != 0) {
      return ctx.Error(Error("int64_ids_blob has " + std::to_string(ids_blob.size()) +
                             " bytes, expected a multiple of 8"));
    }
    size_t n = ids_blob.size() / 8;
    if (data.size() != n * row_floats_bytes) {
      return ctx.Error(Error("fp32_blob has " + std::to_string(data.size()) + " bytes, expected " +
                             std::to_string(n) +
                             " ids * 4*dim = " + std::to_string(n * row_floats_bytes)));
    }
    std::vector<int64_t> iscratch;
    const int64_t* ids = BlobAs<int64_t>(ids_blob, &iscratch);
    if (n > 0) {
      const auto [lo, hi] = std::minmax_element(ids, ids + n);
      if (refused_by_prefix(*lo, *hi + 1)) return;
    }
    session.ChunksForIds(ids, n, &touched);
    if (!ReadyToStore(ctx, touched, session.BytesToStoreIds(ids, n))) return;
    if (prefix != nullptr) prefix->dirty = true;
    s = session.StoreIds(ids, BlobAs<float>(data, &fscratch), n, *ctx.pins);
  } else if ((args.size() == 5 || args.size() == 7) && EqualsIgnoreCase(args[3], "SHM")) {
    // The rows were written by the client into a SHM.RESERVE region: commit them.
    if (!ctx.unix_socket) {
      return ctx.Error(Error("SHM commits are only for clients on the Unix socket (--unixsocket)"));
    }
    int64_t start = 0;
    uint64_t lease = 0;
    s = ParseInt(args[2], "start_id", &start);
    if (s.ok()) s = ParseUint(args[4], "lease", &lease);
    if (!s.ok()) return ctx.Error(s);
    auto size = ctx.server->shm().PeekSize(ctx.client_id, lease);
    if (!size.ok()) return ctx.Error(size.status());
    if (size.value() % row_floats_bytes != 0) {
      (void)ctx.server->shm().Take(ctx.client_id, lease);  // spent
      return ctx.Error(Error("reserved region of lease " + std::to_string(lease) + " has " +
                             std::to_string(size.value()) +
                             " bytes, expected a multiple of 4*dim = " +
                             std::to_string(row_floats_bytes) + " (the lease is spent)"));
    }
    const size_t n = size.value() / row_floats_bytes;
    if (refused_by_prefix(start, start + static_cast<int64_t>(n))) return;
    if (start >= 0) session.ChunksForRange(start, n, &touched);
    if (!ReadyToStore(ctx, touched, session.BytesToStoreRange(start, n))) {
      return;  // the lease stays until the command runs again
    }
    auto region = ctx.server->shm().Take(ctx.client_id, lease);
    if (!region.ok()) return ctx.Error(region.status());
    const BufferRef& b = region.value();
    if (args.size() == 7) {  // CRC32 <value>: the region must hold what the client meant
      if (!EqualsIgnoreCase(args[5], "CRC32")) {
        return ctx.Error(Error("unknown option '" + std::string(args[5].substr(0, 32)) +
                               "'; expected CRC32 <value>"));
      }
      uint64_t want = 0;
      s = ParseUint(args[6], "CRC32", &want);
      if (!s.ok()) return ctx.Error(s);
      const uint64_t got = crc32_z(crc32_z(0, nullptr, 0), b->data(), b->size());
      if (got != want) {
        return ctx.Error(Status(ErrorKind::kCorrupt,
                                "SHM region of lease " + std::to_string(lease) + " has CRC32 " +
                                    std::to_string(got) + ", expected " + std::to_string(want) +
                                    "; nothing stored (the lease is spent)"));
      }
    }
    if (prefix != nullptr) prefix->dirty = true;
    s = session.StoreRange(start, reinterpret_cast<const float*>(b->data()), n, *ctx.pins);
    if (!s.ok()) return ctx.Error(s);
    vs.NoteRows(static_cast<int64_t>(session.rows() - rows_before));
    ++entry.value()->writes;
    if (prefix != nullptr) (void)kvprefix::Published(*ctx.shard, ctx.tenant, ns, prefix);
    return ctx.rb->Integer(static_cast<int64_t>(n));
  } else {
    if (args.size() != 4) {
      return ctx.Error(Error(
          "syntax: V.STOREBATCH <sid> <start_id> <fp32_blob> | <sid> IDS <int64_ids_blob> "
          "<fp32_blob> | <sid> <start_id> SHM <lease> [CRC32 <value>], then [DEADLINE <ms>]"));
    }
    int64_t start = 0;
    s = ParseInt(args[2], "start_id", &start);
    if (!s.ok()) return ctx.Error(s);
    std::string_view data = args[3];
    if (data.empty() || data.size() % row_floats_bytes != 0) {
      return ctx.Error(Error(
          "fp32_blob has " + std::to_string(data.size()) +
          " bytes, expected a non-zero multiple of 4*dim = " + std::to_string(row_floats_bytes)));
    }
    const size_t n = data.size() / row_floats_bytes;
    if (refused_by_prefix(start, start + static_cast<int64_t>(n))) return;
    if (start >= 0) session.ChunksForRange(start, n, &touched);
    if (!ReadyToStore(ctx, touched, session.BytesToStoreRange(start, n))) return;
    if (prefix != nullptr) prefix->dirty = true;
    s = session.StoreRange(start, BlobAs<float>(data, &fscratch), n, *ctx.pins);
  }
  if (!s.ok()) return ctx.Error(s);
  vs.NoteRows(static_cast<int64_t>(session.rows() - rows_before));
  ++entry.value()->writes;
  // The write that completes a namespace publishes it (its publication generation).
  if (prefix != nullptr) (void)kvprefix::Published(*ctx.shard, ctx.tenant, ns, prefix);
  size_t stored =
      EqualsIgnoreCase(args[2], "IDS") ? args[3].size() / 8 : args[3].size() / row_floats_bytes;
  ctx.rb->Integer(static_cast<int64_t>(stored));
}

// A session of a published KV.PREFIX namespace never changes (kvprefix::Published): V.DROP and
// V.RESTORE of one are refused like a write. Ok otherwise.
Status CheckNotPublished(CommandContext& ctx, std::string_view sid, std::string_view what) {
  store::PrefixEntry* prefix = PrefixOf(ctx, sid);
  const std::string_view ns = SessionRouteKey(sid);
  if (prefix == nullptr || !kvprefix::Published(*ctx.shard, ctx.tenant, ns, prefix)) {
    return Status::Ok();
  }
  return kvprefix::PublishedRefusal(ns, *prefix,
                                    std::string(what) + " of '" + std::string(sid) + "'");
}

void Drop(CommandContext& ctx, CmdArgs& args) {
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(args[1]);
  if (Status s = CheckNotPublished(ctx, args[1], "V.DROP"); !s.ok()) return ctx.Error(s);
  bool existed = vs.Drop(key);
  std::vector<uint64_t> snapshots;
  vs.ForEachSealed([&](const store::TenantKey& k, uint64_t n, const auto&) {
    if (k == key) snapshots.push_back(n);
  });
  std::vector<std::string> sealed = vs.TakeSealed(key);
  if (!sealed.empty()) {
    // Sealed snapshots go too: a dropped session leaves nothing behind, in memory or on disk.
    Status s = store::disk::RemoveFiles(vstore::SealedDir(*ctx.server), sealed);
    if (!s.ok()) return ctx.Error(s);
    existed = true;
  }
  if (snapshots.empty() || !cluster_sync::Enabled(*ctx.server)) {
    return ctx.rb->Integer(existed ? 1 : 0);
  }
  // Cluster mode: acknowledged once the replicas dropped their copies too.
  auto done = cluster_sync::Gather(
      snapshots.size(),
      cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Integer(1); }));
  const std::string tenant = ctx.server->users().TenantName(key.tenant);
  for (uint64_t n : snapshots) {
    cluster_sync::ReplicateDrop(*ctx.server, {"VSNAP", tenant, key.name, std::to_string(n)}, 1,
                                done);
  }
}

void Snapshot(CommandContext& ctx, CmdArgs& args) {
  auto entry = ctx.shard->store().vstore.Get(ctx.Key(args[1]));
  if (!entry.ok()) return ctx.Error(entry.status());
  auto* e = entry.value();
  uint64_t id = e->next_snapshot++;
  e->snapshots.emplace(id, e->session->TakeSnapshot());
  ctx.rb->Integer(static_cast<int64_t>(id));
}

void Restore(CommandContext& ctx, CmdArgs& args) {
  auto& vs = ctx.shard->store().vstore;
  uint64_t id = 0;
  Status s = ParseUint(args[2], "snapshot", &id);
  if (!s.ok()) return ctx.Error(s);
  if (s = CheckNotPublished(ctx, args[1], "V.RESTORE"); !s.ok()) return ctx.Error(s);
  store::VStore::Entry* e = vs.Find(ctx.Key(args[1]));
  const bool in_memory = e != nullptr && e->snapshots.count(id) != 0;
  if (!in_memory) {
    if (vs.FindSealed(ctx.Key(args[1]), id) != nullptr) {
      return vstore::RestoreSealed(ctx, std::string(args[1]), id);  // from disk
    }
    if (e == nullptr) return ctx.Error(Error("no such session '" + std::string(args[1]) + "'"));
    return ctx.Error(
        Error("no snapshot " + std::to_string(id) + " of session '" + std::string(args[1]) + "'"));
  }
  if (store::PrefixEntry* p = PrefixOf(ctx, args[1])) p->dirty = true;
  uint64_t before = e->session->rows();
  e->session->Restore(e->snapshots.at(id));
  ++e->writes;
  vs.NoteRows(static_cast<int64_t>(e->session->rows()) - static_cast<int64_t>(before));
  ctx.rb->Ok();
}

void InfoOne(CommandContext& ctx, std::string_view sid) {
  auto entry = ctx.shard->store().vstore.Get(ctx.Key(sid));
  if (!entry.ok()) {
    // A session the namespace's layout lacks (a per-head reader asking an MLA namespace for
    // "<ns>_pk"): say so rather than "no such session".
    if (const store::PrefixEntry* prefix = PrefixOf(ctx, sid)) {
      Status layout = kvprefix::CheckLayoutSession(sid, prefix->manifest);
      if (!layout.ok()) return ctx.Error(layout);
    }
    return ctx.Error(entry.status());
  }
  const auto& e = *entry.value();
  const auto& c = e.session->codec();
  auto& rb = *ctx.rb;
  rb.Map(9);
  rb.Bulk("dim");
  rb.Integer(c.dim());
  rb.Bulk("format");
  rb.Bulk(codec::FormatName(c.format()));
  rb.Bulk("block");
  rb.Integer(c.block());
  rb.Bulk("row_bytes");
  rb.Integer(static_cast<int64_t>(c.row_bytes()));
  rb.Bulk("rows");
  rb.Integer(static_cast<int64_t>(e.session->rows()));
  rb.Bulk("chunks");
  rb.Integer(static_cast<int64_t>(e.session->chunk_count()));
  rb.Bulk("bytes");
  rb.Integer(static_cast<int64_t>(e.session->chunk_bytes()));
  rb.Bulk("snapshots");
  rb.Integer(static_cast<int64_t>(e.snapshots.size()));
  rb.Bulk("sealed");
  rb.Integer(static_cast<int64_t>(ctx.shard->store().vstore.SealedCount(ctx.Key(sid))));
}

void Info(CommandContext& ctx, CmdArgs& args) {
  if (args.size() == 2) return InfoOne(ctx, args[1]);  // on the session's shard
  if (args.size() > 2) return ctx.Error(Error("syntax: V.INFO [<sid>]"));
  const uint32_t tenant = ctx.tenant;
  ReplySumOverShards(ctx, {{"sessions"}, {"rows"}, {"snapshots"}}, [tenant](server::Shard& shard) {
    auto u = shard.store().vstore.UsageOf(tenant);
    return std::vector<double>{static_cast<double>(u.sessions), static_cast<double>(u.rows),
                               static_cast<double>(u.snapshots)};
  });
}

}  // namespace

void RegisterVStoreFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  auto reg = [&](CommandSpec spec) {
    if (spec.first_key == 1) spec.route_key = SessionRouteKey;
    r.Register(std::move(spec));
  };
  reg({"V.CREATE", -4, kKv | kCmdWrite, 1, 1, 1, Create, "vstore",
       "Creates a token-indexed session of fixed row width in one codec.",
       "<sid> <dim> fp32|fp16|bf16|int8|turbo4|turbo3|turbo2|fp8|fp8_e5m2 [BLOCK <n>]"});
  reg(WithOptions(
      {"V.STOREBATCH", -4, kKv | kCmdWrite | kCmdDenyOom | kCmdDeadline, 1, 1, 1, StoreBatch,
       "vstore", "Stores fp32 rows (quantized to the session's codec) at consecutive or given ids.",
       "<sid> <start_id> <fp32_blob> | <sid> IDS <int64_ids_blob> <fp32_blob> | <sid> <start_id> "
       "SHM <lease> [CRC32 <value>]"},
      {{"CRC32", 1}}));
  reg(WithOptions(
      {"V.FETCH", -3, kKv | kCmdReadOnly | kCmdDeadline, 1, 1, 1, vstore::Fetch, "vstore",
       "Fetches rows as fp32 (or RAW stored encoding) by ids or an id range; of a "
       "KV.PREFIX session, some K/V heads (HEADS) or in another codec (AS).",
       "<sid> <id> [<id> ...] | <sid> RANGE <start> <end>, then [RAW|SHM] "
       "[HEADS <first> <count>] [AS <codec>] [MODEL <id>] [GENERATION <g>]"},
      {{"RAW", 0}, {"SHM", 0}, {"MODEL", 1}, {"GENERATION", 1}, {"HEADS", 2}, {"AS", 1}}));
  reg({"V.DROP", 2, kKv | kCmdWrite, 1, 1, 1, Drop, "vstore",
       "Deletes a session and its snapshots; replies 1 if it existed.", "<sid>"});
  reg({"V.SNAPSHOT", 2, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, Snapshot, "vstore",
       "Takes a point-in-time snapshot (later writes do not change it); replies its id.", "<sid>"});
  reg({"V.RESTORE", 3, kKv | kCmdWrite, 1, 1, 1, Restore, "vstore",
       "Makes the session's content equal to a snapshot (in memory, or sealed on disk).",
       "<sid> <snapshot>"});
  // V.INFO <sid> is routed to the session's shard; bare V.INFO runs on the connection's shard
  // and fans out.
  reg({"V.COMMIT", 3, kKv | kCmdWrite, 1, 1, 1, vstore::Commit, "vstore",
       "Seals a snapshot durably in the disk tier; replies once it is durable.",
       "<sid> <snapshot>"});
  reg({"V.INFO", -1, kKv | kCmdReadOnly | kCmdConnection, 1, 1, 1, Info, "vstore",
       "Per-session statistics, or the caller's totals without a sid.", "[<sid>]"});
  srv.AddStartupHook(vstore::LoadSealed);
  cluster_sync::AddSavedKind(vstore::SavedKindOf());
  srv.AddShardInit([&srv](Shard& shard) { shard.store().vstore.set_engine(srv.residency()); });
}

}  // namespace pion::families
