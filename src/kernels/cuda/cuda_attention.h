// The CUDA attention kernels, as launches over device memory (no CUDA types in this header).
// The same math as kernels/attention.h — per query row a mergeable (m, l, o) state under the
// causal / window mask by positions — computed as split-K partials that LaunchCombine merges and
// finalizes:
//
//   LaunchAttend     partials of query-row groups over a dense key range or per-row sparse lists
//                    (fp16 dense with enough rows per group runs on tensor cores, the rest —
//                    fp8 e4m3 with row scales among them — on a shared-memory SIMT kernel;
//                    both keep scores, partials and LSE in fp32)
//   LaunchCombine    merges P partials per row and writes output (o/l) and LSE (m + ln l)
//   LaunchScores     exact scaled scores of query rows over their visible keys (top_k)
//   LaunchSelectRows per-row top-k of those scores by radix select: ascending row lists, the
//                    exact omitted softmax mass
//   LaunchSummarize  per-block mean/min/max of K (sparse-auto summaries)
//   LaunchScoreBlocks block scores of M=1 queries: q·mean, and the Quest bound when asked
//   LaunchSelectBlocks per-head top K_top blocks plus the first and last visible ones, their row
//                    lists, and the block-mean omitted-mass proxy
//
// All pointers are device pointers unless a comment says host. Rows of Q are r = h*m + i.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/attention.h"

