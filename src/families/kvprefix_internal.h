// Helpers shared by the KV.PREFIX command files (kvprefix_family.cc: namespaces and lookups;
// kvprefix_tier.cc: the disk tier). Not a public interface.
#pragma once

#include <array>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "residency/object.h"
#include "server/command.h"
#include "server/shard.h"
#include "store/prefix_registry.h"
#include "store/vsession.h"

namespace pion::families::kvprefix {

// The namespace's sessions, when all exist with the manifest's shape: K then V, or an MLA
// namespace's one latent session (PrefixManifest::SessionSuffixes, in that order).
struct PrefixSessions {
  std::array<const store::VSession*, 2> parts{};
  size_t count = 0;  // 0: some session is missing or of another shape
  bool ok() const { return count > 0; }
  std::span<const store::VSession* const> all() const { return {parts.data(), count}; }
};
PrefixSessions SessionsOf(server::Shard& shard, uint32_t tenant, std::string_view ns,
                          const store::PrefixManifest& m);
bool Complete(const PrefixSessions& s, const store::PrefixManifest& m);
// A namespace is published once complete — every row of every layer written in K and V — and
// what a reader saw as complete never changes (seed 004 §0x01, §0x04B): writes into a
// published namespace's sessions are refused (PublishedRefusal); new K/V are a new publication
// (KV.PREFIX.DROP + REGISTER: a higher cache generation, which readers' GENERATION fences tell
// apart). True when `e` is published; publishes it (its publication generation) the first time
// it is found complete. Runs on the owning shard.
bool Published(server::Shard& shard, uint32_t tenant, std::string_view ns, store::PrefixEntry* e);
// kReadOnly: `what` (e.g. "V.STOREBATCH into 'ns_pk'") would change published namespace ns.
Status PublishedRefusal(std::string_view ns, const store::PrefixEntry& e, std::string_view what);
// kMismatch when `sid` ("<ns>_pk", "<ns>_pv", "<ns>_pl") is not a session of the namespace's
// layout: a per-head reader of an MLA namespace, or an MLA reader of a per-head one.
Status CheckLayoutSession(std::string_view sid, const store::PrefixManifest& m);
// kErr when session rows [lo, hi) fall outside the manifest's n_layers*n_tokens rows.
Status CheckRows(std::string_view ns, const store::PrefixManifest& m, int64_t lo, int64_t hi);
// kCorrupt when the namespace's disk copy failed validation, or a chunk of its sessions did
// (which marks the whole namespace corrupt from then on: counted, logged, never served).
Status Intact(server::Server& srv, const store::TenantKey& ns, store::PrefixEntry* e,
              const PrefixSessions& s);

// The disk tier's directory for prefixes.
std::string PrefixDir(server::Server& srv);

// Every chunk object of the namespace's two sessions.
std::vector<residency::ObjectRef> ChunkObjects(const PrefixSessions& s);

// Runs on the owning shard. Opens a namespace found on disk at start-up (PrefixEntry::resident
// false): reads its chunk index on the I/O pool and creates its two sessions with every chunk
// known by its disk copy (nothing else is read until used); `done` runs on the shard with the
// outcome. Concurrent opens of one namespace share a single read. Ok at once when it is open.
void Open(server::Server& srv, server::Shard& shard, const store::TenantKey& ns,
          std::function<void(const Status&)> done);
// Fails the waiters of an open in flight (the namespace is being dropped).
void CancelOpen(store::PrefixEntry* e, const Status& why);
// For handlers: true when `ns` is a namespace not open yet — the command is then parked until
// it is (it runs again) and the handler must return.
bool ParkUntilOpen(server::CommandContext& ctx, const store::TenantKey& ns);

void RegisterTierCommands(server::Server& srv);

// Cluster mode (families/cluster_sync.cc). Each runs on the shard that owns the namespace.
struct HeldPrefix {
  store::TenantKey key;
  std::string tenant;          // the tenant's name
  uint64_t saved_version = 0;  // 0: never saved
  std::string disk_path;
  bool resident = false;
  bool dirty = false;
  bool corrupt = false;
  uint64_t bytes = 0;  // its sessions' chunks, in whichever tier
};
// Every namespace of this shard.
std::vector<HeldPrefix> HeldPrefixes(server::Server& srv, server::Shard& shard);
// Whether a copy of version `version` pushed by another node may replace what is held here:
// kMismatch ("stale") when the held version is as new, kBusy when a client registered the
// name here meanwhile (a slot being imported).
Status CheckPushable(server::Shard& shard, const store::TenantKey& key, uint64_t version);
// Installs that copy, already durable at `path` (its final name in PrefixDir): the namespace
// becomes known by its disk copy (opened on first use), replacing an older one. Fenced like
// CheckPushable (the file is removed when refused).
Status InstallPushed(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                     uint64_t version, const std::string& path);
// Forgets the namespace here, with its saved files (its slot is not this node's any more).
// With max_version > 0, only when the version held is at most that.
Status DiscardHere(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                   uint64_t max_version);
// Keeps only the saved file of version `version` (a replica's copy): the sessions leave
// memory, the namespace is known by its disk copy again. Anything else is discarded.
Status KeepDiskCopyOnly(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                        uint64_t version);
// The namespace's content as of now, durable: its saved file when nothing changed since the
// save, else a new save. `done` runs on the shard with the file's path and version.
void SaveForMove(server::Server& srv, server::Shard& shard, const store::TenantKey& key,
                 std::function<void(StatusOr<std::pair<std::string, uint64_t>>)> done);

}  // namespace pion::families::kvprefix
