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

#include "families/args.h"
#include "families/tiering.h"
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
  std::vector<residency::ObjectRef> chunks;
  std::vector<residency::Engine::SaveItem> items(1);
  items[0].bytes = store::ChunkIndex({&it->second}, &chunks);
  for (auto& ch : chunks) items.push_back({"", std::move(ch)});
  const std::string dir = SealedDir(srv);
  SaveObjects(ctx, dir, store::SealedObjectName(rec), 1, store::EncodeSealedMeta(rec),
              std::move(items), [key, snap, rec](server::Shard& sh, auto file, auto reply) {
                if (!file.ok()) {
                  return reply([st = file.status()](proto::ReplyBuilder& rb) { rb.Error(st); });
                }
                sh.store().vstore.AddSealed(
                    key, snap,
                    {file.value()->path(), rec.format, rec.dim, rec.block, file.value()});
                reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
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
  auto reply = ctx.Defer();
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
  return LoadSavedObjects(
      srv, SealedDir(srv), "sealed snapshot",
      [&](const store::disk::ListedObject& o, const std::shared_ptr<residency::DiskFile>& file) {
        auto rec = store::DecodeSealedMeta(file->file().meta());
        if (!rec.ok()) return rec.status();
        const uint32_t tid = srv.users().TenantId(rec->tenant);
        auto& vs = srv.shard(srv.OwnerOf(tid, SessionRouteKey(rec->sid))).store().vstore;
        vs.AddSealed({tid, rec->sid}, rec->snapshot,
                     {o.path, rec->format, rec->dim, rec->block, file});
        return Status::Ok();
      });
}

}  // namespace pion::families::vstore
