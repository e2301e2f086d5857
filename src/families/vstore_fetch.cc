// V.FETCH — rows of a V-store session by ids or an id range: decoded to fp32, in the stored
// encoding (RAW, sent straight from the stored chunks), or mapped (SHM: the same-host data
// plane). On a KV.PREFIX session a reader also names the identity it expects (MODEL,
// GENERATION), the K/V heads it wants (HEADS <first> <count>: a tensor-parallel rank's share,
// only those bytes moved) and the codec it computes in (AS <codec>: transcoded on the server);
// codec::RowView shapes the rows.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "families/args.h"
#include "families/kvprefix_internal.h"
#include "families/vstore_internal.h"
#include "server/server.h"
#include "server/worker_pool.h"
#include "store/codec/row_view.h"

namespace pion::families::vstore {
namespace {

using proto::CmdArgs;
using server::CommandContext;

constexpr std::string_view kFetchSyntax =
    "syntax: V.FETCH <sid> <id> [<id> ...] | <sid> RANGE <start> <end>, then any of [RAW|SHM] "
    "[HEADS <first> <count>] [AS <codec>] [MODEL <id>] [GENERATION <g>] [DEADLINE <ms>]";

struct Piece {
  int segment;
  uint64_t offset, length;
};

// How the pieces' bytes make the reply: whole (their concatenation), or strided — the pieces
// hold whole stored rows of `row_stride` bytes, and each output row is the `parts` byte ranges
// of one of them (HEADS in the stored encoding, copied out of the mapping by the reader).
struct Strided {
  size_t row_stride = 0;
  std::vector<codec::RowView::Part> parts;
};

// Leases `held` (the buffers the pieces are in: unchanged until released; `held_bytes` of them)
// to the client and replies the SHM map: lease, bytes (of the reply: `total`), row_bytes,
// pieces, epoch, and with `strided` row_stride and row_parts. Any thread.
void ReplyLease(server::Server& srv, uint64_t client_id, uint32_t tenant, proto::ReplyBuilder& rb,
                std::vector<Piece> pieces, std::vector<BufferRef> held, uint64_t held_bytes,
                uint64_t total, size_t row_bytes, const Strided* strided = nullptr) {
  server::ShmPlane& plane = srv.shm();
  auto lease = plane.Grant(client_id, std::move(held), held_bytes);
  if (!lease.ok()) return rb.Error(lease.status());
  rb.Map(strided != nullptr ? 7 : 5);
  rb.Bulk("lease");
  rb.Integer(static_cast<int64_t>(lease.value()));
  rb.Bulk("bytes");
  rb.Integer(static_cast<int64_t>(total));
  rb.Bulk("row_bytes");
  rb.Integer(static_cast<int64_t>(row_bytes));
  rb.Bulk("pieces");
  rb.Array(pieces.size());
  for (const Piece& p : pieces) {
    rb.Array(3);
    rb.Integer(p.segment);
    rb.Integer(static_cast<int64_t>(p.offset));
    rb.Integer(static_cast<int64_t>(p.length));
  }
  if (strided != nullptr) {
    rb.Bulk("row_stride");
    rb.Integer(static_cast<int64_t>(strided->row_stride));
    rb.Bulk("row_parts");
    rb.Array(strided->parts.size());
    for (const auto& part : strided->parts) {
      rb.Array(2);
      rb.Integer(static_cast<int64_t>(part.offset));
      rb.Integer(static_cast<int64_t>(part.length));
    }
  }
  rb.Bulk("epoch");  // the arena's punch epoch: pinned (CUDA-registered) pages older than it
  rb.Integer(static_cast<int64_t>(plane.ArenaFor(tenant)->punch_epoch()));  // are stale
}

// Rows shaped by a RowView (HEADS, AS) from stored rows: runs of whole rows, each written at
// its place in the output; transcoding a layer is milliseconds of work, so a large one runs
// on the compute pool, split across its threads.
struct ShapeJob {
  codec::RowView shape;
  store::VSession::HostView view;  // holds the stored chunks the runs point into
  std::vector<uint8_t> gathered;   // the ids form: their stored rows, in order
  struct Run {
    const uint8_t* in;
    size_t rows;
    size_t out_row;  // first output row
  };
  std::vector<Run> runs;
  BufferRef out;
  bool shm = false;
  // A range: the output is what the session's shaped copy holds for those rows, adopted into
  // it afterwards on the owning shard (when the session did not change).
  bool fill = false;
  server::Shard* owner = nullptr;
  store::TenantKey key;
  uint64_t writes = 0;
  int64_t start = 0;

