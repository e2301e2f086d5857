#include "families/save_all.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "common/bytes.h"
#include "families/cluster_internal.h"
#include "families/vstore_internal.h"

namespace pion::families {
namespace {

// The family name users know for a saved kind (cluster_internal.h's ObjectId::kind).
std::string FamilyName(const std::string& kind) {
  if (kind == "PREFIX") return "KV.PREFIX";
  if (kind == "ATTENTION") return "ATTEND.PREFIX";
  if (kind == "SSM") return "SSM.PREFIX";
  if (kind == "VSNAP") return "V";
  return kind;
}

// One object to save: a durable family's (kind set) or a plain V session (kind null).
struct Item {
  const cluster_sync::SavedKind* kind = nullptr;
  cluster_sync::HeldObject held;
};

std::vector<Item> UnsavedItems(server::Server& srv, server::Shard& shard) {
  std::vector<Item> out;
  for (const cluster_sync::SavedKind& k : cluster_sync::SavedKinds()) {
    for (cluster_sync::HeldObject& h : k.held(srv, shard)) {
      if (h.live && !h.corrupt) out.push_back({&k, std::move(h)});
    }
  }
  for (const vstore::UnsavedSession& s : vstore::UnsavedSessions(shard)) {
    cluster_sync::HeldObject h;
    h.key = s.key;
    h.bytes = s.bytes;
    out.push_back({nullptr, std::move(h)});
  }
  return out;
}

// Saves run this many at a time on each shard (the I/O queue stays far from full).
constexpr int kInFlight = 8;
constexpr int kMaxPasses = 3;

struct SaveRun {
  server::Server* srv = nullptr;
  std::function<void(Tally)> done;
  std::mutex mu;  // guards tally and wrote
  Tally tally;
  bool wrote = false;  // this pass saved something
  int pass = 0;
  std::atomic<int> shards_left{0};
};

// One shard's part of a pass. Lives on that shard; its callbacks run there.
struct ShardPass {
  std::shared_ptr<SaveRun> run;
  std::vector<Item> items;
  size_t next = 0;
  int in_flight = 0;
  bool pumping = false;   // inside Pump: a save that completes at once just frees its place
  bool finished = false;  // this shard's part is done
};

void StartPass(const std::shared_ptr<SaveRun>& run);

void ShardDone(const std::shared_ptr<SaveRun>& run) {
  if (run->shards_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  bool again;
  {
    std::lock_guard<std::mutex> lock(run->mu);
    again = run->wrote && run->pass < kMaxPasses;
  }
  if (again) return StartPass(run);
  run->done(std::move(run->tally));
}

void Pump(server::Shard& shard, const std::shared_ptr<ShardPass>& p) {
  if (p->pumping || p->finished) return;
  p->pumping = true;
  while (p->in_flight < kInFlight && p->next < p->items.size()) {
    const Item& item = p->items[p->next++];
    ++p->in_flight;
    const std::string family = item.kind ? FamilyName(item.kind->name) : "V";
    const uint64_t before = item.held.version, bytes = item.held.bytes;
    const bool image = item.kind == nullptr;
    auto finish = [p, family, before, bytes, image, &shard](const Status& s, uint64_t version) {
      {
        std::lock_guard<std::mutex> lock(p->run->mu);
        FamilyTally& t = p->run->tally[family];
        if (!s.ok() && s.kind() != ErrorKind::kMiss) {  // kMiss: removed meanwhile
          if (t.failed++ == 0) t.first_error = s.ToString();
        } else if (s.ok() && (image || version != before)) {
          ++t.objects;
          t.bytes += bytes;
          p->run->wrote = true;
        }
      }
      --p->in_flight;
      Pump(shard, p);
    };
    if (image) {
      vstore::SaveImage(*p->run->srv, shard, item.held.key,
                        [finish](const Status& s) { finish(s, 0); });
    } else {
      item.kind->save_for_move(*p->run->srv, shard, item.held.key, item.held.part,
                               [finish](StatusOr<std::pair<std::string, uint64_t>> f) {
                                 finish(f.status(), f.ok() ? f.value().second : 0);
                               });
    }
  }
  p->pumping = false;
  if (p->in_flight == 0 && p->next == p->items.size()) {
    p->finished = true;
    ShardDone(p->run);
  }
}

void StartPass(const std::shared_ptr<SaveRun>& run) {
  server::Server& srv = *run->srv;
  {
    std::lock_guard<std::mutex> lock(run->mu);
    run->wrote = false;
    ++run->pass;
  }
  run->shards_left.store(srv.shard_count(), std::memory_order_release);
  for (int i = 0; i < srv.shard_count(); ++i) {
    srv.shard(i).PostControl([run](server::Shard& shard) {
      auto p = std::make_shared<ShardPass>();
      p->run = run;
      p->items = UnsavedItems(*run->srv, shard);
      Pump(shard, p);
    });
  }
}

}  // namespace

void SaveAll(server::Server& srv, std::function<void(Tally)> done) {
  auto run = std::make_shared<SaveRun>();
  run->srv = &srv;
  run->done = std::move(done);
  StartPass(run);
}

Tally Unsaved(server::Server& srv) {
  Tally t;
  for (int i = 0; i < srv.shard_count(); ++i) {
    for (const Item& item : UnsavedItems(srv, srv.shard(i))) {
      // A namespace counts as held while open: unsaved only when its disk copy lacks writes.
      if (item.kind != nullptr && item.kind->name == "PREFIX") {
        const auto* e = srv.shard(i).store().prefixes.Find(item.held.key);
        if (e == nullptr || (!e->dirty && e->saved_version > 0)) continue;
      }
      FamilyTally& f = t[item.kind ? FamilyName(item.kind->name) : "V"];
      ++f.objects;
      f.bytes += item.held.bytes;
    }
  }
  return t;
}

std::string DescribeTally(const Tally& t, bool errors) {
  std::string out;
  for (const auto& [family, f] : t) {
    if (f.objects == 0 && (!errors || f.failed == 0)) continue;
    if (!out.empty()) out += ", ";
    out += family + " " + std::to_string(f.objects) + " (" + HumanBytes(f.bytes) + ")";
    if (errors && f.failed > 0) {
      out += ", " + std::to_string(f.failed) + " failed: " + f.first_error;
    }
  }
  return out;
}

uint64_t FailedSaves(const Tally& t) {
  uint64_t n = 0;
  for (const auto& [family, f] : t) n += f.failed;
  return n;
}

void RegisterExitReport(server::Server& srv) {
  srv.AddExitHook([](server::Server& s) {
    const Tally t = Unsaved(s);
    const std::string what = DescribeTally(t, false);
    if (what.empty()) {
      spdlog::info("exit: every stored object is saved (nothing unsaved is dropped)");
    } else {
      spdlog::warn(
          "exit: unsaved objects are dropped (objects, bytes per family): {} — SHUTDOWN SAVE "
          "saves every object before exiting",
          what);
    }
  });
}

}  // namespace pion::families
