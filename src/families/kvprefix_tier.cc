// KV.PREFIX disk tier: SAVE, WARM, discovery at start-up, and promotion of disk-only prefixes.
//
// SAVE snapshots the namespace's sessions on the owning shard (copy-on-write chunks: later
// writes do not change what is being saved), writes a new object version on the I/O pool
// (temp file, fsync, rename, directory fsync) and replies only after that; the previous
// version stays valid until the new one is durable. At start-up every saved object is found,
// its header validated, and its namespace registered as not resident; the first LOOKUP or
// WARM reads it back on the I/O pool, verifying every block's checksum, and publishes it. A
// corrupted or truncated object is logged, counted in INFO, refused on access, never served.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "families/args.h"
#include "families/kvprefix_internal.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/prefix_object.h"

namespace pion::families::kvprefix {
namespace {

using proto::CmdArgs;
using server::CommandContext;
using store::PrefixEntry;

// What the I/O thread read back for one namespace.
struct LoadResult {
  Status status;
  std::vector<store::LoadedChunk> chunks;
};

void ReadPrefix(const std::string& path, const store::PrefixManifest& m, LoadResult* out) {
  auto codec = codec::RowCodec::Create(m.format, m.dim());
  if (!codec.ok()) {
    out->status = Status(ErrorKind::kCorrupt, path + ": " + codec.status().message());
    return;
  }
  auto chunks = store::ReadChunkObject(path, codec.value());
  if (!chunks.ok()) {
    out->status = chunks.status();
    return;
  }
  out->chunks = std::move(chunks).value();
}

// Runs on the owning shard when the read finished.
void FinishWarm(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                uint64_t generation, LoadResult& r) {
  PrefixEntry* e = shard.store().prefixes.Find(key);
  if (e == nullptr || e->manifest.cache_generation != generation || !e->warming) return;
  e->warming = false;
  Status s = r.status;
  if (s.ok()) {
    const auto& m = e->manifest;
    auto codec = codec::RowCodec::Create(m.format, m.dim()).value();
    auto& vs = shard.store().vstore;
    std::vector<std::tuple<int64_t, BufferRef, uint64_t>> parts[2];
    for (auto& c : r.chunks) parts[c.part].emplace_back(c.index, c.bytes, c.written);
    const char* suffix[2] = {"_pk", "_pv"};
    for (int p = 0; p < 2 && s.ok(); ++p) {
      store::TenantKey sk{key.tenant, key.name + suffix[p]};
      vs.Drop(sk);
      s = vs.Create(sk, codec);
      if (s.ok()) {
        auto* entry = vs.Find(sk);
        s = entry->session->Load(parts[p]);
        if (s.ok()) vs.NoteRows(static_cast<int64_t>(entry->session->rows()));
      }
    }
    if (s.ok()) {
      e->resident = true;
      e->dirty = false;
      shard.store().prefixes.Touch(e);
      srv.disk_stats().warms.fetch_add(1);
    } else {
      vs.Drop({key.tenant, key.name + "_pk"});
      vs.Drop({key.tenant, key.name + "_pv"});
    }
  }
  if (s.kind() == ErrorKind::kCorrupt) {
    e->corrupt = s.message();
    srv.disk_stats().objects_corrupt.fetch_add(1);
    spdlog::error("disk tier: prefix '{}' is corrupt and will not be served: {}", key.name,
                  s.message());
  }
  auto waiters = std::move(e->warm_waiters);
  e->warm_waiters.clear();
  for (auto& w : waiters) w(s);
}

void Save(CommandContext& ctx, CmdArgs& args) {
  auto& srv = *ctx.server;
  const store::TenantKey key = ctx.Key(args[1]);
  PrefixEntry* e = ctx.shard->store().prefixes.Find(key);
  if (e == nullptr) return ctx.Error(Error("no such prefix namespace '" + key.name + "'"));
  if (!e->corrupt.empty()) return ctx.Error(Status(ErrorKind::kCorrupt, e->corrupt));
  if (!e->resident) return ctx.rb->Ok();  // only on disk: already saved
  PrefixSessions s = SessionsOf(*ctx.shard, ctx.tenant, key.name, e->manifest);
  if (!s.ok()) {
    return ctx.Error(Error("namespace '" + key.name +
                           "' has lost its sessions (V.DROP); "
                           "KV.PREFIX.DROP and register it again"));
  }
  store::PrefixRecord rec;
  rec.tenant = srv.users().TenantName(ctx.tenant);
  rec.ns = key.name;
  rec.manifest = e->manifest;
  rec.prefill_ms = e->prefill_ms;
  rec.complete = Complete(s, e->manifest);
  // Snapshots share the chunks: what is saved is exactly this moment's content.
  auto snap_k = std::make_shared<store::VSession::Snapshot>(s.k->TakeSnapshot());
  auto snap_v = std::make_shared<store::VSession::Snapshot>(s.v->TakeSnapshot());
  const uint64_t version = ctx.shard->store().prefixes.NextVersion(key);
  e->dirty = false;  // a write from now on sets it again
  ctx.shard->store().prefixes.Touch(e);
  const uint64_t generation = e->manifest.cache_generation;
  const std::string dir = PrefixDir(srv);
  const std::string name = store::PrefixObjectName(rec.tenant, rec.ns);
  auto reply = ctx.Defer();
  server::Shard* owner = ctx.shard;
  server::Server* server = &srv;
  bool queued = srv.io()->Submit([=]() {
    std::string index;
    auto blocks = store::ChunkBlocks({snap_k.get(), snap_v.get()}, &index);
    uint64_t bytes = 0;
    for (auto& b : blocks) bytes += b.size();
    Status st = store::disk::WriteObject(dir, name, version, store::EncodePrefixMeta(rec), blocks);
    owner->PostControl([=](server::Shard& sh) {
      PrefixEntry* cur = sh.store().prefixes.Find(key);
      const std::string path = store::disk::ObjectPath(dir, name, version);
      if (cur == nullptr || cur->manifest.cache_generation != generation) {
        if (st.ok()) unlink(path.c_str());  // dropped meanwhile: the drop wins
        server->disk_stats().save_failures.fetch_add(1);
        return reply([key](proto::ReplyBuilder& rb) {
          rb.ErrorLine("ERR namespace '" + key.name + "' was dropped during the save");
        });
      }
      if (!st.ok()) {
        cur->dirty = true;  // the snapshot never reached the disk
        server->disk_stats().save_failures.fetch_add(1);
        spdlog::error("disk tier: saving prefix '{}' failed: {}", key.name, st.message());
        return reply([st](proto::ReplyBuilder& rb) { rb.Error(st); });
      }
      if (version > cur->saved_version) {
        cur->saved_version = version;
        cur->disk_path = path;
        cur->disk_bytes = bytes;
        cur->saved_complete = rec.complete;
      }
      server->disk_stats().saves.fetch_add(1);
      reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
    });
  });
  if (!queued) {
    reply([](proto::ReplyBuilder& rb) {
      rb.ErrorLine("BUSY the disk I/O queue is full; retry later");
    });
  }
}

void WarmCmd(CommandContext& ctx, CmdArgs& args) {
  const store::TenantKey key = ctx.Key(args[1]);
  if (ctx.shard->store().prefixes.Find(key) == nullptr) {
    return ctx.Error(Error("no such prefix namespace '" + key.name + "'"));
  }
  auto reply = ctx.Defer();
  Warm(*ctx.server, *ctx.shard, key, [reply](const Status& s) {
    reply([s](proto::ReplyBuilder& rb) {
      if (s.ok()) {
        rb.Ok();
      } else {
        rb.Error(s);
      }
    });
  });
}

// Start-up: register every saved namespace (not resident) on its owning shard.
Status LoadDiskTier(server::Server& srv) {
  const std::string dir = PrefixDir(srv);
  auto listed = store::disk::ListObjects(dir);
  if (!listed.ok()) return listed.status();
  Status s = store::disk::RemoveLeftoverTemps(dir);
  if (!s.ok()) return s;
  size_t loaded = 0, corrupt = 0;
  for (const auto& o : *listed) {
    // The object name is "prefix\0<tenant>\0<ns>".
    auto p1 = o.name.find('\0'), p2 = o.name.find('\0', p1 + 1);
    if (o.name.compare(0, p1, "prefix") != 0 || p2 == std::string::npos) continue;
    const std::string tenant = o.name.substr(p1 + 1, p2 - p1 - 1), ns = o.name.substr(p2 + 1);
    const uint32_t tid = srv.users().TenantId(tenant);
    const store::TenantKey key{tid, ns};
    auto& reg = srv.shard(srv.OwnerOf(tid, ns)).store().prefixes;
    reg.NoteVersion(key, o.version);
    auto f = store::disk::ObjectFile::Open(o.path);
    StatusOr<store::PrefixRecord> rec =
        f.ok() ? store::DecodePrefixMeta(f->meta()) : StatusOr<store::PrefixRecord>(f.status());
    if (!rec.ok()) {
      PrefixEntry* e = reg.AddFromDisk(key, store::PrefixManifest{}, 0);
      e->corrupt = rec.status().message();
      e->disk_path = o.path;
      e->saved_version = o.version;
      ++corrupt;
      spdlog::error("disk tier: prefix '{}' (tenant '{}') is corrupt and will not be served: {}",
                    ns, tenant, rec.status().message());
      continue;
    }
    PrefixEntry* e = reg.AddFromDisk(key, rec->manifest, rec->prefill_ms);
    e->saved_version = o.version;
    e->disk_path = o.path;
    e->disk_bytes = f->data_bytes();
    e->saved_complete = rec->complete;
    ++loaded;
  }
  srv.disk_stats().objects_loaded.store(loaded);
  srv.disk_stats().objects_corrupt.store(corrupt);
  if (loaded + corrupt > 0) {
    spdlog::info("disk tier: found {} saved prefix(es) under {}{}", loaded, dir,
                 corrupt ? fmt::format(" and {} corrupt one(s)", corrupt) : "");
  }
  return Status::Ok();
}

// The kVStore reclaimer (runs on the shard whose write needs room). First it drops the memory
// copy of the least recently used namespaces whose newest content is safely on disk (they come
// back on demand); if that is not enough it evicts the least recently used unsaved namespaces
// (counted: their data is gone and LOOKUP misses). Never a namespace being written or being
// promoted. Replies in flight keep their chunks alive until sent.
uint64_t DemoteForRoom(server::Server& srv, uint64_t need) {
  server::Shard* shard = server::Shard::Current();
  if (shard == nullptr) return 0;
  auto& reg = shard->store().prefixes;
  auto& vs = shard->store().vstore;
  struct Candidate {
    bool unsaved;
    uint64_t last_used;
    store::TenantKey key;
  };
  std::vector<Candidate> candidates;
  reg.ForEachEntry([&](const store::TenantKey& k, PrefixEntry& e) {
    if (!e.resident || e.warming || e.writing || !e.corrupt.empty()) return;
    const bool clean_on_disk = !e.dirty && e.saved_version > 0;
    candidates.push_back({!clean_on_disk, e.last_used, k});
  });
  // Demotions (clean, saved) before evictions (unsaved); least recently used first.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.unsaved != b.unsaved ? !a.unsaved : a.last_used < b.last_used;
  });
  uint64_t freed = 0;
  for (const auto& c : candidates) {
    if (freed >= need) break;
    for (const char* suffix : {"_pk", "_pv"}) {
      store::TenantKey sk{c.key.tenant, c.key.name + suffix};
      if (auto* s = vs.Find(sk)) freed += s->session->chunk_bytes();
      vs.Drop(sk);
    }
    PrefixEntry* e = reg.Find(c.key);
    if (c.unsaved && e->saved_version == 0) {
      reg.Drop(c.key);  // nothing on disk: the namespace is gone
      srv.disk_stats().evictions.fetch_add(1);
    } else if (c.unsaved) {
      e->resident = false;  // unsaved writes are lost; the older saved version remains
      e->dirty = false;
      srv.disk_stats().evictions.fetch_add(1);
    } else {
      e->resident = false;
      srv.disk_stats().demotions.fetch_add(1);
    }
  }
  return freed;
}

}  // namespace

