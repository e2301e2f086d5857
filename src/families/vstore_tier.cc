// V.COMMIT and restoring V-store sessions from sealed snapshots on disk.
//
// V.COMMIT writes an in-memory snapshot (copy-on-write chunks, so the session keeps taking
// writes) as a disk-tier object on the I/O pool and replies once it is durable. Sealed
// snapshots are found again at start-up; V.RESTORE of one that is not in memory reads it back
// on the I/O pool, verifying every block, and replaces the session's content.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "families/args.h"
#include "families/vstore_internal.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/prefix_object.h"

namespace pion::families::vstore {

std::string SealedDir(server::Server& srv) { return srv.config().dir + "/vsnap"; }

void Commit(server::CommandContext& ctx, proto::CmdArgs& args) {
  auto& srv = *ctx.server;
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(args[1]);
  uint64_t snap = 0;
  Status s = ParseUint(args[2], "snapshot", &snap);
  if (!s.ok()) return ctx.Error(s);
  store::VStore::Entry* e = vs.Find(key);
  auto it = e ? e->snapshots.find(snap) : decltype(e->snapshots.end()){};
  if (e == nullptr || it == e->snapshots.end()) {
    if (vs.FindSealed(key, snap) != nullptr) return ctx.rb->Ok();  // already sealed
    if (e == nullptr) return ctx.Error(Error("no such session '" + key.name + "'"));
    return ctx.Error(
        Error("no snapshot " + std::to_string(snap) + " of session '" + key.name + "'"));
  }
  store::SealedRecord rec;
  rec.tenant = srv.users().TenantName(ctx.tenant);
  rec.sid = key.name;
  rec.snapshot = snap;
  const auto& c = e->session->codec();
  rec.format = c.format();
  rec.dim = c.dim();
  rec.block = c.block();
  auto snapshot = std::make_shared<store::VSession::Snapshot>(it->second);
  const std::string dir = SealedDir(srv);
  const std::string name = store::SealedObjectName(rec);
  auto reply = ctx.Defer();
  server::Shard* owner = ctx.shard;
  server::Server* server = &srv;
  bool queued = srv.io()->Submit([=]() {
    std::string index;
    auto blocks = store::ChunkBlocks({snapshot.get()}, &index);
    Status st = store::disk::WriteObject(dir, name, 1, store::EncodeSealedMeta(rec), blocks);
    owner->PostControl([=](server::Shard& sh) {
      if (!st.ok()) {
        server->disk_stats().save_failures.fetch_add(1);
        return reply([st](proto::ReplyBuilder& rb) { rb.Error(st); });
      }
      server->disk_stats().saves.fetch_add(1);
      sh.store().vstore.AddSealed(
          key, snap, {store::disk::ObjectPath(dir, name, 1), rec.format, rec.dim, rec.block});
      reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
    });
  });
  if (!queued) {
    reply([](proto::ReplyBuilder& rb) {
      rb.ErrorLine("BUSY the disk I/O queue is full; retry later");
    });
  }
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
  auto reply = ctx.Defer();
  const std::string path = sealed->path;
  const codec::RowCodec row_codec = codec.value();
  server::Shard* owner = ctx.shard;
  server::Server* server = ctx.server;
  bool queued = ctx.server->io()->Submit([=]() {
    auto chunks = std::make_shared<StatusOr<std::vector<store::LoadedChunk>>>(
        store::ReadChunkObject(path, row_codec));
    owner->PostControl([=](server::Shard& sh) {
      Status st = chunks->status();
      auto& store = sh.store().vstore;
      if (st.ok()) st = store.Create(key, row_codec);
      if (st.ok()) {
        store::VStore::Entry* e = store.Find(key);
        std::vector<std::tuple<int64_t, BufferRef, uint64_t>> parts;
        for (auto& c : chunks->value()) parts.emplace_back(c.index, c.bytes, c.written);
        const uint64_t before = e->session->rows();
        st = e->session->Load(parts);
        if (st.ok()) {
          store.NoteRows(static_cast<int64_t>(e->session->rows()) - static_cast<int64_t>(before));
          e->snapshots[snapshot] = e->session->TakeSnapshot();  // shares the loaded chunks
          if (e->next_snapshot <= snapshot) e->next_snapshot = snapshot + 1;
          server->disk_stats().warms.fetch_add(1);
        }
      }
      if (st.kind() == ErrorKind::kCorrupt) {
        server->disk_stats().objects_corrupt.fetch_add(1);
        spdlog::error("disk tier: sealed snapshot {} of '{}' is corrupt: {}", snapshot, key.name,
                      st.message());
      }
      reply([st](proto::ReplyBuilder& rb) {
        if (st.ok()) {
          rb.Ok();
        } else {
          rb.Error(st);
        }
      });
    });
  });
  if (!queued) {
    reply([](proto::ReplyBuilder& rb) {
      rb.ErrorLine("BUSY the disk I/O queue is full; retry later");
    });
  }
}

Status LoadSealed(server::Server& srv) {
  const std::string dir = SealedDir(srv);
  auto listed = store::disk::ListObjects(dir);
  if (!listed.ok()) return listed.status();
  Status s = store::disk::RemoveLeftoverTemps(dir);
  if (!s.ok()) return s;
  size_t found = 0;
  for (const auto& o : *listed) {
    auto f = store::disk::ObjectFile::Open(o.path);
    auto rec =
        f.ok() ? store::DecodeSealedMeta(f->meta()) : StatusOr<store::SealedRecord>(f.status());
    if (!rec.ok()) {
      srv.disk_stats().objects_corrupt.fetch_add(1);
      spdlog::error("disk tier: sealed snapshot file {} is corrupt and will not be served: {}",
                    o.path, rec.status().message());
      continue;
    }
    const uint32_t tid = srv.users().TenantId(rec->tenant);
    auto& vs = srv.shard(srv.OwnerOf(tid, SessionRouteKey(rec->sid))).store().vstore;
    vs.AddSealed({tid, rec->sid}, rec->snapshot, {o.path, rec->format, rec->dim, rec->block});
    ++found;
  }
  srv.disk_stats().objects_loaded.fetch_add(found);
  if (found > 0) spdlog::info("disk tier: found {} sealed snapshot(s) under {}", found, dir);
  return Status::Ok();
}

}  // namespace pion::families::vstore
