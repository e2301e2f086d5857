// SHM.* — the same-host data plane's control commands (see server/shm_plane.h). Only a client on
// the Unix socket (--unixsocket) may use them: SHM.ATTACH passes it the file descriptors of its
// tenant's shared-memory segments (SCM_RIGHTS) to map read-only; V.FETCH … SHM then answers with
// (segment, offset, length) pieces under a lease that SHM.RELEASE ends.
#include "families/args.h"
#include "families/families.h"
#include "net/connection.h"
#include "server/server.h"

namespace pion::families {
namespace {

using proto::CmdArgs;
using server::CommandContext;

Status NeedUnixSocket(const CommandContext& ctx) {
  if (ctx.unix_socket) return Status::Ok();
  return Error(
      "shared-memory commands are only for clients on the Unix socket (--unixsocket); this "
      "connection is TCP");
}

// SHM.ATTACH → array of [segment, size]; the segments' fds travel with the reply (SCM_RIGHTS),
// in the same order. Segment ids are the ids V.FETCH … SHM pieces name.
void Attach(CommandContext& ctx, CmdArgs&) {
  Status s = NeedUnixSocket(ctx);
  if (!s.ok()) return ctx.Error(s);
  ShmArena* arena = ctx.server->shm().ArenaFor(ctx.tenant);
  std::vector<ShmArena::SegmentInfo> segs = arena->segments();
  constexpr size_t kMaxPerReply = 250;  // SCM_MAX_FD
  if (segs.size() > kMaxPerReply) segs.resize(kMaxPerReply);
  std::vector<int> fds;
  for (const auto& seg : segs) fds.push_back(seg.read_fd);  // read-only: map, never write
  ctx.rb->AttachFds(std::move(fds));
  ctx.rb->Array(segs.size());
  for (const auto& seg : segs) {
    ctx.rb->Array(2);
    ctx.rb->Integer(seg.fd);
    ctx.rb->Integer(static_cast<int64_t>(seg.size));
  }
}

// SHM.RESERVE <bytes> → [lease, segment, offset, length], with the segment's writable fd
// (SCM_RIGHTS). The client writes its fp32 rows there, then commits with
// V.STOREBATCH <sid> <start> SHM <lease>.
void Reserve(CommandContext& ctx, CmdArgs& args) {
  Status s = NeedUnixSocket(ctx);
  uint64_t bytes = 0;
  if (s.ok()) s = ParseUint(args[1], "bytes", &bytes);
  const uint64_t max = ctx.server->settings().proto_max_bulk_len.load();
  if (s.ok() && (bytes == 0 || bytes > max)) {
    s = Error("bytes must be in [1, proto-max-bulk-len " + std::to_string(max) + "], got " +
              std::to_string(bytes));
  }
  if (!s.ok()) return ctx.Error(s);
  auto r = ctx.server->shm().Reserve(ctx.client_id, bytes);
  if (!r.ok()) return ctx.Error(r.status());
  ctx.rb->AttachFds({r->segment});
  ctx.rb->Array(4);
  ctx.rb->Integer(static_cast<int64_t>(r->lease));
  ctx.rb->Integer(r->segment);
  ctx.rb->Integer(static_cast<int64_t>(r->offset));
  ctx.rb->Integer(static_cast<int64_t>(r->length));
}

void Release(CommandContext& ctx, CmdArgs& args) {
  Status s = NeedUnixSocket(ctx);
  uint64_t lease = 0;
  if (s.ok()) s = ParseUint(args[1], "lease", &lease);
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Integer(ctx.server->shm().Release(ctx.client_id, lease) ? 1 : 0);
}

void Info(CommandContext& ctx, CmdArgs&) {
  server::ShmPlane& plane = ctx.server->shm();
  const auto st = plane.stats();
  auto& rb = *ctx.rb;
  rb.Map(8);
  rb.Bulk("enabled");
  rb.Bool(plane.enabled());
  rb.Bulk("client_leases");
  rb.Integer(static_cast<int64_t>(plane.LeasesOf(ctx.client_id)));
  rb.Bulk("leases");
  rb.Integer(static_cast<int64_t>(st.leases));
  rb.Bulk("leased_bytes");
  rb.Integer(static_cast<int64_t>(st.leased_bytes));
  rb.Bulk("expired");
  rb.Integer(static_cast<int64_t>(st.expired));
  rb.Bulk("arenas");
  rb.Integer(static_cast<int64_t>(st.arenas));
  rb.Bulk("segment_bytes");
  rb.Integer(static_cast<int64_t>(st.segment_bytes));
  rb.Bulk("used_bytes");
  rb.Integer(static_cast<int64_t>(st.used_bytes));
}

}  // namespace

void RegisterShmFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  r.Register({"SHM.ATTACH", 1, kCmdReadOnly | kCmdConnection, 0, 0, 0, Attach, "shm",
              "Passes the caller's shared-memory segments (SCM_RIGHTS; Unix socket only).", ""});
  r.Register({"SHM.RESERVE", 2, kCmdWrite | kCmdConnection | kCmdDenyOom, 0, 0, 0, Reserve, "shm",
              "Reserves a writable staging region (its fd via SCM_RIGHTS) for a V.STOREBATCH ... "
              "SHM commit.",
              "<bytes>"});
  r.Register({"SHM.RELEASE", 2, kCmdWrite | kCmdConnection | kCmdFast, 0, 0, 0, Release, "shm",
              "Ends a lease from V.FETCH ... SHM; replies 1 if it was held.", "<lease>"});
  r.Register({"SHM.INFO", 1, kCmdReadOnly | kCmdConnection, 0, 0, 0, Info, "shm",
              "The data plane: enabled, leases (this client's and all), arena bytes.", ""});
}

}  // namespace pion::families