std::string PrefixDir(server::Server& srv) { return srv.config().dir + "/prefixes"; }

void Warm(server::Server& srv, server::Shard& shard, const store::TenantKey& ns,
          std::function<void(const Status&)> done) {
  PrefixEntry* e = shard.store().prefixes.Find(ns);
  if (e == nullptr) return done(Error("no such prefix namespace '" + ns.name + "'"));
  if (!e->corrupt.empty()) return done(Status(ErrorKind::kCorrupt, e->corrupt));
  if (e->resident) return done(Status::Ok());
  e->warm_waiters.push_back(std::move(done));
  if (e->warming) return;  // coalesced: one read serves every waiter
  e->warming = true;
  const std::string path = e->disk_path;
  const store::PrefixManifest m = e->manifest;
  const uint64_t generation = m.cache_generation;
  server::Shard* owner = &shard;
  server::Server* server = &srv;
  bool queued = srv.io()->Submit([=]() {
    auto result = std::make_shared<LoadResult>();
    ReadPrefix(path, m, result.get());
    owner->PostControl(
        [=](server::Shard& sh) { FinishWarm(*server, sh, ns, generation, *result); });
  });
  if (!queued) {
    e->warming = false;
    CancelWarm(e, Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
  }
}

void CancelWarm(PrefixEntry* e, const Status& why) {
  auto waiters = std::move(e->warm_waiters);
  e->warm_waiters.clear();
  e->warming = false;
  for (auto& w : waiters) w(why);
}

void RegisterTierCommands(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"KV.PREFIX.SAVE", 2, kKv | kCmdWrite, 1, 1, 1, Save, "kvprefix",
              "Persists the namespace to the disk tier; replies after it is durable.", "<ns>"});
  r.Register({"KV.PREFIX.WARM", 2, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, WarmCmd, "kvprefix",
              "Promotes a saved namespace from disk to memory (verifying checksums).", "<ns>"});
  srv.AddStartupHook(LoadDiskTier);
  srv.memory().SetReclaimer(server::MemFamily::kVStore,
                            [&srv](uint64_t need, bool) { return DemoteForRoom(srv, need); });
}

}  // namespace pion::families::kvprefix
