// STATE.* — fixed-size, overwrite-in-place slots (seed 000). Every command is keyed by slot
// id and runs on the shard that owns the id; slots are scoped by tenant. A slot's bytes are a
// residency object: under memory pressure it moves to disk, and READ/WRITE bring it back
// first. STATE.SAVE makes a slot durable (crash-safe, like KV.PREFIX.SAVE); saved slots come
// back after a restart with their last saved bytes.
#include <unistd.h>

#include <cstring>

#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/families.h"
#include "families/keyed_saved.h"
#include "families/shard_sum.h"
#include "families/tiering.h"
#include "net/connection.h"
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
const KeyedFamily& Slots();

// A host-resident object of `size` bytes: zeros, or a copy of `from` (copy on write).
StatusOr<residency::ObjectRef> NewSlotObject(CommandContext& ctx, uint64_t size,
                                             std::unique_ptr<Charge> charge,
                                             const BufferRef& from) {
  auto buf = BufferAllocator::Default()->Allocate(size);
  if (!buf.ok()) return buf.status();
  if (from) {
    std::memcpy(buf.value()->data(), from->data(), size);
  } else {
    std::memset(buf.value()->data(), 0, size);
  }
  return ctx.server->residency()->CreateInHost(Family::kState, {std::move(buf).value()},
                                               std::move(charge));
}

void Alloc(CommandContext& ctx, CmdArgs& args) {
  if (args.size() != 3) return ctx.WrongArity();
  uint64_t bytes;
  Status s = ParseUint(args[2], "bytes", &bytes);
  if (s.ok() && bytes == 0) s = Error("bytes must be at least 1");
  if (s.ok() && bytes > ctx.server->settings().proto_max_bulk_len.load()) {
    s = Error("bytes " + std::to_string(bytes) + " exceeds proto-max-bulk-len " +
              std::to_string(ctx.server->settings().proto_max_bulk_len.load()));
  }
  const store::TenantKey key = ctx.Key(args[1]);
  auto& slots = ctx.shard->store().state;
  bool exists = false;
  if (s.ok()) s = slots.CheckAlloc(key, bytes, &exists);
  if (!s.ok()) return ctx.Error(s);
  if (exists) return ctx.rb->Ok();
  std::unique_ptr<Charge> charge;
  if (!ChargeHost(ctx, Family::kState, bytes, &charge)) return;
  auto obj = NewSlotObject(ctx, bytes, std::move(charge), nullptr);
  if (!obj.ok()) return ctx.Error(obj.status());
  slots.Insert(key, std::move(obj).value());
  ctx.rb->Ok();
}

// STATE.WRITE <id> <offset> <data>
void Write(CommandContext& ctx, CmdArgs& args) {
  if (args.size() != 4) return ctx.WrongArity();
  uint64_t offset;
  Status s = ParseUint(args[2], "offset", &offset);
  if (!s.ok()) return ctx.Error(s);
  const store::TenantKey key = ctx.Key(args[1]);
  auto slot = ctx.shard->store().state.Find(key);
  if (!slot.ok()) return ctx.Error(slot.status());
  store::StateSlots::Slot& sl = *slot.value();
  s = store::StateSlots::CheckRange(key, sl, offset, args[3].size(), "write");
  if (!s.ok()) return ctx.Error(s);
  // Back from disk first, and pinned until written: making room for a copy must not drop it.
  if (!ctx.Resident({sl.obj}, Tier::kHost)) return;
  const uint32_t own_pins = ctx.pins->Counts(Tier::kHost)[sl.obj.get()];
  if (store::StateSlots::WriteInPlace(sl, offset, args[3], own_pins)) return ctx.rb->Ok();
  // Someone holds the bytes (a READ reply in flight, a save, a demotion): copy, then write.
  BufferRef old = sl.obj->HostBlock(0);  // pinned: resident
  std::unique_ptr<Charge> charge;
  if (!ChargeHost(ctx, Family::kState, sl.size, &charge)) return;
  auto obj = NewSlotObject(ctx, sl.size, std::move(charge), old);
  if (!obj.ok()) return ctx.Error(obj.status());
  std::memcpy(obj.value()->HostBlock(0)->data() + offset, args[3].data(), args[3].size());
  ctx.shard->store().state.Replace(sl, std::move(obj).value());
  ctx.rb->Ok();
}

