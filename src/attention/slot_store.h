// SlotStore: the ATTEND.PREFIX slots a shard owns — one layer's K and V per (session, layer),
// kept where the server attends over them instead of shipping them back.
//
// A slot's K and V are one residency object (residency/object.h) of two blocks: on the GPU
// with the cuda backend, in host memory for the CPU kernels, and on disk when the tiers above
// are full — the engine demotes the least recently used and promotes back on the next query,
// byte for byte, so a slot demoted to disk answers bit-identically. A Slot is immutable once
// published: STORE builds a new one (reserve → copy/convert → validate) and Publish() swaps it
// in, so a query that took the old slot keeps computing on it and never sees a mix.
//
// Block summaries (mean/min/max of K per block of B rows, for QUERY_SPARSE_AUTO) are cached on
// the slot per block size: created on the shard (where their bytes are reserved) and filled once
// by the first query that needs them, on a compute thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"
#include "kernels/attention.h"
#include "kernels/cuda/gpu.h"
#include "residency/disk_file.h"
#include "residency/object.h"
#include "store/tenant_key.h"

namespace pion::attention {

using pion::Charge;

struct Summaries {
  uint32_t block = 0;
  uint32_t nblocks = 0;
  std::vector<float> mean, min, max;  // [heads][nblocks][d] (host slots)
  gpu::DeviceMemory dev;              // GPU slots: mean, min, max back to back
  std::once_flag filled;
  std::atomic<bool> ready{false};  // filled (the cost model counts no build for them then)
  Status fill_status;              // set by the filling query (GPU slots can fail)
  std::unique_ptr<Charge> charge;

  size_t elems() const { return mean.empty() ? dev.size() / (3 * sizeof(float)) : mean.size(); }
  const float* dev_mean() const { return static_cast<const float*>(dev.data()); }
  const float* dev_min() const { return dev_mean() + elems(); }
  const float* dev_max() const { return dev_mean() + 2 * elems(); }

  kernels::BlockSummaries View(uint32_t heads, uint32_t d) {
    return {mean.data(), min.data(), max.data(), heads, nblocks, block, d};
  }
};

struct Slot {
  uint32_t heads = 0;
  uint32_t rows = 0;  // N, prefix tokens
  uint32_t d = 0;     // an MLA slot: dk = kv_lora_rank + rope_dim
  kernels::DType dtype = kernels::DType::kF32;
  // K then V, [heads][rows][d] of dtype each (fp8: the e4m3 bytes, then the f32 row scales
  // [heads][rows]; kernels::MakeTensor): two blocks of one residency object. An MLA slot: one
  // block, the latent rows [rows] in `latent`'s layout (kernels::Latent; heads is 1).
  residency::ObjectRef obj;
  // MLA (DeepSeek's latent rows, shared by every query head): kept in host memory and computed
  // by the CPU kernel under every backend (no CUDA MLA kernel yet).
  bool mla = false;
  uint32_t dv = 0;  // kv_lora_rank: the values of a latent row (d − dv: its RoPE part)
  kernels::LatentType latent = kernels::LatentType::kF32;
  bool gpu = false;         // the cuda backend computes over it (its summaries live there too)
  uint64_t generation = 0;  // unique per published slot, store-wide
  std::string source;       // "" for STORE with blobs; "<ns>@<publication>" for STORE FROM

  // fp8: heads · rows · (d + 4) — the bytes and the scales. MLA: the one latent block.
  uint64_t bytes_each() const {
    return mla ? uint64_t{rows} * kernels::LatentRowBytes(latent, d, dv)
               : kernels::TensorBytes(dtype, heads, rows, d);
  }
  uint64_t bytes() const { return (mla ? 1 : 2) * bytes_each(); }
  size_t blocks() const { return mla ? 1 : 2; }
  // "fp32", "fp16", "bf16", "fp8" (per-head K/V) or the latent type's name (MLA).
  std::string_view dtype_name() const {
    return mla ? kernels::LatentTypeName(latent) : kernels::DTypeName(dtype);
  }
  // A tensor over host bytes of this slot's shape (a block the caller holds).
  kernels::Tensor3 Tensor(const BufferRef& block) const {
    return kernels::MakeTensor(block->data(), dtype, heads, rows, d);
  }
  // An MLA slot's latent rows over its host block.
  kernels::Latent LatentView(const BufferRef& block) const {
    return {block->data(), latent, rows, d, dv};
  }

