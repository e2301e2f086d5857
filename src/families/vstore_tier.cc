// V.COMMIT and restoring V-store sessions from sealed snapshots on disk.
//
// V.COMMIT writes an in-memory snapshot (copy-on-write chunks, so the session keeps taking
// writes) as a durable disk-tier object on the I/O pool — each chunk from whichever tier holds
// it — and replies once it is durable; the snapshot's chunks keep it as their disk copy.
// Sealed snapshots are found again at start-up; V.RESTORE of one that is not in memory reads
// its chunk index on the I/O pool and replaces the session's content with chunks known by
// their disk copies (each read, and verified, when it is first used).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <unordered_map>

#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/tiering.h"
#include "families/vstore_internal.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/prefix_object.h"

namespace pion::families::vstore {

std::string SealedDir(server::Server& srv) { return srv.config().dir + "/vsnap"; }

namespace {
// The record of a sealed snapshot of session `key` (its codec's format, dim and block).
store::SealedRecord RecordOf(server::Server& srv, const store::TenantKey& key, uint64_t snap,
                             const codec::RowCodec& c) {
  store::SealedRecord rec;
  rec.tenant = srv.users().TenantName(key.tenant);
  rec.sid = key.name;
  rec.snapshot = snap;
  rec.format = c.format();
  rec.dim = c.dim();
  rec.block = c.block();
  return rec;
}
}  // namespace

void Commit(server::CommandContext& ctx, proto::CmdArgs& args) {
  auto& srv = *ctx.server;
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(args[1]);
  uint64_t snap = 0;
  Status s = ParseUint(args[2], "snapshot", &snap);
  if (!s.ok()) return ctx.Error(s);
  store::VStore::Entry* e = vs.Find(key);
  auto it = e ? e->snapshots.find(snap) : decltype(e->snapshots.end()){};
  const bool cluster = cluster_sync::Enabled(srv);
  const std::string tenant = srv.users().TenantName(ctx.tenant);
  if (e == nullptr || it == e->snapshots.end()) {
    const store::VStore::Sealed* sealed = vs.FindSealed(key, snap);
    if (sealed != nullptr && !cluster) return ctx.rb->Ok();  // already sealed
    if (sealed != nullptr) {
      // Again in cluster mode: a copy that failed is sent now (a replica that has it says so).
      return cluster_sync::ReplicateSaved(
          srv, {"VSNAP", tenant, key.name, std::to_string(snap)}, 1, sealed->path,
          cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Ok(); }));
    }
    if (e == nullptr) return ctx.Error(Error("no such session '" + key.name + "'"));
    return ctx.Error(
        Error("no snapshot " + std::to_string(snap) + " of session '" + key.name + "'"));
  }
  store::SealedRecord rec = RecordOf(srv, key, snap, e->session->codec());
  std::vector<residency::ObjectRef> chunks;
  std::vector<residency::Engine::SaveItem> items(1);
  items[0].bytes = store::ChunkIndex({&it->second}, &chunks);
  for (auto& ch : chunks) items.push_back({"", std::move(ch)});
  const std::string dir = SealedDir(srv);
  SaveObjects(
      ctx, dir, store::SealedObjectName(rec), 1, store::EncodeSealedMeta(rec), std::move(items),
      [srv = &srv, key, snap, rec, cluster](server::Shard& sh, auto file, auto reply) {
        if (!file.ok()) {
          return reply([st = file.status()](proto::ReplyBuilder& rb) { rb.Error(st); });
        }
        sh.store().vstore.AddSealed(
            key, snap, {file.value()->path(), rec.format, rec.dim, rec.block, file.value()});
        if (!cluster) return reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
        cluster_sync::ReplicateSaved(
            *srv, {"VSNAP", rec.tenant, key.name, std::to_string(snap)}, 1, file.value()->path(),
            cluster_sync::AnswerWith(reply, [](proto::ReplyBuilder& rb) { rb.Ok(); }));
      });
}