// STATE.READ <id> <offset> <len>
void Read(CommandContext& ctx, CmdArgs& args) {
  if (args.size() != 4) return ctx.WrongArity();
  uint64_t offset, len;
  Status s = ParseUint(args[2], "offset", &offset);
  if (s.ok()) s = ParseUint(args[3], "len", &len);
  if (!s.ok()) return ctx.Error(s);
  const store::TenantKey key = ctx.Key(args[1]);
  auto slot = ctx.shard->store().state.Find(key);
  if (!slot.ok()) return ctx.Error(slot.status());
  s = store::StateSlots::CheckRange(key, *slot.value(), offset, len, "read");
  if (!s.ok()) return ctx.Error(s);
  if (!ctx.Resident({slot.value()->obj}, Tier::kHost)) return;
  BufferRef b = slot.value()->obj->HostBlock(0);
  ctx.rb->BulkRef(b, b->data() + offset, len);
}

// STATE.FREE <id>: 1 when the slot existed (its saved copy is gone too), 0 otherwise.
void Free(CommandContext& ctx, CmdArgs& args) {
  const store::TenantKey key = ctx.Key(args[1]);
  auto removed = RemoveSaved(*ctx.server, *ctx.shard, Slots(), key);
  if (!removed.ok()) return ctx.Error(removed.status());
  const bool existed = ctx.shard->store().state.Free(key);
  ReplyRemoved(ctx, Slots(), key, removed.value(),
               [existed](proto::ReplyBuilder& rb) { rb.Integer(existed ? 1 : 0); });
}

// What STATE.SAVE writes: the slot's one block, its id and size in the record.
StatusOr<SaveContent> SlotContent(server::Server& srv, server::Shard& shard,
                                  const store::TenantKey& key, store::Durable& o) {
  const auto& sl = static_cast<const store::StateSlots::Slot&>(o);
  store::SavedRecord rec;
  rec.kind = "state";
  rec.Set("tenant", srv.users().TenantName(key.tenant));
  rec.Set("id", key.name);
  rec.SetUint("size", sl.size);
  return SaveContent{
      store::EncodeSavedRecord(rec), {{"", sl.obj}}, shard.store().state.NextVersion(key)};
}

// STATE.SAVE <id>: the slot's bytes durably on disk; replies once they are (and, in cluster
// mode, once the replicas hold them too — again when unchanged, so a failed copy is retried).
void Save(CommandContext& ctx, CmdArgs& args) { SaveCommand(ctx, Slots(), ctx.Key(args[1])); }

void Info(CommandContext& ctx, CmdArgs&) {
  const uint32_t tenant = ctx.tenant;
  ReplySumOverShards(ctx, {{"slots"}, {"bytes"}}, [tenant](server::Shard& shard) {
    auto u = shard.store().state.UsageOf(tenant);
    return std::vector<double>{static_cast<double>(u.slots), static_cast<double>(u.bytes)};
  });
}

