#include "cluster/slot_map.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

namespace pion::cluster {

SlotMap::SlotMap() : owner(kSlots, -1), moving_from(kSlots, -1) {}

int SlotMap::IndexOf(std::string_view id) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].id == id) return static_cast<int>(i);
  }
  return -1;
}

int SlotMap::SlotsOf(int node) const {
  return static_cast<int>(std::count(owner.begin(), owner.end(), node));
}

bool SlotMap::AnyMoving() const {
  return std::any_of(moving_from.begin(), moving_from.end(), [](int16_t m) { return m >= 0; });
}

std::vector<SlotMap::Range> SlotMap::Ranges() const {
  std::vector<Range> out;
  for (int s = 0; s < kSlots; ++s) {
    if (!out.empty() && out.back().owner == owner[s] && out.back().moving_from == moving_from[s] &&
        out.back().end == s - 1) {
      out.back().end = s;
    } else {
      out.push_back({s, s, owner[s], moving_from[s]});
    }
  }
  return out;
}

std::string SlotMap::Encode() const {
  std::string out = "pion-slotmap 1\nepoch " + std::to_string(epoch) + "\n";
  for (const NodeInfo& n : nodes) {
    out += "node " + n.id + " " + n.addr + " " + std::to_string(n.incarnation) + "\n";
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    out += "replicas " + nodes[i].id;
    if (i < replicas.size()) {
      for (int16_t r : replicas[i]) out += " " + nodes[r].id;
    }
    out += "\n";
  }
  for (const Range& r : Ranges()) {
    if (r.owner < 0) continue;
    out +=
        "range " + std::to_string(r.start) + " " + std::to_string(r.end) + " " + nodes[r.owner].id;
    if (r.moving_from >= 0) out += " " + nodes[r.moving_from].id;
    out += "\n";
  }
  return out;
}

StatusOr<SlotMap> SlotMap::Decode(std::string_view text) {
  SlotMap m;
  std::istringstream in{std::string(text)};
  std::string line;
  int lineno = 0;
  auto bad = [&](const std::string& what) {
    return Error("slot map line " + std::to_string(lineno) + " ('" + line.substr(0, 80) +
                 "'): " + what);
  };
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    std::istringstream ls(line);
    std::string word;
    ls >> word;
    if (lineno == 1) {
      int version = 0;
      ls >> version;
      if (word != "pion-slotmap" || version != 1) return bad("expected 'pion-slotmap 1'");
      continue;
    }
    if (word == "epoch") {
      if (!(ls >> m.epoch)) return bad("epoch needs a number");
    } else if (word == "node") {
      NodeInfo n;
      if (!(ls >> n.id >> n.addr >> n.incarnation)) return bad("expected node <id> <addr> <inc>");
      if (!m.nodes.empty() && m.nodes.back().id >= n.id) return bad("nodes out of id order");
      m.nodes.push_back(std::move(n));
      m.replicas.emplace_back();
    } else if (word == "replicas") {
      std::string id;
      ls >> id;
      const int i = m.IndexOf(id);
      if (i < 0) return bad("unknown node '" + id + "'");
      while (ls >> id) {
        const int r = m.IndexOf(id);
        if (r < 0 || r == i) return bad("bad replica '" + id + "'");
        m.replicas[i].push_back(static_cast<int16_t>(r));
      }
    } else if (word == "range") {
      int a = -1, b = -1;
      std::string owner, to;
      if (!(ls >> a >> b >> owner)) return bad("expected range <start> <end> <owner> [<from>]");
      ls >> to;
      if (a < 0 || b < a || b >= kSlots) return bad("slots out of [0, 16383]");
      const int o = m.IndexOf(owner);
      const int t = to.empty() ? -1 : m.IndexOf(to);
      if (o < 0 || (!to.empty() && t < 0)) return bad("unknown node");
      for (int s = a; s <= b; ++s) {
        m.owner[s] = static_cast<int16_t>(o);
        m.moving_from[s] = static_cast<int16_t>(t);
      }
    } else {
      return bad("unknown line kind '" + word + "'");
    }
  }
  if (lineno == 0) return Error("slot map is empty");
  return m;
}

