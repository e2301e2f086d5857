// The attention kernel interface: what every backend (scalar reference, CPU SIMD, later CUDA)
// computes, in the terms of seed 004 §0x07A — a mergeable online-softmax state per query row —
// over per-head K/V (Attend) or over MLA latent rows shared by every head (AttendLatent).
//
// A backend attends query rows over a set of key rows and returns, for every query row, the
// partial state (m, l, o): m the largest scaled score seen, l = Σ exp(s − m), o = Σ exp(s − m)·v
// (unnormalized). Partials over disjoint key sets merge exactly (Merge), which is how split-K
// across threads, prefix + suffix fusion and client-side merges all work; Finalize turns a state
// into the output o/l and its log-sum-exp m + ln l.
//
// Shapes and conventions (all little-endian, row-major):
//   d             the head dim: a multiple of 16 (the CPU backend's vector loops have no scalar
//                 tail; 32..512 are tested); key rows below 2^24 per head
//   K, V          [heads][rows][d], fp32, fp16, bf16 or fp8 (e4m3fn with a scale per row)
//                 elements (Tensor3)
//   Q             [hq][m][d] fp32; query head h reads K/V head head_map[h]
//   scores        s = scale · (q · k), scale usually 1/√d
//   positions     query row i is at absolute position q.pos0 + i, key row t at keys.pos0 + t;
//                 a key is visible when key_pos <= query_pos (causal) and, with a window W > 0,
//                 key_pos > query_pos − W
//   empty rows    a query row that sees no key has m = −inf, l = 0, o = 0; Finalize gives output 0
//                 and lse −inf
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace pion::kernels {

// Element types of stored K/V. kFP8 is e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa
// bits, no infinities, 0x7F/0xFF NaN; the codec README's "fp8") with one f32 scale per row:
// element j of row t of head h is f32(e4m3(byte)) · scale[h][t].
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kFP8 = 3 };
// Bytes of one element (fp8: the e4m3 byte; its row's scale is counted by TensorBytes).
inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : t == DType::kFP8 ? 1 : 2; }
std::string_view DTypeName(DType t);
// "fp32", "fp16", "bf16", "fp8" → the type; false for anything else.
bool ParseDType(std::string_view name, DType* out);

// The bytes of one [heads][rows][d] tensor of `t`: elements, plus for fp8 the scales
// (heads · rows · (d + 4)).
inline uint64_t TensorBytes(DType t, uint32_t heads, uint32_t rows, uint32_t d) {
  const uint64_t n = uint64_t{heads} * rows;
  return n * d * DTypeSize(t) + (t == DType::kFP8 ? n * sizeof(float) : 0);
}

// One stored K or V tensor: [heads][rows][d] elements of `dtype` (fp16 = IEEE binary16, bf16 =
// the top half of a binary32, fp8 = e4m3fn bytes). An fp8 tensor's buffer (TensorBytes) holds
// the e4m3 bytes [heads][rows][d] and then the f32 row scales [heads][rows] — elements and
// scales apart, so every row's bytes stay 16-byte aligned for vector and tensor-copy loads;
// `scales` points at them (MakeTensor sets it).
struct Tensor3 {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  uint32_t heads = 0;
  uint32_t rows = 0;
  uint32_t d = 0;
  const float* scales = nullptr;  // kFP8: [heads][rows]; null otherwise

  const uint8_t* Row(uint32_t head, uint32_t row) const {
    return static_cast<const uint8_t*>(data) +
           ((static_cast<size_t>(head) * rows + row) * d) * DTypeSize(dtype);
  }
  // kFP8: the scale of one row.
  float Scale(uint32_t head, uint32_t row) const {
    return scales[static_cast<size_t>(head) * rows + row];
  }
};

// A tensor over one buffer of TensorBytes(dtype, heads, rows, d) bytes (for fp8, scales after
// the elements).
inline Tensor3 MakeTensor(const void* block, DType dtype, uint32_t heads, uint32_t rows,
                          uint32_t d) {
  Tensor3 t{block, dtype, heads, rows, d, nullptr};
  if (dtype == DType::kFP8 && block != nullptr) {
    t.scales = reinterpret_cast<const float*>(static_cast<const uint8_t*>(block) +
                                              uint64_t{heads} * rows * d);
  }
  return t;
}

