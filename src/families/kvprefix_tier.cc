// KV.PREFIX disk tier: SAVE, WARM, discovery at start-up, and opening a namespace found on disk.
//
// A namespace's chunks are residency objects (residency/object.h): under memory pressure the
// engine moves the least recently used to disk and brings them back when read, whether the
// namespace was saved or not. SAVE is what makes one durable: it snapshots the namespace's
// sessions on the owning shard (copy-on-write chunks: later writes do not change what is being
// saved), writes a new object version on the I/O pool — each chunk from whichever tier holds
// it — (temp file, fsync, rename, directory fsync) and replies only after that; the previous
// version stays valid until the new one is durable, and the saved chunks keep it as their disk
// copy (a later demotion writes nothing). At start-up every saved object is found and its
// header validated; the first use of the namespace reads its chunk index and knows every chunk
// by its disk copy, and each chunk is read (and its checksum verified) when it is first needed.
// A corrupted or truncated object is logged, counted in INFO, refused on access, never served.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/kvprefix_internal.h"
#include "families/tiering.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/prefix_object.h"

namespace pion::families::kvprefix {
namespace {

using proto::CmdArgs;
using server::CommandContext;
using store::PrefixEntry;

using ChunkIndex = std::vector<std::vector<store::VSession::DiskChunk>>;

// Drops the namespace's V-store sessions (those of its layout).
void DropSessions(server::Shard& shard, const store::TenantKey& key,
                  const store::PrefixManifest& m) {
  for (std::string_view suffix : m.SessionSuffixes()) {
    shard.store().vstore.Drop({key.tenant, key.name + std::string(suffix)});
  }
}

// Runs on the owning shard when the chunk index was read.
void FinishOpen(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                uint64_t generation, const StatusOr<ChunkIndex>& index) {
  PrefixEntry* e = shard.store().prefixes.Find(key);
  if (e == nullptr || e->manifest.cache_generation != generation || !e->opening) return;
  e->opening = false;
  Status s = index.status();
  if (s.ok()) {
    const auto& m = e->manifest;
    auto codec = codec::RowCodec::Create(m.format, m.dim()).value();
    auto& vs = shard.store().vstore;
    const auto suffix = m.SessionSuffixes();
    for (size_t p = 0; p < suffix.size() && s.ok(); ++p) {
      store::TenantKey sk{key.tenant, key.name + std::string(suffix[p])};
      vs.Drop(sk);
      s = vs.Create(sk, codec);
      if (s.ok()) {
        auto* entry = vs.Find(sk);
        s = entry->session->LoadFromDisk(e->saved_file, index.value()[p]);
        if (s.ok()) vs.NoteRows(static_cast<int64_t>(entry->session->rows()));
      }
    }
    if (s.ok()) {
      e->resident = true;
      e->dirty = false;
      srv.disk_stats().warms.fetch_add(1);
    } else {
      DropSessions(shard, key, m);
    }
  }
  if (s.kind() == ErrorKind::kCorrupt) {
    e->corrupt = s.message();
    srv.disk_stats().objects_corrupt.fetch_add(1);
    spdlog::error("disk tier: prefix '{}' is corrupt and will not be served: {}", key.name,
                  s.message());
  }
  auto waiters = std::move(e->open_waiters);
  e->open_waiters.clear();
  for (auto& w : waiters) w(s);
}

// What a save of one namespace writes, taken on the owning shard.
struct SaveJob {
  std::string name;  // the object's name
  uint64_t version = 0;
  std::string meta;
  std::vector<residency::Engine::SaveItem> items;
  uint64_t generation = 0;
  bool complete = false;
  std::string tenant;
};

// Snapshots the namespace's sessions (copy-on-write chunks: exactly this moment's content) for
// a save. Runs on the owning shard; kErr when the namespace lost its sessions.
StatusOr<SaveJob> PrepareSave(server::Server& srv, server::Shard& shard,
                              const store::TenantKey& key, PrefixEntry* e) {
  PrefixSessions s = SessionsOf(shard, key.tenant, key.name, e->manifest);
  if (!s.ok()) {
    return Error("namespace '" + key.name +
                 "' has lost its sessions (V.DROP); "
                 "KV.PREFIX.DROP and register it again");
  }
  store::PrefixRecord rec;
  rec.tenant = srv.users().TenantName(key.tenant);
  rec.ns = key.name;
  rec.manifest = e->manifest;
  rec.prefill_ms = e->prefill_ms;
  rec.complete = Complete(s, e->manifest);
  std::vector<store::VSession::Snapshot> snaps;
  for (const store::VSession* sess : s.all()) snaps.push_back(sess->TakeSnapshot());
  std::vector<const store::VSession::Snapshot*> parts;
  for (const auto& snap : snaps) parts.push_back(&snap);
  std::vector<residency::ObjectRef> chunks;
  SaveJob job;
  job.items.resize(1);
  job.items[0].bytes = store::ChunkIndex(parts, &chunks);
  for (auto& c : chunks) job.items.push_back({"", std::move(c)});
  job.version = shard.store().prefixes.NextVersion(key);
  job.generation = e->manifest.cache_generation;
  job.complete = rec.complete;
  job.tenant = rec.tenant;
  job.name = store::PrefixObjectName(rec.tenant, rec.ns);
  job.meta = store::EncodePrefixMeta(rec);
  e->dirty = false;  // a write from now on sets it again
  return job;
}

// On the owning shard once the save's file is durable (or failed): publishes the version.
// Returns what the save's reply says.
Status FinishSave(server::Shard& sh, const store::TenantKey& key, uint64_t version,
                  uint64_t generation, bool complete,
                  const StatusOr<std::shared_ptr<residency::DiskFile>>& file) {
  PrefixEntry* cur = sh.store().prefixes.Find(key);
  if (cur == nullptr || cur->manifest.cache_generation != generation) {
    if (file.ok()) unlink(file.value()->path().c_str());  // dropped meanwhile: the drop wins
    return Error("namespace '" + key.name + "' was dropped during the save");
  }
  if (!file.ok()) {
    cur->dirty = true;  // the snapshot never reached the disk
    spdlog::error("disk tier: saving prefix '{}' failed: {}", key.name, file.status().message());
    return file.status();
  }
  if (version > cur->saved_version) {
    cur->saved_version = version;
    cur->saved_file = file.value();
    cur->disk_path = file.value()->path();
    cur->disk_bytes = file.value()->file().data_bytes();
    cur->saved_complete = complete;
  }
  return Status::Ok();
}

void Save(CommandContext& ctx, CmdArgs& args) {
  auto& srv = *ctx.server;
  const store::TenantKey key = ctx.Key(args[1]);
  PrefixEntry* e = ctx.shard->store().prefixes.Find(key);
  if (e == nullptr) return ctx.Error(Error("no such prefix namespace '" + key.name + "'"));
  if (!e->corrupt.empty()) return ctx.Error(Status(ErrorKind::kCorrupt, e->corrupt));
  if (!e->resident) return ctx.rb->Ok();  // only on disk: already saved
  auto job = PrepareSave(srv, *ctx.shard, key, e);
  if (!job.ok()) return ctx.Error(job.status());
  const uint64_t version = job->version, generation = job->generation;
  const bool complete = job->complete;
  const std::string tenant = job->tenant;
  server::Server* srv_ptr = &srv;
  SaveObjects(ctx, PrefixDir(srv), job->name, version, std::move(job->meta), std::move(job->items),
              [srv_ptr, key, tenant, version, generation, complete](server::Shard& sh, auto file,
                                                                    auto reply) {
                Status s = FinishSave(sh, key, version, generation, complete, file);
                if (!s.ok()) return reply([s](proto::ReplyBuilder& rb) { rb.Error(s); });
                if (!cluster_sync::Enabled(*srv_ptr)) {
                  return reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
                }
                // Cluster mode: acknowledged once the replicas hold it too.
                cluster_sync::ReplicateSaved(
                    *srv_ptr, {"PREFIX", tenant, key.name, ""}, version, file.value()->path(),
                    cluster_sync::AnswerWith(reply, [](proto::ReplyBuilder& rb) { rb.Ok(); }));
              });
}

// KV.PREFIX.WARM <ns> [DEADLINE <ms>]: every chunk into host memory (a prefetch).
void WarmCmd(CommandContext& ctx, CmdArgs& args) {
  if (args.size() != 2) return ctx.WrongArity();
  const store::TenantKey key = ctx.Key(args[1]);
  PrefixEntry* e = ctx.shard->store().prefixes.Find(key);
  if (e == nullptr) return ctx.Error(Error("no such prefix namespace '" + key.name + "'"));
  if (!e->corrupt.empty()) return ctx.Error(Status(ErrorKind::kCorrupt, e->corrupt));
  if (ParkUntilOpen(ctx, key)) return;
  PrefixSessions s = SessionsOf(*ctx.shard, ctx.tenant, key.name, e->manifest);
  if (!s.ok()) return ctx.Error(Error("namespace '" + key.name + "' has lost its sessions"));
  Status intact = Intact(*ctx.server, key, e, s);
  if (!intact.ok()) return ctx.Error(intact);
  if (!ctx.Resident(ChunkObjects(s), residency::Tier::kHost)) return;
  ctx.rb->Ok();
}

// Start-up: register every saved namespace (not open) on its owning shard.
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
    auto f = srv.residency()->OpenSaved(o.path);
    StatusOr<store::PrefixRecord> rec = f.ok() ? store::DecodePrefixMeta(f.value()->file().meta())
                                               : StatusOr<store::PrefixRecord>(f.status());
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
    e->saved_file = f.value();
    e->disk_bytes = f.value()->file().data_bytes();
    e->saved_complete = rec->complete;
    ++loaded;
  }
  srv.disk_stats().objects_loaded.fetch_add(loaded);
  srv.disk_stats().objects_corrupt.fetch_add(corrupt);
  if (loaded + corrupt > 0) {
    spdlog::info("disk tier: found {} saved prefix(es) under {}{}", loaded, dir,
                 corrupt ? fmt::format(" and {} corrupt one(s)", corrupt) : "");
  }
  return Status::Ok();
}

}  // namespace

