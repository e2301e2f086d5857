// DEBUG.FAULT — the fault-injection switch of the test binary pion-server-faults (seed 004
// §0x0B1). Only that binary links this file and installs its injector; the release pion-server
// has neither the command nor any way to turn a fault on.
//
//   DEBUG.FAULT SET <point> <action> [COUNT <n>] [DELAY <ms>] [TARGET <dir>]
//     point:  disk.write | disk.fsync | disk.read | gpu.copy
//     action: error | short | nospace | corrupt | slow
//     COUNT:  how many matching calls it hits (default 1; -1 = until cleared)
//     DELAY:  for slow, how long each call waits (default 100 ms)
//     TARGET: only calls on that directory ("spill", "prefixes", "ssm", "state", "attention",
//             "vsnap"; "gpu" for copies); default any
//   DEBUG.FAULT CLEAR
//   DEBUG.FAULT LIST   -> one map per rule: point, action, left, delay_ms, target, fired
#include "faults/fault_family.h"

#include <mutex>
#include <string>
#include <vector>

#include "common/faults.h"
#include "families/args.h"
#include "server/server.h"

namespace pion::faults {
namespace {

using families::EqualsIgnoreCase;

struct Rule {
  Point point;
  Fault fault;
  int64_t left;  // -1: forever
  std::string target;
  uint64_t fired = 0;
};

const char* kPoints[] = {"disk.write", "disk.fsync", "disk.read", "gpu.copy"};
const char* kActions[] = {"none", "error", "short", "nospace", "corrupt", "slow"};

class Table final : public Injector {
 public:
  Fault Next(Point point, std::string_view target) override {
    std::lock_guard lock(mu_);
    for (Rule& r : rules_) {
      if (r.point != point || r.left == 0) continue;
      if (!r.target.empty() && r.target != target) continue;
      if (r.left > 0) --r.left;
      ++r.fired;
      return r.fault;
    }
    return {};
  }
  void Add(Rule r) {
    std::lock_guard lock(mu_);
    rules_.push_back(std::move(r));
  }
  void Clear() {
    std::lock_guard lock(mu_);
    rules_.clear();
  }
  std::vector<Rule> rules() const {
    std::lock_guard lock(mu_);
    return rules_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Rule> rules_;
};

Table& TheTable() {
  static Table t;
  return t;
}

void Command(server::CommandContext& ctx, proto::CmdArgs& args) {
  auto& rb = *ctx.rb;
  std::string_view sub = args[1];
  if (EqualsIgnoreCase(sub, "CLEAR") && args.size() == 2) {
    TheTable().Clear();
    return rb.Ok();
  }
  if (EqualsIgnoreCase(sub, "LIST") && args.size() == 2) {
    auto rules = TheTable().rules();
    rb.Array(rules.size());
    for (const Rule& r : rules) {
      rb.Map(6);
      rb.Bulk("point");
      rb.Bulk(kPoints[static_cast<int>(r.point)]);
      rb.Bulk("action");
      rb.Bulk(kActions[static_cast<int>(r.fault.action)]);
      rb.Bulk("left");
      rb.Integer(r.left);
      rb.Bulk("delay_ms");
      rb.Integer(r.fault.delay_ms);
      rb.Bulk("target");
      rb.Bulk(r.target);
      rb.Bulk("fired");
      rb.Integer(static_cast<int64_t>(r.fired));
    }
    return;
  }
  if (!EqualsIgnoreCase(sub, "SET") || args.size() < 4) {
    return ctx.Error(Error(
        "syntax: DEBUG.FAULT SET <disk.write|disk.fsync|disk.read|gpu.copy> "
        "<error|short|nospace|corrupt|slow> [COUNT <n>] [DELAY <ms>] [TARGET <dir>] | CLEAR | "
        "LIST"));
  }
  Rule r{Point::kCount, {}, 1, ""};
  for (int i = 0; i < 4; ++i) {
    if (EqualsIgnoreCase(args[2], kPoints[i])) r.point = static_cast<Point>(i);
  }
  if (r.point == Point::kCount) {
    return ctx.Error(Error("unknown fault point '" + std::string(args[2].substr(0, 32)) + "'"));
  }
  bool known = false;
  for (int i = 1; i < 6; ++i) {
    if (EqualsIgnoreCase(args[3], kActions[i])) {
      r.fault.action = static_cast<Action>(i);
      known = true;
    }
  }
  if (!known) {
    return ctx.Error(Error("unknown fault action '" + std::string(args[3].substr(0, 32)) + "'"));
  }
  r.fault.delay_ms = r.fault.action == Action::kSlow ? 100 : 0;
  for (size_t i = 4; i + 1 < args.size() + 1; i += 2) {
    if (i + 1 >= args.size()) return ctx.Error(Error("option needs a value"));
    int64_t v = 0;
    if (EqualsIgnoreCase(args[i], "COUNT") && ParseInt64(args[i + 1], &v) && v >= -1) {
      r.left = v;
    } else if (EqualsIgnoreCase(args[i], "DELAY") && ParseInt64(args[i + 1], &v) && v >= 0) {
      r.fault.delay_ms = static_cast<int>(v);
    } else if (EqualsIgnoreCase(args[i], "TARGET")) {
      r.target = std::string(args[i + 1]);
    } else {
      return ctx.Error(Error("bad option '" + std::string(args[i].substr(0, 32)) + "'"));
    }
  }
  TheTable().Add(std::move(r));
  rb.Ok();
}

}  // namespace

void RegisterFaultFamily(server::Server& srv) {
  Install(&TheTable());
  using namespace server;
  srv.registry().Register({"DEBUG.FAULT", -2, kCmdAdmin, 0, 0, 0, Command, "debug",
                           "Test builds only (pion-server-faults): injects disk and GPU-copy "
                           "faults.",
                           "SET <point> <action> [COUNT <n>] [DELAY <ms>] [TARGET <dir>] | "
                           "CLEAR | LIST"});
}

}  // namespace pion::faults