// The query rows of one call. head_map is required: the caller builds the contiguous GQA map
// (h / (hq / heads)) when the command has none.
struct Queries {
  const float* q = nullptr;  // [hq][m][d]
  uint32_t hq = 0;
  uint32_t m = 0;
  uint32_t d = 0;
  const int32_t* head_map = nullptr;  // [hq], each in [0, keys.k.heads)
  int64_t pos0 = 0;                   // absolute position of query row 0
};

// The key rows attended. Dense: rows [begin, end) of every K/V head. Sparse (rows != nullptr):
// query row r = h*m + i attends rows[r*stride .. r*stride + counts[r]) instead — distinct
// indices in [0, k.rows), any order. Masking by position applies in both cases.
struct Keys {
  Tensor3 k;
  Tensor3 v;  // same heads/rows/d as k; dtype may differ
  int64_t pos0 = 0;
  uint32_t begin = 0;
  uint32_t end = 0;
  const int32_t* rows = nullptr;    // [hq*m][stride]
  const int32_t* counts = nullptr;  // [hq*m]
  uint32_t stride = 0;
  // Sparse, M = 1: the rows of query heads mapped to one K/V head have equal lists (SHARED
  // sparse-auto), so a kernel may read each listed key once for all of them.
  bool shared_lists = false;
};

// Online-softmax state of n query rows, in caller-owned memory: m[n], l[n], o[n][d].
struct Partial {
  float* m = nullptr;
  float* l = nullptr;
  float* o = nullptr;
  size_t n = 0;
  uint32_t d = 0;
};

// Block selectors for sparse-auto (seed 004 §0x05J–0x05K).
enum class BlockSelector : uint8_t {
  kMean = 0,   // q · mean(k over the block): a cheap proxy, not a bound
  kQuest = 1,  // Σ_j max(q_j·min_j, q_j·max_j): an upper bound on q·k for every key in the block
};

// Per-head block summaries of K: blocks of `block` rows (the last may be partial).
// mean/min/max are [heads][nblocks][d] fp32, nblocks = ceil(rows / block).
struct BlockSummaries {
  float* mean = nullptr;
  float* min = nullptr;
  float* max = nullptr;
  uint32_t heads = 0;
  uint32_t nblocks = 0;
  uint32_t block = 0;
  uint32_t d = 0;
};

// ---- MLA: attention over shared latent rows ----------------------------------------------------
// DeepSeek V2/V3's Multi-head Latent Attention in the absorbed formulation. A token's cache row
// (a "latent") holds dv compressed values c (kv_lora_rank) then dk − dv decoupled-RoPE key values
// (rope_dim), and every query head attends the same rows: a head's query arrives already
// multiplied by W_UK (dv values) followed by its RoPE part (dk − dv values), its score against
// row t is s = scale · (q · row_t) over all dk values, and its output is Σ softmax(s)_t · c_t — the
// rows' first dv values (the caller applies W_UV). Partials are the usual (m, l, o), o of dv
// values, and merge like every other.

// Storage of latent rows. Every type is a codec's RAW row (src/store/codec/README.md), kept as
// stored: kF32/kF16/kBF16 dk elements; kFP8 [f32 scale][dk e4m3fn] (Pion's fp8: one scale per
// row); kFP8DsMla DeepSeek-V3.2's [dv e4m3fn][dv/128 f32 scales, one per 128 values][dk − dv
// bf16] (dv a multiple of 128, dk − dv = 64: 656 bytes for 512 + 64).
enum class LatentType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kFP8 = 3, kFP8DsMla = 4 };
std::string_view LatentTypeName(LatentType t);  // "fp32", "fp16", "bf16", "fp8", "fp8_ds_mla"
// Bytes of one stored latent row.
inline size_t LatentRowBytes(LatentType t, uint32_t dk, uint32_t dv) {
  switch (t) {
    case LatentType::kF32:
      return size_t{4} * dk;
    case LatentType::kFP8:
      return size_t{4} + dk;
    case LatentType::kFP8DsMla:
      return size_t{dv} + 4 * (dv / 128) + 2 * size_t{dk - dv};
    default:
      return size_t{2} * dk;
  }
}

