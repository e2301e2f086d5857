// Helpers shared by the KV.PREFIX command files (kvprefix_family.cc: namespaces and lookups;
// kvprefix_tier.cc: the disk tier). Not a public interface.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "residency/object.h"
#include "server/command.h"
#include "server/shard.h"
#include "store/prefix_registry.h"
#include "store/vsession.h"

namespace pion::families::kvprefix {

// The namespace's two sessions, when both exist with the manifest's shape.
struct PrefixSessions {
  const store::VSession* k = nullptr;
  const store::VSession* v = nullptr;
  bool ok() const { return k != nullptr && v != nullptr; }
};
PrefixSessions SessionsOf(server::Shard& shard, uint32_t tenant, std::string_view ns,
                          const store::PrefixManifest& m);
bool Complete(const PrefixSessions& s, const store::PrefixManifest& m);
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

}  // namespace pion::families::kvprefix
