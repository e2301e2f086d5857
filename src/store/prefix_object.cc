#include "store/prefix_object.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace pion::store {

namespace {
std::string Hex(const std::string& s) {
  static const char* k = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(k[c >> 4]);
    out.push_back(k[c & 15]);
  }
  return out;
}
bool Unhex(const std::string& h, std::string* out) {
  if (h.size() % 2) return false;
  out->clear();
  for (size_t i = 0; i < h.size(); i += 2) {
    char* end = nullptr;
    std::string byte = h.substr(i, 2);
    long v = std::strtol(byte.c_str(), &end, 16);
    if (*end != '\0') return false;
    out->push_back(static_cast<char>(v));
  }
  return true;
}
}  // namespace

std::string PrefixObjectName(const std::string& tenant, const std::string& ns) {
  std::string name = "prefix";
  name.push_back('\0');
  name += tenant;
  name.push_back('\0');
  name += ns;
  return name;
}

std::string EncodePrefixMeta(const PrefixRecord& r) {
  // Values are hex-escaped so any byte (newlines, '=') survives.
  const auto& m = r.manifest;
  char num[512];
  std::snprintf(num, sizeof(num),
                "layers=%u\ntokens=%u\nkv_heads=%u\nhead_dim=%u\nformat=%s\ngeneration=%llu\n"
                "prefill_ms=%.17g\ncomplete=%d\n",
                m.n_layers, m.n_tokens, m.kv_heads, m.head_dim,
                std::string(codec::FormatName(m.format)).c_str(),
                static_cast<unsigned long long>(m.cache_generation), r.prefill_ms,
                r.complete ? 1 : 0);
  std::string meta = "pion-prefix v1\ntenant=" + Hex(r.tenant) + "\nns=" + Hex(r.ns) +
                     "\nmodel=" + Hex(m.model) + "\nposition=" + Hex(m.position) + "\n" + num;
  if (m.mla()) {  // absent: per-head (every file written before MLA namespaces existed)
    meta += "layout=mla\nkv_lora_rank=" + std::to_string(m.kv_lora_rank) +
            "\nrope_dim=" + std::to_string(m.rope_dim) + "\n";
  }
  return meta;
}

StatusOr<PrefixRecord> DecodePrefixMeta(std::string_view meta) {
  std::istringstream in{std::string(meta)};
  std::string line;
  if (!std::getline(in, line) || line != "pion-prefix v1") {
    return Status(ErrorKind::kCorrupt, "prefix manifest has an unknown header");
  }
  PrefixRecord r;
  int seen = 0;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    auto& m = r.manifest;
    bool ok = true;
    if (k == "tenant") {
      ok = Unhex(v, &r.tenant);
    } else if (k == "ns") {
      ok = Unhex(v, &r.ns);
    } else if (k == "model") {
      ok = Unhex(v, &m.model);
    } else if (k == "position") {
      ok = Unhex(v, &m.position);
    } else if (k == "layers") {
      m.n_layers = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
    } else if (k == "tokens") {
      m.n_tokens = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
    } else if (k == "kv_heads") {
      m.kv_heads = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
    } else if (k == "head_dim") {
      m.head_dim = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
    } else if (k == "format") {
      auto f = codec::ParseFormat(v);
      ok = f.has_value();
      if (ok) m.format = *f;
    } else if (k == "generation") {
      m.cache_generation = std::strtoull(v.c_str(), nullptr, 10);
    } else if (k == "prefill_ms") {
      r.prefill_ms = std::strtod(v.c_str(), nullptr);
    } else if (k == "complete") {
      r.complete = v == "1";
    } else if (k == "layout") {  // optional fields: not counted in `seen`
      if (v != "mla" && v != "heads") {
        return Status(ErrorKind::kCorrupt, "prefix manifest field 'layout' is malformed");
      }
      m.layout = v == "mla" ? PrefixLayout::kMla : PrefixLayout::kHeads;
      continue;
    } else if (k == "kv_lora_rank") {
      m.kv_lora_rank = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
      continue;
    } else if (k == "rope_dim") {
      m.rope_dim = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
      continue;
    } else {
      continue;
    }
    if (!ok) return Status(ErrorKind::kCorrupt, "prefix manifest field '" + k + "' is malformed");
    ++seen;
  }
  if (seen < 12 || r.manifest.n_layers == 0 || r.manifest.n_tokens == 0 ||
      r.manifest.kv_heads == 0 || r.manifest.head_dim == 0) {
    return Status(ErrorKind::kCorrupt, "prefix manifest is incomplete");
  }
  if (r.manifest.mla() && (r.manifest.kv_heads != 1 || r.manifest.kv_lora_rank == 0 ||
                           r.manifest.kv_lora_rank + r.manifest.rope_dim != r.manifest.head_dim)) {
    return Status(ErrorKind::kCorrupt, "prefix manifest has an inconsistent MLA layout");
  }
  return r;
}

