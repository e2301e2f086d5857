// SSM.PREFIX.* — recurrent state for hybrid models (seed 002): opaque per-layer blobs keyed by
// (session, layer), stored as received (no copy) and replied from the stored bytes.
#include "families/args.h"
#include "families/families.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;

void Store(CommandContext& ctx, CmdArgs& args) {
  uint64_t layer;
  Status s = ParseUint(args[2], "layer", &layer);
  if (!s.ok()) return ctx.Error(s);
  auto blob = args.TakeBuffer(3);  // adopts the received buffer when it has its own
  if (!blob.ok()) return ctx.Error(blob.status());
  s = ctx.shard->store().ssm.Store(ctx.Key(args[1]), layer, std::move(blob).value());
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Ok();
}

void Fetch(CommandContext& ctx, CmdArgs& args) {
  uint64_t layer;
  Status s = ParseUint(args[2], "layer", &layer);
  if (!s.ok()) return ctx.Error(s);
  BufferRef blob = ctx.shard->store().ssm.Fetch(ctx.Key(args[1]), layer);
  if (!blob) return ctx.rb->Null();
  ctx.rb->BulkRef(blob);
}

void Drop(CommandContext& ctx, CmdArgs& args) {
  std::optional<uint64_t> layer;
  if (args.size() == 3) {
    uint64_t l;
    Status s = ParseUint(args[2], "layer", &l);
    if (!s.ok()) return ctx.Error(s);
    layer = l;
  }
  ctx.shard->store().ssm.Drop(ctx.Key(args[1]), layer);
  ctx.rb->Ok();
}

}  // namespace

void RegisterSsmFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register({"SSM.PREFIX.STORE", 4, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, Store, "ssm",
              "Stores one layer's recurrent-state blob (opaque; replaces any previous one).",
              "<sid> <layer> <state_blob>"});
  r.Register({"SSM.PREFIX.FETCH", 3, kKv | kCmdReadOnly, 1, 1, 1, Fetch, "ssm",
              "Returns one layer's blob, or null when absent.", "<sid> <layer>"});
  r.Register({"SSM.PREFIX.DROP", -2, kKv | kCmdWrite, 1, 1, 1, Drop, "ssm",
              "Drops one layer, or every layer of the session; idempotent.", "<sid> [<layer>]"});
  srv.AddShardInit([&srv](Shard& shard) {
    shard.store().ssm.set_budget(srv.memory().BudgetFor(MemFamily::kSsm));
  });
}

}  // namespace pion::families