void RestoreSealed(server::CommandContext& ctx, const std::string& sid, uint64_t snapshot) {
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(sid);
  const store::VStore::Sealed* sealed = vs.FindSealed(key, snapshot);
  auto codec = codec::RowCodec::Create(sealed->format, sealed->dim, sealed->block);
  if (!codec.ok()) return ctx.Error(Status(ErrorKind::kCorrupt, codec.status().message()));
  if (store::VStore::Entry* e = vs.Find(key)) {
    const auto& have = e->session->codec();
    if (have.dim() != sealed->dim || have.format() != sealed->format) {
      return ctx.Error(Status(ErrorKind::kMismatch,
                              "session '" + sid + "' has another shape than its sealed snapshot " +
                                  std::to_string(snapshot) + "; V.DROP it first"));
    }
  }
  auto answer = cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Ok(); });
  const std::shared_ptr<residency::DiskFile> file = sealed->file;
  const codec::RowCodec row_codec = codec.value();
  server::Shard* owner = ctx.shard;
  server::Server* server = ctx.server;
  bool queued = ctx.server->io()->Submit([=]() {
    const uint64_t chunk_bytes = uint64_t{store::kRowsPerChunk} * row_codec.row_bytes();
    auto index = std::make_shared<StatusOr<std::vector<std::vector<store::VSession::DiskChunk>>>>(
        store::ReadChunkIndex(*file, chunk_bytes, /*parts=*/1));
    owner->PostControl([=](server::Shard& sh) {
      Status st = index->status();
      auto& store = sh.store().vstore;
      if (st.ok()) st = store.Create(key, row_codec);
      if (st.ok()) {
        store::VStore::Entry* e = store.Find(key);
        const uint64_t before = e->session->rows();
        st = e->session->LoadFromDisk(file, index->value()[0]);
        if (st.ok()) {
          store.NoteRows(static_cast<int64_t>(e->session->rows()) - static_cast<int64_t>(before));
          e->snapshots[snapshot] = e->session->TakeSnapshot();  // shares the chunks
          ++e->writes;
          if (e->next_snapshot <= snapshot) e->next_snapshot = snapshot + 1;
          server->disk_stats().warms.fetch_add(1);
        }
      }
      if (st.kind() == ErrorKind::kCorrupt) {
        server->disk_stats().objects_corrupt.fetch_add(1);
        spdlog::error("disk tier: sealed snapshot {} of '{}' is corrupt: {}", snapshot, key.name,
                      st.message());
      }
      answer(st);
    });
  });
  if (!queued) answer(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
}

namespace {

// Registers a sealed snapshot's file on the shard that owns its session. With `expect`, the
// file must be that session's snapshot `expect_snapshot`. Start-up (main thread) or the shard.
Status Adopt(server::Server& srv, const std::string& path,
             const std::shared_ptr<residency::DiskFile>& file, const store::TenantKey* expect,
             uint64_t expect_snapshot) {
  auto rec = store::DecodeSealedMeta(file->file().meta());
  if (!rec.ok()) return rec.status();
  const uint32_t tid = srv.users().TenantId(rec->tenant);
  const store::TenantKey key{tid, rec->sid};
  if (expect != nullptr && (!(key == *expect) || rec->snapshot != expect_snapshot)) {
    return Status(ErrorKind::kCorrupt, "it holds snapshot " + std::to_string(rec->snapshot) +
                                           " of session '" + rec->sid.substr(0, 64) + "'");
  }
  auto& vs = srv.shard(srv.OwnerOf(tid, SessionRouteKey(rec->sid))).store().vstore;
  vs.AddSealed(key, rec->snapshot, {path, rec->format, rec->dim, rec->block, file, rec->image});
  return Status::Ok();
}

bool SnapshotOf(const std::string& part, uint64_t* snap) {
  int64_t v = 0;
  if (!ParseInt64(part, &v) || v < 0) return false;
  *snap = static_cast<uint64_t>(v);
  return true;
}

Status CheckCopy(server::Shard& sh, const store::TenantKey& key, const std::string& part) {
  uint64_t snap = 0;
  if (!SnapshotOf(part, &snap)) {
    return Error("a sealed snapshot copy needs its snapshot number as its part, got '" +
                 part.substr(0, 32) + "'");
  }
  if (sh.store().vstore.FindSealed(key, snap) != nullptr) {
    return Status(ErrorKind::kMismatch, "stale: snapshot " + part + " of session '" +
                                            key.name.substr(0, 128) +
                                            "' is sealed here already (a sealed snapshot never "
                                            "changes)");
  }
  return Status::Ok();
}

}  // namespace

