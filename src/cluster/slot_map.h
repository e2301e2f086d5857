// The cluster's slot map — which node owns each of the 16384 hash slots, which nodes keep
// copies of each node's saved objects, and which slots are moving — and the leader's rules for
// changing it (fail-over, replica placement, rebalancing). The map lives in etcd as one value
// (Encode/Decode), written only by compare-and-swap, so every node sees the same epochs in the
// same order. Pure data and functions: no I/O, no threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cluster/key_slot.h"
#include "common/status.h"

namespace pion::cluster {

struct NodeInfo {
  std::string id;           // --node-id
  std::string addr;         // --announce host:port, where clients reach it
  int64_t incarnation = 0;  // the etcd lease of its current run: changes at every restart
};

struct SlotMap {
  SlotMap();

  uint64_t epoch = 0;           // bumped by every change
  std::vector<NodeInfo> nodes;  // sorted by id
  std::vector<int16_t> owner;   // per slot: index into nodes, -1 when unassigned
  // Per slot: the node its keys are still moving from, or -1. A slot that moves is given to
  // its new owner at once (clients are sent there with -MOVED, and so learn of a new node);
  // the owner sends clients on to the previous one (-ASK) for keys that have not arrived yet.
  std::vector<int16_t> moving_from;
  std::vector<std::vector<int16_t>> replicas;  // per node: the nodes that copy its saves

  int IndexOf(std::string_view id) const;  // -1 when the map does not name it
  int SlotsOf(int node) const;
  bool AnyMoving() const;

  struct Range {
    int start = 0, end = 0;  // inclusive, as CLUSTER SLOTS
    int owner = -1;
    int moving_from = -1;
  };
  // Maximal runs of slots with the same owner and migration source, in slot order.
  std::vector<Range> Ranges() const;

  // Text form stored in etcd ("pion-slotmap 1", epoch, node, replicas and range lines).
  std::string Encode() const;
  // kErr names the line that does not parse or refers to an unknown node.
  static StatusOr<SlotMap> Decode(std::string_view text);
};

// The leader's step: given the current map and the nodes that hold a live lease, the next map
// (epoch + 1), or nothing when no change is due. In order:
//  - a slot whose owner has no lease goes to the first of that owner's replicas that is live
//    (it holds copies of the owner's saves); with none live, to the live node owning fewest
//    slots (nothing of it survives: its keys are misses there, never stale hits);
//  - a migration from a node without a lease continues from that node's first live replica
//    (it holds the copies of what was saved there), or is called off without one;
//  - nodes without a lease and without slots leave the map; live ones join it;
//  - each node's replicas are the next `replicas` live nodes after it in id order;
//  - when no slot moves and nothing failed over in this step: slots of nodes above their even
//    share go to those below it (owner = the new node, moving_from = the old one), so that
//    every node ends within one slot of 16384 / n.
// `why` gets one line per kind of change, for the log.
std::optional<SlotMap> Reconcile(const SlotMap& current, const std::vector<NodeInfo>& live,
                                 int replicas, std::vector<std::string>* why);

// The map after `source` sent every key of `slots` to their owner: nothing moves there any more.
SlotMap FinishMoves(const SlotMap& current, int source, const std::vector<int>& slots);

}  // namespace pion::cluster