std::optional<SlotMap> Reconcile(const SlotMap& cur, const std::vector<NodeInfo>& live_in,
                                 int n_replicas, std::vector<std::string>* why) {
  std::map<std::string, NodeInfo> live;
  for (const NodeInfo& n : live_in) live[n.id] = n;
  if (live.empty()) return std::nullopt;  // nobody to give anything to

  // The next node list: every live node, plus dead ones that still own slots (resolved below).
  SlotMap next;
  next.epoch = cur.epoch + 1;
  for (const auto& [id, n] : live) next.nodes.push_back(n);
  std::sort(next.nodes.begin(), next.nodes.end(),
            [](const NodeInfo& a, const NodeInfo& b) { return a.id < b.id; });
  next.replicas.assign(next.nodes.size(), {});
  auto new_index = [&](int old) { return old < 0 ? -1 : next.IndexOf(cur.nodes[old].id); };

  std::vector<int> count(next.nodes.size(), 0);
  for (int s = 0; s < kSlots; ++s) {
    const int o = new_index(cur.owner[s]);
    if (o >= 0) ++count[o];
  }
  bool failed_over = false, cancelled = false, assigned = false;
  // The first live replica of node `old` (an index of cur), as an index of next; -1 if none.
  auto live_replica = [&](int old) {
    for (int16_t r : cur.replicas[old]) {
      const int i = new_index(r);
      if (i >= 0) return i;
    }
    return -1;
  };
  for (int s = 0; s < kSlots; ++s) {
    int o = new_index(cur.owner[s]);
    int f = new_index(cur.moving_from[s]);
    if (o < 0) {
      // Dead (or never assigned): its first live replica, else the least loaded live node.
      if (cur.owner[s] >= 0) {
        o = live_replica(cur.owner[s]);
        failed_over = true;
      } else {
        assigned = true;
      }
      if (o < 0) o = static_cast<int>(std::min_element(count.begin(), count.end()) - count.begin());
      ++count[o];
    }
    if (cur.moving_from[s] >= 0 && f < 0) {
      f = live_replica(cur.moving_from[s]);  // it holds the copies of the source's saves
      if (f < 0) cancelled = true;
      failed_over = true;
    }
    if (f == o) f = -1;
    next.owner[s] = static_cast<int16_t>(o);
    next.moving_from[s] = static_cast<int16_t>(f);
  }

  const int n = static_cast<int>(next.nodes.size());
  const int r = std::min(n_replicas, n - 1);
  for (int i = 0; i < n; ++i) {
    for (int k = 1; k <= r; ++k) next.replicas[i].push_back(static_cast<int16_t>((i + k) % n));
  }

  bool rebalanced = false;
  if (!failed_over && !next.AnyMoving()) {
    // Even shares: the first (16384 mod n) nodes in id order take one slot more.
    std::vector<int> target(n, kSlots / n);
    for (int i = 0; i < kSlots % n; ++i) ++target[i];
    std::vector<int> have(n, 0);
    for (int s = 0; s < kSlots; ++s) ++have[next.owner[s]];
    bool uneven = false;
    for (int i = 0; i < n; ++i) uneven |= std::abs(have[i] - target[i]) > 1;
    if (uneven) {
      // Surplus slots, highest first from each node above its target, to nodes below theirs.
      std::vector<int> surplus;
      std::vector<int> keep = have;
      for (int s = kSlots - 1; s >= 0; --s) {
        const int o = next.owner[s];
        if (keep[o] > target[o]) {
          surplus.push_back(s);
          --keep[o];
        }
      }
      size_t k = 0;
      for (int i = 0; i < n; ++i) {
        for (int need = target[i] - have[i]; need > 0 && k < surplus.size(); --need) {
          const int slot = surplus[k++];
          next.moving_from[slot] = next.owner[slot];
          next.owner[slot] = static_cast<int16_t>(i);
        }
      }
      rebalanced = k > 0;
    }
  }

  // Anything to write? Compare what the map says, not the epoch.
  SlotMap same = next;
  same.epoch = cur.epoch;
  if (same.Encode() == cur.Encode()) return std::nullopt;
  if (why != nullptr) {
    if (failed_over) why->push_back("slots of a node without a lease failed over to its replica");
    if (assigned) why->push_back("unassigned slots were assigned");
    if (cancelled)
      why->push_back("a migration from a node without a lease or replica was called off");
    if (rebalanced) why->push_back("slots move to even out the shares (their keys follow)");
    if (why->empty()) why->push_back("membership or replica placement changed");
  }
  return next;
}

SlotMap FinishMoves(const SlotMap& current, int source, const std::vector<int>& slots) {
  SlotMap next = current;
  ++next.epoch;
  for (int s : slots) {
    if (next.moving_from[s] == source) next.moving_from[s] = -1;
  }
  return next;
}

}  // namespace pion::cluster