namespace {

// Start-up: the session of `key` as its image `snapshot` holds it (chunks known by their disk
// copies). Main thread, before the shards run.
Status RestoreImage(server::Shard& shard, const store::TenantKey& key, uint64_t snapshot,
                    const store::VStore::Sealed& image) {
  auto codec = codec::RowCodec::Create(image.format, image.dim, image.block);
  if (!codec.ok()) return Status(ErrorKind::kCorrupt, codec.status().message());
  const uint64_t chunk_bytes = uint64_t{store::kRowsPerChunk} * codec.value().row_bytes();
  auto index = store::ReadChunkIndex(*image.file, chunk_bytes, /*parts=*/1);
  if (!index.ok()) return index.status();
  auto& vs = shard.store().vstore;
  Status s = vs.Create(key, codec.value());
  if (!s.ok()) return s;
  store::VStore::Entry* e = vs.Find(key);
  s = e->session->LoadFromDisk(image.file, index.value()[0]);
  if (!s.ok()) {
    vs.Drop(key);
    return s;
  }
  vs.NoteRows(static_cast<int64_t>(e->session->rows()));
  e->snapshots[snapshot] = e->session->TakeSnapshot();
  e->next_snapshot = snapshot + 1;
  e->imaged_writes = e->writes;
  return Status::Ok();
}

}  // namespace

Status LoadSealed(server::Server& srv) {
  Status s = LoadSavedObjects(
      srv, SealedDir(srv), "sealed snapshot",
      [&](const store::disk::ListedObject& o, const std::shared_ptr<residency::DiskFile>& file) {
        return Adopt(srv, o.path, file, nullptr, 0);
      });
  if (!s.ok()) return s;
  for (int i = 0; i < srv.shard_count(); ++i) {
    server::Shard& shard = srv.shard(i);
    std::unordered_map<store::TenantKey, std::pair<uint64_t, const store::VStore::Sealed*>,
                       store::TenantKeyHash>
        newest;
    shard.store().vstore.ForEachSealed(
        [&](const store::TenantKey& key, uint64_t n, const store::VStore::Sealed& sealed) {
          auto& slot = newest[key];
          if (sealed.image && n > slot.first) slot = {n, &sealed};
        });
    for (const auto& [key, image] : newest) {
      if (image.second == nullptr) continue;
      Status r = RestoreImage(shard, key, image.first, *image.second);
      if (r.ok()) {
        spdlog::info("disk tier: V session '{}' restored from its image (snapshot {})", key.name,
                     image.first);
      } else {
        srv.disk_stats().objects_corrupt.fetch_add(1);
        spdlog::error("disk tier: V session '{}' not restored from its image (snapshot {}): {}",
                      key.name, image.first, r.message());
      }
    }
  }
  return Status::Ok();
}

std::vector<UnsavedSession> UnsavedSessions(server::Shard& shard) {
  std::vector<UnsavedSession> out;
  auto& prefixes = shard.store().prefixes;
  shard.store().vstore.ForEach([&](const store::TenantKey& key, const store::VStore::Entry& e) {
    const std::string_view route = SessionRouteKey(key.name);
    if (route.size() != key.name.size() &&
        prefixes.Find(store::TenantKey{key.tenant, std::string(route)}) != nullptr) {
      return;  // a KV.PREFIX namespace's session: the namespace's save keeps it
    }
    if (e.unsaved()) out.push_back({key, e.session->chunk_bytes()});
  });
  return out;
}