std::string PrefixDir(server::Server& srv) { return srv.config().dir + "/prefixes"; }

std::vector<residency::ObjectRef> ChunkObjects(const PrefixSessions& s) {
  std::vector<residency::ObjectRef> out;
  for (const store::VSession* sess : s.all()) {
    for (const auto& [i, c] : sess->chunks()) out.push_back(c->obj);
  }
  return out;
}

void Open(server::Server& srv, server::Shard& shard, const store::TenantKey& ns,
          std::function<void(const Status&)> done) {
  PrefixEntry* e = shard.store().prefixes.Find(ns);
  if (e == nullptr) return done(Error("no such prefix namespace '" + ns.name + "'"));
  if (!e->corrupt.empty()) return done(Status(ErrorKind::kCorrupt, e->corrupt));
  if (e->resident) return done(Status::Ok());
  if (!e->saved_file) {
    return done(Status(ErrorKind::kCorrupt, "namespace '" + ns.name + "' has no disk copy"));
  }
  e->open_waiters.push_back(std::move(done));
  if (e->opening) return;  // coalesced: one read serves every waiter
  e->opening = true;
  const std::shared_ptr<residency::DiskFile> file = e->saved_file;
  const store::PrefixManifest& m = e->manifest;
  const uint64_t generation = m.cache_generation;
  const int parts = static_cast<int>(m.SessionSuffixes().size());
  const uint64_t chunk_bytes = uint64_t{store::kRowsPerChunk} *
                               codec::RowCodec::Create(m.format, m.dim()).value().row_bytes();
  server::Shard* owner = &shard;
  server::Server* server = &srv;
  bool queued = srv.io()->Submit([=]() {
    auto index =
        std::make_shared<StatusOr<ChunkIndex>>(store::ReadChunkIndex(*file, chunk_bytes, parts));
    owner->PostControl([=](server::Shard& sh) { FinishOpen(*server, sh, ns, generation, *index); });
  });
  if (!queued) CancelOpen(e, Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
}

void CancelOpen(PrefixEntry* e, const Status& why) {
  auto waiters = std::move(e->open_waiters);
  e->open_waiters.clear();
  e->opening = false;
  for (auto& w : waiters) w(why);
}

bool ParkUntilOpen(CommandContext& ctx, const store::TenantKey& ns) {
  PrefixEntry* e = ctx.shard->store().prefixes.Find(ns);
  if (e == nullptr || e->resident) return false;
  server::Server* srv = ctx.server;
  server::Shard* shard = ctx.shard;
  ctx.ParkUntil([srv, shard, ns](std::function<void(const Status&)> done) {
    Open(*srv, *shard, ns, std::move(done));
  });
  return true;
}

std::vector<HeldPrefix> HeldPrefixes(server::Server& srv, server::Shard& shard) {
  std::vector<HeldPrefix> out;
  shard.store().prefixes.ForEachEntry([&](const store::TenantKey& k, PrefixEntry& e) {
    const PrefixSessions s = SessionsOf(shard, k.tenant, k.name, e.manifest);
    uint64_t bytes = 0;
    for (const store::VSession* sess : s.all()) bytes += sess->chunk_bytes();
    out.push_back({k, srv.users().TenantName(k.tenant), e.saved_version, e.disk_path, e.resident,
                   e.dirty, !e.corrupt.empty(), s.ok() ? bytes : e.disk_bytes});
  });
  return out;
}

Status CheckPushable(server::Shard& shard, const store::TenantKey& key, uint64_t version) {
  PrefixEntry* e = shard.store().prefixes.Find(key);
  if (e == nullptr) return Status::Ok();
  if (e->saved_version >= version && e->corrupt.empty()) {
    return Status(ErrorKind::kMismatch, "stale: namespace '" + key.name + "' is at version " +
                                            std::to_string(e->saved_version) + " here, not below " +
                                            std::to_string(version));
  }
  if (e->resident && e->saved_version == 0 && e->dirty) {
    return Status(ErrorKind::kBusy, "namespace '" + key.name +
                                        "' was registered on this node meanwhile; not replaced");
  }
  return Status::Ok();
}

Status InstallPushed(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                     uint64_t version, const std::string& path) {
  Status ok = CheckPushable(shard, key, version);
  if (!ok.ok()) {
    unlink(path.c_str());
    return ok;
  }
  auto f = srv.residency()->OpenSaved(path);
  StatusOr<store::PrefixRecord> rec = f.ok() ? store::DecodePrefixMeta(f.value()->file().meta())
                                             : StatusOr<store::PrefixRecord>(f.status());
  if (!rec.ok()) {
    unlink(path.c_str());
    return Status(ErrorKind::kCorrupt, "the copy of namespace '" + key.name +
                                           "' does not open: " + rec.status().message());
  }
  auto& reg = shard.store().prefixes;
  std::string old_path;
  if (PrefixEntry* e = reg.Find(key)) {
    if (e->opening) CancelOpen(e, Error("namespace '" + key.name + "' was replaced by its owner"));
    old_path = e->disk_path;
    DropSessions(shard, key, e->manifest);
    reg.Drop(key);
  }
  reg.NoteVersion(key, version);
  PrefixEntry* e = reg.AddFromDisk(key, rec->manifest, rec->prefill_ms);
  e->saved_version = version;
  e->disk_path = path;
  e->saved_file = f.value();
  e->disk_bytes = f.value()->file().data_bytes();
  e->saved_complete = rec->complete;
  e->dirty = false;
  if (!old_path.empty() && old_path != path) unlink(old_path.c_str());
  return Status::Ok();
}

Status DiscardHere(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                   uint64_t max_version) {
  auto& reg = shard.store().prefixes;
  PrefixEntry* e = reg.Find(key);
  if (e == nullptr) return Status::Ok();
  if (max_version != 0 && e->saved_version > max_version) return Status::Ok();  // newer here
  if (e->opening) CancelOpen(e, Error("namespace '" + key.name + "' left this node"));
  if (e->saved_version > 0 || !e->corrupt.empty()) {
    Status s = store::disk::RemoveObject(
        PrefixDir(srv), store::PrefixObjectName(srv.users().TenantName(key.tenant), key.name));
    if (!s.ok()) return s;
  }
  DropSessions(shard, key, e->manifest);
  reg.Drop(key);
  return Status::Ok();
}

Status KeepDiskCopyOnly(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                        uint64_t version) {
  PrefixEntry* e = shard.store().prefixes.Find(key);
  if (e == nullptr) return Status::Ok();
  if (e->saved_version != version || !e->saved_file || !e->corrupt.empty()) {
    return DiscardHere(srv, shard, key, 0);
  }
  if (e->opening) CancelOpen(e, Error("namespace '" + key.name + "' left this node"));
  DropSessions(shard, key, e->manifest);
  e->resident = false;
  e->dirty = false;
  return Status::Ok();
}

void SaveForMove(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                 std::function<void(StatusOr<std::pair<std::string, uint64_t>>)> done) {
  PrefixEntry* e = shard.store().prefixes.Find(key);
  if (e == nullptr) return done(Status(ErrorKind::kMiss, "namespace '" + key.name + "' is gone"));
  if (!e->corrupt.empty()) return done(Status(ErrorKind::kCorrupt, e->corrupt));
  if (!e->resident || !e->dirty) {
    if (e->saved_version > 0) return done(std::make_pair(e->disk_path, e->saved_version));
  }
  auto job = PrepareSave(srv, shard, key, e);
  if (!job.ok()) return done(job.status());
  const uint64_t version = job->version, generation = job->generation;
  const bool complete = job->complete;
  bool queued = WriteObjectsLater(
      srv, shard, PrefixDir(srv), job->name, version, std::move(job->meta), std::move(job->items),
      [key, version, generation, complete, done](server::Shard& sh,
                                                 StatusOr<std::shared_ptr<residency::DiskFile>> f) {
        Status s = FinishSave(sh, key, version, generation, complete, f);
        if (!s.ok()) return done(s);
        done(std::make_pair(f.value()->path(), version));
      });
  if (!queued) {
    e->dirty = true;
    done(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
  }
}

// KV.PREFIX namespaces as cluster mode copies and moves them (cluster_internal.h).
cluster_sync::SavedKind SavedKindOf() {
  using cluster_sync::HeldObject;
  auto held_of = [](const HeldPrefix& p) {
    return HeldObject{p.key,       p.tenant,   "",        p.saved_version,
                      p.disk_path, p.resident, p.corrupt, p.bytes};
  };
  cluster_sync::SavedKind k;
  k.name = "PREFIX";
  k.held = [held_of](server::Server& srv, server::Shard& sh) {
    std::vector<HeldObject> out;
    for (const auto& p : HeldPrefixes(srv, sh)) out.push_back(held_of(p));
    return out;
  };
  k.find = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
              const std::string&) -> std::optional<HeldObject> {
    PrefixEntry* e = sh.store().prefixes.Find(key);
    if (e == nullptr) return std::nullopt;
    return HeldObject{key,
                      srv.users().TenantName(key.tenant),
                      "",
                      e->saved_version,
                      e->disk_path,
                      e->resident,
                      !e->corrupt.empty()};
  };
  k.file_of = [](server::Server& srv, const cluster_sync::ObjectId& id) {
    return std::make_pair(PrefixDir(srv), store::PrefixObjectName(id.tenant, id.key));
  };
  k.check = [](server::Server&, server::Shard& sh, const store::TenantKey& key, const std::string&,
               uint64_t version) { return CheckPushable(sh, key, version); };
  k.install = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                 const std::string&, uint64_t version,
                 const std::string& path) { return InstallPushed(srv, sh, key, version, path); };
  k.discard = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                 const std::string&,
                 uint64_t max_version) { return DiscardHere(srv, sh, key, max_version); };
  k.keep_copy = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                   const std::string&,
                   uint64_t version) { return KeepDiskCopyOnly(srv, sh, key, version); };
  k.save_for_move = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                       const std::string&,
                       auto done) { SaveForMove(srv, sh, key, std::move(done)); };
  return k;
}

void RegisterTierCommands(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"KV.PREFIX.SAVE", 2, kKv | kCmdWrite, 1, 1, 1, Save, "kvprefix",
              "Persists the namespace to the disk tier; replies after it is durable.", "<ns>"});
  r.Register({"KV.PREFIX.WARM", -2, kKv | kCmdWrite | kCmdDenyOom | kCmdDeadline, 1, 1, 1, WarmCmd,
              "kvprefix",
              "Brings every chunk of the namespace into memory (verifying checksums of what "
              "comes from disk).",
              "<ns> [DEADLINE <ms>]"});
  srv.AddStartupHook(LoadDiskTier);
  cluster_sync::AddSavedKind(SavedKindOf());
}

}  // namespace pion::families::kvprefix
