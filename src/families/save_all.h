// SHUTDOWN SAVE and the exit report: what every family holds that its disk copy lacks.
//
// The durable families (cluster_sync::SavedKinds(): KV.PREFIX namespaces, ATTEND.PREFIX slots,
// SSM sessions, STATE slots) save an object through their `save_for_move` — the object as of
// now, durable, written only when it changed since its last save; plain V sessions save as
// images (vstore_internal.h). Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "server/server.h"

namespace pion::families {

struct FamilyTally {
  uint64_t objects = 0;  // saved (SaveAll) or unsaved (Unsaved)
  uint64_t bytes = 0;
  uint64_t failed = 0;
  std::string first_error;  // of the first failed save
};
// By family as users name them: "KV.PREFIX", "ATTEND.PREFIX", "SSM.PREFIX", "STATE", "V".
using Tally = std::map<std::string, FamilyTally>;

// Saves every object whose content is not durable, on every shard, then looks again until a
// pass saves nothing more (a write parked before the caller paused writes may land late; at
// most a few passes). `done` runs on a shard thread with what was saved and what failed.
void SaveAll(server::Server& srv, std::function<void(Tally)> done);

// What an exit would drop now: per family, the objects whose content is not durable, and
// their bytes. Runs on the main thread once the shards stopped.
Tally Unsaved(server::Server& srv);

// "KV.PREFIX 3 (1.50M), STATE 1 (8B)"; with errors, each family's failures and first error.
std::string DescribeTally(const Tally& t, bool errors);
uint64_t FailedSaves(const Tally& t);

// Logs what an exit drops (SIGTERM, SHUTDOWN NOSAVE, or nothing after SHUTDOWN SAVE).
void RegisterExitReport(server::Server& srv);

}  // namespace pion::families
