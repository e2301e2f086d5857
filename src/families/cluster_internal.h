// What the KV.PREFIX family asks of cluster mode (families/cluster_sync.cc): copies of its
// saved objects on this node's replicas. Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "server/server.h"

namespace pion::families::cluster_sync {

// True when the server runs as a cluster node (--cluster).
bool Enabled(server::Server& srv);

// After version `version` of a namespace is durable here (at `path`): sends the object file to
// every replica of this node; `done` (on the replication thread) gets Ok once all of them hold
// it, else which replica failed and why (the save stays durable here).
void ReplicateSaved(server::Server& srv, std::string tenant, std::string ns, uint64_t version,
                    std::string path, std::function<void(const Status&)> done);

// After a namespace saved up to `version` was dropped here: the replicas drop their copies
// (queued behind earlier saves, in order); `done` gets Ok once all of them did, else which
// replica did not and why — so a fail-over never serves a dropped namespace.
void ReplicateDrop(server::Server& srv, std::string tenant, std::string ns, uint64_t version,
                   std::function<void(const Status&)> done);

}  // namespace pion::families::cluster_sync
