// PrefixRegistry: the KV.PREFIX namespaces a shard owns, each with an immutable identity
// manifest (seed 004 §0x01): who stored it, for which model, in which layout and codec, under
// which position/RoPE contract, and at which generation.
//
// A namespace's K and V rows live in the V-store sessions "<ns>_pk" and "<ns>_pv" (same
// shard); layer l's rows are ids [l*n_tokens, (l+1)*n_tokens). An MLA namespace (DeepSeek
// V2/V3's Multi-head Latent Attention) has one session instead, "<ns>_pl": per token and layer
// one latent row of kv_lora_rank compressed values then rope_dim decoupled-RoPE key values,
// shared by every head. The layout is part of the identity: a per-head reader never gets an
// MLA namespace's rows, nor an MLA reader a per-head one's. The registry never serves rows
// itself: it decides whether a prefix is complete and whose it is. Generations are fences:
// DROP + REGISTER of the same name gives a higher cache generation, so a reader holding the
// old one is refused. Runs on the owning shard.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "residency/disk_file.h"
#include "store/codec/codec.h"
#include "store/tenant_key.h"

namespace pion::store {

// How a namespace's rows are laid out: per-head K and V, or MLA latents.
enum class PrefixLayout : uint8_t { kHeads, kMla };
std::string_view LayoutName(PrefixLayout l);  // "heads", "mla"

// The session suffixes of each layout, in part order (a saved file's parts).
inline constexpr std::string_view kHeadsSuffixes[] = {"_pk", "_pv"};
inline constexpr std::string_view kMlaSuffixes[] = {"_pl"};

struct PrefixManifest {
  std::string model;     // MODEL id ("" when the client gave none)
  std::string position;  // POSITION / RoPE digest ("" when none)
  uint32_t n_layers = 0;
  uint32_t n_tokens = 0;
  uint32_t kv_heads = 0;  // kMla: 1 (one latent row per token)
  uint32_t head_dim = 0;  // kMla: kv_lora_rank + rope_dim
  codec::Format format = codec::Format::kFp16;
  uint64_t cache_generation = 0;  // bumped by every DROP + REGISTER of the name
  PrefixLayout layout = PrefixLayout::kHeads;
  uint32_t kv_lora_rank = 0;  // kMla: the compressed values of a latent row (its V part)
  uint32_t rope_dim = 0;      // kMla: the decoupled-RoPE key values after them

  bool mla() const { return layout == PrefixLayout::kMla; }
  uint32_t dim() const { return kv_heads * head_dim; }
  uint64_t rows() const { return uint64_t{n_layers} * n_tokens; }
  // The suffixes of its V-store sessions: "_pk", "_pv", or "_pl" for MLA.
  std::span<const std::string_view> SessionSuffixes() const {
    if (mla()) return kMlaSuffixes;
    return kHeadsSuffixes;
  }
  // Fields that define the contents (not the generation).
  bool SameIdentity(const PrefixManifest& o) const {
    return model == o.model && position == o.position && n_layers == o.n_layers &&
           n_tokens == o.n_tokens && kv_heads == o.kv_heads && head_dim == o.head_dim &&
           format == o.format && layout == o.layout && kv_lora_rank == o.kv_lora_rank &&
           rope_dim == o.rope_dim;
  }
  // "model m layout 32x4096x8x128 fp16 position p" (MLA: "... layout 61x4096xMLA(512+64)
  // fp8_ds_mla ...") for error messages.
  std::string Describe() const;
  // "per-head K/V ('ns_pk', 'ns_pv')" / "MLA latents (kv_lora_rank 512 + rope_dim 64 per token,
  // one session 'ns_pl')": what a reader of the other layout is told it holds.
  std::string DescribeLayout(std::string_view ns) const;
};

struct PrefixEntry {
  PrefixManifest manifest;
  double prefill_ms = 0;     // the client's measured cold prefill (value receipt)
  uint64_t hits = 0;         // LOOKUPs answered HIT
  uint64_t publication = 0;  // the publication generation once complete (0: not yet)

  // Disk tier. Its chunks' bytes live in the residency engine (memory or disk, wherever they
  // were last needed); this is the namespace's durable copy.
  uint64_t saved_version = 0;  // newest durable version on disk (0: never saved)
  std::string disk_path;
  std::shared_ptr<residency::DiskFile> saved_file;  // that version, open
  uint64_t disk_bytes = 0;
  bool saved_complete = false;  // the saved version holds every row
  // Its sessions exist (opened): false only for a namespace found on disk at start-up and not
  // used since — the first use reads its chunk index and knows every chunk by its disk copy.
  bool resident = true;
  std::string corrupt;   // non-empty: the disk copy failed validation; never served
  bool opening = false;  // that chunk index is being read
  bool dirty = true;     // memory holds writes the newest saved version lacks
  std::vector<std::function<void(const Status&)>> open_waiters;  // coalesced first uses
};

class PrefixRegistry {
 public:
  // Registers ns. The same identity again is Ok (idempotent; PREFILL_MS may be updated);
  // another identity is kMismatch until the namespace is dropped.
  StatusOr<PrefixEntry*> Register(const TenantKey& ns, PrefixManifest m, double prefill_ms);
  PrefixEntry* Find(const TenantKey& ns);
  // Removes ns; the next REGISTER of the name gets a higher generation. True if it existed.
  bool Drop(const TenantKey& ns);
  // Adds a namespace found in the disk tier at start-up (not resident). Its generation is
  // kept, and later generations of the name stay above it.
  PrefixEntry* AddFromDisk(const TenantKey& ns, PrefixManifest m, double prefill_ms);
  // The version the next save of ns writes: above every version ever written for the name,
  // across DROP and restarts (NoteVersion() records versions found on disk).
  uint64_t NextVersion(const TenantKey& ns) { return ++versions_[ns]; }
  void NoteVersion(const TenantKey& ns, uint64_t v) {
    if (v > versions_[ns]) versions_[ns] = v;
  }
  // Marks a complete prefix as published (first time only); returns its publication generation.
  uint64_t Publish(PrefixEntry* e);

  template <typename F>
  void ForEachEntry(F&& f) {
    for (auto& [k, e] : entries_) f(k, e);
  }
  template <typename F>
  void ForEach(uint32_t tenant, F&& f) const {
    for (const auto& [k, e] : entries_) {
      if (k.tenant == tenant) f(k, e);
    }
  }

 private:
  std::unordered_map<TenantKey, PrefixEntry, TenantKeyHash> entries_;
  // Last generation handed out per name, kept after DROP so generations never repeat.
  std::unordered_map<TenantKey, uint64_t, TenantKeyHash> generations_;
  std::unordered_map<TenantKey, uint64_t, TenantKeyHash> versions_;
  uint64_t next_publication_ = 1;
};

}  // namespace pion::store
