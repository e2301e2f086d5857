// Shared by the V.* command files (vstore_family.cc: sessions; vstore_tier.cc: sealed
// snapshots on disk). Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "families/cluster_internal.h"
#include "server/command.h"
#include "store/prefix_registry.h"

namespace pion::families::vstore {

// "<ns>_pk" / "<ns>_pv" / "<ns>_pl" (an MLA namespace's latents) route like "<ns>" (a
// KV.PREFIX namespace and its sessions share a shard); other session ids route as themselves.
std::string_view SessionRouteKey(std::string_view sid);

// The KV.PREFIX namespace whose session `sid` is ("<ns>_pk" / "<ns>_pv" / "<ns>_pl"), or null
// (the namespace's layout may not have that session: kvprefix::CheckLayoutSession).
store::PrefixEntry* PrefixOf(server::CommandContext& ctx, std::string_view sid);

// V.FETCH (vstore_fetch.cc).
void Fetch(server::CommandContext& ctx, proto::CmdArgs& args);

std::string SealedDir(server::Server& srv);
// V.COMMIT <sid> <snapshot>.
void Commit(server::CommandContext& ctx, proto::CmdArgs& args);
// Restores the session from a sealed snapshot on disk (creating the session if it is not in
// memory); replies later. Runs on the owning shard.
void RestoreSealed(server::CommandContext& ctx, const std::string& sid, uint64_t snapshot);
// Registers the sealed snapshots found on disk at start-up, and restores every session that
// has an image (below) from its newest one.
Status LoadSealed(server::Server& srv);

// Session images: SHUTDOWN SAVE keeps a plain V session (not a KV.PREFIX namespace's: the
// namespace saves those) by sealing a snapshot of it marked as its image; start-up restores
// the session from its newest image (its chunks read when first used), and an image replaces
// the older ones. Each runs on the owning shard.
struct UnsavedSession {
  store::TenantKey key;
  uint64_t bytes = 0;
};
// The plain sessions changed since their newest image (or never imaged).
std::vector<UnsavedSession> UnsavedSessions(server::Shard& shard);
// Seals the session as it is now as its image; `done` runs on the shard once it is durable.
void SaveImage(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
               std::function<void(const Status&)> done);
// Sealed snapshots as cluster mode copies and moves them (cluster_internal.h).
cluster_sync::SavedKind SavedKindOf();

}  // namespace pion::families::vstore
