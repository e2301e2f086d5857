// ATTEND.PREFIX.* slots (Stage 2): one layer's K and V resident per (session, layer), so the
// server attends over a cached prefix instead of shipping it back. This file holds the slot
// commands — STORE (blobs, or FROM a Stage 1 namespace), LOOKUP, DROP, INFO — and the family's
// registration; the QUERY forms are in attend_prefix_query.cc.
//
// STORE is reserve → copy/convert → validate → publish: the bytes are charged (least recently
// used slots move to disk if host memory needs room), converted to the storage precision, put
// on the GPU under the cuda backend, and only then swapped in, so a concurrent QUERY sees the
// old slot or the new one, never a partial one. A slot's K and V are a residency object: it is
// demoted GPU -> host -> disk under pressure and promoted back by the next query.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>

#include "families/args.h"
#include "families/attend_prefix_internal.h"
#include "families/cluster_internal.h"
#include "families/families.h"
#include "families/kvprefix_internal.h"
#include "families/tiering.h"
#include "kernels/cuda/gpu.h"
#include "server/server.h"
#include "store/codec/codec.h"
#include "store/disk/object_file.h"
#include "store/saved_record.h"

namespace pion::families {
namespace attend {

Status ParseLayer(std::string_view text, uint32_t* out) {
  uint64_t v = 0;
  Status s = ParseUint(text, "layer", &v);
  if (!s.ok()) return s;
  if (v >= kMaxLayer) {
    return Error("layer must be below " + std::to_string(kMaxLayer) + ", got " + std::string(text));
  }
  *out = static_cast<uint32_t>(v);
  return Status::Ok();
}

Status ParseCount(std::string_view text, std::string_view what, uint32_t max, uint32_t* out) {
  int64_t v = 0;
  if (!ParseInt64(text, &v) || v < 1 || v > max) {
    return Error(std::string(what) + " must be an integer in [1, " + std::to_string(max) +
                 "], got '" + std::string(text.substr(0, 32)) + "'");
  }
  *out = static_cast<uint32_t>(v);
  return Status::Ok();
}

Status ParseHeadDim(std::string_view text, uint32_t* out) {
  int64_t v = 0;
  if (ParseInt64(text, &v)) {
    for (uint32_t d : kHeadDims) {
      if (v == d) {
        *out = d;
        return Status::Ok();
      }
    }
  }
  return Error("D must be one of 32, 64, 96, 128, 160, 192, 256, 512, got '" +
               std::string(text.substr(0, 32)) + "'");
}

Status CheckBlobSize(std::string_view what, std::string_view formula, uint64_t expected,
                     uint64_t got) {
  if (expected == got) return Status::Ok();
  return Error(std::string(what) + " must be " + std::string(formula) + " = " +
               std::to_string(expected) + " bytes, got " + std::to_string(got));
}

StatusOr<attention::SlotRef> FindSlot(server::CommandContext& ctx, std::string_view sid,
                                      uint32_t layer) {
  attention::SlotRef slot = ctx.shard->store().attention.Find(ctx.Key(sid), layer);
  if (slot) return slot;
  ctx.server->attention_counters().misses.fetch_add(1, std::memory_order_relaxed);
  return Status(ErrorKind::kMiss,
                "no attention slot for session '" + std::string(sid.substr(0, 128)) + "' layer " +
                    std::to_string(layer) + " (never stored, or dropped); ATTEND.PREFIX.STORE it");
}

const kernels::AttentionKernels& Kernels(server::Server&) { return kernels::CpuKernels(); }
std::string_view BackendName(server::Server& srv) { return srv.attention_backend(); }

}  // namespace attend

namespace {

using namespace attend;
using proto::CmdArgs;
using server::CommandContext;

// The storage type of a slot built from fp32 values (blob STORE): fp16 under --attention-fp16.
kernels::DType StorageType(server::Server& srv) {
  return srv.config().attention_fp16 ? kernels::DType::kF16 : kernels::DType::kF32;
}

// The storage type of a slot bound from a namespace stored in `source`: a bf16 namespace keeps
// bf16 (exact, half of fp32's bytes; a bf16 model's cache can alias it) unless --attention-fp16
// asks for fp16.
// An fp8 namespace keeps fp8 (its e4m3 bytes and row scales as they are: a quarter of fp32's
// bytes; --attention-fp16 would widen it, so it does not apply).
kernels::DType StorageType(server::Server& srv, codec::Format source) {
  if (source == codec::Format::kFp8) return kernels::DType::kFP8;
  if (source == codec::Format::kBf16 && !srv.config().attention_fp16) return kernels::DType::kBF16;
  return StorageType(srv);
}

// The storage of an MLA slot's latent rows from a namespace (or blob) codec: kept as stored —
// fp16, bf16, Pion's fp8 and DeepSeek-V3.2's fp8_ds_mla rows are what the MLA kernel reads —
// except fp32, which --attention-fp16 stores as fp16 like every other fp32 slot.
kernels::LatentType LatentStorage(server::Server& srv, codec::Format source) {
  switch (source) {
    case codec::Format::kFp16:
      return kernels::LatentType::kF16;
    case codec::Format::kBf16:
      return kernels::LatentType::kBF16;
    case codec::Format::kFp8:
      return kernels::LatentType::kFP8;
    case codec::Format::kFp8DsMla:
      return kernels::LatentType::kFP8DsMla;
    default:
      return srv.config().attention_fp16 ? kernels::LatentType::kF16 : kernels::LatentType::kF32;
  }
}

// The codec whose RAW rows are a latent type's rows (attention.h: LatentType).
codec::Format LatentCodec(kernels::LatentType t) {
  switch (t) {
    case kernels::LatentType::kF16:
      return codec::Format::kFp16;
    case kernels::LatentType::kBF16:
      return codec::Format::kBf16;
    case kernels::LatentType::kFP8:
      return codec::Format::kFp8;
    case kernels::LatentType::kFP8DsMla:
      return codec::Format::kFp8DsMla;
    default:
      return codec::Format::kFp32;
  }
}

// The shapes the MLA kernels take: kv_lora_rank and rope_dim multiples of 16, kv_lora_rank at
// most 2048 and their sum at most 4096 (DeepSeek V2/V3: 512 + 64).
Status CheckMlaShape(uint32_t rank, uint32_t rope, std::string_view whose) {
  if (rank == 0 || rank % 16 != 0 || rope % 16 != 0 || rank > 2048 || rank + rope > 4096) {
    return Error(std::string(whose) + " has kv_lora_rank " + std::to_string(rank) +
                 " and rope_dim " + std::to_string(rope) +
                 "; MLA attention needs multiples of 16 (kv_lora_rank in [16, 2048], the sum at "
                 "most 4096)");
  }
  return Status::Ok();
}

// Where a slot's host copy lives: under the cuda backend in page-locked memory, so that a
// promotion to the GPU is one DMA from it (and a demotion lands in it) at link speed.
BufferAllocator* HostAllocator(const attention::Slot& slot) {
  return slot.gpu ? gpu::PinnedHostAllocator() : BufferAllocator::Default();
}

// fp32 [rows][d] → the storage type, into dst.
void ConvertRows(const float* src, size_t n_rows, uint32_t d, kernels::DType t, uint8_t* dst) {
  if (t == kernels::DType::kF32) {
    std::memcpy(dst, src, n_rows * d * sizeof(float));
    return;
  }
  static const codec::RowCodec fp16 = codec::RowCodec::Create(codec::Format::kFp16, 1).value();
  static const codec::RowCodec bf16 = codec::RowCodec::Create(codec::Format::kBf16, 1).value();
  // A dim-1 codec: n_rows * d independent elements.
  (t == kernels::DType::kBF16 ? bf16 : fp16).Encode(src, n_rows * d, dst);
}

// Rows [r0, r1) of a blob STORE's tensor ([heads·rows] rows of d elements of `in`) into the
// slot's block `dst` of type `out` (n_rows rows in all): fp32 converted to the storage type;
// 16-bit types copied; fp8 rows ([f32 scale][d e4m3], the codec's layout) split into the
// block's e4m3 bytes and its scales after them (kernels::MakeTensor).
void CopyBlobRows(kernels::DType in, const uint8_t* src, uint64_t r0, uint64_t r1, uint32_t d,
                  uint64_t n_rows, kernels::DType out, uint8_t* dst) {
  const size_t esize = kernels::DTypeSize(out);
  if (in == kernels::DType::kF32) {
    return ConvertRows(reinterpret_cast<const float*>(src) + r0 * d, r1 - r0, d, out,
                       dst + r0 * d * esize);
  }
  if (in != kernels::DType::kFP8) {
    std::memcpy(dst + r0 * d * esize, src + r0 * d * esize, (r1 - r0) * d * esize);
    return;
  }
  uint8_t* scales = dst + n_rows * d;
  for (uint64_t r = r0; r < r1; ++r) {
    const uint8_t* row = src + r * (d + 4);
    std::memcpy(scales + r * 4, row, 4);
    std::memcpy(dst + r * d, row + 4, d);
  }
}

// An fp8 blob's row scales: finite and not negative (what the codec's encoder writes), or an
// error naming the first row that is not.
Status CheckFp8Scales(std::string_view what, const uint8_t* blob, uint32_t heads, uint32_t rows,
                      uint32_t d) {
  const uint64_t n = uint64_t{heads} * rows;
  for (uint64_t r = 0; r < n; ++r) {
    float scale;
    std::memcpy(&scale, blob + r * (d + 4), 4);
    if (!(scale >= 0.0f) || !std::isfinite(scale)) {
      return Error(std::string(what) + " row " + std::to_string(r) + " (head " +
                   std::to_string(r / rows) + " row " + std::to_string(r % rows) + ") has scale " +
                   std::to_string(scale) + "; fp8 row scales must be finite and >= 0");
    }
  }
  return Status::Ok();
}

// The last step of every STORE, from any thread: under the cuda backend the slot's GPU copy is
// made first (reserve on the GPU — demoting least recently used copies — then upload, check
// the allocation's id: a STORE that cannot get GPU room answers -OOM tier=gpu rather than
// publish a slot the GPU does not hold); then the slot is published on its shard, swapping in
// atomically, and the reply is OK.
void Finish(server::Server* srv, int shard_id, std::shared_ptr<attention::Slot> slot,
            store::TenantKey sid, uint32_t layer, bool promotion, residency::Deadline deadline,
            std::function<void(server::CommandContext::ReplyWriter)> reply) {
  auto publish = [=](const Status& st) {
    srv->shard(shard_id).PostControl([=](server::Shard& sh) {
      if (!st.ok()) {
        if (slot->gpu) {
          srv->attention_counters().gpu_upload_failures.fetch_add(1, std::memory_order_relaxed);
        }
        return reply([st](proto::ReplyBuilder& rb) { rb.Error(st); });
      }
      slot->generation = attention::NextSlotGeneration();
      sh.store().attention.Publish(sid, layer, slot);
      (promotion ? srv->attention_counters().stores_from : srv->attention_counters().stores)
          .fetch_add(1, std::memory_order_relaxed);
      reply([](proto::ReplyBuilder& rb) { rb.Ok(); });
    });
  };
  if (!slot->gpu) return publish(Status::Ok());
  srv->residency()->Require({slot->obj}, residency::Tier::kGpu, deadline,
                            [publish](const Status& s, residency::PinSet) { publish(s); });
}

// Publishes an MLA slot built from `block` (its latent rows) on the calling shard.
void PublishLatent(CommandContext& ctx, std::shared_ptr<attention::Slot> slot,
                   const store::TenantKey& sid, uint32_t layer, BufferRef block,
                   std::unique_ptr<Charge> charge) {
  slot->obj = ctx.server->residency()->CreateInHost(residency::Family::kAttention, {block},
                                                    std::move(charge));
  slot->generation = attention::NextSlotGeneration();
  ctx.shard->store().attention.Publish(sid, layer, std::move(slot));
  ctx.server->attention_counters().stores.fetch_add(1, std::memory_order_relaxed);
  ctx.rb->Ok();
}

// ATTEND.PREFIX.STORE <sid> <layer> MLA <N> <kv_lora_rank> <rope_dim> <latent_blob>
//   [DTYPE fp32|fp16|bf16|fp8|fp8_ds_mla]
// An MLA slot from the client's latent rows: N rows of kv_lora_rank + rope_dim values in the
// RAW layout of DTYPE (default fp32), kept as sent (fp32: fp16 under --attention-fp16).
void StoreMlaBlobs(CommandContext& ctx, CmdArgs& args) {
  uint32_t layer, rows, rank;
  uint64_t rope = 0;
  Status s = ParseLayer(args[2], &layer);
  if (s.ok()) s = ParseCount(args[4], "N", kMaxRows, &rows);
  if (s.ok()) s = ParseCount(args[5], "kv_lora_rank", 4096, &rank);
  if (s.ok()) s = ParseUint(args[6], "rope_dim", &rope);
  if (s.ok() && rope > 4096)
    s = Error("rope_dim must be at most 4096, got " + std::to_string(rope));
  if (s.ok()) s = CheckMlaShape(rank, static_cast<uint32_t>(rope), "the latent_blob");
  if (!s.ok()) return ctx.Error(s);
  codec::Format format = codec::Format::kFp32;
  if (args.size() == 10) {
    if (!EqualsIgnoreCase(args[8], "DTYPE")) {
      return ctx.Error(
          Error("unknown option '" + std::string(args[8].substr(0, 32)) + "'; expected DTYPE"));
    }
    const auto f = codec::ParseFormat(args[9]);
    if (!f ||
        (*f != codec::Format::kFp32 && *f != codec::Format::kFp16 && *f != codec::Format::kBf16 &&
         *f != codec::Format::kFp8 && *f != codec::Format::kFp8DsMla)) {
      return ctx.Error(
          Error("DTYPE of MLA latents must be one of fp32, fp16, bf16, fp8, "
                "fp8_ds_mla, got '" +
                std::string(args[9].substr(0, 32)) + "'"));
    }
    format = *f;
  }
  const uint32_t dk = rank + static_cast<uint32_t>(rope);
  if (format == codec::Format::kFp8DsMla && (rope != codec::kDsMlaRope || rank % 128 != 0)) {
    return ctx.Error(
        Error("fp8_ds_mla holds kv_lora_rank (a multiple of 128) + 64 RoPE values, "
              "got kv_lora_rank " +
              std::to_string(rank) + " rope_dim " + std::to_string(rope)));
  }
  const codec::RowCodec codec = codec::RowCodec::Create(format, dk).value();
  const std::string shape = " (N=" + std::to_string(rows) +
                            " kv_lora_rank=" + std::to_string(rank) +
                            " rope_dim=" + std::to_string(rope) + ")";
  std::string formula;
  switch (format) {
    case codec::Format::kFp32:
      formula = "N*(kv_lora_rank+rope_dim)*4" + shape;
      break;
    case codec::Format::kFp8:
      formula = "N*(4+kv_lora_rank+rope_dim)" + shape + ", rows of [f32 scale][e4m3 values]";
      break;
    case codec::Format::kFp8DsMla:
      formula = "N*(kv_lora_rank+kv_lora_rank/32+2*rope_dim)" + shape +
                ", rows of [kv_lora_rank e4m3][f32 scale per 128][rope_dim bf16]";
      break;
    default:
      formula = "N*(kv_lora_rank+rope_dim)*2" + shape;
  }
  s = CheckBlobSize("latent_blob", formula, uint64_t{rows} * codec.row_bytes(), args[7].size());
  if (!s.ok()) return ctx.Error(s);
  if (format == codec::Format::kFp8 || format == codec::Format::kFp8DsMla) {
    // Scales as the codec writes them: finite and not negative.
    const auto* blob = reinterpret_cast<const uint8_t*>(args[7].data());
    const bool ds = format == codec::Format::kFp8DsMla;
    const uint32_t groups = ds ? rank / codec::kDsMlaGroup : 1;
    for (uint64_t r = 0; r < rows; ++r) {
      for (uint32_t g = 0; g < groups; ++g) {
        float scale;
        std::memcpy(&scale, blob + r * codec.row_bytes() + (ds ? rank + 4 * g : 0), 4);
        if (!(scale >= 0.0f) || !std::isfinite(scale)) {
          return ctx.Error(Error("latent_blob row " + std::to_string(r) + " has scale " +
                                 std::to_string(scale) + "; fp8 scales must be finite and >= 0"));
        }
      }
    }
  }
  server::Server& srv = *ctx.server;
  auto slot = std::make_shared<attention::Slot>();
  slot->mla = true;
  slot->heads = 1;
  slot->rows = rows;
  slot->d = dk;
  slot->dv = rank;
  slot->latent = LatentStorage(srv, format);
  std::unique_ptr<Charge> charge;
  if (!ChargeHost(ctx, residency::Family::kAttention, slot->bytes(), &charge)) return;
  auto b = args.TakeBuffer(7);
  if (!b.ok()) return ctx.Error(b.status());
  BufferRef src = std::move(b).value();
  const store::TenantKey sid = ctx.Key(args[1]);
  if (LatentCodec(slot->latent) == format) {  // the received rows are the slot's: adopted
    return PublishLatent(ctx, std::move(slot), sid, layer, std::move(src), std::move(charge));
  }
  auto dst = BufferAllocator::Default()->Allocate(slot->bytes());
  if (!dst.ok()) return ctx.Error(dst.status());
  ConvertRows(reinterpret_cast<const float*>(src->data()), rows, dk, kernels::DType::kF16,
              dst.value()->data());  // fp32 → fp16 (--attention-fp16)
  PublishLatent(ctx, std::move(slot), sid, layer, std::move(dst).value(), std::move(charge));
}

// ATTEND.PREFIX.STORE <sid> <layer> <H> <N> <D> <K_blob> <V_blob> [DTYPE fp32|fp16|bf16|fp8]
// DTYPE names the blobs' element type (default fp32); fp16, bf16 and fp8 slots keep it.
void StoreBlobs(CommandContext& ctx, CmdArgs& args) {
  uint32_t layer, heads, rows, d;
  Status s = ParseLayer(args[2], &layer);
  if (s.ok()) s = ParseCount(args[3], "H", kMaxHeads, &heads);
  if (s.ok()) s = ParseCount(args[4], "N", kMaxRows, &rows);
  if (s.ok()) s = ParseHeadDim(args[5], &d);
  if (!s.ok()) return ctx.Error(s);
  kernels::DType in = kernels::DType::kF32;
  if (args.size() == 10) {
    if (!EqualsIgnoreCase(args[8], "DTYPE")) {
      return ctx.Error(
          Error("unknown option '" + std::string(args[8].substr(0, 32)) + "'; expected DTYPE"));
    }
    std::string name(args[9].substr(0, 32));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (!kernels::ParseDType(name, &in)) {
      return ctx.Error(Error("DTYPE must be one of fp32, fp16, bf16, fp8, got '" +
                             std::string(args[9].substr(0, 32)) + "'"));
    }
  }
  const uint64_t elems = uint64_t{heads} * rows * d;
  const std::string shape = " (H=" + std::to_string(heads) + " N=" + std::to_string(rows) +
                            " D=" + std::to_string(d) + ")";
  const std::string formula = in == kernels::DType::kF32 ? "H*N*D*4" + shape
                              : in == kernels::DType::kFP8
                                  ? "H*N*(D+4)" + shape + ", rows of [f32 scale][D e4m3]"
                                  : "H*N*D*2" + shape;
  const uint64_t blob_bytes = kernels::TensorBytes(in, heads, rows, d);
  s = CheckBlobSize("K_blob", formula, blob_bytes, args[6].size());
  if (s.ok()) s = CheckBlobSize("V_blob", formula, blob_bytes, args[7].size());
  if (s.ok() && in == kernels::DType::kFP8) {
    s = CheckFp8Scales("K_blob", reinterpret_cast<const uint8_t*>(args[6].data()), heads, rows, d);
    if (s.ok()) {
      s = CheckFp8Scales("V_blob", reinterpret_cast<const uint8_t*>(args[7].data()), heads, rows,
                         d);
    }
  }
  if (!s.ok()) return ctx.Error(s);

  server::Server& srv = *ctx.server;
  auto slot = std::make_shared<attention::Slot>();
  slot->heads = heads;
  slot->rows = rows;
  slot->d = d;
  slot->dtype = in == kernels::DType::kF32 ? StorageType(srv) : in;
  slot->gpu = srv.gpu_attention();
  std::unique_ptr<Charge> charge;
  if (!ChargeHost(ctx, residency::Family::kAttention, slot->bytes(), &charge)) return;
  BufferRef src[2];
  for (int i = 0; i < 2; ++i) {
    auto b = args.TakeBuffer(6 + i);  // adopts the received buffer: no copy
    if (!b.ok()) return ctx.Error(b.status());
    src[i] = std::move(b).value();
  }
  const store::TenantKey sid = ctx.Key(args[1]);
  server::Server* srvp = &srv;
  const int shard_id = ctx.shard->id();
  const residency::Deadline deadline = ctx.deadline;
  // The received bytes are the slot's (fp32, fp16, bf16 kept as sent): adopted as they are.
  if (slot->dtype == in && in != kernels::DType::kFP8 && !slot->gpu) {
    slot->obj = srv.residency()->CreateInHost(residency::Family::kAttention, {src[0], src[1]},
                                              std::move(charge));
    slot->generation = attention::NextSlotGeneration();
    ctx.shard->store().attention.Publish(sid, layer, std::move(slot));
    srv.attention_counters().stores.fetch_add(1, std::memory_order_relaxed);
    return ctx.rb->Ok();
  }
  // Converted (fp16 from fp32, fp8 rows split into bytes and scales), or copied into
  // page-locked memory under the cuda backend.
  BufferRef dst[2];
  for (BufferRef& b : dst) {
    auto a = HostAllocator(*slot)->Allocate(slot->bytes_each());
    if (!a.ok()) return ctx.Error(a.status());
    b = std::move(a).value();
  }
  // fp16: a large conversion runs on the compute pool (it is O(bytes), like a query).
  auto shared_charge = std::make_shared<std::unique_ptr<Charge>>(std::move(charge));
  const uint64_t n_rows = uint64_t{heads} * rows;
  auto convert = [srvp, slot, src, dst, elems, n_rows, in, d](server::WorkerPool* pool,
                                                              std::unique_ptr<Charge> charge) {
    const size_t pieces =
        pool == nullptr ? 1 : std::clamp<size_t>(elems >> 22, 1, static_cast<size_t>(n_rows));
    auto run = [&](size_t p) {
      const uint64_t a = n_rows * p / pieces, b = n_rows * (p + 1) / pieces;
      for (int i = 0; i < 2; ++i) {
        CopyBlobRows(in, src[i]->data(), a, b, d, n_rows, slot->dtype, dst[i]->data());
      }
    };
    if (pool != nullptr) {
      pool->ParallelFor(pieces, run);
    } else {
      run(0);
    }
    slot->obj = srvp->residency()->CreateInHost(residency::Family::kAttention, {dst[0], dst[1]},
                                                std::move(charge), HostAllocator(*slot));
  };
  if (elems < (1u << 20) && !slot->gpu) {
    convert(nullptr, std::move(*shared_charge));
    slot->generation = attention::NextSlotGeneration();
    ctx.shard->store().attention.Publish(sid, layer, std::move(slot));
    srv.attention_counters().stores.fetch_add(1, std::memory_order_relaxed);
    return ctx.rb->Ok();
  }
  auto reply = ctx.Defer();
  bool queued = srv.compute()->Submit(
      [srvp, shard_id, slot, sid, layer, convert, shared_charge, deadline, reply]() {
        convert(srvp->compute(), std::move(*shared_charge));
        Finish(srvp, shard_id, slot, sid, layer, false, deadline, reply);
      });
  if (!queued) {
    ctx.shard->stats().Reject(server::RejectReason::kBusy);
    reply([](proto::ReplyBuilder& rb) {
      rb.Error(Status(ErrorKind::kBusy, "the compute queue is full; retry later"));
    });
  }
}

// What STORE FROM reads: a point-in-time view of one layer of a complete namespace.
struct Source {
  store::PrefixManifest manifest;
  uint64_t publication = 0;
  store::VSession::Snapshot k, v;
  codec::RowCodec codec = codec::RowCodec::Create(codec::Format::kFp32, 1).value();
  std::shared_ptr<residency::PinSet> pins;  // the layer's chunks, held in host memory
};

// Runs on the namespace's shard: opens it if it is only on disk, checks identity, completeness
// and the layer, snapshots its sessions (copy-on-write, O(chunks)) and brings the layer's
// chunks into host memory (pinned there for the decode); `done` may run on another thread.
void PrepareSource(server::Server& srv, server::Shard& shard, const store::TenantKey& ns,
                   uint32_t layer, std::optional<std::string> model,
                   std::optional<std::string> position, residency::Deadline deadline,
                   std::function<void(StatusOr<std::shared_ptr<Source>>)> done) {
  if (shard.store().prefixes.Find(ns) == nullptr) {
    return done(Error("no such prefix namespace '" + ns.name + "'"));
  }
  server::Server* srvp = &srv;
  kvprefix::Open(
      srv, shard, ns, [srvp, &shard, ns, layer, model, position, deadline, done](const Status& w) {
        if (!w.ok()) return done(w);
        store::PrefixEntry* e = shard.store().prefixes.Find(ns);
        if (e == nullptr) return done(Error("namespace '" + ns.name + "' was dropped meanwhile"));
        const store::PrefixManifest& m = e->manifest;
        if ((model && *model != m.model) || (position && *position != m.position)) {
          return done(Status(ErrorKind::kMismatch, "namespace '" + ns.name + "' holds " +
                                                       m.Describe() + ", not model '" +
                                                       model.value_or(m.model) + "' position '" +
                                                       position.value_or(m.position) + "'"));
        }
        if (layer >= m.n_layers) {
          return done(Error("layer " + std::to_string(layer) + " is out of range: namespace '" +
                            ns.name + "' has " + std::to_string(m.n_layers) + " layers"));
        }
        if (m.mla()) {
          Status shape = CheckMlaShape(m.kv_lora_rank, m.rope_dim, "namespace '" + ns.name + "'");
          if (!shape.ok()) return done(shape);
        } else if (std::find(std::begin(kHeadDims), std::end(kHeadDims), m.head_dim) ==
                   std::end(kHeadDims)) {
          return done(Error("namespace '" + ns.name + "' has head_dim " +
                            std::to_string(m.head_dim) +
                            "; attention needs one of 32, 64, 96, 128, 160, 192, 256, 512"));
        }
        auto sessions = kvprefix::SessionsOf(shard, ns.tenant, ns.name, m);
        if (!kvprefix::Complete(sessions, m)) {
          return done(Error("namespace '" + ns.name + "' is not complete (rows missing in its " +
                            (m.mla() ? "latent session" : "K or V sessions") +
                            "); a half-written prefix is never bound"));
        }
        auto src = std::make_shared<Source>();
        src->manifest = m;
        src->publication = shard.store().prefixes.Publish(e);
        src->k = sessions.parts[0]->TakeSnapshot();  // an MLA namespace: its latent rows
        if (!m.mla()) src->v = sessions.parts[1]->TakeSnapshot();
        src->codec = sessions.parts[0]->codec();
        // The layer's chunks (ids [layer*T, (layer+1)*T) of each session), in memory.
        std::vector<residency::ObjectRef> objs;
        const int64_t first = int64_t{layer} * m.n_tokens, last = first + m.n_tokens - 1;
        for (const auto* snap : {&src->k, &src->v}) {
          for (int64_t c = first / store::kRowsPerChunk; c <= last / store::kRowsPerChunk; ++c) {
            auto it = snap->chunks.find(c);
            if (it != snap->chunks.end()) objs.push_back(it->second->obj);
          }
        }
        srvp->residency()->Require(std::move(objs), residency::Tier::kHost, deadline,
                                   [src, done](const Status& s, residency::PinSet pins) {
                                     if (!s.ok()) return done(s);
                                     src->pins =
                                         std::make_shared<residency::PinSet>(std::move(pins));
                                     done(src);
                                   });
      });
}

// Runs on a compute thread: an MLA namespace's layer `layer` into the slot's latent block: its
// stored rows copied as they are (the slot keeps the namespace's codec), or, for fp32 under
// --attention-fp16, decoded and stored as fp16.
void CopyLatentLayer(server::WorkerPool& pool, const Source& src, uint32_t layer,
                     const attention::Slot& slot, const BufferRef& dst) {
  const uint32_t T = src.manifest.n_tokens, dk = slot.d;
  store::VSession ls(src.codec, nullptr);
  ls.Restore(src.k);
  const int64_t base = int64_t{layer} * T;
  store::VSession::HostView view;  // pinned in memory by PrepareSource
  std::vector<residency::ObjectRef> missing;
  ls.ViewRange(base, base + T, &view, &missing);
  const bool same = LatentCodec(slot.latent) == src.codec.format();
  const size_t rb = slot.bytes_each() / T;
  const uint32_t pieces = std::max<uint32_t>(1, std::min<uint32_t>(pool.threads(), T / 256));
  pool.ParallelFor(pieces, [&](size_t p) {
    const uint32_t t_begin = static_cast<uint32_t>(uint64_t{T} * p / pieces);
    const uint32_t t_end = static_cast<uint32_t>(uint64_t{T} * (p + 1) / pieces);
    constexpr uint32_t kStep = store::kRowsPerChunk;
    std::vector<int64_t> ids(kStep);
    std::vector<float> rows(size_t{kStep} * dk);
    for (uint32_t t0 = t_begin; t0 < t_end; t0 += kStep) {
      const uint32_t n = std::min(kStep, t_end - t0);
      uint8_t* out = dst->data() + size_t{t0} * rb;
      if (same) {
        for (uint32_t t = 0; t < n; ++t) ids[t] = base + t0 + t;
        ls.RawIds(view, ids.data(), n, out);
      } else {
        ls.DecodeRange(view, base + t0, base + t0 + n, rows.data());
        ConvertRows(rows.data(), n, dk, kernels::DType::kF16, out);
      }
    }
  });
}

// Runs on a compute thread: decodes layer `layer` of the source (token-major rows of
// kv_heads*head_dim) into head-major [H][T][D] slot buffers of the storage type. An fp8
// source into an fp8 slot is not decoded: each token's e4m3 bytes are moved to their heads'
// rows as they are, and its scale (one per token row of the namespace) becomes the scale of
// each of its heads' rows.
void DecodeLayer(server::WorkerPool& pool, const Source& src, uint32_t layer,
                 const attention::Slot& slot, const BufferRef& k, const BufferRef& v) {
  const store::PrefixManifest& m = src.manifest;
  const uint32_t H = m.kv_heads, T = m.n_tokens, D = m.head_dim;
  store::VSession ks(src.codec, nullptr), vs(src.codec, nullptr);
  ks.Restore(src.k);
  vs.Restore(src.v);
  const int64_t base = int64_t{layer} * T;
  store::VSession::HostView kview, vview;  // pinned in memory by PrepareSource
  std::vector<residency::ObjectRef> missing;
  ks.ViewRange(base, base + T, &kview, &missing);
  vs.ViewRange(base, base + T, &vview, &missing);
  const size_t esize = kernels::DTypeSize(slot.dtype);
  const uint32_t pieces = std::max<uint32_t>(1, std::min<uint32_t>(pool.threads(), T / 256));
  if (slot.dtype == kernels::DType::kFP8) {
    const size_t rb = src.codec.row_bytes();  // 4 + H*D
    pool.ParallelFor(pieces, [&](size_t p) {
      const uint32_t t_begin = static_cast<uint32_t>(uint64_t{T} * p / pieces);
      const uint32_t t_end = static_cast<uint32_t>(uint64_t{T} * (p + 1) / pieces);
      constexpr uint32_t kStep = store::kRowsPerChunk;
      std::vector<int64_t> ids(kStep);
      std::vector<uint8_t> raw(kStep * rb);
      for (uint32_t t0 = t_begin; t0 < t_end; t0 += kStep) {
        const uint32_t n = std::min(kStep, t_end - t0);
        for (uint32_t t = 0; t < n; ++t) ids[t] = base + t0 + t;
        for (int kv = 0; kv < 2; ++kv) {
          (kv == 0 ? ks : vs).RawIds(kv == 0 ? kview : vview, ids.data(), n, raw.data());
          uint8_t* dst = (kv == 0 ? k : v)->data();
          uint8_t* scales = dst + size_t{H} * T * D;
          for (uint32_t h = 0; h < H; ++h) {
            for (uint32_t t = 0; t < n; ++t) {
              const uint8_t* row = raw.data() + t * rb;
              std::memcpy(dst + (size_t{h} * T + t0 + t) * D, row + 4 + size_t{h} * D, D);
              std::memcpy(scales + (size_t{h} * T + t0 + t) * 4, row, 4);
            }
          }
        }
      }
    });
    return;
  }
  pool.ParallelFor(pieces, [&](size_t p) {
    const uint32_t t_begin = static_cast<uint32_t>(uint64_t{T} * p / pieces);
    const uint32_t t_end = static_cast<uint32_t>(uint64_t{T} * (p + 1) / pieces);
    constexpr uint32_t kStep = store::kRowsPerChunk;
    std::vector<float> rows(size_t{kStep} * H * D), head(size_t{kStep} * D);
    for (uint32_t t0 = t_begin; t0 < t_end; t0 += kStep) {
      const uint32_t n = std::min(kStep, t_end - t0);
      for (int kv = 0; kv < 2; ++kv) {
        (kv == 0 ? ks : vs)
            .DecodeRange(kv == 0 ? kview : vview, base + t0, base + t0 + n, rows.data());
        uint8_t* dst = (kv == 0 ? k : v)->data();
        for (uint32_t h = 0; h < H; ++h) {
          for (uint32_t t = 0; t < n; ++t) {
            std::memcpy(head.data() + size_t{t} * D, rows.data() + (size_t{t} * H + h) * D,
                        D * sizeof(float));
          }
          ConvertRows(head.data(), n, D, slot.dtype, dst + (size_t{h} * T + t0) * D * esize);
        }
      }
    }
  });
}

// ATTEND.PREFIX.STORE <sid> <layer> FROM <ns> [MODEL <id>] [POSITION <digest>]
void StoreFrom(CommandContext& ctx, CmdArgs& args) {
  uint32_t layer;
  Status s = ParseLayer(args[2], &layer);
  if (!s.ok()) return ctx.Error(s);
  std::optional<std::string> model, position;
  for (size_t i = 5; i < args.size(); i += 2) {
    if (i + 1 >= args.size()) {
      return ctx.Error(Error("option '" + std::string(args[i].substr(0, 32)) + "' needs a value"));
    }
    if (EqualsIgnoreCase(args[i], "MODEL")) {
      model = std::string(args[i + 1]);
    } else if (EqualsIgnoreCase(args[i], "POSITION")) {
      position = std::string(args[i + 1]);
    } else {
      return ctx.Error(Error("unknown option '" + std::string(args[i].substr(0, 32)) +
                             "'; expected MODEL or POSITION"));
    }
  }
  server::Server* srv = ctx.server;
  const store::TenantKey sid = ctx.Key(args[1]);
  const store::TenantKey ns = ctx.Key(args[4]);
  const int sid_shard = ctx.shard->id();
  auto reply = ctx.Defer();
  auto fail = [reply](Status st) { reply([st](proto::ReplyBuilder& rb) { rb.Error(st); }); };

  // Step 2, on the session's shard: reserve and allocate, then decode on a compute thread, then
  // publish back on this shard.
  const residency::Deadline deadline = ctx.deadline;
  auto build = [srv, sid, layer, sid_shard, reply, fail, deadline,
                ns](std::shared_ptr<Source> src) {
    const store::PrefixManifest& m = src->manifest;
    auto slot = std::make_shared<attention::Slot>();
    slot->heads = m.kv_heads;
    slot->rows = m.n_tokens;
    slot->d = m.head_dim;
    slot->dtype = StorageType(*srv, src->codec.format());
    slot->gpu = srv->gpu_attention();
    if (m.mla()) {  // one latent block; computed on the CPU under every backend
      slot->mla = true;
      slot->dv = m.kv_lora_rank;
      slot->latent = LatentStorage(*srv, src->codec.format());
      slot->dtype = kernels::DType::kF32;
      slot->gpu = false;
    }
    slot->source = ns.name + "@" + std::to_string(src->publication);
    ChargeHostLater(*srv, residency::Family::kAttention, slot->bytes(), deadline,
                    [srv, src, slot, sid, layer, sid_shard, reply, fail,
                     deadline](StatusOr<std::unique_ptr<Charge>> charge) {
                      if (!charge.ok()) return fail(charge.status());
                      auto kb = HostAllocator(*slot)->Allocate(slot->bytes_each());
                      auto vb = slot->mla ? StatusOr<BufferRef>(BufferRef())
                                          : HostAllocator(*slot)->Allocate(slot->bytes_each());
                      if (!kb.ok() || !vb.ok()) return fail(kb.ok() ? vb.status() : kb.status());
                      auto held =
                          std::make_shared<std::unique_ptr<Charge>>(std::move(charge).value());
                      BufferRef k = std::move(kb).value(), v = std::move(vb).value();
                      bool queued = srv->compute()->Submit(
                          [srv, src, slot, sid, layer, sid_shard, reply, deadline, held, k, v]() {
                            std::vector<BufferRef> blocks = {k};
                            if (slot->mla) {
                              CopyLatentLayer(*srv->compute(), *src, layer, *slot, k);
                            } else {
                              DecodeLayer(*srv->compute(), *src, layer, *slot, k, v);
                              blocks.push_back(v);
                            }
                            src->pins.reset();  // the namespace's chunks may leave memory again
                            slot->obj = srv->residency()->CreateInHost(
                                residency::Family::kAttention, std::move(blocks), std::move(*held),
                                HostAllocator(*slot));
                            Finish(srv, sid_shard, slot, sid, layer, true, deadline, reply);
                          });
                      if (!queued) {
                        srv->shard(sid_shard).stats().Reject(server::RejectReason::kBusy);
                        fail(Status(ErrorKind::kBusy, "the compute queue is full; retry later"));
                      }
                    });
  };

  // Step 1, on the namespace's shard.
  auto prepare = [srv, ns, layer, model, position, deadline, sid_shard, build,
                  fail](server::Shard& nss) {
    PrepareSource(
        *srv, nss, ns, layer, model, position, deadline,
        [srv, sid_shard, build, fail](StatusOr<std::shared_ptr<Source>> src) {
          if (!src.ok()) return fail(src.status());
          auto ready = std::move(src).value();
          srv->shard(sid_shard).PostControl([build, ready](server::Shard&) { build(ready); });
        });
  };
  const int ns_shard = srv->OwnerOf(ns.tenant, ns.name);
  if (ns_shard == sid_shard) return prepare(*ctx.shard);
  if (!srv->shard(ns_shard).Post(prepare)) {
    ctx.shard->stats().Reject(server::RejectReason::kBusy);
    fail(Status(ErrorKind::kBusy,
                "shard " + std::to_string(ns_shard) + " inbox is full; retry later"));
  }
}

void Store(CommandContext& ctx, CmdArgs& args) {
  if (args.size() >= 5 && EqualsIgnoreCase(args[3], "FROM")) return StoreFrom(ctx, args);
  const bool mla = args.size() >= 4 && EqualsIgnoreCase(args[3], "MLA");
  if (args.size() != 8 && args.size() != 10) {
    return ctx.Error(Error(
        "wrong number of arguments for 'attend.prefix.store': expected <sid> <layer> <H> <N> <D> "
        "<K_blob> <V_blob> [DTYPE fp32|fp16|bf16|fp8] or <sid> <layer> MLA <N> <kv_lora_rank> "
        "<rope_dim> <latent_blob> [DTYPE fp32|fp16|bf16|fp8|fp8_ds_mla] or <sid> <layer> FROM "
        "<ns> [MODEL <id>] [POSITION <digest>]"));
  }
  if (mla) return StoreMlaBlobs(ctx, args);
  StoreBlobs(ctx, args);
}

void Lookup(CommandContext& ctx, CmdArgs& args) {
  uint32_t layer;
  Status s = ParseLayer(args[2], &layer);
  if (!s.ok()) return ctx.Error(s);
  const bool hit = ctx.shard->store().attention.Find(ctx.Key(args[1]), layer) != nullptr;
  ctx.rb->SimpleString(hit ? "HIT" : "MISS");
}

constexpr const char* kDirName = "attention";

std::string SlotObjectName(server::Server& srv, const store::TenantKey& sid, uint32_t layer) {
  return store::SavedObjectName("attention", srv.users().TenantName(sid.tenant),
                                sid.name + std::string(1, '\0') + std::to_string(layer));
}

void Drop(CommandContext& ctx, CmdArgs& args) {
  std::optional<uint32_t> layer;
  if (args.size() == 3) {
    uint32_t l;
    Status s = ParseLayer(args[2], &l);
    if (!s.ok()) return ctx.Error(s);
    layer = l;
  }
  const store::TenantKey sid = ctx.Key(args[1]);
  auto& slots = ctx.shard->store().attention;
  // Saved copies go too: a dropped slot leaves nothing behind, in memory or on disk.
  std::vector<std::pair<uint32_t, uint64_t>> saved;  // layer, version
  for (const auto& [l, slot] : slots.Layers(sid)) {
    const auto* sv = slots.SavedOf(sid, l);
    if ((layer && l != *layer) || sv == nullptr) continue;
    Status s = store::disk::RemoveObject(SavedDir(*ctx.server, kDirName),
                                         SlotObjectName(*ctx.server, sid, l));
    if (!s.ok()) return ctx.Error(s);
    saved.emplace_back(l, sv->version);
  }
  const int64_t dropped = static_cast<int64_t>(slots.Drop(sid, layer));
  if (saved.empty() || !cluster_sync::Enabled(*ctx.server)) return ctx.rb->Integer(dropped);
  // Cluster mode: acknowledged once the replicas dropped their copies too.
  auto done = cluster_sync::Gather(
      saved.size(), cluster_sync::AnswerWith(
                        ctx.Defer(), [dropped](proto::ReplyBuilder& rb) { rb.Integer(dropped); }));
  const std::string tenant = ctx.server->users().TenantName(sid.tenant);
  for (const auto& [l, version] : saved) {
    cluster_sync::ReplicateDrop(*ctx.server, {"ATTENTION", tenant, sid.name, std::to_string(l)},
                                version, done);
  }
}

using SavedFile = StatusOr<std::pair<std::string, uint64_t>>;

// One layer's slot as of now, durable (K and V as the two blocks of one object file, taken
// from whichever tier holds them): `done` runs on the shard with the file and its version.
// Runs on the owning shard.
void SaveLayer(server::Server& srv, server::Shard& shard, const store::TenantKey& sid,
               uint32_t layer, attention::SlotRef slot, std::function<void(SavedFile)> done) {
  auto& slots = shard.store().attention;
  if (const auto* saved = slots.SavedOf(sid, layer);
      saved != nullptr && saved->generation == slot->generation) {
    return done(std::make_pair(saved->file->path(), saved->version));
  }
  store::SavedRecord rec;
  rec.kind = "attention";
  rec.Set("tenant", srv.users().TenantName(sid.tenant));
  rec.Set("sid", sid.name);
  rec.SetUint("layer", layer);
  rec.SetUint("heads", slot->heads);
  rec.SetUint("rows", slot->rows);
  rec.SetUint("head_dim", slot->d);
  rec.Set("dtype", std::string(slot->dtype_name()));
  if (slot->mla) {  // absent: a per-head slot (every file written before MLA slots)
    rec.Set("layout", "mla");
    rec.SetUint("kv_lora_rank", slot->dv);
  }
  rec.SetUint("generation", slot->generation);
  rec.Set("source", slot->source);
  const uint64_t version = slots.NextVersion(sid, layer);
  const uint64_t generation = slot->generation;
  server::Server* srvp = &srv;
  server::Shard* owner = &shard;
  const std::string dir = SavedDir(srv, kDirName);
  auto items = std::vector<residency::Engine::SaveItem>{{"", slot->obj}};
  auto job = [=]() {
    std::vector<std::vector<uint32_t>> blocks;
    auto file = srvp->residency()->WriteSaved(dir, SlotObjectName(*srvp, sid, layer), version,
                                              store::EncodeSavedRecord(rec), items, &blocks);
    owner->PostControl([=](server::Shard& sh) {
      if (!file.ok()) {
        srvp->disk_stats().save_failures.fetch_add(1);
        return done(file.status());
      }
      srvp->residency()->AttachDisk(items[0].obj, items[0].obj->generation(), file.value(),
                                    blocks[0]);
      srvp->disk_stats().saves.fetch_add(1);
      attention::SlotRef cur = sh.store().attention.Find(sid, layer);
      if (cur == nullptr) {
        unlink(file.value()->path().c_str());  // dropped meanwhile: the drop wins
        return done(Status(ErrorKind::kMiss,
                           "attention slot for session '" + sid.name.substr(0, 128) + "' layer " +
                               std::to_string(layer) + " was dropped during the save"));
      }
      if (cur->generation == generation) {
        sh.store().attention.SetSaved(sid, layer, {file.value(), version, generation});
      }
      done(std::make_pair(file.value()->path(), version));
    });
  };
  if (!srv.io()->Submit(std::move(job))) {
    done(Status(ErrorKind::kBusy, "the disk I/O queue is full; retry later"));
  }
}

// ATTEND.PREFIX.SAVE <sid> [<layer>]: the slot (or every layer of the session) durably on
// disk, one crash-safe object file per layer; replies once all are (in cluster mode, once the
// replicas hold them too). Saved slots come back after a restart with their generation, and
// answer bit-identically.
void Save(CommandContext& ctx, CmdArgs& args) {
  const store::TenantKey sid = ctx.Key(args[1]);
  auto& slots = ctx.shard->store().attention;
  std::vector<std::pair<uint32_t, attention::SlotRef>> layers;
  if (args.size() == 3) {
    uint32_t l;
    Status s = ParseLayer(args[2], &l);
    if (!s.ok()) return ctx.Error(s);
    auto found = FindSlot(ctx, args[1], l);
    if (!found.ok()) return ctx.Error(found.status());
    layers.emplace_back(l, std::move(found).value());
  } else {
    layers = slots.Layers(sid);
    if (layers.empty()) {
      return ctx.Error(Status(ErrorKind::kMiss, "no attention slots for session '" +
                                                    std::string(args[1].substr(0, 128)) + "'"));
    }
  }
  server::Server* srv = ctx.server;
  const bool cluster = cluster_sync::Enabled(*srv);
  // Only what changed since its last save (in cluster mode each copy is sent again: a failed
  // one is retried; a replica that has it answers at once).
  if (!cluster) {
    std::erase_if(layers, [&](const auto& e) {
      const auto* saved = slots.SavedOf(sid, e.first);
      return saved != nullptr && saved->generation == e.second->generation;
    });
    if (layers.empty()) return ctx.rb->Ok();
  }
  auto done = cluster_sync::Gather(
      layers.size(),
      cluster_sync::AnswerWith(ctx.Defer(), [](proto::ReplyBuilder& rb) { rb.Ok(); }));
  const std::string tenant = srv->users().TenantName(sid.tenant);
  for (const auto& [layer, slot] : layers) {
    const uint32_t l = layer;
    SaveLayer(*srv, *ctx.shard, sid, l, slot, [srv, sid, l, tenant, cluster, done](SavedFile f) {
      if (!f.ok() || !cluster) return done(f.status());
      cluster_sync::ReplicateSaved(*srv, {"ATTENTION", tenant, sid.name, std::to_string(l)},
                                   f->second, f->first, done);
    });
  }
}

// Installs the saved file of version `version` as its slot, known by its disk copy (a query
// promotes it), with its generation (every new one is above it), on the shard that owns it
// (replacing a slot held there). With `expect`, the file must be that session's layer
// `expect_layer`. Runs at start-up (main thread) or on the owning shard.
Status Adopt(server::Server& srv, uint64_t version,
             const std::shared_ptr<residency::DiskFile>& file, const store::TenantKey* expect,
             uint32_t expect_layer) {
  auto rec = store::DecodeSavedRecord(file->file().meta(), "attention");
  if (!rec.ok()) return rec.status();
  auto tenant = rec->Get("tenant");
  auto sid = rec->Get("sid");
  auto dtype = rec->Get("dtype");
  auto layer = rec->GetUint("layer");
  auto heads = rec->GetUint("heads");
  auto rows = rec->GetUint("rows");
  auto d = rec->GetUint("head_dim");
  auto gen = rec->GetUint("generation");
  for (const Status* x : {&tenant.status(), &sid.status(), &dtype.status(), &layer.status(),
                          &heads.status(), &rows.status(), &d.status(), &gen.status()}) {
    if (!x->ok()) return *x;
  }
  auto slot = std::make_shared<attention::Slot>();
  slot->heads = static_cast<uint32_t>(heads.value());
  slot->rows = static_cast<uint32_t>(rows.value());
  slot->d = static_cast<uint32_t>(d.value());
  bool typed = false;
  if (rec->Get("layout").ok() && rec->Get("layout").value() == "mla") {
    auto rank = rec->GetUint("kv_lora_rank");
    if (!rank.ok()) return rank.status();
    slot->mla = true;
    slot->dv = static_cast<uint32_t>(rank.value());
    for (auto t : {kernels::LatentType::kF32, kernels::LatentType::kF16, kernels::LatentType::kBF16,
                   kernels::LatentType::kFP8, kernels::LatentType::kFP8DsMla}) {
      if (dtype.value() == kernels::LatentTypeName(t)) slot->latent = t, typed = true;
    }
    typed = typed && slot->heads == 1 && slot->dv > 0 && slot->dv <= slot->d &&
            CheckMlaShape(slot->dv, slot->d - slot->dv, "it").ok();
  } else {
    typed = kernels::ParseDType(dtype.value(), &slot->dtype);
  }
  bool fits = typed && file->file().block_count() == slot->blocks();
  for (size_t b = 0; fits && b < slot->blocks(); ++b) {
    fits = file->file().block_length(b) == slot->bytes_each();
  }
  if (!fits) return Status(ErrorKind::kCorrupt, "its blocks do not match its shape");
  const uint32_t tid = srv.users().TenantId(tenant.value());
  const store::TenantKey key{tid, sid.value()};
  const uint32_t l = static_cast<uint32_t>(layer.value());
  if (expect != nullptr && (!(key == *expect) || l != expect_layer)) {
    return Status(ErrorKind::kCorrupt,
                  "it holds session '" + key.name.substr(0, 64) + "' layer " + std::to_string(l));
  }
  slot->gpu = srv.gpu_attention() && !slot->mla;
  slot->generation = gen.value();
  slot->source = rec->Get("source").ok() ? rec->Get("source").value() : std::string();
  slot->obj =
      slot->mla ? srv.residency()->CreateOnDisk(residency::Family::kAttention, {slot->bytes_each()},
                                                file, {0}, HostAllocator(*slot))
                : srv.residency()->CreateOnDisk(residency::Family::kAttention,
                                                {slot->bytes_each(), slot->bytes_each()}, file,
                                                {0, 1}, HostAllocator(*slot));
  attention::NoteSlotGeneration(slot->generation);
  auto& slots = srv.shard(srv.OwnerOf(tid, key.name)).store().attention;
  std::string old_path;
  if (const auto* old = slots.SavedOf(key, l)) old_path = old->file->path();
  slots.NoteVersion(key, l, version);
  slots.Publish(key, l, slot);
  slots.SetSaved(key, l, {file, version, slot->generation});
  if (!old_path.empty() && old_path != file->path()) unlink(old_path.c_str());
  return Status::Ok();
}

// Start-up: saved slots come back on their sessions' shards, known by their disk copies.
Status LoadSaved(server::Server& srv) {
  return LoadSavedObjects(
      srv, SavedDir(srv, kDirName), "attention slot",
      [&](const store::disk::ListedObject& o, const std::shared_ptr<residency::DiskFile>& file) {
        return Adopt(srv, o.version, file, nullptr, 0);
      });
}

cluster_sync::HeldObject HeldOf(server::Server& srv, const store::TenantKey& sid, uint32_t layer,
                                const attention::SlotRef& slot,
                                const attention::SlotStore::Saved* saved) {
  const bool current = saved != nullptr && saved->generation == slot->generation;
  return {sid,
          srv.users().TenantName(sid.tenant),
          std::to_string(layer),
          saved != nullptr ? saved->version : 0,
          saved != nullptr ? saved->file->path() : std::string(),
          !current,
          false,
          slot->bytes()};
}

// A copy's layer ("part" on the wire).
bool LayerOf(const std::string& part, uint32_t* layer) {
  int64_t v = 0;
  if (!ParseInt64(part, &v) || v < 0 || v > UINT32_MAX) return false;
  *layer = static_cast<uint32_t>(v);
  return true;
}

Status CheckCopy(server::Shard& sh, const store::TenantKey& sid, const std::string& part,
                 uint64_t version) {
  uint32_t l = 0;
  if (!LayerOf(part, &l)) {
    return Error("an attention slot copy needs its layer as its part, got '" + part.substr(0, 32) +
                 "'");
  }
  auto& slots = sh.store().attention;
  attention::SlotRef slot = slots.Find(sid, l);
  if (slot == nullptr) return Status::Ok();
  const auto* saved = slots.SavedOf(sid, l);
  if (saved != nullptr && saved->version >= version) {
    return Status(ErrorKind::kMismatch, "stale: attention slot '" + sid.name.substr(0, 128) +
                                            "' layer " + part + " is at version " +
                                            std::to_string(saved->version) + " here, not below " +
                                            std::to_string(version));
  }
  if (saved == nullptr || saved->generation != slot->generation) {
    return Status(ErrorKind::kBusy, "attention slot '" + sid.name.substr(0, 128) + "' layer " +
                                        part + " was stored on this node meanwhile; not replaced");
  }
  return Status::Ok();
}

// ATTEND.PREFIX slots as cluster mode copies and moves them (cluster_internal.h): one object
// per layer, the layer its part.
cluster_sync::SavedKind SavedKindOf() {
  using cluster_sync::HeldObject;
  cluster_sync::SavedKind k;
  k.name = "ATTENTION";
  k.held = [](server::Server& srv, server::Shard& sh) {
    std::vector<HeldObject> out;
    sh.store().attention.ForEach([&](const store::TenantKey& sid, uint32_t l,
                                     const attention::SlotRef& slot,
                                     const attention::SlotStore::Saved* saved) {
      out.push_back(HeldOf(srv, sid, l, slot, saved));
    });
    return out;
  };
  k.find = [](server::Server& srv, server::Shard& sh, const store::TenantKey& sid,
              const std::string& part) -> std::optional<HeldObject> {
    uint32_t l = 0;
    if (!LayerOf(part, &l)) return std::nullopt;
    attention::SlotRef slot = sh.store().attention.Find(sid, l);
    if (slot == nullptr) return std::nullopt;
    return HeldOf(srv, sid, l, slot, sh.store().attention.SavedOf(sid, l));
  };
  k.file_of = [](server::Server& srv, const cluster_sync::ObjectId& id) {
    return std::make_pair(
        SavedDir(srv, kDirName),
        store::SavedObjectName("attention", id.tenant, id.key + std::string(1, '\0') + id.part));
  };
  k.check = [](server::Server&, server::Shard& sh, const store::TenantKey& sid,
               const std::string& part,
               uint64_t version) { return CheckCopy(sh, sid, part, version); };
  k.install = [](server::Server& srv, server::Shard& sh, const store::TenantKey& sid,
                 const std::string& part, uint64_t version, const std::string& path) {
    uint32_t l = 0;
    LayerOf(part, &l);  // CheckCopy refuses a part that is not a layer
    return InstallSavedCopy(
        srv, path, "attention slot '" + sid.name.substr(0, 128) + "' layer " + part,
        [&] { return CheckCopy(sh, sid, part, version); },
        [&](const auto& file) { return Adopt(srv, version, file, &sid, l); });
  };
  k.discard = [](server::Server& srv, server::Shard& sh, const store::TenantKey& sid,
                 const std::string& part, uint64_t max_version) {
    uint32_t l = 0;
    if (!LayerOf(part, &l)) return Status::Ok();
    auto& slots = sh.store().attention;
    if (slots.Find(sid, l) == nullptr) return Status::Ok();
    const auto* saved = slots.SavedOf(sid, l);
    if (max_version != 0 && saved != nullptr && saved->version > max_version) return Status::Ok();
    if (saved != nullptr) {
      Status s = store::disk::RemoveObject(SavedDir(srv, kDirName), SlotObjectName(srv, sid, l));
      if (!s.ok()) return s;
    }
    slots.Drop(sid, l);
    return Status::Ok();
  };
  k.save_for_move = [](server::Server& srv, server::Shard& sh, const store::TenantKey& sid,
                       const std::string& part, std::function<void(SavedFile)> done) {
    uint32_t l = 0;
    attention::SlotRef slot = LayerOf(part, &l) ? sh.store().attention.Find(sid, l) : nullptr;
    if (slot == nullptr) {
      return done(Status(ErrorKind::kMiss, "attention slot '" + sid.name.substr(0, 128) +
                                               "' layer " + part + " is gone"));
    }
    SaveLayer(srv, sh, sid, l, std::move(slot), std::move(done));
  };
  return k;
}

// Four map entries: heads, rows, head_dim, dtype.
void WriteShape(proto::ReplyBuilder& rb, const attention::Slot& slot) {
  rb.Bulk("heads");
  rb.Integer(slot.heads);
  rb.Bulk("rows");
  rb.Integer(slot.rows);
  rb.Bulk("head_dim");
  rb.Integer(slot.d);
  rb.Bulk("dtype");
  rb.Bulk(slot.dtype_name());
}

// One exported layer, pinned and leased (see Export), with what both reply forms tell of it.
struct Exported {
  attention::SlotRef slot;
  std::string handle;
  uint64_t lease = 0;
  uint64_t v_offset = 0;  // V's bytes after K's in the allocation
  uint64_t bytes = 0;     // of K (= of V)
};

// The PACKED form's record of one exported layer: kPackedExportBytes little-endian bytes.
//   0 handle[64]   64 device (PCI bus id, NUL-padded)[16]   80 k_offset u64   88 v_offset u64
//   96 bytes u64   104 heads u32   108 rows u32   112 head_dim u32   116 dtype u32 (0 fp32,
//   1 fp16, 2 bf16, 3 fp8: bytes then scales)   120 generation u64   128 lease u64   136 ttl_ms u64
//   144 zero[16]
constexpr size_t kPackedExportBytes = 160;

void PackExport(const Exported& e, uint64_t ttl_ms, uint8_t* out) {
  const attention::Slot& slot = *e.slot;
  std::memset(out, 0, kPackedExportBytes);
  std::memcpy(out, e.handle.data(), std::min<size_t>(e.handle.size(), 64));
  const std::string& bus = gpu::Info().pci_bus_id;
  std::memcpy(out + 64, bus.data(), std::min<size_t>(bus.size(), 15));
  auto u64 = [out](size_t at, uint64_t x) { std::memcpy(out + at, &x, 8); };
  auto u32 = [out](size_t at, uint32_t x) { std::memcpy(out + at, &x, 4); };
  u64(80, 0);
  u64(88, e.v_offset);
  u64(96, e.bytes);
  u32(104, slot.heads);
  u32(108, slot.rows);
  u32(112, slot.d);
  u32(116, static_cast<uint32_t>(slot.dtype));
  u64(120, slot.generation);
  u64(128, e.lease);
  u64(136, ttl_ms);
}

// ATTEND.PREFIX.EXPORT <sid> <layer> [<layer> ...] [PACKED]: CUDA IPC handles to the slots' GPU
// copies for a process on the same host and GPU (Unix socket only, the caller's tenant only).
// Each copy is pinned under its own lease — neither evicted nor freed, even if the slot is
// replaced or dropped — until SHM.RELEASE, the connection closes, or --shm-lease-ttl-ms passes.
// Several layers are one command (one hop to the session's shard); all or nothing: when one
// cannot be exported, the leases already granted are released and its error is the reply.
// PACKED: one bulk of fixed records (PackExport) instead of maps — cheap to parse for a client
// that exports every layer of a model per request.
void Export(CommandContext& ctx, CmdArgs& args) {
  const bool packed = args.size() > 3 && EqualsIgnoreCase(args[args.size() - 1], "PACKED");
  std::vector<uint32_t> layers(args.size() - 2 - (packed ? 1 : 0));
  for (size_t i = 0; i < layers.size(); ++i) {
    Status s = ParseLayer(args[i + 2], &layers[i]);
    if (!s.ok()) return ctx.Error(s);
  }
  if (!ctx.unix_socket) {
    return ctx.Error(Error(
        "ATTEND.PREFIX.EXPORT is for same-host clients: connect over the --unixsocket socket"));
  }
  server::Server& srv = *ctx.server;
  if (!srv.gpu_attention()) {
    return ctx.Error(
        Error("ATTEND.PREFIX.EXPORT needs slots on the GPU (--attention-backend "
              "cuda); this server keeps them in host memory"));
  }
  std::vector<attention::SlotRef> slots;
  std::vector<residency::ObjectRef> objs;
  for (uint32_t layer : layers) {
    auto found = FindSlot(ctx, args[1], layer);
    if (!found.ok()) return ctx.Error(found.status());
    if (found.value()->mla) {
      return ctx.Error(Error("the slot of session '" + std::string(args[1].substr(0, 128)) +
                             "' layer " + std::to_string(layer) +
                             " holds MLA latents, which stay in host memory and are computed on "
                             "the CPU (no CUDA MLA kernel yet): it has no GPU copy to export"));
    }
    objs.push_back(found.value()->obj);
    slots.push_back(std::move(found).value());
  }
  // Every layer on the GPU first (promoted from host or disk when it was demoted).
  if (!ctx.Resident(objs, residency::Tier::kGpu)) return;
  std::vector<Exported> out;
  out.reserve(layers.size());
  auto fail = [&](const Status& s) {
    for (const Exported& e : out) srv.shm().Release(ctx.client_id, e.lease);
    ctx.Error(s);
  };
  for (auto& slot : slots) {
    residency::GpuPin pin = slot->obj->Gpu();  // pinned by Resident(): present
    if (!pin) return fail(Status(ErrorKind::kMiss, "a GPU copy left meanwhile; retry"));
    auto handle = pin->IpcHandle();
    if (!handle.ok()) return fail(handle.status());
    const uint64_t v_offset = static_cast<uint64_t>(static_cast<const uint8_t*>(pin->block(1)) -
                                                    static_cast<const uint8_t*>(pin->block(0)));
    const uint64_t bytes = slot->bytes_each();
    // The lease holds the pin: the copy is neither demoted nor freed until it ends.
    auto lease = srv.shm().Grant(ctx.client_id, {}, slot->bytes(),
                                 std::make_shared<residency::GpuPin>(std::move(pin)));
    if (!lease.ok()) return fail(lease.status());
    out.push_back({std::move(slot), std::move(handle).value(), lease.value(), v_offset, bytes});
  }
  auto& rb = *ctx.rb;
  const uint64_t ttl_ms = static_cast<uint64_t>(srv.shm().lease_ttl().count());
  if (packed) {
    std::string records(out.size() * kPackedExportBytes, '\0');
    for (size_t i = 0; i < out.size(); ++i) {
      PackExport(out[i], ttl_ms,
                 reinterpret_cast<uint8_t*>(records.data()) + i * kPackedExportBytes);
    }
    return rb.Bulk(records);
  }
  if (out.size() > 1) rb.Array(out.size());
  for (const Exported& e : out) {
    rb.Map(12);
    rb.Bulk("handle");
    rb.Bulk(e.handle);
    rb.Bulk("device");
    rb.Bulk(gpu::Info().pci_bus_id);
    rb.Bulk("k_offset");
    rb.Integer(0);
    rb.Bulk("v_offset");
    rb.Integer(static_cast<int64_t>(e.v_offset));
    rb.Bulk("bytes");
    rb.Integer(static_cast<int64_t>(e.bytes));
    WriteShape(rb, *e.slot);
    rb.Bulk("generation");
    rb.Integer(static_cast<int64_t>(e.slot->generation));
    rb.Bulk("lease");
    rb.Integer(static_cast<int64_t>(e.lease));
    rb.Bulk("ttl_ms");
    rb.Integer(static_cast<int64_t>(ttl_ms));
  }
}

void Info(CommandContext& ctx, CmdArgs& args) {
  auto layers = ctx.shard->store().attention.Layers(ctx.Key(args[1]));
  auto& rb = *ctx.rb;
  rb.Array(layers.size());
  for (const auto& [layer, slot] : layers) {
    rb.Map(13);
    rb.Bulk("layer");
    rb.Integer(layer);
    WriteShape(rb, *slot);
    rb.Bulk("layout");  // "heads" (K and V per head) or "mla" (latent rows for every head)
    rb.Bulk(slot->mla ? "mla" : "heads");
    rb.Bulk("kv_lora_rank");
    rb.Integer(slot->mla ? slot->dv : 0);
    rb.Bulk("rope_dim");
    rb.Integer(slot->mla ? slot->d - slot->dv : 0);
    // The fastest tier holding its K and V now (a query brings it to its backend's tier).
    const unsigned tiers = slot->obj->Tiers();
    rb.Bulk("tier");
    rb.Bulk(tiers & 1u ? "gpu" : tiers & 2u ? "host" : "disk");
    rb.Bulk("bytes");
    rb.Integer(static_cast<int64_t>(slot->bytes()));
    rb.Bulk("generation");
    rb.Integer(static_cast<int64_t>(slot->generation));
    rb.Bulk("source");
    rb.Bulk(slot->source);
    rb.Bulk("backend");  // MLA slots: the CPU under every backend (no CUDA MLA kernel yet)
    rb.Bulk(slot->mla ? std::string_view("cpu") : BackendName(*ctx.server));
  }
}

}  // namespace

void RegisterAttendPrefixFamily(server::Server& srv) {
  using namespace server;
  auto& r = srv.registry();
  constexpr uint32_t kKv = kCmdKvCache;
  r.Register(WithOptions(
      {"ATTEND.PREFIX.STORE", -5, kKv | kCmdWrite | kCmdDenyOom | kCmdDeadline, 1, 1, 1, Store,
       "attend_prefix",
       "Makes one layer's K/V (or MLA latent rows) resident for server-side attention (blobs, "
       "or bound from a KV.PREFIX namespace).",
       "<sid> <layer> <H> <N> <D> <K_blob> <V_blob> [DTYPE fp32|fp16|bf16|fp8] | <sid> <layer> "
       "MLA <N> <kv_lora_rank> <rope_dim> <latent_blob> [DTYPE fp32|fp16|bf16|fp8|fp8_ds_mla] | "
       "<sid> <layer> FROM <ns> [MODEL <id>] [POSITION <digest>]"},
      {{"DTYPE", 1}, {"MODEL", 1}, {"POSITION", 1}}));
  r.Register({"ATTEND.PREFIX.LOOKUP", 3, kKv | kCmdReadOnly | kCmdFast, 1, 1, 1, Lookup,
              "attend_prefix", "+HIT when the slot is resident, +MISS otherwise.",
              "<sid> <layer>"});
  r.Register({"ATTEND.PREFIX.DROP", -2, kKv | kCmdWrite, 1, 1, 1, Drop, "attend_prefix",
              "Drops one layer's slot, or every layer of the session (saved copies too); replies "
              "how many.",
              "<sid> [<layer>]"});
  r.Register({"ATTEND.PREFIX.SAVE", -2, kKv | kCmdWrite, 1, 1, 1, Save, "attend_prefix",
              "Makes one layer's slot, or every layer of the session, durable (a crash-safe "
              "object file each); replies once they are on disk.",
              "<sid> [<layer>]"});
  r.Register(WithOptions(
      {"ATTEND.PREFIX.EXPORT", -3, kKv | kCmdReadOnly | kCmdDeadline, 1, 1, 1, Export,
       "attend_prefix",
       "CUDA IPC handles to slots' GPU copies for a same-host process (Unix socket, cuda "
       "backend), each pinned under a lease until SHM.RELEASE; several layers: an array; "
       "PACKED: fixed binary records.",
       "<sid> <layer> [<layer> ...] [PACKED]"},
      {{"PACKED", 0}}));
  r.Register({"ATTEND.PREFIX.INFO", 2, kKv | kCmdReadOnly, 1, 1, 1, Info, "attend_prefix",
              "The session's resident layers: shape, layout, storage type, bytes, generation, "
              "source.",
              "<sid>"});
  RegisterQueryCommands(srv);
  srv.memory().set_family_limit(MemFamily::kAttention, srv.config().attention_memory);
  srv.AddStartupHook(LoadSaved);
  cluster_sync::AddSavedKind(SavedKindOf());
}

}  // namespace pion::families
