// V.* — token-indexed value sessions (seed 000): V.CREATE, V.STOREBATCH, V.FETCH, V.INFO,
// V.DROP, V.SNAPSHOT, V.RESTORE. Rows arrive as little-endian fp32 and are quantized to the
// session's codec on store; V.FETCH decodes to fp32, or with RAW sends the stored encoding
// (layout: src/store/codec/README.md) straight from the stored chunks.
//
// A session id "<ns>_pk" / "<ns>_pv" is routed like "<ns>", so a KV.PREFIX namespace and its
// two sessions live on one shard.
#include <zlib.h>

#include <cstring>
#include <vector>

#include "families/args.h"
#include "families/cluster_internal.h"
#include "families/families.h"
#include "families/kvprefix_internal.h"
#include "families/shard_sum.h"
#include "families/vstore_internal.h"
#include "net/connection.h"
#include "server/server.h"
#include "store/disk/object_file.h"

namespace pion::families {
namespace vstore {

std::string_view SessionRouteKey(std::string_view sid) {
  if (sid.size() > 3 && (sid.ends_with("_pk") || sid.ends_with("_pv"))) {
    return sid.substr(0, sid.size() - 3);
  }
  return sid;
}

}  // namespace vstore

namespace {

using vstore::SessionRouteKey;

using proto::CmdArgs;
using server::CommandContext;

// Views a little-endian blob as T elements; copies into `scratch` when it is not aligned.
template <typename T>
const T* BlobAs(std::string_view blob, std::vector<T>* scratch) {
  if (reinterpret_cast<uintptr_t>(blob.data()) % alignof(T) == 0) {
    return reinterpret_cast<const T*>(blob.data());
  }
  scratch->resize(blob.size() / sizeof(T));
  std::memcpy(scratch->data(), blob.data(), scratch->size() * sizeof(T));
  return scratch->data();
}

void Create(CommandContext& ctx, CmdArgs& args) {
  uint64_t dim = 0, block = 0;
  Status s = ParseUint(args[2], "dim", &dim);
  if (!s.ok()) return ctx.Error(s);
  auto format = codec::ParseFormat(args[3]);
  if (!format) {
    return ctx.Error(Error("format must be one of " + std::string(codec::FormatChoices()) +
                           ", got '" + std::string(args[3].substr(0, 32)) + "'"));
  }
  if (args.size() == 6 && EqualsIgnoreCase(args[4], "BLOCK")) {
    s = ParseUint(args[5], "BLOCK", &block);
    if (!s.ok()) return ctx.Error(s);
  } else if (args.size() != 4) {
    return ctx.Error(Error("syntax: V.CREATE <sid> <dim> <format> [BLOCK <n>]"));
  }
  if (dim == 0 || dim > codec::RowCodec::kMaxDim || block > codec::RowCodec::kMaxTurboBlock) {
    return ctx.Error(Error("dim must be in [1, " + std::to_string(codec::RowCodec::kMaxDim) +
                           "], got " + std::to_string(dim)));
  }
  auto codec =
      codec::RowCodec::Create(*format, static_cast<uint32_t>(dim), static_cast<uint32_t>(block));
  if (!codec.ok()) return ctx.Error(codec.status());
  s = ctx.shard->store().vstore.Create(ctx.Key(args[1]), codec.value());
  if (!s.ok()) return ctx.Error(s);
  ctx.rb->Ok();
}

// The KV.PREFIX namespace whose session this is, if any ("<ns>_pk" / "<ns>_pv").
store::PrefixEntry* PrefixOf(CommandContext& ctx, std::string_view sid) {
  std::string_view ns = SessionRouteKey(sid);
  if (ns.size() == sid.size()) return nullptr;
  return ctx.shard->store().prefixes.Find(ctx.Key(ns));
}

// Before a store: every written chunk it touches is pinned in memory (brought back first, as
// for a read: making room for the new bytes must not drop one of them), and its new bytes
// fit (demotions make room). False when the command was parked or refused (the reply is
// written).
bool ReadyToStore(CommandContext& ctx, const std::vector<residency::ObjectRef>& touched,
                  uint64_t bytes) {
  if (!touched.empty() && !ctx.Resident(touched, residency::Tier::kHost)) return false;
  server::MemoryAccountant& mem = ctx.server->memory();
  const uint64_t max = mem.maxmemory(), free = mem.Headroom(server::MemFamily::kVStore);
  if (free >= bytes) return true;
  if (max != 0 && bytes > max) {
    ctx.Error(Status(ErrorKind::kOom,
                     "command not allowed when used memory > 'maxmemory': vstore write of " +
                         std::to_string(bytes) + " bytes is more than all of maxmemory " +
                         std::to_string(max) + " (" + HumanBytes(max) + "); store it in parts"));
    return false;
  }
  return ctx.Room(residency::Tier::kHost, residency::Family::kVStore, bytes);
}

void StoreBatch(CommandContext& ctx, CmdArgs& args) {
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(args[1]);
  store::PrefixEntry* prefix = PrefixOf(ctx, args[1]);
  if (prefix != nullptr &&
      kvprefix::ParkUntilOpen(ctx, {ctx.tenant, std::string(SessionRouteKey(args[1]))})) {
    return;  // a namespace found on disk: its sessions first
  }
  auto entry = vs.Get(key);
  if (!entry.ok()) return ctx.Error(entry.status());
  store::VSession& session = *entry.value()->session;
  const size_t row_floats_bytes = size_t{4} * session.dim();
  const uint64_t rows_before = session.rows();
  std::vector<float> fscratch;
  std::vector<residency::ObjectRef> touched;
  Status s;
  if (EqualsIgnoreCase(args[2], "IDS")) {
    if (args.size() != 5)
      return ctx.Error(Error("syntax: V.STOREBATCH <sid> IDS <ids> <fp32_blob>"));
    std::string_view ids_blob = args[3], data = args[4];
    if (ids_blob.size() % 8 != 0) {
      return ctx.Error(Error("int64_ids_blob has " + std::to_string(ids_blob.size()) +
                             " bytes, expected a multiple of 8"));
    }
    size_t n = ids_blob.size() / 8;
    if (data.size() != n * row_floats_bytes) {
      return ctx.Error(Error("fp32_blob has " + std::to_string(data.size()) + " bytes, expected " +
                             std::to_string(n) +
                             " ids * 4*dim = " + std::to_string(n * row_floats_bytes)));
    }
    std::vector<int64_t> iscratch;
    const int64_t* ids = BlobAs<int64_t>(ids_blob, &iscratch);
    session.ChunksForIds(ids, n, &touched);
    if (!ReadyToStore(ctx, touched, session.BytesToStoreIds(ids, n))) return;
    if (prefix != nullptr) prefix->dirty = true;
    s = session.StoreIds(ids, BlobAs<float>(data, &fscratch), n, *ctx.pins);
  } else if ((args.size() == 5 || args.size() == 7) && EqualsIgnoreCase(args[3], "SHM")) {
    // The rows were written by the client into a SHM.RESERVE region: commit them.
    if (!ctx.unix_socket) {
      return ctx.Error(Error("SHM commits are only for clients on the Unix socket (--unixsocket)"));
    }
    int64_t start = 0;
    uint64_t lease = 0;
    s = ParseInt(args[2], "start_id", &start);
    if (s.ok()) s = ParseUint(args[4], "lease", &lease);
    if (!s.ok()) return ctx.Error(s);
    auto size = ctx.server->shm().PeekSize(ctx.client_id, lease);
    if (!size.ok()) return ctx.Error(size.status());
    if (size.value() % row_floats_bytes != 0) {
      (void)ctx.server->shm().Take(ctx.client_id, lease);  // spent
      return ctx.Error(Error("reserved region of lease " + std::to_string(lease) + " has " +
                             std::to_string(size.value()) +
                             " bytes, expected a multiple of 4*dim = " +
                             std::to_string(row_floats_bytes) + " (the lease is spent)"));
    }
    const size_t n = size.value() / row_floats_bytes;
    if (start >= 0) session.ChunksForRange(start, n, &touched);
    if (!ReadyToStore(ctx, touched, session.BytesToStoreRange(start, n))) {
      return;  // the lease stays until the command runs again
    }
    auto region = ctx.server->shm().Take(ctx.client_id, lease);
    if (!region.ok()) return ctx.Error(region.status());
    const BufferRef& b = region.value();
    if (args.size() == 7) {  // CRC32 <value>: the region must hold what the client meant
      if (!EqualsIgnoreCase(args[5], "CRC32")) {
        return ctx.Error(Error("unknown option '" + std::string(args[5].substr(0, 32)) +
                               "'; expected CRC32 <value>"));
      }
      uint64_t want = 0;
      s = ParseUint(args[6], "CRC32", &want);
      if (!s.ok()) return ctx.Error(s);
      const uint64_t got = crc32_z(crc32_z(0, nullptr, 0), b->data(), b->size());
      if (got != want) {
        return ctx.Error(Status(ErrorKind::kCorrupt,
                                "SHM region of lease " + std::to_string(lease) + " has CRC32 " +
                                    std::to_string(got) + ", expected " + std::to_string(want) +
                                    "; nothing stored (the lease is spent)"));
      }
    }
    if (prefix != nullptr) prefix->dirty = true;
    s = session.StoreRange(start, reinterpret_cast<const float*>(b->data()), n, *ctx.pins);
    if (!s.ok()) return ctx.Error(s);
    vs.NoteRows(static_cast<int64_t>(session.rows() - rows_before));
    return ctx.rb->Integer(static_cast<int64_t>(n));
  } else {
    if (args.size() != 4) {
      return ctx.Error(Error("syntax: V.STOREBATCH <sid> <start_id> <fp32_blob>"));
    }
    int64_t start = 0;
    s = ParseInt(args[2], "start_id", &start);
    if (!s.ok()) return ctx.Error(s);
    std::string_view data = args[3];
    if (data.empty() || data.size() % row_floats_bytes != 0) {
      return ctx.Error(Error(
          "fp32_blob has " + std::to_string(data.size()) +
          " bytes, expected a non-zero multiple of 4*dim = " + std::to_string(row_floats_bytes)));
    }
    const size_t n = data.size() / row_floats_bytes;
    if (start >= 0) session.ChunksForRange(start, n, &touched);
    if (!ReadyToStore(ctx, touched, session.BytesToStoreRange(start, n))) return;
    if (prefix != nullptr) prefix->dirty = true;
    s = session.StoreRange(start, BlobAs<float>(data, &fscratch), n, *ctx.pins);
  }
  if (!s.ok()) return ctx.Error(s);
  vs.NoteRows(static_cast<int64_t>(session.rows() - rows_before));
  size_t stored =
      EqualsIgnoreCase(args[2], "IDS") ? args[3].size() / 8 : args[3].size() / row_floats_bytes;
  ctx.rb->Integer(static_cast<int64_t>(stored));
}

// V.FETCH … RANGE … SHM: the stored bytes as (segment, offset, length) pieces in the tenant's
// shared-memory arena, under a lease that keeps them unchanged until released. Pieces held
// outside an arena (a prefix warmed from disk) are copied into one first.
void ReplyShm(CommandContext& ctx, const store::VSession& session,
              const store::VSession::HostView& view, int64_t start, int64_t end) {
  server::ShmPlane& plane = ctx.server->shm();
  struct Piece {
    int segment;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  std::vector<BufferRef> held;
  uint64_t total = 0;
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
    total += len;
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
  auto lease = plane.Grant(ctx.client_id, std::move(held), total);
  if (!lease.ok()) return ctx.Error(lease.status());
  auto& rb = *ctx.rb;
  rb.Map(5);
  rb.Bulk("lease");
  rb.Integer(static_cast<int64_t>(lease.value()));
  rb.Bulk("bytes");
  rb.Integer(static_cast<int64_t>(total));
  rb.Bulk("row_bytes");
  rb.Integer(static_cast<int64_t>(session.codec().row_bytes()));
  rb.Bulk("pieces");
  rb.Array(pieces.size());
  for (const Piece& p : pieces) {
    rb.Array(3);
    rb.Integer(p.segment);
    rb.Integer(static_cast<int64_t>(p.offset));
    rb.Integer(static_cast<int64_t>(p.length));
  }
  rb.Bulk("epoch");  // the arena's punch epoch: pinned (CUDA-registered) pages older than it
  rb.Integer(static_cast<int64_t>(plane.ArenaFor(ctx.tenant)->punch_epoch()));  // are stale
}

void Fetch(CommandContext& ctx, CmdArgs& args) {
  store::PrefixEntry* prefix = PrefixOf(ctx, args[1]);
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
  // Trailing options (ids are integers, so keywords cannot be mistaken for them):
  // RAW, and for a KV.PREFIX session the identity the reader expects, MODEL <id> and
  // GENERATION <g> — a reader of another model or of a dropped generation is refused.
  size_t end_arg = args.size();
  bool raw = false, shm = false;
  while (end_arg > 2) {
    if (EqualsIgnoreCase(args[end_arg - 1], "RAW")) {
      raw = true;
      --end_arg;
    } else if (EqualsIgnoreCase(args[end_arg - 1], "SHM")) {
      shm = raw = true;  // a mapping of the stored encoding
      --end_arg;
    } else if (end_arg > 3 && (EqualsIgnoreCase(args[end_arg - 2], "MODEL") ||
                               EqualsIgnoreCase(args[end_arg - 2], "GENERATION"))) {
      std::string_view opt = args[end_arg - 2], val = args[end_arg - 1];
      if (prefix == nullptr) {
        return ctx.Error(Error(std::string(opt) +
                               " applies to KV.PREFIX sessions (<ns>_pk, "
                               "<ns>_pv); '" +
                               std::string(args[1]) + "' is not one"));
      }
      const auto& m = prefix->manifest;
      if (EqualsIgnoreCase(opt, "MODEL") && val != m.model) {
        return ctx.Error(Status(ErrorKind::kMismatch, "session '" + std::string(args[1]) +
                                                          "' holds model '" + m.model + "', not '" +
                                                          std::string(val) + "'"));
      }
      if (EqualsIgnoreCase(opt, "GENERATION")) {
        uint64_t g = 0;
        Status gs = ParseUint(val, "GENERATION", &g);
        if (!gs.ok()) return ctx.Error(gs);
        if (g != m.cache_generation) {
          return ctx.Error(Status(ErrorKind::kMismatch,
                                  "session '" + std::string(args[1]) + "' is at generation " +
                                      std::to_string(m.cache_generation) + ", not " +
                                      std::to_string(g) +
                                      " (its namespace was dropped and registered again)"));
        }
      }
      end_arg -= 2;
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
  int64_t start = 0, end = 0;
  std::vector<int64_t> ids;
  Status s;
  if (range) {
    if (end_arg != 5) return ctx.Error(Error("syntax: V.FETCH <sid> RANGE <start> <end> [RAW]"));
    s = ParseInt(args[3], "start", &start);
    if (s.ok()) s = ParseInt(args[4], "end", &end);
    if (s.ok() && (start < 0 || end <= start)) {
      s = Error("RANGE needs 0 <= start < end, got " + std::to_string(start) + " " +
                std::to_string(end));
    }
    if (!s.ok()) return ctx.Error(s);
    s = session.CheckRange(start, end);
  } else {
    if (end_arg < 3) return ctx.Error(Error("syntax: V.FETCH <sid> <id> [<id> ...] [RAW]"));
    ids.resize(end_arg - 2);
    for (size_t i = 2; i < end_arg && s.ok(); ++i) s = ParseInt(args[i], "id", &ids[i - 2]);
    if (!s.ok()) return ctx.Error(s);
    s = session.CheckIds(ids.data(), ids.size());
  }
  if (!s.ok()) {  // a missing id: name the session too
    return ctx.Error(Error(s.message() + " in session '" + std::string(args[1]) + "'"));
  }
  const uint64_t n = range ? static_cast<uint64_t>(end - start) : ids.size();
  const uint64_t bytes = n * (raw ? session.codec().row_bytes() : size_t{4} * session.dim());
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

void Drop(CommandContext& ctx, CmdArgs& args) {
  auto& vs = ctx.shard->store().vstore;
  const store::TenantKey key = ctx.Key(args[1]);
  bool existed = vs.Drop(key);
  std::vector<uint64_t> snapshots;
  vs.ForEachSealed([&](const store::TenantKey& k, uint64_t n, const auto&) {
    if (k == key) snapshots.push_back(n);
  });
  std::vector<std::string> sealed = vs.TakeSealed(key);
  if (!sealed.empty()) {
    // Sealed snapshots go too: a dropped session leaves nothing behind, in memory or on disk.
    Status s = store::disk::RemoveFiles(vstore::SealedDir(*ctx.server), sealed);
    if (!s.ok()) return ctx.Error(s);
    existed = true;
  }
  if (snapshots.empty() || !cluster_sync::Enabled(*ctx.server)) {
    return ctx.rb->Integer(existed ? 1 : 0);
  }
  // Cluster mode: acknowledged once the replicas dropped their copies too.
  auto done = cluster_sync::Gather(
      snapshots.size(),
      cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Integer(1); }));
  const std::string tenant = ctx.server->users().TenantName(key.tenant);
  for (uint64_t n : snapshots) {
    cluster_sync::ReplicateDrop(*ctx.server, {"VSNAP", tenant, key.name, std::to_string(n)}, 1,
                                done);
  }
}

void Snapshot(CommandContext& ctx, CmdArgs& args) {
  auto entry = ctx.shard->store().vstore.Get(ctx.Key(args[1]));
  if (!entry.ok()) return ctx.Error(entry.status());
  auto* e = entry.value();
  uint64_t id = e->next_snapshot++;
  e->snapshots.emplace(id, e->session->TakeSnapshot());
  ctx.rb->Integer(static_cast<int64_t>(id));
}

void Restore(CommandContext& ctx, CmdArgs& args) {
  auto& vs = ctx.shard->store().vstore;
  uint64_t id = 0;
  Status s = ParseUint(args[2], "snapshot", &id);
  if (!s.ok()) return ctx.Error(s);
  store::VStore::Entry* e = vs.Find(ctx.Key(args[1]));
  const bool in_memory = e != nullptr && e->snapshots.count(id) != 0;
  if (!in_memory) {
    if (vs.FindSealed(ctx.Key(args[1]), id) != nullptr) {
      return vstore::RestoreSealed(ctx, std::string(args[1]), id);  // from disk
    }
    if (e == nullptr) return ctx.Error(Error("no such session '" + std::string(args[1]) + "'"));
    return ctx.Error(
        Error("no snapshot " + std::to_string(id) + " of session '" + std::string(args[1]) + "'"));
  }
  if (store::PrefixEntry* p = PrefixOf(ctx, args[1])) p->dirty = true;
  uint64_t before = e->session->rows();
  e->session->Restore(e->snapshots.at(id));
  vs.NoteRows(static_cast<int64_t>(e->session->rows()) - static_cast<int64_t>(before));
  ctx.rb->Ok();
}

void InfoOne(CommandContext& ctx, std::string_view sid) {
  auto entry = ctx.shard->store().vstore.Get(ctx.Key(sid));
  if (!entry.ok()) return ctx.Error(entry.status());
  const auto& e = *entry.value();
  const auto& c = e.session->codec();
  auto& rb = *ctx.rb;
  rb.Map(9);
  rb.Bulk("dim");
  rb.Integer(c.dim());
  rb.Bulk("format");
  rb.Bulk(codec::FormatName(c.format()));
  rb.Bulk("block");
  rb.Integer(c.block());
  rb.Bulk("row_bytes");
  rb.Integer(static_cast<int64_t>(c.row_bytes()));
  rb.Bulk("rows");
  rb.Integer(static_cast<int64_t>(e.session->rows()));
  rb.Bulk("chunks");
  rb.Integer(static_cast<int64_t>(e.session->chunk_count()));
  rb.Bulk("bytes");
  rb.Integer(static_cast<int64_t>(e.session->chunk_bytes()));
  rb.Bulk("snapshots");
  rb.Integer(static_cast<int64_t>(e.snapshots.size()));
  rb.Bulk("sealed");
  rb.Integer(static_cast<int64_t>(ctx.shard->store().vstore.SealedCount(ctx.Key(sid))));
}

void Info(CommandContext& ctx, CmdArgs& args) {
  if (args.size() == 2) return InfoOne(ctx, args[1]);  // on the session's shard
  if (args.size() > 2) return ctx.Error(Error("syntax: V.INFO [<sid>]"));
  const uint32_t tenant = ctx.tenant;
  ReplySumOverShards(ctx, {{"sessions"}, {"rows"}, {"snapshots"}}, [tenant](server::Shard& shard) {
    auto u = shard.store().vstore.UsageOf(tenant);
    return std::vector<double>{static_cast<double>(u.sessions), static_cast<double>(u.rows),
                               static_cast<double>(u.snapshots)};
  });
}

}  // namespace

void RegisterVStoreFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  auto reg = [&](CommandSpec spec) {
    if (spec.first_key == 1) spec.route_key = SessionRouteKey;
    r.Register(std::move(spec));
  };
  reg({"V.CREATE", -4, kKv | kCmdWrite, 1, 1, 1, Create, "vstore",
       "Creates a token-indexed session of fixed row width in one codec.",
       "<sid> <dim> fp32|fp16|bf16|int8|turbo4|turbo3|turbo2|fp8|fp8_e5m2 [BLOCK <n>]"});
  reg({"V.STOREBATCH", -4, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, StoreBatch, "vstore",
       "Stores fp32 rows (quantized to the session's codec) at consecutive or given ids.",
       "<sid> <start_id> <fp32_blob> | <sid> IDS <int64_ids_blob> <fp32_blob> | <sid> <start_id> "
       "SHM <lease> [CRC32 <value>]"});
  reg({"V.FETCH", -3, kKv | kCmdReadOnly, 1, 1, 1, Fetch, "vstore",
       "Fetches rows as fp32 (or RAW stored encoding) by ids or an id range.",
       "<sid> <id> [<id> ...] | <sid> RANGE <start> <end>, then [RAW|SHM] [MODEL <id>] "
       "[GENERATION <g>]"});
  reg({"V.DROP", 2, kKv | kCmdWrite, 1, 1, 1, Drop, "vstore",
       "Deletes a session and its snapshots; replies 1 if it existed.", "<sid>"});
  reg({"V.SNAPSHOT", 2, kKv | kCmdWrite | kCmdDenyOom, 1, 1, 1, Snapshot, "vstore",
       "Takes a point-in-time snapshot (later writes do not change it); replies its id.", "<sid>"});
  reg({"V.RESTORE", 3, kKv | kCmdWrite, 1, 1, 1, Restore, "vstore",
       "Makes the session's content equal to a snapshot (in memory, or sealed on disk).",
       "<sid> <snapshot>"});
  // V.INFO <sid> is routed to the session's shard; bare V.INFO runs on the connection's shard
  // and fans out.
  reg({"V.COMMIT", 3, kKv | kCmdWrite, 1, 1, 1, vstore::Commit, "vstore",
       "Seals a snapshot durably in the disk tier; replies once it is durable.",
       "<sid> <snapshot>"});
  reg({"V.INFO", -1, kKv | kCmdReadOnly | kCmdConnection, 1, 1, 1, Info, "vstore",
       "Per-session statistics, or the caller's totals without a sid.", "[<sid>]"});
  srv.AddStartupHook(vstore::LoadSealed);
  cluster_sync::AddSavedKind(vstore::SavedKindOf());
  srv.AddShardInit([&srv](Shard& shard) { shard.store().vstore.set_engine(srv.residency()); });
}

}  // namespace pion::families
