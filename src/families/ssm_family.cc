// SSM.PREFIX.* — recurrent state for hybrid models (seed 002): opaque per-layer blobs keyed by
// (session, layer), each a residency object: stored as received (no copy), replied from the
// stored bytes, demoted to disk under memory pressure and brought back by FETCH.
// SSM.PREFIX.SAVE makes a session durable (one object file, crash-safe like KV.PREFIX.SAVE);
// start-up finds saved sessions again. The disk holds what was last saved: a STORE or a layer
// DROP after the save changes memory only, until the next SAVE.
#include <unistd.h>

#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/families.h"
#include "families/keyed_saved.h"
#include "families/tiering.h"
#include "server/server.h"
#include "store/disk/object_file.h"
#include "store/saved_record.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using residency::Family;
using residency::Tier;
using server::CommandContext;

// The family as keyed_saved.h saves, reloads and copies it (defined at the end).
const KeyedFamily& Sessions();

// SSM.PREFIX.STORE <sid> <layer> <state_blob>
void Store(CommandContext& ctx, CmdArgs& args) {
  if (args.size() != 4) return ctx.WrongArity();
  uint64_t layer;
  Status s = ParseUint(args[2], "layer", &layer);
  if (!s.ok()) return ctx.Error(s);
  auto blob = args.TakeBuffer(3);  // adopts the received buffer when it has its own
  if (!blob.ok()) return ctx.Error(blob.status());
  std::unique_ptr<Charge> charge;
  if (!ChargeHost(ctx, Family::kSsm, blob.value()->size(), &charge)) return;
  auto obj = ctx.server->residency()->CreateInHost(Family::kSsm, {std::move(blob).value()},
                                                   std::move(charge));
  ctx.shard->store().ssm.Put(ctx.Key(args[1]), layer, std::move(obj));
  ctx.rb->Ok();
}

// SSM.PREFIX.FETCH <sid> <layer>
void Fetch(CommandContext& ctx, CmdArgs& args) {
  if (args.size() != 3) return ctx.WrongArity();
  uint64_t layer;
  Status s = ParseUint(args[2], "layer", &layer);
  if (!s.ok()) return ctx.Error(s);
  residency::ObjectRef obj = ctx.shard->store().ssm.Blob(ctx.Key(args[1]), layer);
  if (!obj) return ctx.rb->Null();
  if (!ctx.Resident({obj}, Tier::kHost)) return;  // promoted from disk, then run again
  ctx.rb->BulkRef(obj->HostBlock(0));
}

// SSM.PREFIX.DROP <sid> [<layer>]
void Drop(CommandContext& ctx, CmdArgs& args) {
  std::optional<uint64_t> layer;
  if (args.size() == 3) {
    uint64_t l;
    Status s = ParseUint(args[2], "layer", &l);
    if (!s.ok()) return ctx.Error(s);
    layer = l;
  }
  const store::TenantKey key = ctx.Key(args[1]);
  uint64_t removed = 0;
  if (!layer) {
    // The whole session: gone everywhere, disk included.
    auto r = RemoveSaved(*ctx.server, *ctx.shard, Sessions(), key);
    if (!r.ok()) return ctx.Error(r.status());
    removed = r.value();
  }
  ctx.shard->store().ssm.Drop(key, layer);
  ReplyRemoved(ctx, Sessions(), key, removed, [](proto::ReplyBuilder& rb) { rb.Ok(); });
}

// What SSM.PREFIX.SAVE writes: every layer's blob, in layer order, with the layer numbers in
// the record.
StatusOr<SaveContent> SessionContent(server::Server& srv, server::Shard& shard,
                                     const store::TenantKey& key, store::Durable& o) {
  const auto& session = static_cast<const store::SsmStore::Session&>(o);
  if (session.layers.empty()) {
    return Error("SSM session '" + key.name.substr(0, 128) +
                 "' has no layers to save (SSM.PREFIX.DROP it instead)");
  }
  SaveContent c;
  std::string layers;
  for (const auto& [l, obj] : session.layers) {
    c.items.push_back({"", obj});
    if (!layers.empty()) layers += ',';
    layers += std::to_string(l);
  }
  store::SavedRecord rec;
  rec.kind = "ssm";
  rec.Set("tenant", srv.users().TenantName(key.tenant));
  rec.Set("sid", key.name);
  rec.Set("layers", layers);
  c.meta = store::EncodeSavedRecord(rec);
  c.version = shard.store().ssm.NextVersion(key);
  return c;
}

// SSM.PREFIX.SAVE <sid>: every layer of the session into one durable object file; in cluster
// mode acknowledged once the replicas hold it too (again when unchanged: a failed copy is
// retried).
void Save(CommandContext& ctx, CmdArgs& args) { SaveCommand(ctx, Sessions(), ctx.Key(args[1])); }

// SSM.PREFIX.INFO <sid>: layers, bytes and where they are.
void Info(CommandContext& ctx, CmdArgs& args) {
  store::SsmStore::Session* session = ctx.shard->store().ssm.Find(ctx.Key(args[1]));
  if (session == nullptr) {
    return ctx.Error(Error("no such SSM session '" + std::string(args[1].substr(0, 128)) + "'"));
  }
  uint64_t bytes = 0, host = 0, disk_only = 0;
  for (const auto& [l, obj] : session->layers) {
    bytes += obj->bytes();
    const unsigned tiers = obj->Tiers();
    if (tiers & (1u << static_cast<int>(Tier::kHost))) host += obj->bytes();
    if (tiers == (1u << static_cast<int>(Tier::kDisk))) disk_only += obj->bytes();
  }
  auto& rb = *ctx.rb;
  rb.Map(6);
  rb.Bulk("layers");
  rb.Integer(static_cast<int64_t>(session->layers.size()));
  rb.Bulk("bytes");
  rb.Integer(static_cast<int64_t>(bytes));
  rb.Bulk("bytes_host");
  rb.Integer(static_cast<int64_t>(host));
  rb.Bulk("bytes_disk_only");
  rb.Integer(static_cast<int64_t>(disk_only));
  rb.Bulk("saved_version");
  rb.Integer(static_cast<int64_t>(session->saved_version));
  rb.Bulk("dirty");
  rb.Integer(session->dirty() ? 1 : 0);
}

