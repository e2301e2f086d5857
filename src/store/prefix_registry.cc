#include "store/prefix_registry.h"

namespace pion::store {

std::string_view LayoutName(PrefixLayout l) { return l == PrefixLayout::kMla ? "mla" : "heads"; }

std::string PrefixManifest::Describe() const {
  std::string s = "model '" + model + "' layout " + std::to_string(n_layers) + "x" +
                  std::to_string(n_tokens) + "x";
  if (mla()) {
    s += "MLA(" + std::to_string(kv_lora_rank) + "+" + std::to_string(rope_dim) + ")";
  } else {
    s += std::to_string(kv_heads) + "x" + std::to_string(head_dim);
  }
  s += " " + std::string(codec::FormatName(format));
  s += " position '" + position + "'";
  return s;
}

std::string PrefixManifest::DescribeLayout(std::string_view ns) const {
  const std::string name(ns.substr(0, 128));
  if (mla()) {
    return "MLA latents (kv_lora_rank " + std::to_string(kv_lora_rank) + " + rope_dim " +
           std::to_string(rope_dim) + " per token, one session '" + name + "_pl')";
  }
  return "per-head K/V (" + std::to_string(kv_heads) + " heads of " + std::to_string(head_dim) +
         ", sessions '" + name + "_pk', '" + name + "_pv')";
}

StatusOr<PrefixEntry*> PrefixRegistry::Register(const TenantKey& ns, PrefixManifest m,
                                                double prefill_ms) {
  auto it = entries_.find(ns);
  if (it != entries_.end()) {
    if (!it->second.manifest.SameIdentity(m)) {
      return Status(ErrorKind::kMismatch, "namespace '" + ns.name + "' is registered with " +
                                              it->second.manifest.Describe() + ", not " +
                                              m.Describe() + "; KV.PREFIX.DROP it first");
    }
    if (prefill_ms > 0) it->second.prefill_ms = prefill_ms;
    return &it->second;
  }
  m.cache_generation = ++generations_[ns];
  PrefixEntry e;
  e.manifest = std::move(m);
  e.prefill_ms = prefill_ms;
  return &entries_.emplace(ns, std::move(e)).first->second;
}

PrefixEntry* PrefixRegistry::AddFromDisk(const TenantKey& ns, PrefixManifest m, double prefill_ms) {
  uint64_t& last = generations_[ns];
  if (m.cache_generation > last) last = m.cache_generation;
  PrefixEntry e;
  e.manifest = std::move(m);
  e.prefill_ms = prefill_ms;
  e.resident = false;
  e.dirty = false;
  return &(entries_[ns] = std::move(e));
}

PrefixEntry* PrefixRegistry::Find(const TenantKey& ns) {
  auto it = entries_.find(ns);
  return it == entries_.end() ? nullptr : &it->second;
}

bool PrefixRegistry::Drop(const TenantKey& ns) { return entries_.erase(ns) > 0; }

uint64_t PrefixRegistry::Publish(PrefixEntry* e) {
  if (e->publication == 0) e->publication = next_publication_++;
  return e->publication;
}

}  // namespace pion::store