std::string ChunkIndex(const std::vector<const VSession::Snapshot*>& parts,
                       std::vector<residency::ObjectRef>* objs) {
  std::string index;
  objs->clear();
  for (size_t part = 0; part < parts.size(); ++part) {
    for (const auto& [i, chunk] : parts[part]->chunks) {
      index.push_back(static_cast<char>(part));
      uint64_t fields[2] = {static_cast<uint64_t>(i), chunk->written};
      for (uint64_t f : fields) {
        for (int b = 0; b < 8; ++b) index.push_back(static_cast<char>((f >> (8 * b)) & 0xff));
      }
      objs->push_back(chunk->obj);
    }
  }
  return index;
}

StatusOr<std::vector<LoadedChunk>> ParsePrefixIndex(std::string_view block0) {
  if (block0.size() % 17 != 0) {
    return Status(ErrorKind::kCorrupt, "prefix chunk index has a partial entry");
  }
  std::vector<LoadedChunk> out;
  for (size_t off = 0; off < block0.size(); off += 17) {
    const auto* p = reinterpret_cast<const uint8_t*>(block0.data() + off);
    uint64_t f[2] = {0, 0};
    for (int j = 0; j < 2; ++j) {
      for (int b = 0; b < 8; ++b) f[j] |= static_cast<uint64_t>(p[1 + 8 * j + b]) << (8 * b);
    }
    if (p[0] > 1 || static_cast<int64_t>(f[0]) < 0) {  // part 0: K (or the MLA latent), 1: V
      return Status(ErrorKind::kCorrupt, "prefix chunk index entry is malformed");
    }
    out.push_back(LoadedChunk{p[0], static_cast<int64_t>(f[0]), f[1]});
  }
  return out;
}

StatusOr<std::vector<std::vector<VSession::DiskChunk>>> ReadChunkIndex(
    const residency::DiskFile& file, uint64_t chunk_bytes, int parts) {
  const auto& f = file.file();
  if (f.block_count() == 0) return Status(ErrorKind::kCorrupt, file.path() + " has no chunk index");
  std::string index(f.block_length(0), '\0');
  Status s = file.ReadBlock(0, reinterpret_cast<uint8_t*>(index.data()));
  if (!s.ok()) return s;
  auto entries = ParsePrefixIndex(index);
  if (!entries.ok()) return entries.status();
  if (entries->size() + 1 != f.block_count()) {
    return Status(ErrorKind::kCorrupt, file.path() + ": chunk index does not match the blocks");
  }
  std::vector<std::vector<VSession::DiskChunk>> out(static_cast<size_t>(parts));
  for (size_t i = 0; i < entries->size(); ++i) {
    const LoadedChunk& c = (*entries)[i];
    if (c.part >= parts || f.block_length(i + 1) != chunk_bytes) {
      return Status(ErrorKind::kCorrupt,
                    file.path() + ": chunk " + std::to_string(i) + " has the wrong size or part");
    }
    out[static_cast<size_t>(c.part)].push_back({c.index, c.written, static_cast<uint32_t>(i + 1)});
  }
  return out;
}

std::string SealedObjectName(const SealedRecord& r) {
  std::string name = "vsnap";
  name.push_back('\0');
  name += r.tenant;
  name.push_back('\0');
  name += r.sid;
  name.push_back('\0');
  name += std::to_string(r.snapshot);
  return name;
}

std::string EncodeSealedMeta(const SealedRecord& r) {
  return "pion-vsnap v1\ntenant=" + Hex(r.tenant) + "\nsid=" + Hex(r.sid) +
         "\nsnapshot=" + std::to_string(r.snapshot) +
         "\nformat=" + std::string(codec::FormatName(r.format)) + "\ndim=" + std::to_string(r.dim) +
         "\nblock=" + std::to_string(r.block) + "\n" + (r.image ? "image=1\n" : "");
}

StatusOr<SealedRecord> DecodeSealedMeta(std::string_view meta) {
  std::istringstream in{std::string(meta)};
  std::string line;
  if (!std::getline(in, line) || line != "pion-vsnap v1") {
    return Status(ErrorKind::kCorrupt, "sealed snapshot manifest has an unknown header");
  }
  SealedRecord r;
  int seen = 0;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    bool ok = true;
    if (k == "tenant") {
      ok = Unhex(v, &r.tenant);
    } else if (k == "sid") {
      ok = Unhex(v, &r.sid);
    } else if (k == "snapshot") {
      r.snapshot = std::strtoull(v.c_str(), nullptr, 10);
    } else if (k == "format") {
      auto f = codec::ParseFormat(v);
      ok = f.has_value();
      if (ok) r.format = *f;
    } else if (k == "dim") {
      r.dim = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
    } else if (k == "block") {
      r.block = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
    } else if (k == "image") {
      r.image = v == "1";
      continue;  // optional: not counted among the required fields
    } else {
      continue;
    }
    if (!ok) return Status(ErrorKind::kCorrupt, "sealed snapshot field '" + k + "' is malformed");
    ++seen;
  }
  if (seen < 6 || r.dim == 0 || r.snapshot == 0) {
    return Status(ErrorKind::kCorrupt, "sealed snapshot manifest is incomplete");
  }
  return r;
}

}  // namespace pion::store
