// The executor: runs one ATTEND.PREFIX query form over a slot with an AttentionKernels backend —
// the plan the wire command was parsed into, split-K across threads, exact merges, block
// selection for the sparse forms, and the receipt that says what was computed.
//
// Semantics (seed 004 §0x04W/§0x07A, §0x05, §0x09G–0x09K):
//   - prefix keys sit at positions 0..N−1, suffix keys (fused forms) at N..N+S−1;
//   - plain and sparse forms put query row i at q_pos0 + i (default N: right after the prefix);
//     fused forms put the M queries at the last M suffix positions;
//   - a query sees keys at positions <= its own and, with window W > 0, > its own − W;
//   - dense forms are exact; top_k, caller-sparse and sparse-auto are approximate unless their
//     support covers every visible key, and the receipt says which.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kernels/attention.h"

namespace pion::attention {

enum class Form : uint8_t {
  kDense,
  kTopK,
  kFused,
  kSparse,
  kSparseAuto,
  kSparseAutoFused,
  kMla,        // MLA (latent rows shared by every head): dense, MTP rows causal among themselves
  kMlaSparse,  // MLA over caller-chosen rows per query token (DeepSeek-V3.2's indexer)
  kMlaFused,   // MLA over the prefix and the client's suffix latents, merged
};
std::string_view FormName(Form f);
inline constexpr int kFormCount = 9;
inline bool IsMla(Form f) {
  return f == Form::kMla || f == Form::kMlaSparse || f == Form::kMlaFused;
}

struct Plan {
  Form form = Form::kDense;
  kernels::Queries q;  // q.pos0 is filled by the executor for fused forms
  int64_t window = 0;
  float scale = 0;  // 0: 1/sqrt(d)
  uint32_t top_k = 0;
  // Fused forms: the suffix K/V [heads][s][d] fp32.
  kernels::Tensor3 k_suffix, v_suffix;
  // kSparse: caller rows [hq][stride], counts [hq] (validated by the caller).
  const int32_t* rows = nullptr;
  const int32_t* counts = nullptr;
  uint32_t stride = 0;
  // Sparse-auto forms.
  uint32_t block = 0;
  uint32_t k_top = 0;
  kernels::BlockSelector selector = kernels::BlockSelector::kMean;
  // SHARED: the query heads of one K/V head choose one set of blocks together, each block
  // ranked by the highest of their scores (so the group reads each chosen K/V row once).
  bool shared_blocks = false;
  // RECENT: the `recent` visible blocks before the last are always among the chosen (they
  // count in k_top): a decode step's local context, whatever the scores say.
  uint32_t recent = 0;
  kernels::BlockSummaries summaries;  // filled for the slot's K, block size `block`
  // Compute Receipt::omitted_mass_bound (asked with RECEIPT): for sparse-auto one more block
  // scoring pass (Quest's bound) where the selector is mean.
  bool mass_bound = false;
  // Compute Receipt::omitted_mass_exact (AUDIT): every visible prefix key scored once more.
  bool audit = false;
  // MLA forms (RunMla, over latent rows): q is [hq][m][dk] with q.d = dk (kv_lora_rank +
  // rope_dim; q.head_map unused: every head reads the one latent), outputs have dv =
  // kv_lora_rank values, `scale` is the caller's. kMlaSparse: rows/counts/stride are per query
  // token ([m][stride], [m]) and shared by its heads. kMlaFused: the client's suffix latents,
  // fp32 [S][dk], at positions N..N+S−1, the m queries at the last m of them.
  uint32_t dv = 0;
  kernels::Latent latent_suffix;
};

struct Receipt {
  bool exact = true;
  uint64_t rows_attended = 0;     // Σ over query rows of keys attended
  uint64_t visible_rows = 0;      // Σ over query rows of keys the mask allows
  std::vector<uint64_t> support;  // per query head: keys attended (summed over its rows)
  std::vector<std::vector<uint32_t>> blocks;  // sparse-auto: per query head, chosen blocks
  uint32_t blocks_total = 0;                  // sparse-auto: blocks visible per head
  double omitted_mass_estimate = 0;  // block-mean proxy (sparse-auto), exact scores (top_k)
  // A bound never below the true share of softmax mass left out (mean over query rows; the
  // mass of every row the query sees, prefix and suffix): sparse-auto from Quest's per-block
  // bound on q·k over the blocks left out against the exact mass of the rows attended (with
  // Plan::mass_bound; else 0), top_k the exact share, caller-chosen rows 1 unless they cover
  // every visible key, exact forms 0.
  double omitted_mass_bound = 0;
  // With Plan::audit: the true share left out (mean over query rows, of all the mass the row
  // sees) — sparse-auto and caller-chosen rows from every visible prefix key's exact score,
  // top_k its exact estimate, 0 for exact forms.
  double omitted_mass_exact = 0;
  uint32_t splits = 1;  // key-range pieces computed in parallel
  double micros = 0;    // the whole computation (pieces, merge)
  // Where the time of a split dense pass went (0 when it was not split): the latest start of a
  // piece after the pass began (the hand-off to the other threads), the longest piece, and the
  // merge of the pieces' partials.
  double piece_start_max_us = 0;
  double piece_max_us = 0;
  double merge_us = 0;
  double queue_us = 0;     // set by the server: admitted -> a compute thread started the query
  double estimate_us = 0;  // set by the server: the cost model's estimate of `micros` (0: none)
};

// Runs pieces in parallel: WorkerPool::ParallelFor in the server, a plain loop in tests.
struct Parallel {
  int threads = 1;
  std::function<void(size_t n, const std::function<void(size_t)>& fn)> run;
  void For(size_t n, const std::function<void(size_t)>& fn) const {
    if (run && n > 1) return run(n, fn);
    for (size_t i = 0; i < n; ++i) fn(i);
  }
};

// Output rows: q.hq * q.m for the dense/top_k forms and the fused forms, q.hq for the sparse
// forms (M = 1). out receives rows * d floats, lse (may be null) rows floats.
// The caller has validated shapes; Run only fails on internal limits.
Status Run(const kernels::AttentionKernels& kernels, const Parallel& parallel, Plan plan,
           const kernels::Tensor3& k, const kernels::Tensor3& v, float* out, float* lse,
           Receipt* receipt);

// MLA forms over the latent rows `c` (c.dk = plan.q.d, c.dv = plan.dv): out receives hq·m·dv
// floats, lse hq·m (may be null) — every form returns both, mergeable with the client's own
// partials. Dense passes are split by row range across `parallel` and merged exactly; sparse
// lists by their positions. The caller has validated shapes and lists.
Status RunMla(const kernels::AttentionKernels& kernels, const Parallel& parallel, Plan plan,
              const kernels::Latent& c, float* out, float* lse, Receipt* receipt);

// Fills block summaries of k (heads, nblocks, block, d set; arrays allocated), the K/V heads
// split across `parallel`.
void Summarize(const kernels::AttentionKernels& kernels, const Parallel& parallel,
               const kernels::Tensor3& k, const kernels::BlockSummaries& out);

// Quest's bound on the share of softmax mass one sparse-auto query row left out (seed 004
// §0x05J): every key of block b scores at most ub[b] (Σ_j max(q_j·min_j, q_j·max_j), unscaled),
// so the visible blocks not `chosen` (ascending) hold at most Σ rows_b · exp(scale · ub[b]) of
// exp-mass; against `lse`, the log of the exact exp-mass the row attended (chosen rows, and a
// fused form's suffix), the share left out is at most that sum over itself plus the attended
// mass. Visible rows [lo, hi) in blocks of `block` rows. 0 when every visible block was chosen.
double OmittedMassBound(const float* ub, const std::vector<uint32_t>& chosen, uint32_t block,
                        uint64_t lo, uint64_t hi, float scale, float lse);

// RECENT: the blocks [first, second) that always rank first — the `recent` visible blocks
// before the last of blocks b_lo..b_hi, never the first (chosen anyway); empty for 0.
std::pair<uint32_t, uint32_t> RecentBlocks(uint32_t b_lo, uint32_t b_hi, uint32_t recent);

// log Σ exp(scores[t]) over the t < n not `kept` (AUDIT: the exact exp-mass a row left out);
// −inf when every t was kept.
double LogSumExpLeftOut(const float* scores, const uint8_t* kept, size_t n);

// The share of softmax mass a row left out, from the log of the exp-mass of the keys it left
// out (`log_left`, −inf for none) and `lse`, the log of the exp-mass it attended.
double ShareLeftOut(double log_left, float lse);

// How many key-range pieces a dense pass over `rows` rows should use with `threads` threads.
uint32_t SplitsFor(uint64_t bytes_read, uint64_t rows, int threads);

}  // namespace pion::attention
