// STATE.* — fixed-size, overwrite-in-place slots (seed 000). Every command is keyed by slot
// id and runs on the shard that owns the id; slots are scoped by tenant.
#include "families/args.h"
#include "families/families.h"
#include "families/shard_sum.h"
#include "net/connection.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;

void Alloc(CommandContext& ctx, CmdArgs& args) {
  uint64_t bytes;
  Status s = ParseUint(args[2], "bytes", &bytes);
  if (s.ok() && bytes == 0) s = Error("bytes must be at least 1");
  if (s.ok() && bytes > ctx.server->settings().proto_max_bulk_len.load()) {
    s = Error("bytes " + std::to_string(bytes) + " exceeds proto-max-bulk-len " +
              std::to_string(ctx.server->settings().proto_max_bulk_len.load()));
  }
  if (s.ok()) s = ctx.shard->store().state.Alloc(ctx.Key(args[1]), bytes);
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Ok();
}

void Write(CommandContext& ctx, CmdArgs& args) {
  uint64_t offset;
  Status s = ParseUint(args[2], "offset", &offset);
  if (s.ok()) s = ctx.shard->store().state.Write(ctx.Key(args[1]), offset, args[3]);
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Ok();
}

void Read(CommandContext& ctx, CmdArgs& args) {
  uint64_t offset, len;
  Status s = ParseUint(args[2], "offset", &offset);
  if (s.ok()) s = ParseUint(args[3], "len", &len);
  if (!s.ok()) return ctx.Error(s);
  const uint8_t* begin = nullptr;
  auto buf = ctx.shard->store().state.Read(ctx.Key(args[1]), offset, len, &begin);
  if (!buf.ok()) return ctx.Error(buf.status());
  ctx.rb->BulkRef(buf.value(), begin, len);
}

void Free(CommandContext& ctx, CmdArgs& args) {
  ctx.rb->Integer(ctx.shard->store().state.Free(ctx.Key(args[1])) ? 1 : 0);
}

void Info(CommandContext& ctx, CmdArgs&) {
  const uint32_t tenant = ctx.tenant;
  ReplySumOverShards(ctx, {{"slots"}, {"bytes"}}, [tenant](server::Shard& shard) {
    auto u = shard.store().state.UsageOf(tenant);
    return std::vector<double>{static_cast<double>(u.slots), static_cast<double>(u.bytes)};
  });
}

}  // namespace

void RegisterStateFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"STATE.ALLOC", 3, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, Alloc, "state",
              "Reserves a zero-filled fixed-size slot (idempotent for the same size).",
              "<id> <bytes>"});
  r.Register({"STATE.WRITE", 4, kKv | kCmdWrite, 1, 1, 1, Write, "state",
              "Overwrites bytes of a slot in place; never grows it.", "<id> <offset> <data>"});
  r.Register({"STATE.READ", 4, kKv | kCmdReadOnly, 1, 1, 1, Read, "state",
              "Reads len bytes at offset.", "<id> <offset> <len>"});
  r.Register({"STATE.FREE", 2, kKv | kCmdWrite, 1, 1, 1, Free, "state",
              "Frees a slot; replies 1 if it existed, 0 otherwise.", "<id>"});
  r.Register({"STATE.INFO", 1, kKv | kCmdReadOnly | kCmdConnection, 0, 0, 0, Info, "state",
              "Slot count and bytes of the caller's tenant.", ""});
  srv.AddShardInit([&srv](Shard& shard) {
    shard.store().state.set_budget(srv.memory().BudgetFor(MemFamily::kState));
  });
}

}  // namespace pion::families
