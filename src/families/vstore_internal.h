// Shared by the V.* command files (vstore_family.cc: sessions; vstore_tier.cc: sealed
// snapshots on disk). Not a public interface.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "families/cluster_internal.h"
#include "server/command.h"

namespace pion::families::vstore {

// "<ns>_pk" / "<ns>_pv" route like "<ns>" (a KV.PREFIX namespace and its sessions share a
// shard); other session ids route as themselves.
std::string_view SessionRouteKey(std::string_view sid);

std::string SealedDir(server::Server& srv);
// V.COMMIT <sid> <snapshot>.
void Commit(server::CommandContext& ctx, proto::CmdArgs& args);
// Restores the session from a sealed snapshot on disk (creating the session if it is not in
// memory); replies later. Runs on the owning shard.
void RestoreSealed(server::CommandContext& ctx, const std::string& sid, uint64_t snapshot);
// Registers the sealed snapshots found on disk at start-up.
Status LoadSealed(server::Server& srv);
// Sealed snapshots as cluster mode copies and moves them (cluster_internal.h).
cluster_sync::SavedKind SavedKindOf();

}  // namespace pion::families::vstore