void SaveImage(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
               std::function<void(const Status&)> done) {
  store::VStore::Entry* e = shard.store().vstore.Find(key);
  if (e == nullptr) return done(Status(ErrorKind::kMiss, "session '" + key.name + "' is gone"));
  const uint64_t snap = e->next_snapshot++;
  auto it = e->snapshots.emplace(snap, e->session->TakeSnapshot()).first;
  const uint64_t writes_then = e->writes;
  store::SealedRecord rec = RecordOf(srv, key, snap, e->session->codec());
  rec.image = true;
  std::vector<residency::ObjectRef> chunks;
  std::vector<residency::Engine::SaveItem> items(1);
  items[0].bytes = store::ChunkIndex({&it->second}, &chunks);
  for (auto& ch : chunks) items.push_back({"", std::move(ch)});
  const std::string dir = SealedDir(srv);
  bool queued = WriteObjectsLater(
      srv, shard, dir, store::SealedObjectName(rec), 1, store::EncodeSealedMeta(rec),
      std::move(items),
      [key, snap, rec, writes_then, dir, done](server::Shard& sh,
                                               StatusOr<std::shared_ptr<residency::DiskFile>> f) {
        if (!f.ok()) return done(f.status());
        auto& vs = sh.store().vstore;
        std::vector<std::string> older;  // the images this one replaces
        std::vector<uint64_t> older_snaps;
        vs.ForEachSealed([&](const store::TenantKey& k, uint64_t n, const auto& s) {
          if (k == key && s.image && n < snap) older_snaps.push_back(n);
        });
        for (uint64_t n : older_snaps) older.push_back(vs.TakeSealed(key, n));
        vs.AddSealed(key, snap,
                     {f.value()->path(), rec.format, rec.dim, rec.block, f.value(), true});
        store::VStore::Entry* cur = vs.Find(key);
        if (cur != nullptr && (!cur->imaged_writes || *cur->imaged_writes < writes_then)) {
          cur->imaged_writes = writes_then;
        }
        done(store::disk::RemoveFiles(dir, older));
      });
  if (!queued) done(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
}

cluster_sync::SavedKind SavedKindOf() {
  using cluster_sync::HeldObject;
  cluster_sync::SavedKind k;
  k.name = "VSNAP";
  k.route_key = SessionRouteKey;
  k.held = [](server::Server& srv, server::Shard& sh) {
    std::vector<HeldObject> out;
    sh.store().vstore.ForEachSealed(
        [&](const store::TenantKey& key, uint64_t n, const store::VStore::Sealed& s) {
          out.push_back({key, srv.users().TenantName(key.tenant), std::to_string(n), 1, s.path,
                         false, false});
        });
    return out;
  };
  k.find = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
              const std::string& part) -> std::optional<HeldObject> {
    uint64_t n = 0;
    const store::VStore::Sealed* s =
        SnapshotOf(part, &n) ? sh.store().vstore.FindSealed(key, n) : nullptr;
    if (s == nullptr) return std::nullopt;
    return HeldObject{key, srv.users().TenantName(key.tenant), part, 1, s->path, false, false};
  };
  k.file_of = [](server::Server& srv, const cluster_sync::ObjectId& id) {
    store::SealedRecord rec;
    rec.tenant = id.tenant;
    rec.sid = id.key;
    SnapshotOf(id.part, &rec.snapshot);
    return std::make_pair(SealedDir(srv), store::SealedObjectName(rec));
  };
  k.check = [](server::Server&, server::Shard& sh, const store::TenantKey& key,
               const std::string& part, uint64_t) { return CheckCopy(sh, key, part); };
  k.install = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                 const std::string& part, uint64_t, const std::string& path) {
    uint64_t n = 0;
    SnapshotOf(part, &n);  // CheckCopy refuses a part that is not a snapshot number
    return InstallSavedCopy(
        srv, path, "snapshot " + part + " of session '" + key.name.substr(0, 128) + "'",
        [&] { return CheckCopy(sh, key, part); },
        [&](const auto& file) { return Adopt(srv, path, file, &key, n); });
  };
  k.discard = [](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                 const std::string& part, uint64_t) {
    uint64_t n = 0;
    if (!SnapshotOf(part, &n)) return Status::Ok();
    const std::string path = sh.store().vstore.TakeSealed(key, n);
    if (path.empty()) return Status::Ok();
    return store::disk::RemoveFiles(SealedDir(srv), {path});
  };
  k.save_for_move = [](server::Server&, server::Shard& sh, const store::TenantKey& key,
                       const std::string& part,
                       std::function<void(StatusOr<std::pair<std::string, uint64_t>>)> done) {
    uint64_t n = 0;
    const store::VStore::Sealed* s =
        SnapshotOf(part, &n) ? sh.store().vstore.FindSealed(key, n) : nullptr;
    if (s == nullptr) {
      return done(Status(ErrorKind::kMiss, "snapshot " + part + " of session '" +
                                               key.name.substr(0, 128) + "' is gone"));
    }
    done(std::make_pair(s->path, uint64_t{1}));
  };
  return k;
}

}  // namespace pion::families::vstore
