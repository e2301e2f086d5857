// Helpers shared by the KV.PREFIX command files (kvprefix_family.cc: namespaces and lookups;
// kvprefix_tier.cc: the disk tier). Not a public interface.
#pragma once

#include <functional>
#include <string>
#include <string_view>

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

// The disk tier's directory for prefixes.
std::string PrefixDir(server::Server& srv);

// Runs on the owning shard. Promotes a non-resident namespace from disk (reserve, read and
// verify every block on the I/O pool, then install and publish on the shard); `done` runs on
// the shard with the outcome. Concurrent promotions of one namespace share a single read.
void Warm(server::Server& srv, server::Shard& shard, const store::TenantKey& ns,
          std::function<void(const Status&)> done);
// Fails the waiters of an in-flight promotion (the namespace is being dropped).
void CancelWarm(store::PrefixEntry* e, const Status& why);

void RegisterTierCommands(server::Server& srv);

}  // namespace pion::families::kvprefix
