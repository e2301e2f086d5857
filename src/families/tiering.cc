#include "families/tiering.h"

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

std::string SavedDir(server::Server& srv, std::string_view name) {
  return srv.config().dir + "/" + std::string(name);
}

void SaveObjects(server::CommandContext& ctx, std::string dir, std::string name,
                 uint64_t version, std::string meta, std::vector<residency::ObjectRef> objs,
                 SaveDone done) {
  // The bytes as of now (the pins keep them host-resident; the refs keep them alive and
  // make a concurrent write copy instead of changing them under the save).
  auto blocks = std::make_shared<std::vector<BufferRef>>();
  std::vector<uint64_t> generations;
  std::vector<std::vector<uint32_t>> indexes(objs.size());
  for (size_t i = 0; i < objs.size(); ++i) {
    std::vector<BufferRef> b;
    if (!objs[i]->HostBlocks(&b)) {
      return ctx.Error(Status(ErrorKind::kMiss, "an object went from memory during its save"));
    }
    generations.push_back(objs[i]->generation());
    for (auto& x : b) {
      indexes[i].push_back(static_cast<uint32_t>(blocks->size()));
      blocks->push_back(std::move(x));
    }
  }
  server::Server* srv = ctx.server;
  server::Shard* owner = ctx.shard;
  auto reply = ctx.Defer();
  auto job = [=, objs = std::move(objs), generations = std::move(generations),
              indexes = std::move(indexes)]() {
    std::vector<std::span<const uint8_t>> spans;
    for (const auto& b : *blocks) spans.emplace_back(b->data(), b->size());
    auto file = srv->residency()->WriteSaved(dir, name, version, meta, spans);
    owner->PostControl([=](server::Shard& sh) {
      if (file.ok()) {
        for (size_t i = 0; i < objs.size(); ++i) {
          srv->residency()->AttachDisk(objs[i], generations[i], file.value(), indexes[i]);
        }
        srv->disk_stats().saves.fetch_add(1);
      } else {
        srv->disk_stats().save_failures.fetch_add(1);
      }
      done(sh, file, reply);
    });
  };
  if (!srv->io()->Submit(std::move(job))) {
    reply([](proto::ReplyBuilder& rb) {
      rb.Error(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
    });
  }
}

}  // namespace pion::families