namespace pion::kernels::cuda {

// A group of query rows that attend the same K/V head (so each key is read once for all of
// them); a sparse item holds one row.
inline constexpr int kItemRows = 16;
struct Item {
  int32_t kv = 0;
  int32_t n = 0;
  int32_t rows[kItemRows] = {};
};
// Host: the dense grouping — rows of query heads mapped to the same K/V head, kItemRows at a
// time (a group's rows are consecutive query positions of its heads, so their key ranges
// overlap; the kernels rely on an item's rows ascending by position), each K/V head's run padded
// with empty items to a multiple of `pad` (the row groups of one tensor-core block). head_map is
// host memory.
std::vector<Item> DenseItems(uint32_t hq, uint32_t m, const int32_t* head_map, int pad = 1);
// Host: one item per query row (sparse lists differ per row).
std::vector<Item> RowItems(uint32_t hq, uint32_t m, const int32_t* head_map);
// Host: the most rows of any of `items` (AttendArgs::item_rows).
uint32_t MaxRows(const std::vector<Item>& items);
// Host: g when `items` are DenseItems of M = 1 queries whose K/V head i has query heads
// i*g .. i*g + g − 1 (unpadded), else 0 (AttendArgs::uniform_group).
uint32_t UniformGroup(const std::vector<Item>& items, uint32_t m);

// A CUtensorMap's bytes (cuda.h stays out of this header).
struct alignas(64) TensorMapBytes {
  unsigned char b[128] = {};
};
// A tensor map for TMA tensor copies (cuTensorMapEncodeTiled through the runtime's driver entry
// point: no libcuda link; defined in flash.cu, each thread keeping its last few maps): `rank`
// dimensions (1 to 3, innermost first) of `elem`, strides[i] the bytes from one index of
// dimension i + 1 to the next (multiples of 16), boxes of box[] elements; out-of-range elements
// of a box land as zeros. Host; sm_90 devices.
enum class TensorElem : uint8_t { kU8, kF16, kF32 };
enum class TensorSwizzle : uint8_t { kNone, k64B, k128B };
Status EncodeTensorMap(TensorMapBytes* map, TensorElem elem, uint32_t rank, const void* base,
                       const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                       TensorSwizzle swizzle);
// A 2-D tensor map over K or V rows [heads·rows][d] of `elem` bytes (2 or 4) for TMA tensor
// copies of `box_rows` rows × `box_cols` columns (columns past d: zero-filled).
Status EncodeRows(TensorMapBytes* map, const void* base, uint32_t elem, uint32_t heads,
                  uint32_t rows, uint32_t d, uint32_t box_cols, uint32_t box_rows);

struct AttendArgs {
  const float* q = nullptr;  // [hq][m][d]
  uint32_t hq = 0, m = 0, d = 0;
  int64_t q_pos0 = 0;
  const void* k = nullptr;  // [heads][rows][d] of dtype
  const void* v = nullptr;
  DType dtype = DType::kF32;
  // fp8: the row scales [heads][rows] of K and V (kernels::MakeTensor's layout: after the
  // e4m3 bytes); null for the other types.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  uint32_t heads = 0, rows = 0;
  int64_t k_pos0 = 0;
  uint32_t begin = 0, end = 0;  // dense key range
  // Sparse: per query row r, list[r*stride .. + counts[r]) (distinct, in [0, rows)). Every row
  // of an item attends the list of its first row: with dense items (grouped by K/V head) that
  // is one list per group, each chosen key read once for the group (SHARED sparse-auto).
  const int32_t* list = nullptr;
  const int32_t* counts = nullptr;
  uint32_t stride = 0;
  float scale = 0;
  int64_t window = 0;
  const Item* items = nullptr;
  uint32_t n_items = 0;
  uint32_t item_rows = kItemRows;  // the most rows of any item (MaxRows(items))
  bool dense_items = true;         // items from DenseItems (eligible for tensor cores)
  uint32_t splits = 1;             // key-range pieces per item (blockIdx.y)
  // Dense M = 1 items exactly as DenseItems lays them out without padding: item i is K/V head i
  // with query rows i*g .. i*g + g − 1, g = uniform_group (0: not so; UniformGroup decides).
  // The decode kernels then take rows, positions and key range from these arguments instead of
  // loading the items first — the first K/V tiles are requested one memory round trip sooner
  // (H200, GQA 32/8 d = 128, same run: fp16 2K 9.26 -> 8.94 µs, fp32 2K 13.12 -> 12.90).
  uint32_t uniform_group = 0;
  // Tensor-core decode (one row group a block) over at least 32 tiles a block: the block's four
  // warps take its 16-key tiles in turn (warp w tiles w, w + 4, ...: the block reads one
  // contiguous run) instead of a quarter of them each. Measured on the H200 (GQA 32/8, d = 128):
  // 128K 138.2 -> 135.5 µs, 32K 41.8 -> 41.1; at 8K (16 tiles a block) 14.08 vs 14.15, so not
  // there. false: always quarters (the bench's PION_BENCH_INTERLEAVE=0, for comparison).
  // 2: head-wide — every warp of every split takes the head's tiles in turn (fp8's default
  // where 1 applies; for the others the bench's PION_BENCH_INTERLEAVE=2, for comparison).
  uint8_t interleave = 1;
  // fp32 decode (4 to 8 query rows per K/V head, d = 64..128) on tensor cores: tf32 MMAs with
  // every operand split hi + lo (about fp32's accuracy); false: the SIMT kernel (the bench's
  // PION_BENCH_F32TC=0, for comparison).
  bool f32_tensor = true;
  // fp8 decode (dense, at most 8 query rows per K/V head, d = 32..128) on tensor cores: tiles
  // staged as e4m3, each lane widening its own K and V bytes to fp16 fragments in registers,
  // the packed fp16 MMAs with Q and P split hi + lo; false: the SIMT kernel (the bench's
  // PION_BENCH_F8TC=0, for comparison).
  bool fp8_tensor = true;
  // bf16 decode (one row group a block) on tensor cores: the fp16 decode shapes on bf16 MMAs,
  // Q and P split into bf16 hi + lo; false: the SIMT kernel (the bench's PION_BENCH_BF16TC=0,
  // for comparison).
  bool bf16_tensor = true;
  // Decode on sm_90 (dense, one row group a block): a full 16-row tile arrives as one 2-D tensor
  // copy (TMA) each for K and V — a box of one padded tile row's width, its tail past d
  // zero-filled — instead of 16-byte cp.async pieces; false: cp.async always (the bench's
  // PION_BENCH_TENSOR=0, for comparison). LaunchAttend fills the maps.
  bool tensor_tiles = true;
  TensorMapBytes map_k, map_v;
  // Dense M = 1 decode of fp16, bf16 or fp8 K/V (d 64 or 128, up to 8 query heads a K/V head,
  // uniform_group set) on sm_90: the streaming decode (decode_stream.cu) — each block streams
  // its split through one ring of 64-key tiles, each K and V tile one or two swizzled tensor
  // copies, its four warps taking 16 keys of every tile — instead of the tensor-core decode's
  // per-warp rings; false: the tensor-core decode (the bench's PION_BENCH_STREAM=0, for
  // comparison). LaunchFlash fills map_k, map_v and, for fp8, the row scales' map_ks, map_vs.
  bool stream_decode = true;
  TensorMapBytes map_ks, map_vs;
  // Partial outputs: part p, row r at [p*nrows + r] (o: times d).
  float* part_m = nullptr;
  float* part_l = nullptr;
  float* part_o = nullptr;
  uint32_t part0 = 0;  // this launch writes parts part0 .. part0 + splits - 1
  uint32_t nrows = 0;  // hq * m
  // Finish in the launch (optional; only when it writes every part of its rows, part0 = 0):
  // the last block of each blockIdx.x to finish merges its rows' splits into out [nrows][d] and
  // lse [nrows] — no LaunchCombine. counters: one per blockIdx.x, zero, left zero after.
  uint32_t* counters = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
};
// Blocks along x of a LaunchAttend of `a` (one counter each when finishing in the launch).
uint32_t GridBlocks(const AttendArgs& a);

// Whether LaunchAttend runs these args on tensor cores (fp16, dense items — with or without
// shared lists — d <= 256, sm_80+; fp32 for 4 to 8 query rows per K/V head, d = 64..128; fp8
// dense for up to 8 query rows per K/V head, d = 32..128; per-row
// sparse lists measure faster on the SIMT kernel), and how
// many 16-row groups one such block holds (8 when a K/V head has >= 128 query rows at d = 128 or
// >= 512 at smaller d, else 4 from 64 rows, else 1).
// Call before building items: DenseItems(..., FlashRowGroups(a)) when UsesTensorCores(a).
bool UsesTensorCores(const AttendArgs& a);
int FlashRowGroups(const AttendArgs& a);
// bf16 and fp8 slots with 64 or more query rows a K/V head (d <= 128) on the eight-group batched
// tensor-core kernel (flash_batched.cu: 15x / 8.6x faster than their SIMT kernel at M = 512, N =
// 32K on the H200, and correct in every test) instead of the SIMT kernel. On by default (its
// compute-sanitizer racecheck, in a process of its own — GpuExecutor.BatchedSmoke — reports no
// hazard); process-wide; off: the SIMT kernel (the bench's PION_BENCH_LOWP_BATCHED=0 and
// GpuExecutor.LowpBatched compare them).
void SetLowpBatched(bool on);
bool LowpBatched();
// Whether LaunchAttend runs `a` (items and uniform_group set) on the streaming decode
// (decode_stream.cu; AttendArgs::stream_decode): dense M = 1, fp16, bf16 or fp8 K/V, d 64 or
// 128, 1 to 8 query heads a K/V head, sm_90, 16-byte aligned K/V (and fp8 scales).
bool StreamDecodeFits(const AttendArgs& a);
// Its keys a tile for `a`: 16 KB of K rows up to 128 keys (64 keys of fp16 and bf16 d = 128, 128
// of the others) — or 64 everywhere after SetStreamDecodeTile(64), process-wide,
// for comparison (the bench's PION_BENCH_STREAM_TILE=64, GpuExecutor.StreamDecode); 0 restores.
uint32_t StreamDecodeTile(const AttendArgs& a);
void SetStreamDecodeTile(uint32_t keys);
// Its blocks a multiprocessor (the split-K plan's slots): enough rings for ~96 KB of tiles in
// flight (decode_stream.cu) — or n after SetStreamDecodeBlocks(n), process-wide, for comparison
// (the bench's PION_BENCH_STREAM_BLOCKS=n); 0 restores.
void SetStreamDecodeBlocks(uint32_t n);
// Its teams of four warps a block: two (each streaming its own ring) where a ring holds under
// 64 KB and the range is long (decode_stream.cu), else one — or n (1 or 2; 2 only where a ring
// holds under 64 KB) after SetStreamDecodeTeams(n), process-wide, for comparison (the bench's
// PION_BENCH_STREAM_TEAMS=n, GpuExecutor.StreamDecode); 0 restores.
uint32_t StreamDecodeTeams(const AttendArgs& a, uint64_t keys);
void SetStreamDecodeTeams(uint32_t n);
// Back-to-back launches overlap (on by default; the bench's PION_BENCH_OVERLAP=0 for
// comparison): the streaming decode lets the launch after it place its blocks from its start and
// waits for the launch before it only where it writes its partials, and the combine lets the
// next launch place its blocks before it waits — so a decode's first tiles stream while the
// call before it drains. Safe because every kernel launched as a dependent waits before it
// reads what an earlier kernel wrote, and the decode reads nothing a kernel writes (K, V and Q
// arrive by copies).
void SetOverlapCalls(bool on);
bool OverlapCalls();
// Key-range splits for a dense launch of `a` (items set) over `keys` keys: enough blocks for one
// full wave of the device at the kernel's occupancy, at least two key tiles per split.
uint32_t PlanSplits(const AttendArgs& a, uint64_t keys);

Status LaunchAttend(const AttendArgs& a, void* stream);
Status LaunchCombine(uint32_t parts, uint32_t nrows, uint32_t d, const float* part_m,
                     const float* part_l, const float* part_o, float* out, float* lse,
                     void* stream);

// Scores of rows [row0, row0 + n) (r = h*m + i) over each row's visible keys, into
// scores[(r - row0) * a.rows + t] for the visible t (other entries untouched).
Status LaunchScores(const AttendArgs& a, const int32_t* head_map, uint32_t row0, uint32_t n,
                    float* scores, void* stream);
// Per row of that chunk: keep = min(top_k, visible); list[r*top_k ..] ascending key indices,
// counts[r] = keep, omitted[r] = exact softmax mass left out, exact[r] = (keep == visible).
Status LaunchSelectRows(const AttendArgs& a, uint32_t row0, uint32_t n, const float* scores,
                        uint32_t top_k, int32_t* list, int32_t* counts, float* omitted,
                        uint8_t* exact, void* stream);

// SHARED sparse-auto in one launch (sparse_fused.cu): per K/V head one thread-block cluster of
// `cluster` blocks scores the head's blocks, selects the top k_top (plus the first and last
// visible blocks, as LaunchSelectBlocks with shared), attends its share of the chosen rows on the
// tensor cores, and the cluster merges them into out/lse over distributed shared memory; the
// receipts as LaunchSelectBlocks writes them, without the row lists. fp16 K/V, d ∈ {64, 128},
// M = 1, at most kMaxSharedGroup query heads per K/V head and kMaxFusedHeads K/V heads, sm_90+.
inline constexpr int kMaxSharedGroup = 8;
inline constexpr int kMaxFusedHeads = 32;
inline constexpr int kFusedTraceMarks = 16;  // FusedSparseArgs::trace: marks a block
struct FusedSparseArgs {
  const float* q = nullptr;  // [hq][d]
  uint32_t hq = 0, d = 0;
  // [heads][kMaxSharedGroup]: the query heads of each K/V head, −1 past the last (GroupMembers).
  // In the launch's parameters, so the kernel's first loads are the queries themselves.
  int16_t members[kMaxFusedHeads * kMaxSharedGroup] = {};
  const void* k = nullptr;  // fp16 [heads][rows][d]
  const void* v = nullptr;
  uint32_t heads = 0, rows = 0;
  const float* mean = nullptr;  // block summaries [heads][nb][d]
  const float* min = nullptr;
  const float* max = nullptr;
  uint32_t nb = 0, block = 0;
  uint32_t lo = 0, hi = 0;  // visible rows (hi > lo)
  uint32_t k_top = 0;
  float scale = 0;
  bool quest = false;
  uint32_t cluster = 8;       // blocks a head (8 or 16): SparseAutoSharedCluster
  float* out = nullptr;       // [hq][d]
  float* lse = nullptr;       // [hq]
  int32_t* blocks = nullptr;  // [hq][k_top + 2]
  int32_t* nchosen = nullptr;
  int32_t* counts = nullptr;
  float* omitted = nullptr;
  long long* trace = nullptr;  // bench only: [blocks][kFusedTraceMarks] clock64 phase marks
  // Attention tiles whose 16 rows are contiguous arrive as one 2-D tensor copy (TMA) each for K
  // and V — a box of d + 8 columns, the 8 past the row zero-filled, so it lands in the padded
  // tile layout — instead of a bulk copy a row (32 copies a tile, whose issue the copy unit
  // serializes); false: the per-row copies (the bench's PION_BENCH_TENSOR=0, for comparison).
  // LaunchSparseAutoShared fills the maps.
  bool tensor_tiles = true;
  TensorMapBytes map_k, map_v;
};
// Host: the member heads of FusedSparseArgs / DecodeClusterArgs for hq query heads on `heads`
// K/V heads (head_map host memory): each K/V head's query heads, kMaxSharedGroup slots a head,
// −1 past the last. Returns the largest group, 0 when one exceeds the slots or there are more
// than kMaxFusedHeads K/V heads.
uint32_t GroupMembers(uint32_t hq, const int32_t* head_map, uint32_t heads,
                      int16_t (&members)[kMaxFusedHeads * kMaxSharedGroup]);
Status LaunchSparseAutoShared(const FusedSparseArgs& a, void* stream);
// Whether LaunchSparseAutoShared takes a query of this shape on this device: fp16 K/V, d 64 or
// 128, at most kMaxSharedGroup query heads per K/V head (`group`), `visible_blocks` within its
// staging, sm_90+, and no more K/V `heads` than the device runs clusters of 8 at once (in waves
// the four launches are faster: H200, MHA 32/32 at N = 64K, one launch 61.5 µs, four 44.3).
bool SparseAutoSharedFits(DType dtype, uint32_t d, uint32_t group, uint32_t visible_blocks,
                          uint32_t heads);
// The cluster size for `heads` K/V heads: 16 where every head's cluster of 16 runs at once, else
// 8 (measured on the H200: clusters of 10, 12 and 14 run no more heads at once than 16; a
// second wave costs more than the wider clusters save). `want` (8 or 16) forces it where the
// device has it (the bench compares them).
uint32_t SparseAutoSharedCluster(uint32_t d, uint32_t heads, uint32_t want = 0);
// How many clusters of `cluster` (8 or 16) blocks of the kernel the device runs at once.
int SparseAutoSharedActiveClusters(uint32_t d, uint32_t cluster);

// Dense M = 1 decode over a short visible range in one launch (decode_cluster.cu): per K/V
// head one thread-block cluster of 8 blocks splits the range, each warp streams its run of keys
// through its own ring of bulk copies, the math is fp32 (SIMT), and the cluster merges over
// distributed shared memory into out/lse — no partials and no combine launch. fp32 or fp16 K/V,
// d 64 or 128, at most 4 query heads per K/V head, sm_90+.
inline constexpr int kDecodeCluster = 8;  // blocks a K/V head
struct DecodeClusterArgs {
  const float* q = nullptr;  // [hq][d]
  uint32_t hq = 0, d = 0;
  int16_t members[kMaxFusedHeads * kMaxSharedGroup] = {};  // GroupMembers
  uint32_t group = 0;                                      // the largest group (GroupMembers)
  const void* k = nullptr;                                 // [heads][rows][d] of dtype
  const void* v = nullptr;
  DType dtype = DType::kF32;
  uint32_t heads = 0, rows = 0;
  uint32_t lo = 0, hi = 0;  // the visible rows [lo, hi) of every query (hi > lo)
  float scale = 0;
  float* out = nullptr;  // [hq][d]
  float* lse = nullptr;  // [hq]
  uint32_t tile = 0;     // keys a tile, 16 or 32 (with 8 warps); 0: chosen by the range
};
// Whether LaunchDecodeCluster takes `keys` visible keys of this shape on this device: the
// dtypes and head dims above, 1..4 query heads a K/V head (`group`), every K/V head's cluster
// resident at once, and a range short enough that 8 blocks a head beat the split-K launch and its
// combine (DecodeClusterMaxKeys).
bool DecodeClusterFits(DType dtype, uint32_t d, uint32_t group, uint32_t heads, uint64_t keys);
// The longest visible range (keys) the one launch takes for this dtype (any head dim it has).
uint64_t DecodeClusterMaxKeys(DType dtype);
Status LaunchDecodeCluster(const DecodeClusterArgs& a, void* stream);

// scales: fp8 K's row scales [heads][rows] (null for the other types); the summaries are of
// the decoded values, e4m3 × scale.
Status LaunchSummarize(const void* k, DType dtype, const float* scales, uint32_t heads,
                       uint32_t rows, uint32_t d, uint32_t block, uint32_t nblocks, float* mean,
                       float* min, float* max, void* stream);
// sel[h*nb + b] by the selector, mean_scores[h*nb + b] = q·mean (both unscaled). q is M=1.
// Blocks [force_lo, force_hi) get sel +inf (RECENT: always chosen), their mean scores as ever.
Status LaunchScoreBlocks(const float* q, uint32_t hq, uint32_t d, const int32_t* head_map,
                         const float* mean, const float* min, const float* max, uint32_t nblocks,
                         BlockSelector selector, float* sel, float* mean_scores, void* stream,
                         uint32_t force_lo = 0, uint32_t force_hi = 0);
// Visible rows [lo, hi) (hi > lo), blocks b_lo = lo/B .. b_hi = (hi-1)/B. Per head h:
// blocks[h*(k_top+2) ..] ascending chosen blocks (nchosen[h] of them), list[h*stride ..] their
// visible rows ascending (counts[h]), omitted[h] the block-mean proxy of the mass left out.
// shared (SHARED): head h ranks blocks by the highest sel of the heads mapped to head_map[h]
// (device memory), so a group's heads choose alike.
Status LaunchSelectBlocks(const float* sel, const float* mean_scores, const int32_t* head_map,
                          uint32_t hq, bool shared, uint32_t nblocks, uint32_t block, uint32_t lo,
                          uint32_t hi, uint32_t k_top, float scale, int32_t* blocks,
                          int32_t* nchosen, int32_t* list, int32_t* counts, uint32_t stride,
                          float* omitted, void* stream);

}  // namespace pion::kernels::cuda