  void Fill(server::Shard& shard) const {
    auto& vs = shard.store().vstore;
    const store::VStore::Entry* e = vs.Find(key);
    if (!fill || e == nullptr || e->writes != writes) return;
    if (store::VStore::Entry::Shaped* copy = vs.ShapedOf(key, shape)) {
      (void)copy->session->AdoptEncoded(start, out->data(), out->size() / shape.out_row_bytes());
    }
  }

  void Apply(size_t i) const {
    std::vector<float> scratch;
    const Run& r = runs[i];
    shape.Apply(r.in, r.rows, out->data() + r.out_row * shape.out_row_bytes(), &scratch);
  }
  void Reply(server::Server& srv, uint64_t client_id, uint32_t tenant,
             proto::ReplyBuilder& rb) const {
    if (!shm) return rb.BulkRef(out);
    ReplyLease(srv, client_id, tenant, rb,
               {{out->segment_fd(), out->segment_offset(), out->size()}}, {out}, out->size(),
               out->size(), shape.out_row_bytes());
  }
};

// Output bytes from which shaping goes to the compute pool (below, the hand-off costs more).
constexpr uint64_t kShapeOnPoolBytes = uint64_t{1} << 20;

// V.FETCH … RANGE … SHM: the stored bytes as (segment, offset, length) pieces in the tenant's
// shared-memory arena, under a lease that keeps them unchanged until released. Pieces held
// outside an arena (a prefix warmed from disk) are copied into one first. With `shape` (HEADS
// in the stored encoding) the pieces are the whole stored rows and the reply names the byte
// ranges of each that the reader copies: nothing is gathered here.
void ReplyShm(CommandContext& ctx, const store::VSession& session,
              const store::VSession::HostView& view, int64_t start, int64_t end,
              const codec::RowView* shape = nullptr) {
  server::ShmPlane& plane = ctx.server->shm();
  std::vector<Piece> pieces;
  std::vector<BufferRef> held;
  uint64_t held_bytes = 0;
  Status failed;
  session.RawRange(view, start, end, [&](const BufferRef& b, const uint8_t* p, size_t len) {
    if (!failed.ok()) return;
    BufferRef src = b;
    uint64_t off = static_cast<uint64_t>(p - b->data());
    if (b->segment_fd() < 0) {
      auto copy = plane.AllocatorFor(ctx.tenant)->Allocate(len);
      if (!copy.ok()) {
        failed = copy.status();
        return;
      }
      std::memcpy(copy.value()->data(), p, len);
      src = std::move(copy).value();
      off = 0;
    }
    held_bytes += len;
    const int segment = src->segment_fd();
    const uint64_t at = src->segment_offset() + off;
    if (held.empty() || held.back() != src) held.push_back(src);  // the lease keeps it unchanged
    if (!pieces.empty() && pieces.back().segment == segment &&
        pieces.back().offset + pieces.back().length == at) {
      // Adjacent in the segment (one buffer, or chunks allocated one after another): one piece,
      // so the client makes one copy of it.
      pieces.back().length += len;
      return;
    }
    pieces.push_back({segment, at, len});
  });
  if (!failed.ok()) return ctx.Error(failed);
  if (shape == nullptr) {
    return ReplyLease(*ctx.server, ctx.client_id, ctx.tenant, *ctx.rb, std::move(pieces),
                      std::move(held), held_bytes, held_bytes, session.codec().row_bytes());
  }
  const Strided strided{session.codec().row_bytes(), shape->StoredParts()};
  const uint64_t rows = held_bytes / strided.row_stride;
  ReplyLease(*ctx.server, ctx.client_id, ctx.tenant, *ctx.rb, std::move(pieces), std::move(held),
             held_bytes, rows * shape->out_row_bytes(), shape->out_row_bytes(), &strided);
}

// The reader's identity options on a KV.PREFIX session: kMismatch when they are not the
// namespace's.
Status CheckIdentity(std::string_view sid, const store::PrefixEntry* prefix, std::string_view opt,
                     std::string_view val) {
  if (prefix == nullptr) {
    return Error(std::string(opt) +
                 " applies to KV.PREFIX sessions (<ns>_pk, <ns>_pv, <ns>_pl); '" +
                 std::string(sid.substr(0, 128)) + "' is not one");
  }
  const auto& m = prefix->manifest;
  if (EqualsIgnoreCase(opt, "MODEL") && val != m.model) {
    return Status(ErrorKind::kMismatch, "session '" + std::string(sid) + "' holds model '" +
                                            m.model + "', not '" + std::string(val) + "'");
  }
  if (EqualsIgnoreCase(opt, "GENERATION")) {
    uint64_t g = 0;
    Status gs = ParseUint(val, "GENERATION", &g);
    if (!gs.ok()) return gs;
    if (g != m.cache_generation) {
      return Status(ErrorKind::kMismatch, "session '" + std::string(sid) + "' is at generation " +
                                              std::to_string(m.cache_generation) + ", not " +
                                              std::to_string(g) +
                                              " (its namespace was dropped and registered again)");
    }
  }
  return Status::Ok();
}

}  // namespace

void Fetch(CommandContext& ctx, CmdArgs& args) {
  store::PrefixEntry* prefix = PrefixOf(ctx, args[1]);
  if (prefix != nullptr) {  // a per-head reader of an MLA namespace, or the other way round
    Status layout = kvprefix::CheckLayoutSession(args[1], prefix->manifest);
    if (!layout.ok()) return ctx.Error(layout);
  }
  if (prefix != nullptr &&
      kvprefix::ParkUntilOpen(ctx, {ctx.tenant, std::string(SessionRouteKey(args[1]))})) {
    return;  // a namespace found on disk: its sessions first
  }
  auto entry = ctx.shard->store().vstore.Get(ctx.Key(args[1]));
  if (!entry.ok()) return ctx.Error(entry.status());
  const store::VSession& session = *entry.value()->session;
  if (prefix != nullptr) {
    const store::TenantKey ns{ctx.tenant, std::string(SessionRouteKey(args[1]))};
    Status intact =
        kvprefix::Intact(*ctx.server, ns, prefix,
                         kvprefix::SessionsOf(*ctx.shard, ctx.tenant, ns.name, prefix->manifest));
    if (!intact.ok()) return ctx.Error(intact);
  }
  // Trailing options, in any order (ids are integers, so keywords cannot be mistaken for them).
  size_t end_arg = args.size();
  bool raw = false, shm = false;
  std::optional<std::pair<uint64_t, uint64_t>> heads;  // first, count
  std::optional<codec::Format> as;
  while (end_arg > 2) {
    std::string_view last = args[end_arg - 1];
    if (EqualsIgnoreCase(last, "RAW")) {
      raw = true;
      --end_arg;
    } else if (EqualsIgnoreCase(last, "SHM")) {
      shm = raw = true;  // a mapping of the stored encoding
      --end_arg;
    } else if (end_arg > 3 && (EqualsIgnoreCase(args[end_arg - 2], "MODEL") ||
                               EqualsIgnoreCase(args[end_arg - 2], "GENERATION"))) {
      Status s = CheckIdentity(args[1], prefix, args[end_arg - 2], last);
      if (!s.ok()) return ctx.Error(s);
      end_arg -= 2;
    } else if (end_arg > 3 && EqualsIgnoreCase(args[end_arg - 2], "AS")) {
      as = codec::ParseFormat(last);
      if (!as) {
        return ctx.Error(Error("AS must name a codec, one of " +
                               std::string(codec::FormatChoices()) + ", got '" +
                               std::string(last.substr(0, 32)) + "'"));
      }
      end_arg -= 2;
    } else if (end_arg > 4 && EqualsIgnoreCase(args[end_arg - 3], "HEADS")) {
      uint64_t first = 0, count = 0;
      Status s = ParseUint(args[end_arg - 2], "HEADS first", &first);
      if (s.ok()) s = ParseUint(last, "HEADS count", &count);
      if (!s.ok()) return ctx.Error(s);
      heads = {first, count};
      end_arg -= 3;
    } else {
      break;
    }
  }
  const bool range = end_arg > 2 && EqualsIgnoreCase(args[2], "RANGE");
  if (shm && !range) return ctx.Error(Error("SHM needs the RANGE form of V.FETCH"));
  if (shm && !ctx.unix_socket) {
    return ctx.Error(
        Error("SHM mappings are only given to clients on the Unix socket (--unixsocket); this "
              "connection is TCP: fetch without SHM"));
  }
  // HEADS and AS: the rows a reader asks for, shaped from the stored ones.
  std::optional<codec::RowView> shape;
  if (heads || as) {
    uint32_t first_col = 0, cols = session.dim();
    if (heads) {
      if (prefix == nullptr) {
        return ctx.Error(
            Error("HEADS applies to KV.PREFIX sessions (<ns>_pk, <ns>_pv: their "
                  "manifest gives kv_heads and head_dim); '" +
                  std::string(args[1].substr(0, 128)) + "' is not one"));
      }
      const auto& m = prefix->manifest;
      if (m.mla()) {
        return ctx.Error(Error(
            "HEADS applies to per-head namespaces; '" + std::string(args[1].substr(0, 128)) +
            "' holds MLA latents, one row per token shared by every head (fetch whole rows)"));
      }
      if (heads->second == 0 || heads->first >= m.kv_heads ||
          heads->second > m.kv_heads - heads->first) {
        return ctx.Error(
            Error("HEADS " + std::to_string(heads->first) + " " + std::to_string(heads->second) +
                  " is not inside the namespace's " + std::to_string(m.kv_heads) +
                  " K/V heads (first + count <= " + std::to_string(m.kv_heads) + ", count >= 1)"));
      }
      first_col = static_cast<uint32_t>(heads->first) * m.head_dim;
      cols = static_cast<uint32_t>(heads->second) * m.head_dim;
    }
    using Output = codec::RowView::Output;
    auto view = codec::RowView::Create(session.codec(), first_col, cols,
                                       as    ? Output::kCodec
                                       : raw ? Output::kStored
                                             : Output::kFp32,
                                       as);
    if (!view.ok()) return ctx.Error(view.status());
    if (!view->identity()) shape = std::move(view).value();
    if (as) raw = true;  // the reply is the target codec's encoding
  }
  int64_t start = 0, end = 0;
  std::vector<int64_t> ids;
  Status s;
  if (range) {
    if (end_arg != 5) return ctx.Error(Error(std::string(kFetchSyntax)));
    s = ParseInt(args[3], "start", &start);
    if (s.ok()) s = ParseInt(args[4], "end", &end);
    if (s.ok() && (start < 0 || end <= start)) {
      s = Error("RANGE needs 0 <= start < end, got " + std::to_string(start) + " " +
                std::to_string(end));
    }
    if (!s.ok()) return ctx.Error(s);
    s = session.CheckRange(start, end);
  } else {
    if (end_arg < 3) return ctx.Error(Error(std::string(kFetchSyntax)));
    ids.resize(end_arg - 2);
    for (size_t i = 2; i < end_arg && s.ok(); ++i) s = ParseInt(args[i], "id", &ids[i - 2]);
    if (!s.ok()) return ctx.Error(s);
    s = session.CheckIds(ids.data(), ids.size());
  }
  if (!s.ok()) {  // a missing id: name the session too
    return ctx.Error(Error(s.message() + " in session '" + std::string(args[1]) + "'"));
  }
  const uint64_t n = range ? static_cast<uint64_t>(end - start) : ids.size();
  const uint64_t row_out = shape ? shape->out_row_bytes()
                           : raw ? session.codec().row_bytes()
                                 : size_t{4} * session.dim();
  const uint64_t bytes = n * row_out;
  const uint64_t max = ctx.server->settings().proto_max_bulk_len.load();
  if (!shm && bytes > max) {
    return ctx.Error(Error("reply of " + std::to_string(n) + " rows is " + std::to_string(bytes) +
                           " bytes, more than proto-max-bulk-len " + std::to_string(max) +
                           "; fetch it in parts"));
  }
  // The chunks it reads in memory (brought back from disk first when they were demoted).
  store::VSession::HostView view;
  std::vector<residency::ObjectRef> missing;
  auto take_view = [&] {
    return range ? session.ViewRange(start, end, &view, &missing)
                 : session.ViewIds(ids.data(), ids.size(), &view, &missing);
  };
  if (!take_view()) {
    if (!ctx.Resident(missing, residency::Tier::kHost)) return;  // runs again once they are in
    missing.clear();
    if (!take_view()) {
      return ctx.Error(Status(ErrorKind::kMiss, "chunks of '" + std::string(args[1]) +
                                                    "' left memory while being read; retry"));
    }
  }
  // HEADS and AS of a range: from the session's shaped copy when it holds those rows in
  // memory (a prefix read many times by a tensor-parallel rank, or in the reader's codec, is
  // shaped once). A read that has to shape the rows makes the copy when their bytes fit in
  // memory now (nothing is demoted for a copy) — a transcode (AS) at once, a slice of stored
  // columns (HEADS alone) once a second read asks for the same rows; --fetch-copies off never
  // keeps one.
  bool fill = false;
  if (shape && range && ctx.server->settings().fetch_copies.load(std::memory_order_relaxed)) {
    store::VStore::Entry::Shaped* copy =
        ctx.shard->store().vstore.ShapedOf(ctx.Key(args[1]), *shape);
    store::VSession::HostView cview;
    std::vector<residency::ObjectRef> cmissing;
    if (copy != nullptr && copy->session->RangeWritten(start, end) &&
        copy->session->ViewRange(start, end, &cview, &cmissing)) {
      if (shm) return ReplyShm(ctx, *copy->session, cview, start, end);
      ctx.rb->BulkStart(bytes);
      copy->session->RawRange(
          cview, start, end,
          [&](const BufferRef& b, const uint8_t* p, size_t len) { ctx.rb->BulkPiece(b, p, len); });
      ctx.rb->BulkEnd();
      return;
    }
    const bool keep = copy != nullptr && (shape->output() != codec::RowView::Output::kStored ||
                                          copy->AskAgain(start, end));
    fill = keep && ctx.server->residency()->RoomNow(residency::Tier::kHost,
                                                    residency::Family::kVStore, bytes);
  }
  if (shape && shm && range && !fill && !shape->StoredParts().empty()) {
    // Columns of the stored rows: the reader copies them out of the mapping itself (one pass
    // over the bytes it needs instead of a gather here and a copy there).
    return ReplyShm(ctx, session, view, start, end, &*shape);
  }
  if (shape) {
    // Shaped rows into one buffer (the tenant's arena for SHM: leased as one piece).
    auto out = (shm ? ctx.server->shm().AllocatorFor(ctx.tenant) : BufferAllocator::Default())
                   ->Allocate(bytes);
    if (!out.ok()) return ctx.Error(out.status());
    auto job = std::make_shared<ShapeJob>(ShapeJob{std::move(shape).value(), std::move(view)});
    job->out = std::move(out).value();
    job->shm = shm;
    job->fill = fill;
    job->owner = ctx.shard;
    job->key = ctx.Key(args[1]);
    job->writes = entry.value()->writes;
    job->start = start;
    const size_t in_row = session.codec().row_bytes();
    constexpr size_t kRunRows = 256;  // a piece of work for one thread
    auto add_runs = [&](const uint8_t* p, size_t rows, size_t out_row) {
      for (size_t r = 0; r < rows; r += kRunRows) {
        job->runs.push_back({p + r * in_row, std::min(kRunRows, rows - r), out_row + r});
      }
    };
    if (range) {
      size_t out_row = 0;
      session.RawRange(job->view, start, end, [&](const BufferRef&, const uint8_t* p, size_t len) {
        add_runs(p, len / in_row, out_row);
        out_row += len / in_row;
      });
    } else {
      job->gathered.resize(ids.size() * in_row);
      session.RawIds(job->view, ids.data(), ids.size(), job->gathered.data());
      add_runs(job->gathered.data(), ids.size(), 0);
    }
    server::Server* srv = ctx.server;
    if (bytes < kShapeOnPoolBytes) {
      for (size_t i = 0; i < job->runs.size(); ++i) job->Apply(i);
      job->Fill(*ctx.shard);
      return job->Reply(*srv, ctx.client_id, ctx.tenant, *ctx.rb);
    }
    auto reply = ctx.Defer();
    const uint64_t client_id = ctx.client_id;
    const uint32_t tenant = ctx.tenant;
    const bool queued = srv->compute()->Submit([srv, job, reply, client_id, tenant] {
      srv->compute()->ParallelFor(job->runs.size(), [&](size_t i) { job->Apply(i); });
      reply([srv, job, client_id, tenant](proto::ReplyBuilder& rb) {
        job->Reply(*srv, client_id, tenant, rb);
      });
      if (job->fill) job->owner->PostControl([job](server::Shard& sh) { job->Fill(sh); });
    });
    if (!queued) {
      reply([](proto::ReplyBuilder& rb) {
        rb.Error(Status(ErrorKind::kBusy, "the compute queue is full; retry later"));
      });
    }
    return;
  }
  if (shm) return ReplyShm(ctx, session, view, start, end);
  if (raw && range) {  // straight from the stored chunks, no copy
    ctx.rb->BulkStart(bytes);
    session.RawRange(view, start, end, [&](const BufferRef& b, const uint8_t* p, size_t len) {
      ctx.rb->BulkPiece(b, p, len);
    });
    ctx.rb->BulkEnd();
    return;
  }
  auto out = BufferAllocator::Default()->Allocate(bytes);
  if (!out.ok()) return ctx.Error(out.status());
  uint8_t* dst = out.value()->data();
  if (raw) {
    session.RawIds(view, ids.data(), ids.size(), dst);
  } else if (range) {
    session.DecodeRange(view, start, end, reinterpret_cast<float*>(dst));
  } else {
    session.DecodeIds(view, ids.data(), ids.size(), reinterpret_cast<float*>(dst));
  }
  ctx.rb->BulkRef(out.value());
}

}  // namespace pion::families::vstore