// Installs the saved file of version `version` as its session, its layers known by their disk
// copies, on the shard that owns it (replacing a session held there). With `expect`, the file
// must be that session's. Runs at start-up (main thread) or on the owning shard.
Status Adopt(server::Server& srv, uint64_t version,
             const std::shared_ptr<residency::DiskFile>& file, const store::TenantKey* expect) {
  auto rec = store::DecodeSavedRecord(file->file().meta(), "ssm");
  auto tenant = rec.ok() ? rec->Get("tenant") : StatusOr<std::string>(rec.status());
  auto sid = rec.ok() ? rec->Get("sid") : StatusOr<std::string>(rec.status());
  auto layers = rec.ok() ? rec->Get("layers") : StatusOr<std::string>(rec.status());
  if (!tenant.ok()) return tenant.status();
  if (!sid.ok()) return sid.status();
  if (!layers.ok()) return layers.status();
  std::vector<uint64_t> ids;
  for (size_t p = 0; p < layers->size();) {
    size_t c = layers->find(',', p);
    if (c == std::string::npos) c = layers->size();
    ids.push_back(std::strtoull(layers->substr(p, c - p).c_str(), nullptr, 10));
    p = c + 1;
  }
  if (ids.size() != file->file().block_count()) {
    return Status(ErrorKind::kCorrupt, "its layer list does not match its blocks");
  }
  const uint32_t tid = srv.users().TenantId(tenant.value());
  const store::TenantKey key{tid, sid.value()};
  if (expect != nullptr && !(key == *expect)) {
    return Status(ErrorKind::kCorrupt, "it holds SSM session '" + key.name.substr(0, 64) + "'");
  }
  server::Shard& shard = srv.shard(srv.OwnerOf(tid, key.name));
  auto& ssm = shard.store().ssm;
  ssm.NoteVersion(key, version);
  const std::string old_path = ForgetHeld(shard, Sessions(), key);
  for (size_t i = 0; i < ids.size(); ++i) {
    ssm.Put(key, ids[i],
            srv.residency()->CreateOnDisk(Family::kSsm, {file->file().block_length(i)}, file,
                                          {static_cast<uint32_t>(i)}));
  }
  store::SsmStore::Session& session = ssm.Get(key);
  session.NoteSaved(file, version, session.writes);
  if (!old_path.empty() && old_path != file->path()) unlink(old_path.c_str());
  return Status::Ok();
}

const KeyedFamily& Sessions() {
  static const KeyedFamily f{
      "SSM",
      "ssm",
      "SSM session",
      "dropped",
      [](server::Shard& sh, const store::TenantKey& key) -> store::Durable* {
        return sh.store().ssm.Find(key);
      },
      [](server::Shard& sh, const auto& each) {
        sh.store().ssm.ForEachSession(
            [&](const store::TenantKey& key, const store::SsmStore::Session& s) { each(key, s); });
      },
      [](server::Shard& sh, const store::TenantKey& key) {
        sh.store().ssm.Drop(key, std::nullopt);
      },
      SessionContent,
      Adopt,
      [](const store::Durable& o) {
        uint64_t n = 0;
        for (const auto& [l, blob] : static_cast<const store::SsmStore::Session&>(o).layers) {
          n += blob->bytes();
        }
        return n;
      }};
  return f;
}

}  // namespace

void RegisterSsmFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"SSM.PREFIX.STORE", -4, kKv | kCmdWrite | kCmdDenyOom | kCmdDeadline, 1, 1, 1, Store,
              "ssm", "Stores one layer's recurrent-state blob (opaque; replaces any previous one).",
              "<sid> <layer> <state_blob> [DEADLINE <ms>]"});
  r.Register({"SSM.PREFIX.FETCH", -3, kKv | kCmdReadOnly | kCmdDeadline, 1, 1, 1, Fetch, "ssm",
              "Returns one layer's blob (brought back from disk if it was demoted), or null when "
              "absent.",
              "<sid> <layer> [DEADLINE <ms>]"});
  r.Register({"SSM.PREFIX.DROP", -2, kKv | kCmdWrite, 1, 1, 1, Drop, "ssm",
              "Drops one layer, or every layer of the session (its saved copy too); idempotent.",
              "<sid> [<layer>]"});
  r.Register({"SSM.PREFIX.SAVE", 2, kKv | kCmdWrite, 1, 1, 1, Save, "ssm",
              "Makes the session durable (every layer, one crash-safe object file); replies once "
              "it is on disk.",
              "<sid>"});
  r.Register({"SSM.PREFIX.INFO", 2, kKv | kCmdReadOnly, 1, 1, 1, Info, "ssm",
              "The session's layers, bytes, bytes in memory and on disk only, saved version and "
              "whether it changed since.",
              "<sid>"});
  srv.AddStartupHook([](server::Server& srv) { return LoadKeyedSaved(srv, Sessions()); });
  cluster_sync::AddSavedKind(KeyedSavedKind(Sessions()));
}

}  // namespace pion::families