// Installs the saved file of version `version` as its slot, known by its disk copy, on the
// shard that owns it (replacing a slot held there). With `expect`, the file must be that
// slot's. Runs at start-up (main thread) or on the owning shard.
Status Adopt(server::Server& srv, uint64_t version,
             const std::shared_ptr<residency::DiskFile>& file, const store::TenantKey* expect) {
  auto rec = store::DecodeSavedRecord(file->file().meta(), "state");
  auto tenant = rec.ok() ? rec->Get("tenant") : StatusOr<std::string>(rec.status());
  auto id = rec.ok() ? rec->Get("id") : StatusOr<std::string>(rec.status());
  auto size = rec.ok() ? rec->GetUint("size") : StatusOr<uint64_t>(rec.status());
  if (!tenant.ok()) return tenant.status();
  if (!id.ok()) return id.status();
  if (!size.ok()) return size.status();
  if (file->file().block_count() != 1 || file->file().block_length(0) != size.value()) {
    return Status(ErrorKind::kCorrupt, "its block does not match its size");
  }
  const uint32_t tid = srv.users().TenantId(tenant.value());
  const store::TenantKey key{tid, id.value()};
  if (expect != nullptr && !(key == *expect)) {
    return Status(ErrorKind::kCorrupt, "it holds state slot '" + key.name.substr(0, 64) + "'");
  }
  server::Shard& shard = srv.shard(srv.OwnerOf(tid, key.name));
  shard.store().state.NoteVersion(key, version);
  const std::string old_path = ForgetHeld(shard, Slots(), key);
  store::StateSlots::Slot& sl = shard.store().state.Insert(
      key, srv.residency()->CreateOnDisk(Family::kState, {size.value()}, file, {0}));
  sl.NoteSaved(file, version, sl.writes);
  if (!old_path.empty() && old_path != file->path()) unlink(old_path.c_str());
  return Status::Ok();
}

const KeyedFamily& Slots() {
  static const KeyedFamily f{
      "STATE",
      "state",
      "state slot",
      "freed",
      [](server::Shard& sh, const store::TenantKey& key) -> store::Durable* {
        auto slot = sh.store().state.Find(key);
        return slot.ok() ? slot.value() : nullptr;
      },
      [](server::Shard& sh, const auto& each) {
        sh.store().state.ForEach(
            [&](const store::TenantKey& key, const store::StateSlots::Slot& sl) { each(key, sl); });
      },
      [](server::Shard& sh, const store::TenantKey& key) { sh.store().state.Free(key); },
      SlotContent,
      Adopt,
      [](const store::Durable& o) { return static_cast<const store::StateSlots::Slot&>(o).size; }};
  return f;
}

}  // namespace

void RegisterStateFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"STATE.ALLOC", -3, kKv | kCmdWrite | kCmdDenyOom | kCmdDeadline, 1, 1, 1, Alloc,
              "state", "Reserves a zero-filled fixed-size slot (idempotent for the same size).",
              "<id> <bytes> [DEADLINE <ms>]"});
  r.Register({"STATE.WRITE", -4, kKv | kCmdWrite | kCmdDeadline, 1, 1, 1, Write, "state",
              "Overwrites bytes of a slot in place; never grows it.",
              "<id> <offset> <data> [DEADLINE <ms>]"});
  r.Register({"STATE.READ", -4, kKv | kCmdReadOnly | kCmdDeadline, 1, 1, 1, Read, "state",
              "Reads len bytes at offset (bringing the slot back from disk if it was demoted).",
              "<id> <offset> <len> [DEADLINE <ms>]"});
  r.Register({"STATE.FREE", 2, kKv | kCmdWrite, 1, 1, 1, Free, "state",
              "Frees a slot (its saved copy too); replies 1 if it existed, 0 otherwise.", "<id>"});
  r.Register({"STATE.SAVE", 2, kKv | kCmdWrite, 1, 1, 1, Save, "state",
              "Makes the slot durable (a crash-safe object file); replies once it is on disk.",
              "<id>"});
  r.Register({"STATE.INFO", 1, kKv | kCmdReadOnly | kCmdConnection, 0, 0, 0, Info, "state",
              "Slot count and bytes of the caller's tenant.", ""});
  srv.AddStartupHook([](server::Server& srv) { return LoadKeyedSaved(srv, Slots()); });
  cluster_sync::AddSavedKind(KeyedSavedKind(Slots()));
}

}  // namespace pion::families
