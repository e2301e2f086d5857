// What the dispatcher asks of cluster mode (--cluster): where a command on a hash slot runs —
// here, here if its key is still here (the slot is moving away: -ASK otherwise), or on another
// node (-MOVED). The cluster module (src/cluster, families/cluster_family.cc) implements it;
// in single-node mode the server has none and routes nothing.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace pion::server {

class Shard;
struct CommandSpec;

struct SlotRoute {
  enum class Kind {
    kServe,       // this node owns the slot, or the client was sent here with -ASK for it
    kCheckKey,    // keys of the slot are moving: CheckKey() decides on the key's shard
    kMoved,       // another node owns it: -MOVED <slot> <addr>
    kUnassigned,  // nobody owns it: -CLUSTERDOWN
  };
  Kind kind = Kind::kServe;
  std::string addr;        // kMoved: the owner; kCheckKey: where a key that is not here is asked
  bool importing = false;  // kCheckKey: this node owns the slot and its keys come from addr
  std::string from_id;     // importing: the id of the node at addr
};

class ClusterRouting {
 public:
  virtual ~ClusterRouting() = default;
  // By this node's newest slot map; `asking`: the client's previous command was ASKING. Any
  // thread; cheap (no lock on the common path).
  virtual SlotRoute Route(int slot, bool asking) = 0;
  // For kCheckKey: empty when the command runs here, else the error line to answer instead
  // (-ASK <slot> <addr> for a key that is not here — or, importing, whose current bytes have
  // not arrived from addr yet —, -TRYAGAIN for one being sent). `key` is the argument `spec`
  // routes by. Runs on the shard that owns the key.
  virtual std::string CheckKey(Shard& shard, uint32_t tenant, const CommandSpec& spec,
                               std::string_view key, int slot, const SlotRoute& route) = 0;
};

}  // namespace pion::server
