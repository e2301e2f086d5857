// What the families of one durable object a key share — STATE slots and SSM sessions: a save
// writes the whole object as one crash-safe object file (tiering.h's WriteObjectsLater), the
// SAVE command replies once it is durable (and, in cluster mode, once the replicas hold it),
// start-up installs every saved file again, and cluster mode copies and moves the objects
// (cluster_internal.h's SavedKind). A family describes itself once as a KeyedFamily; what
// differs (its store, the meta record, how a file becomes an object) stays in its own file.
// Everything runs on the shard that owns the key. Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "families/cluster_internal.h"
#include "residency/disk_file.h"
#include "residency/engine.h"
#include "server/command.h"
#include "store/durable.h"
#include "store/tenant_key.h"

namespace pion::families {

// A save's outcome: the durable file's path and version (the newer one when a later save
// finished first), or why there is none.
using SavedFile = StatusOr<std::pair<std::string, uint64_t>>;

// What one save of an object writes: its meta record (store/saved_record.h), its objects in
// order, and the version it takes (the store's NextVersion).
struct SaveContent {
  std::string meta;
  std::vector<residency::Engine::SaveItem> items;
  uint64_t version = 0;
};

struct KeyedFamily {
  std::string kind;  // cluster mode's ObjectId::kind: "STATE", "SSM"
  std::string dir;   // the saved files' directory (SavedDir) and name family (SavedObjectName)
  std::string what;  // in messages: "state slot", "SSM session"
  std::string gone;  // how one stops existing, for a save it outran: "freed", "dropped"
  // The object of `key` on this shard, or null.
  std::function<store::Durable*(server::Shard&, const store::TenantKey&)> find;
  // Every object of the shard.
  std::function<void(server::Shard&,
                     const std::function<void(const store::TenantKey&, const store::Durable&)>&)>
      for_each;
  // Forgets the object in memory (its saved file is the caller's to remove).
  std::function<void(server::Shard&, const store::TenantKey&)> forget;
  // What a save of the object writes now, or why it cannot be saved.
  std::function<StatusOr<SaveContent>(server::Server&, server::Shard&, const store::TenantKey&,
                                      store::Durable&)>
      content;
  // Installs the saved file of `version` as its object, known by its disk copy, on the shard
  // that owns it (replacing one held there; ReplaceHeld). With `expect`, the file must hold
  // that key's object (kCorrupt otherwise). Runs at start-up or on the owning shard.
  std::function<Status(server::Server&, uint64_t version,
                       const std::shared_ptr<residency::DiskFile>&, const store::TenantKey* expect)>
      adopt;
  // The object's content size (the shutdown report counts what an exit without SAVE drops).
  std::function<uint64_t(const store::Durable&)> bytes;
};

// <dir>'s object name of `key`.
std::string SavedNameOf(server::Server& srv, const KeyedFamily& f, const store::TenantKey& key);

// The object as of now, durable: `done` runs on the shard with the file and its version — the
// saved one when nothing changed since. "no such <what>" when there is none.
void SaveKeyed(server::Server& srv, server::Shard& shard, const KeyedFamily& f,
               const store::TenantKey& key, std::function<void(SavedFile)> done);

// The SAVE command: replies OK once the object is durable (in cluster mode also once every
// replica holds that version; again when unchanged, so a failed copy is retried).
void SaveCommand(server::CommandContext& ctx, const KeyedFamily& f, const store::TenantKey& key);

// The removal commands (STATE.FREE, SSM.PREFIX.DROP of a whole session), before they forget the
// object: removes its saved file, if any (a few unlinks and one directory fsync). Returns the
// version removed (0: none) or why it could not be.
StatusOr<uint64_t> RemoveSaved(server::Server& srv, server::Shard& shard, const KeyedFamily& f,
                               const store::TenantKey& key);

// ... and after: replies `ok`; in cluster mode, when a saved version was removed, once every
// replica dropped its copy too (so a fail-over never serves it), else with their error.
void ReplyRemoved(server::CommandContext& ctx, const KeyedFamily& f, const store::TenantKey& key,
                  uint64_t removed_version, server::CommandContext::ReplyWriter ok);

// For `adopt`: forgets the object of `key` held on `shard` (if any) and returns the path of its
// saved file (empty: none), for the caller to remove once the new file is installed.
std::string ForgetHeld(server::Shard& shard, const KeyedFamily& f, const store::TenantKey& key);

// Start-up: every saved file of the family comes back on its owning shard (LoadSavedObjects).
Status LoadKeyedSaved(server::Server& srv, const KeyedFamily& f);

// The family as cluster mode copies and moves it. `f` must outlive the server (a static).
cluster_sync::SavedKind KeyedSavedKind(const KeyedFamily& f);

}  // namespace pion::families
