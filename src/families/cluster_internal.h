// What the families with saved objects ask of cluster mode (families/cluster_sync.cc), and
// what cluster mode asks of them: each family whose objects are saved to disk (KV.PREFIX
// namespaces, STATE slots, SSM.PREFIX sessions, ATTEND.PREFIX slots, sealed V.COMMIT
// snapshots) describes them once as a SavedKind; the replication thread copies, moves and
// discards every kind the same way. Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "server/server.h"
#include "store/tenant_key.h"

namespace pion::families::cluster_sync {

// True when the server runs as a cluster node (--cluster).
bool Enabled(server::Server& srv);

// Which saved object: on the wire `<kind> <tenant> <key> ... [<part>]`.
struct ObjectId {
  std::string kind;    // PREFIX, STATE, SSM, ATTENTION, VSNAP
  std::string tenant;  // the tenant's name (ids are per process)
  std::string key;     // the family's key, as clients name it
  std::string part;    // which object of the key: "" when one per key; the layer, the snapshot
};

// One object of a family held on a shard, as cluster mode sees it.
struct HeldObject {
  store::TenantKey key;
  std::string tenant;    // the tenant's name
  std::string part;      // as ObjectId::part
  uint64_t version = 0;  // the saved version; 0: never saved
  std::string path;      // the saved file
  bool live = false;     // clients changed it here since that save (or it was never saved)
  bool corrupt = false;  // its saved copy failed validation: never sent
  uint64_t bytes = 0;    // its content's size, in whichever tier holds it
};

// A family's saved objects. Every function runs on the shard that owns the key.
struct SavedKind {
  std::string name;  // ObjectId::kind
  // The key whose hash slot the object lives in (V sessions route by their namespace); null:
  // the key itself.
  std::function<std::string_view(std::string_view)> route_key;
  // Every object of this family on the shard, saved or not.
  std::function<std::vector<HeldObject>(server::Server&, server::Shard&)> held;
  // One of them, if held.
  std::function<std::optional<HeldObject>(server::Server&, server::Shard&, const store::TenantKey&,
                                          const std::string& part)>
      find;
  // Where version `version` of a pushed copy is written: the directory and object name.
  std::function<std::pair<std::string, std::string>(server::Server&, const ObjectId&)> file_of;
  // Whether a copy of version `version` may replace what is held: kMismatch "stale: ..." when
  // the held version is as new (an older generation never replaces a newer one), kBusy when a
  // client created it on this node meanwhile (a slot being imported).
  std::function<Status(server::Server&, server::Shard&, const store::TenantKey&,
                       const std::string& part, uint64_t version)>
      check;
  // Installs the copy, durable at `path` (named by file_of): known by its disk copy, the
  // older one replaced. Fenced like check (the file is removed when refused).
  std::function<Status(server::Server&, server::Shard&, const store::TenantKey&,
                       const std::string& part, uint64_t version, const std::string& path)>
      install;
  // Forgets it here with its saved files; with max_version > 0 only when the version held is
  // at most that.
  std::function<Status(server::Server&, server::Shard&, const store::TenantKey&,
                       const std::string& part, uint64_t max_version)>
      discard;
  // After it moved to a node this one is a replica of: keep only the saved copy of `version`
  // (null: what is held is that copy already, nothing to do).
  std::function<Status(server::Server&, server::Shard&, const store::TenantKey&,
                       const std::string& part, uint64_t version)>
      keep_copy;
  // Its content as of now, durable: the saved file when nothing changed since, else a new
  // save. `done` runs on the shard with the file and its version.
  std::function<void(server::Server&, server::Shard&, const store::TenantKey&,
                     const std::string& part,
                     std::function<void(StatusOr<std::pair<std::string, uint64_t>>)>)>
      save_for_move;
};

// Called by each family's Register function (idempotent by name).
void AddSavedKind(SavedKind kind);
const std::vector<SavedKind>& SavedKinds();
// Null when no family registered `name`.
const SavedKind* FindSavedKind(std::string_view name);
// The key `kind`'s object `key` routes by.
std::string_view RouteKeyOf(const SavedKind& kind, std::string_view key);

// After version `version` of an object is durable here (at `path`): sends the object file to
// every replica of this node; `done` (on the replication thread) gets Ok once all of them hold
// it, else which replica failed and why (the save stays durable here).
void ReplicateSaved(server::Server& srv, ObjectId id, uint64_t version, std::string path,
                    std::function<void(const Status&)> done);

// After an object saved up to `version` was dropped here: the replicas drop their copies
// (queued behind earlier saves, in order); `done` gets Ok once all of them did, else which
// replica did not and why — so a fail-over never serves a dropped object.
void ReplicateDrop(server::Server& srv, ObjectId id, uint64_t version,
                   std::function<void(const Status&)> done);

// For handlers: a `done` for ReplicateSaved / ReplicateDrop that answers `ok` through the
// deferred `reply`, or the replicas' error.
std::function<void(const Status&)> AnswerWith(
    std::function<void(server::CommandContext::ReplyWriter)> reply,
    server::CommandContext::ReplyWriter ok);

// For n saves or drops of one command: a `done` to call n times (from any thread) that calls
// `all` once, with Ok when every call was Ok, else the first error. n must be at least 1.
std::function<void(const Status&)> Gather(size_t n, std::function<void(const Status&)> all);

}  // namespace pion::families::cluster_sync
