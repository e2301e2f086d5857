// How a KV.PREFIX namespace is laid out as a disk-tier object (store/disk/object_file.h).
//
// meta:    "pion-prefix v1" lines of key=value (tenant, ns, model, position, layout, codec,
//          cache generation, prefill ms, committed rows; an MLA namespace adds layout=mla,
//          kv_lora_rank, rope_dim); text, so a person can read it.
// block 0: the chunk index: per chunk u8 part (0 = K, 1 = V; an MLA namespace's one part, 0,
//          is its latent session), i64 chunk index, u64 written bitmap (little-endian, 17
//          bytes each).
// block i: the i-th indexed chunk's stored bytes (64 rows in the session's codec), written
//          straight from the chunk buffers of a snapshot, no copy.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "residency/disk_file.h"
#include "residency/object.h"
#include "store/disk/object_file.h"
#include "store/prefix_registry.h"
#include "store/vsession.h"

namespace pion::store {

struct PrefixRecord {
  std::string tenant;  // tenant name (ids are per process)
  std::string ns;
  PrefixManifest manifest;
  double prefill_ms = 0;
  bool complete = false;
};

// The object name of a namespace (tenant and ns may hold any bytes).
std::string PrefixObjectName(const std::string& tenant, const std::string& ns);

std::string EncodePrefixMeta(const PrefixRecord& r);
StatusOr<PrefixRecord> DecodePrefixMeta(std::string_view meta);

// Block 0 of a chunk object (a saved prefix, a sealed snapshot) from session snapshots (part
// i = parts[i]: a prefix has K and V, a sealed V snapshot one part): per chunk u8 part, i64
// chunk index, u64 written bitmap. `objs` receives the chunks' objects in the same order:
// they are blocks 1..n of the file.
std::string ChunkIndex(const std::vector<const VSession::Snapshot*>& parts,
                       std::vector<residency::ObjectRef>* objs);

// One chunk of a chunk object file.
struct LoadedChunk {
  int part;  // 0 = K, 1 = V
  int64_t index;
  uint64_t written;
};
// Parses block 0 into (part, index, written) entries.
StatusOr<std::vector<LoadedChunk>> ParsePrefixIndex(std::string_view block0);

// Reads and checks block 0 of a chunk object file (every entry a block of `chunk_bytes`, at
// most `parts` parts): per part, the chunks as VSession::LoadFromDisk takes them. Blocking:
// call off the shards. kCorrupt on any mismatch.
StatusOr<std::vector<std::vector<VSession::DiskChunk>>> ReadChunkIndex(
    const residency::DiskFile& file, uint64_t chunk_bytes, int parts);

// A sealed V-store snapshot (V.COMMIT) as a disk-tier object.
struct SealedRecord {
  std::string tenant;
  std::string sid;
  uint64_t snapshot = 0;
  codec::Format format = codec::Format::kFp32;
  uint32_t dim = 0;
  uint32_t block = 0;
  bool image = false;  // the live session as SHUTDOWN SAVE sealed it (restored at start-up)
};
std::string SealedObjectName(const SealedRecord& r);
std::string EncodeSealedMeta(const SealedRecord& r);
StatusOr<SealedRecord> DecodeSealedMeta(std::string_view meta);

}  // namespace pion::store
