#include "families/keyed_saved.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include "families/tiering.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/saved_record.h"

namespace pion::families {

namespace {

std::string Named(const KeyedFamily& f, const store::TenantKey& key) {
  return f.what + " '" + key.name.substr(0, 128) + "'";
}

// Whether a pushed copy of `version` may replace what this shard holds (SavedKind::check).
Status CheckCopy(const KeyedFamily& f, server::Shard& sh, const store::TenantKey& key,
                 uint64_t version) {
  const store::Durable* o = f.find(sh, key);
  if (o == nullptr) return Status::Ok();
  if (o->saved_version >= version) {
    return Status(ErrorKind::kMismatch, "stale: " + Named(f, key) + " is at version " +
                                            std::to_string(o->saved_version) + " here, not below " +
                                            std::to_string(version));
  }
  if (o->dirty()) {
    return Status(ErrorKind::kBusy,
                  Named(f, key) + " was written on this node meanwhile; not replaced");
  }
  return Status::Ok();
}

cluster_sync::HeldObject HeldOf(server::Server& srv, const KeyedFamily& f,
                                const store::TenantKey& key, const store::Durable& o) {
  return {key,
          srv.users().TenantName(key.tenant),
          "",
          o.saved_version,
          o.saved ? o.saved->path() : std::string(),
          o.dirty(),
          false,
          f.bytes(o)};
}

}  // namespace

std::string SavedNameOf(server::Server& srv, const KeyedFamily& f, const store::TenantKey& key) {
  return store::SavedObjectName(f.dir, srv.users().TenantName(key.tenant), key.name);
}

void SaveKeyed(server::Server& srv, server::Shard& shard, const KeyedFamily& f,
               const store::TenantKey& key, std::function<void(SavedFile)> done) {
  store::Durable* o = f.find(shard, key);
  if (o == nullptr) return done(Error("no such " + Named(f, key)));
  if (!o->dirty()) return done(std::make_pair(o->saved->path(), o->saved_version));
  auto content = f.content(srv, shard, key, *o);
  if (!content.ok()) return done(content.status());
  const uint64_t version = content->version;
  const uint64_t incarnation = o->incarnation, writes = o->writes;
  bool queued = WriteObjectsLater(
      srv, shard, SavedDir(srv, f.dir), SavedNameOf(srv, f, key), version, std::move(content->meta),
      std::move(content->items),
      [&f, key, version, incarnation, writes, done](server::Shard& sh, auto file) {
        store::Durable* cur = f.find(sh, key);
        if (cur == nullptr || cur->incarnation != incarnation) {
          // Removed meanwhile: the removal wins.
          if (file.ok()) unlink(file.value()->path().c_str());
          return done(Error(Named(f, key) + " was " + f.gone + " during the save"));
        }
        if (!file.ok()) {
          spdlog::error("disk tier: saving {} '{}' failed: {}", f.what, key.name,
                        file.status().message());
          return done(file.status());
        }
        cur->NoteSaved(file.value(), version, writes);
        done(std::make_pair(cur->saved->path(), cur->saved_version));
      });
  if (!queued) done(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
}

void SaveCommand(server::CommandContext& ctx, const KeyedFamily& f, const store::TenantKey& key) {
  const store::Durable* o = f.find(*ctx.shard, key);
  if (o == nullptr) return ctx.Error(Error("no such " + Named(f, key)));
  const bool cluster = cluster_sync::Enabled(*ctx.server);
  if (!o->dirty() && !cluster) return ctx.rb->Ok();  // the disk holds exactly this
  auto reply = ctx.Defer();
  server::Server* srv = ctx.server;
  const std::string tenant = srv->users().TenantName(key.tenant);
  SaveKeyed(*srv, *ctx.shard, f, key, [srv, &f, key, tenant, cluster, reply](SavedFile file) {
    if (!file.ok()) return reply([st = file.status()](proto::ReplyBuilder& rb) { rb.Error(st); });
    if (!cluster) return reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
    cluster_sync::ReplicateSaved(
        *srv, {f.kind, tenant, key.name, ""}, file->second, file->first,
        cluster_sync::AnswerWith(reply, [](proto::ReplyBuilder& rb) { rb.Ok(); }));
  });
}

StatusOr<uint64_t> RemoveSaved(server::Server& srv, server::Shard& shard, const KeyedFamily& f,
                               const store::TenantKey& key) {
  const store::Durable* o = f.find(shard, key);
  if (o == nullptr || !o->saved) return uint64_t{0};
  Status s = store::disk::RemoveObject(SavedDir(srv, f.dir), SavedNameOf(srv, f, key));
  if (!s.ok()) return s;
  return o->saved_version;
}

void ReplyRemoved(server::CommandContext& ctx, const KeyedFamily& f, const store::TenantKey& key,
                  uint64_t removed_version, server::CommandContext::ReplyWriter ok) {
  if (removed_version == 0 || !cluster_sync::Enabled(*ctx.server)) return ok(*ctx.rb);
  cluster_sync::ReplicateDrop(
      *ctx.server, {f.kind, ctx.server->users().TenantName(key.tenant), key.name, ""},
      removed_version, cluster_sync::AnswerWith(ctx.Defer(), std::move(ok)));
}

std::string ForgetHeld(server::Shard& shard, const KeyedFamily& f, const store::TenantKey& key) {
  const store::Durable* old = f.find(shard, key);
  if (old == nullptr) return "";
  std::string path = old->saved ? old->saved->path() : std::string();
  f.forget(shard, key);
  return path;
}

Status LoadKeyedSaved(server::Server& srv, const KeyedFamily& f) {
  return LoadSavedObjects(
      srv, SavedDir(srv, f.dir), f.what,
      [&](const store::disk::ListedObject& o, const std::shared_ptr<residency::DiskFile>& file) {
        return f.adopt(srv, o.version, file, nullptr);
      });
}

cluster_sync::SavedKind KeyedSavedKind(const KeyedFamily& f) {
  using cluster_sync::HeldObject;
  cluster_sync::SavedKind k;
  k.name = f.kind;
  k.held = [&f](server::Server& srv, server::Shard& sh) {
    std::vector<HeldObject> out;
    f.for_each(sh, [&](const store::TenantKey& key, const store::Durable& o) {
      out.push_back(HeldOf(srv, f, key, o));
    });
    return out;
  };
  k.find = [&f](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                const std::string&) -> std::optional<HeldObject> {
    const store::Durable* o = f.find(sh, key);
    if (o == nullptr) return std::nullopt;
    return HeldOf(srv, f, key, *o);
  };
  k.file_of = [&f](server::Server& srv, const cluster_sync::ObjectId& id) {
    return std::make_pair(SavedDir(srv, f.dir), store::SavedObjectName(f.dir, id.tenant, id.key));
  };
  k.check = [&f](server::Server&, server::Shard& sh, const store::TenantKey& key,
                 const std::string&, uint64_t version) { return CheckCopy(f, sh, key, version); };
  k.install = [&f](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                   const std::string&, uint64_t version, const std::string& path) {
    return InstallSavedCopy(
        srv, path, Named(f, key), [&] { return CheckCopy(f, sh, key, version); },
        [&](const auto& file) { return f.adopt(srv, version, file, &key); });
  };
  k.discard = [&f](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                   const std::string&, uint64_t max_version) {
    const store::Durable* o = f.find(sh, key);
    if (o == nullptr) return Status::Ok();
    if (max_version != 0 && o->saved_version > max_version) return Status::Ok();
    auto removed = RemoveSaved(srv, sh, f, key);
    if (!removed.ok()) return removed.status();
    f.forget(sh, key);
    return Status::Ok();
  };
  k.save_for_move = [&f](server::Server& srv, server::Shard& sh, const store::TenantKey& key,
                         const std::string&, std::function<void(SavedFile)> done) {
    SaveKeyed(srv, sh, f, key, std::move(done));
  };
  return k;
}

}  // namespace pion::families