// `rows` stored latent rows back to back (LatentRowBytes each; no alignment needed).
struct Latent {
  const uint8_t* data = nullptr;
  LatentType type = LatentType::kF32;
  uint32_t rows = 0;
  uint32_t dk = 0;  // kv_lora_rank + rope_dim: a query head's width
  uint32_t dv = 0;  // kv_lora_rank: an output row's width

  size_t row_bytes() const { return LatentRowBytes(type, dk, dv); }
  const uint8_t* Row(uint32_t t) const { return data + static_cast<size_t>(t) * row_bytes(); }
};

// Query rows of one MLA call: q [hq][m][dk] fp32 (each head's absorbed query, then its RoPE
// part); query row r = h*m + i is at absolute position pos0 + i.
struct LatentQueries {
  const float* q = nullptr;
  uint32_t hq = 0;
  uint32_t m = 0;
  int64_t pos0 = 0;
};

// The latent rows attended. Dense: rows [begin, end). Sparse (rows != nullptr): query token i —
// every head's row h*m + i — attends rows[i*stride .. i*stride + counts[i]) instead (distinct
// indices in [0, c.rows), any order): DeepSeek-V3.2's indexer picks them per token, for all
// heads. Key row t sits at position pos0 + t; masking by position applies in both cases.
struct LatentKeys {
  Latent c;
  int64_t pos0 = 0;
  uint32_t begin = 0;
  uint32_t end = 0;
  const int32_t* rows = nullptr;    // [m][stride]
  const int32_t* counts = nullptr;  // [m]
  uint32_t stride = 0;
};

class AttentionKernels {
 public:
  virtual ~AttentionKernels() = default;
  virtual std::string_view name() const = 0;

  // Overwrites out (n = q.hq * q.m, d = q.d) with the partial state of every query row over
  // `keys` under the causal/window mask. Preconditions (checked by the caller): shapes agree,
  // head_map entries valid, sparse indices in range.
  virtual void Attend(const Queries& q, const Keys& keys, float scale, int64_t window,
                      const Partial& out) const = 0;

  // Exact scaled scores of every query row against dense rows [keys.begin, keys.end):
  // out[(h*m + i) * (end - begin) + (t - begin)], −inf where the mask hides the key.
  virtual void Scores(const Queries& q, const Keys& keys, float scale, int64_t window,
                      float* out) const = 0;

  // Fills summaries (heads, nblocks, block, d already set; arrays allocated) from k.
  virtual void Summarize(const Tensor3& k, const BlockSummaries& out) const = 0;

  // Block scores of M=1 queries (q.m == 1): out[h * nblocks + b] by the selector, against the
  // summaries of K/V head head_map[h]. Unscaled (ranking only).
  virtual void ScoreBlocks(const Queries& q, const BlockSummaries& s, BlockSelector selector,
                           float* out) const = 0;

  // MLA: overwrites out (n = q.hq * q.m rows of d = keys.c.dv) with the partial state of every
  // query row over the latent rows of `keys` under the causal/window mask. Preconditions
  // (checked by the caller): dk and dv multiples of 16, dv < dk (or equal, no RoPE part),
  // kFP8DsMla's shape, sparse indices in range.
  virtual void AttendLatent(const LatentQueries& q, const LatentKeys& keys, float scale,
                            int64_t window, const Partial& out) const = 0;
};

// The scalar reference: plain loops, double accumulation, no SIMD. The oracle for the tests.
const AttentionKernels& ReferenceKernels();
// The CPU backend: Highway SIMD with runtime dispatch (AVX-512, AVX2, SSE4, scalar).
const AttentionKernels& CpuKernels();

// Partial-state algebra, shared by every backend (O(n·d), host memory).
// Empties `p` (m = −inf, l = 0, o = 0).
void ClearPartial(const Partial& p);
// into := into ⊕ from (the exact online-softmax merge; either side may be empty).
void MergePartial(const Partial& into, const Partial& from);
// out[n][d] = o / l (0 for an empty row); lse[n] = m + ln l (−inf for an empty row). lse may be
// null.
void FinalizePartial(const Partial& p, float* out, float* lse);

}  // namespace pion::kernels
