// What every family does with the residency engine (residency/engine.h) on its command path:
// charge host bytes for a new object (parking the command while demotions make room), and
// find its saved-object directory. Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/byte_budget.h"
#include "residency/disk_file.h"
#include "residency/engine.h"
#include "residency/object.h"
#include "residency/tier.h"
#include "server/command.h"
#include "store/disk/object_file.h"

namespace pion::families {

// Host bytes for a new object of family f. True with *out set when they are reserved. False
// when the command was parked (demotions make room first; the handler runs again) or refused
// (the reply is written: the request alone exceeds the memory limit, or no room can be made).
bool ChargeHost(server::CommandContext& ctx, residency::Family f, uint64_t bytes,
                std::unique_ptr<Charge>* out);

// The same off a command's handler (a deferred step on a shard or a compute thread): `done`
// gets the charge, or kOom when the bytes can never fit or no room could be made in time. It
// may run on another thread.
void ChargeHostLater(server::Server& srv, residency::Family f, uint64_t bytes,
                     residency::Deadline deadline,
                     std::function<void(StatusOr<std::unique_ptr<Charge>>)> done);

// <--dir>/<name>: where a family's saved objects live ("ssm", "state", "attention").
std::string SavedDir(server::Server& srv, std::string_view name);

// Start-up: every object file in `dir` (leftover temporaries of interrupted saves removed
// first) is opened through the engine and handed to `take` with its listing; `take` installs
// it and returns Ok, or says why it cannot be served. Files that fail to open or that `take`
// refuses are logged as corrupt ("saved <what> file ... is corrupt") and counted in
// objects_corrupt, never served; the others count in objects_loaded and are logged as found.
using TakeSaved = std::function<Status(const store::disk::ListedObject& listed,
                                       const std::shared_ptr<residency::DiskFile>& file)>;
Status LoadSavedObjects(server::Server& srv, const std::string& dir, std::string_view what,
                        const TakeSaved& take);

// Cluster mode: installs a saved object's file that another node sent, durable at `path`.
// `check` first (may it replace what is held? its refusal is returned as is); then the file is
// opened and `adopt` installs it. A file that does not open or that `adopt` refuses comes back
// as kCorrupt "the copy of <what> does not open: ..."; a refused file is removed. Runs on the
// shard that owns the object.
Status InstallSavedCopy(
    server::Server& srv, const std::string& path, const std::string& what,
    const std::function<Status()>& check,
    const std::function<Status(const std::shared_ptr<residency::DiskFile>&)>& adopt);

// What a save's completion gets on the owning shard: the durable file (or why there is none)
// and the writer of the command's deferred reply, which it must call once.
using SaveDone =
    std::function<void(server::Shard& shard, StatusOr<std::shared_ptr<residency::DiskFile>> file,
                       std::function<void(server::CommandContext::ReplyWriter)> reply)>;

// Writes `items` (raw blocks and objects, in order) as one durable object file
// (<dir>/<hex name>.<version>.pobj: temp file, fsync, rename, directory fsync, under the disk
// quota) on the I/O pool and replies only after that. Each object's bytes are taken from
// whichever tier holds them as of the call (a later write copies instead of changing them
// under the save). On success each object whose content did not change meanwhile gets that
// file as its durable disk copy (a later demotion then costs no write); then `done` runs on
// this shard. Counts disk_saves / disk_save_failures.
void SaveObjects(server::CommandContext& ctx, std::string dir, std::string name, uint64_t version,
                 std::string meta, std::vector<residency::Engine::SaveItem> items, SaveDone done);

// The same without a command (a slot moving to another node saves what it moves): `done` runs
// on `owner_shard` with the durable file or why there is none. False when the I/O queue is
// full (nothing was started).
using WriteDone =
    std::function<void(server::Shard& shard, StatusOr<std::shared_ptr<residency::DiskFile>> file)>;
bool WriteObjectsLater(server::Server& srv, server::Shard& owner_shard, std::string dir,
                       std::string name, uint64_t version, std::string meta,
                       std::vector<residency::Engine::SaveItem> items, WriteDone done);

}  // namespace pion::families
