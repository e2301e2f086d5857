#include "families/tiering.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <span>

#include "server/server.h"

namespace pion::families {

bool ChargeHost(server::CommandContext& ctx, residency::Family f, uint64_t bytes,
                std::unique_ptr<Charge>* out) {
  residency::Engine* engine = ctx.server->residency();
  auto charge = engine->ReserveHost(f, bytes);
  if (charge.ok()) {
    *out = std::move(charge).value();
    return true;
  }
  if (charge.status().kind() != ErrorKind::kOom) {
    ctx.Error(charge.status());
    return false;
  }
  // What could never fit is refused at once, with the accountant's own words.
  server::MemoryAccountant& mem = ctx.server->memory();
  const uint64_t max = mem.maxmemory();
  const uint64_t cap = mem.family_limit(server::Server::MemFamilyOf(f));
  if ((max != 0 && bytes > max) || (cap != 0 && bytes > cap)) {
    ctx.Error(charge.status());
    return false;
  }
  if (!ctx.Room(residency::Tier::kHost, f, bytes)) return false;  // parked: runs again
  charge = engine->ReserveHost(f, bytes);
  if (!charge.ok()) {
    ctx.Error(charge.status());
    return false;
  }
  *out = std::move(charge).value();
  return true;
}

void ChargeHostLater(server::Server& srv, residency::Family f, uint64_t bytes,
                     residency::Deadline deadline,
                     std::function<void(StatusOr<std::unique_ptr<Charge>>)> done) {
  residency::Engine* engine = srv.residency();
  auto charge = engine->ReserveHost(f, bytes);
  if (charge.ok() || charge.status().kind() != ErrorKind::kOom) return done(std::move(charge));
  server::MemoryAccountant& mem = srv.memory();
  const uint64_t max = mem.maxmemory();
  const uint64_t cap = mem.family_limit(server::Server::MemFamilyOf(f));
  if ((max != 0 && bytes > max) || (cap != 0 && bytes > cap)) return done(std::move(charge));
  engine->MakeRoom(residency::Tier::kHost, f, bytes, deadline,
                   [engine, f, bytes, done = std::move(done)](const Status& s) {
                     if (!s.ok()) return done(s);
                     done(engine->ReserveHost(f, bytes));
                   });
}

std::string SavedDir(server::Server& srv, std::string_view name) {
  return srv.config().dir + "/" + std::string(name);
}

Status LoadSavedObjects(server::Server& srv, const std::string& dir, std::string_view what,
                        const TakeSaved& take) {
  auto listed = store::disk::ListObjects(dir);
  if (!listed.ok()) return listed.status();
  Status s = store::disk::RemoveLeftoverTemps(dir);
  if (!s.ok()) return s;
  size_t found = 0;
  for (const auto& o : *listed) {
    auto file = srv.residency()->OpenSaved(o.path);
    Status st = file.ok() ? take(o, file.value()) : file.status();
    if (!st.ok()) {
      srv.disk_stats().objects_corrupt.fetch_add(1);
      spdlog::error("disk tier: saved {} file {} is corrupt and will not be served: {}", what,
                    o.path, st.message());
      continue;
    }
    ++found;
  }
  srv.disk_stats().objects_loaded.fetch_add(found);
  if (found > 0) spdlog::info("disk tier: found {} saved {}(s) under {}", found, what, dir);
  return Status::Ok();
}

Status InstallSavedCopy(
    server::Server& srv, const std::string& path, const std::string& what,
    const std::function<Status()>& check,
    const std::function<Status(const std::shared_ptr<residency::DiskFile>&)>& adopt) {
  Status ok = check();
  if (!ok.ok()) {
    unlink(path.c_str());
    return ok;
  }
  auto file = srv.residency()->OpenSaved(path);
  ok = file.ok() ? adopt(file.value()) : file.status();
  if (!ok.ok()) {
    unlink(path.c_str());
    return Status(ErrorKind::kCorrupt, "the copy of " + what + " does not open: " + ok.message());
  }
  return Status::Ok();
}

bool WriteObjectsLater(server::Server& srv, server::Shard& owner_shard, std::string dir,
                       std::string name, uint64_t version, std::string meta,
                       std::vector<residency::Engine::SaveItem> items, WriteDone done) {
  // Hold the bytes as of now: host blocks by ref (a write then copies), the objects' own
  // generations to fence the disk copies attached after.
  std::vector<uint64_t> generations;
  std::vector<std::vector<BufferRef>> host(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].obj) items[i].obj->HostBlocks(&host[i]);
    generations.push_back(items[i].obj ? items[i].obj->generation() : 0);
  }
  server::Server* server = &srv;
  server::Shard* owner = &owner_shard;
  auto job = [=, items = std::move(items), generations = std::move(generations),
              host = std::move(host)]() {
    std::vector<std::vector<uint32_t>> blocks;
    auto file = server->residency()->WriteSaved(dir, name, version, meta, items, &blocks);
    owner->PostControl([=](server::Shard& sh) {
      if (file.ok()) {
        for (size_t i = 0; i < items.size(); ++i) {
          if (!items[i].obj) continue;
          server->residency()->AttachDisk(items[i].obj, generations[i], file.value(), blocks[i]);
        }
        server->disk_stats().saves.fetch_add(1);
      } else {
        server->disk_stats().save_failures.fetch_add(1);
      }
      done(sh, file);
    });
  };
  return srv.io()->Submit(std::move(job));
}

void SaveObjects(server::CommandContext& ctx, std::string dir, std::string name, uint64_t version,
                 std::string meta, std::vector<residency::Engine::SaveItem> items, SaveDone done) {
  auto reply = ctx.Defer();
  bool queued = WriteObjectsLater(
      *ctx.server, *ctx.shard, std::move(dir), std::move(name), version, std::move(meta),
      std::move(items),
      [done = std::move(done), reply](server::Shard& sh,
                                      StatusOr<std::shared_ptr<residency::DiskFile>> file) {
        done(sh, std::move(file), reply);
      });
  if (!queued) {
    reply([](proto::ReplyBuilder& rb) {
      rb.Error(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
    });
  }
}

}  // namespace pion::families