  // Shard thread only: the summaries for block size b, creating (and charging) them if needed.
  // At most kMaxSummaries block sizes are cached per slot; the least recently used is dropped.
  StatusOr<std::shared_ptr<Summaries>> SummariesFor(uint32_t b, const ByteBudget* budget) const;
  static constexpr size_t kMaxSummaries = 4;

 private:
  mutable std::list<std::shared_ptr<Summaries>> summaries_;  // most recently used first
};

using SlotRef = std::shared_ptr<const Slot>;

// Generations of published slots, unique across shards and restarts.
uint64_t NextSlotGeneration();
// A saved slot's generation found at start-up: every later one is above it.
void NoteSlotGeneration(uint64_t g);

class SlotStore {
 public:
  // Publishes a slot (replacing any previous slot of the same session and layer).
  void Publish(const store::TenantKey& sid, uint32_t layer, SlotRef slot);
  // The slot, or null.
  SlotRef Find(const store::TenantKey& sid, uint32_t layer) const;
  // Drops one layer, or every layer of the session. Returns how many slots were dropped.
  size_t Drop(const store::TenantKey& sid, std::optional<uint32_t> layer);
  // Layers of a session, in order (for ATTEND.PREFIX.INFO).
  std::vector<std::pair<uint32_t, SlotRef>> Layers(const store::TenantKey& sid) const;

  // The durable copy of a layer (ATTEND.PREFIX.SAVE): which file, and the generation of the
  // slot it holds (the slot is saved while its generation matches).
  struct Saved {
    std::shared_ptr<residency::DiskFile> file;
    uint64_t version = 0;
    uint64_t generation = 0;
  };
  // Null when the layer was never saved (or dropped since).
  const Saved* SavedOf(const store::TenantKey& sid, uint32_t layer) const;
  void SetSaved(const store::TenantKey& sid, uint32_t layer, Saved saved);
  uint64_t NextVersion(const store::TenantKey& sid, uint32_t layer) {
    return ++versions_[{sid, layer}];
  }
  void NoteVersion(const store::TenantKey& sid, uint32_t layer, uint64_t v) {
    uint64_t& cur = versions_[{sid, layer}];
    if (v > cur) cur = v;
  }

  // f(sid, layer, slot, saved or null) for every slot of every tenant.
  template <typename F>
  void ForEach(F&& f) const {
    for (const auto& [sid, layers] : sessions_) {
      for (const auto& [l, e] : layers) f(sid, l, e.slot, e.saved ? &*e.saved : nullptr);
    }
  }

  struct Usage {
    uint64_t sessions = 0;
    uint64_t slots = 0;
    uint64_t bytes = 0;  // in whichever tier
  };
  // Readable from any thread.
  Usage Total() const {
    return {sessions_gauge_.load(std::memory_order_relaxed),
            slots_gauge_.load(std::memory_order_relaxed),
            bytes_gauge_.load(std::memory_order_relaxed)};
  }
  Usage UsageOf(uint32_t tenant) const;

 private:
  void PublishGauges();

  struct Entry {
    SlotRef slot;
    std::optional<Saved> saved;
  };
  std::unordered_map<store::TenantKey, std::map<uint32_t, Entry>, store::TenantKeyHash> sessions_;
  std::map<std::pair<store::TenantKey, uint32_t>, uint64_t> versions_;
  uint64_t slots_ = 0;
  uint64_t bytes_ = 0;
  std::atomic<uint64_t> sessions_gauge_{0};
  std::atomic<uint64_t> slots_gauge_{0};
  std::atomic<uint64_t> bytes_gauge_{0};
};

}  // namespace pion::attention
