// The ATTEND.* attention index (seed 000, seed 004 §0x07G–0x07G1, §0x07C): a session stages
// token K/V rows with their positions, FINALIZE builds an HNSW graph (hnswlib) over the keys
// staged so far and publishes it, and queries search the published graph for the top-k keys and
// can attend over the rows found.
//
// Contracts:
//   - Staged rows live in fixed-size chunks that never move: STORE appends with one copy per
//     chunk touched, and a published index keeps its own snapshot of the chunk list, so rows it
//     names are never reclaimed while it can return them (entries unreachable before rows go).
//   - An index covers rows [0, n) as of its FINALIZE (its generation); rows staged later are
//     invisible to queries until the next FINALIZE.
//   - Candidate ids are row indexes in the session; positions are the tokens' positions (a
//     STORE gives its start position): replies carry both.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/buffer.h"
#include "common/byte_budget.h"
#include "common/status.h"
#include "store/tenant_key.h"

namespace pion::store {

enum class IndexMetric : uint8_t { kIp = 0, kL2 = 1, kCos = 2 };
std::string_view IndexMetricName(IndexMetric m);

struct IndexParams {
  uint32_t key_dim = 0;
  uint32_t value_dim = 0;
  IndexMetric metric = IndexMetric::kIp;
  uint32_t m = 16;                 // graph degree
  uint32_t ef_construction = 200;  // build-time beam
};

// Rows in chunks of kChunkRows; a snapshot shares the chunks (append-only, never moved).
class IndexRows {
 public:
  static constexpr uint32_t kChunkRows = 4096;
  // One Buffer (BufferAllocator: large regions are reused, not faulted in afresh, and never
  // zero-filled) holding positions, keys and values.
  struct Chunk {
    BufferRef mem;
    int64_t* positions = nullptr;  // [kChunkRows]
    float* keys = nullptr;         // [kChunkRows][key_dim]
    float* values = nullptr;       // [kChunkRows][value_dim]
  };

  IndexRows() = default;
  IndexRows(uint32_t key_dim, uint32_t value_dim) : key_dim_(key_dim), value_dim_(value_dim) {}

  // Allocates the chunks n more rows need (kOom when the memory cannot be had; nothing changes).
  Status Reserve(uint64_t n);
  // Appends n rows (Reserve(n) first); row i gets position start_pos + i.
  void Append(const float* keys, const float* values, uint64_t n, int64_t start_pos);
  uint64_t size() const { return n_; }
  uint32_t key_dim() const { return key_dim_; }
  uint32_t value_dim() const { return value_dim_; }
  const float* Key(uint64_t i) const {
    return chunks_[i / kChunkRows]->keys + (i % kChunkRows) * key_dim_;
  }
  const float* Value(uint64_t i) const {
    return chunks_[i / kChunkRows]->values + (i % kChunkRows) * value_dim_;
  }
  int64_t Position(uint64_t i) const { return chunks_[i / kChunkRows]->positions[i % kChunkRows]; }
  // Bytes held by the chunks (allocated capacity).
  uint64_t bytes() const;
  // Bytes one more chunk costs.
  uint64_t chunk_bytes() const {
    return uint64_t{kChunkRows} * ((key_dim_ + value_dim_) * sizeof(float) + sizeof(int64_t));
  }
  // Chunks needed to hold `more` further rows.
  uint64_t ChunksFor(uint64_t more) const;

 private:
  uint32_t key_dim_ = 0, value_dim_ = 0;
  uint64_t n_ = 0;
  std::vector<std::shared_ptr<Chunk>> chunks_;
};

// Runs fn(0..n-1), possibly in parallel (WorkerPool::ParallelFor in the server).
using ParallelRun = std::function<void(size_t n, const std::function<void(size_t)>& fn)>;

// An HNSW graph over rows [0, rows.size()) of a snapshot; immutable once built.
class BuiltIndex {
 public:
  ~BuiltIndex();
  // Builds over every row of `rows` (inserts split over `parallel`), then calibrates the plan
  // below (the probes' exact scans and searches split over `parallel` too).
  static StatusOr<std::shared_ptr<const BuiltIndex>> Build(const IndexParams& p, IndexRows rows,
                                                           uint64_t generation,
                                                           const ParallelRun& parallel);

  struct Hit {
    uint32_t id = 0;  // row index in the session
    float score = 0;  // ip: q·k; cos: cosine similarity; l2: −‖q − k‖²
  };
  // The best `k` rows for query q (key_dim floats), best first; beam max(ef, k).
  std::vector<Hit> Search(const float* q, uint32_t k, uint32_t ef) const;
  // Exact top-k by the same score: a float scan of every key (vectorised) for the best
  // candidates, re-scored in double; best first, ties by id.
  std::vector<Hit> BruteForce(const float* q, uint32_t k) const;
  // BruteForce of each of m queries qs[0, m) (each key_dim floats), the keys read once a block
  // at a time for all of them: the same hits as m BruteForce calls.
  std::vector<std::vector<Hit>> BruteForceBatch(const float* const* qs, size_t m, uint32_t k) const;

  // How a query without EF runs, chosen at build time from a calibration: recall@32 against
  // BruteForce measured at doubling beams over probe queries of two kinds — stored keys (the
  // key distribution) and random directions of the keys' typical norm (queries are out of
  // distribution for their keys) — the worse kind counting. The default beam is the smallest
  // whose recall, less two standard errors over the probes, is at least kTargetRecall; when
  // none is, or when a search at that beam costs more than the scan (measured: the probes' mean
  // search against the median of a few lone scans), queries scan (exact).
  static constexpr double kTargetRecall = 0.98;
  struct Plan {
    bool scan = false;    // no EF given: exact scan
    uint32_t ef = 0;      // no EF given and !scan: this beam
    double recall = 1.0;  // the estimate for that choice
  };
  const Plan& plan() const { return plan_; }
  // The calibrated recall@32 estimate of a search with beam ef: that of the largest measured
  // beam not above ef. The calibration measures beam 32 (the narrowest a recall@32 search
  // uses) besides the doubling ones from 80, so a narrow EF reports its own beam's recall.
  double RecallAt(uint32_t ef) const;

  const IndexRows& rows() const { return rows_; }
  const IndexParams& params() const { return params_; }
  uint64_t generation() const { return generation_; }
  uint64_t bytes() const { return bytes_; }
  // The estimate for a query without EF (plan().recall).
  double recall_estimate() const { return plan_.recall; }
  // Wall time of the graph's build (key preparation and inserts) and of the calibration that
  // follows it, in milliseconds.
  double build_ms() const { return build_ms_; }
  double calibrate_ms() const { return calibrate_ms_; }

 private:
  BuiltIndex() = default;
  struct Graph;
  float Score(const float* q, const float* k) const;
  IndexParams params_;
  IndexRows rows_;
  uint64_t generation_ = 0;
  uint64_t bytes_ = 0;
  void Calibrate(const ParallelRun& parallel);
  double build_ms_ = 0, calibrate_ms_ = 0;
  Plan plan_;
  std::vector<std::pair<uint32_t, double>> recall_by_ef_;  // ascending beams
  std::unique_ptr<Graph> graph_;
};

// Attention over chosen rows: softmax of (q·k)/√key_dim over `ids`, output Σ p·v (value_dim
// floats) and its log-sum-exp (merge-compatible with ATTEND.PREFIX partials). ids empty: output
// 0, lse −inf.
void AttendRows(const IndexRows& rows, const float* q, const std::vector<uint32_t>& ids, float* out,
                float* lse);

// One ATTEND session: its parameters, staged rows and the published index (if any).
struct IndexSession {
  IndexParams params;
  IndexRows rows;
  std::shared_ptr<const BuiltIndex> index;  // null until the first FINALIZE completes
  uint64_t next_generation = 1;
  bool building = false;
  std::shared_ptr<std::atomic<uint64_t>> queries = std::make_shared<std::atomic<uint64_t>>(0);
  // Worker time spent on queries (search, and attention with ATTEND), in nanoseconds.
  std::shared_ptr<std::atomic<uint64_t>> query_ns = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t charged_rows = 0, charged_index = 0;  // bytes reserved against the budget
};

// A shard's ATTEND sessions. Shard thread only (gauges readable anywhere).
class IndexStore {
 public:
  void set_budget(ByteBudget b) { budget_ = std::move(b); }
  // kErr when the session exists.
  StatusOr<IndexSession*> Create(const TenantKey& sid, const IndexParams& p);
  IndexSession* Find(const TenantKey& sid);
  // Appends n rows (reserving the chunks they need first: kOom leaves the session unchanged).
  Status Append(IndexSession& s, const float* keys, const float* values, uint64_t n,
                int64_t start_pos);
  // Publishes a built index (charging its bytes; the previous index's are released).
  Status Publish(IndexSession& s, std::shared_ptr<const BuiltIndex> index);
  bool Drop(const TenantKey& sid);
  template <typename F>
  void ForEach(uint32_t tenant, F&& f) const {
    for (const auto& [k, s] : sessions_) {
      if (k.tenant == tenant) f(k, *s);
    }
  }

  struct Usage {
    uint64_t sessions = 0, rows = 0, indexed_rows = 0, bytes = 0;
  };
  Usage Total() const {
    return {sessions_gauge_.load(std::memory_order_relaxed),
            rows_gauge_.load(std::memory_order_relaxed),
            indexed_gauge_.load(std::memory_order_relaxed),
            bytes_gauge_.load(std::memory_order_relaxed)};
  }

 private:
  void Gauges();
  ByteBudget budget_;
  std::unordered_map<TenantKey, std::unique_ptr<IndexSession>, TenantKeyHash> sessions_;
  std::atomic<uint64_t> sessions_gauge_{0}, rows_gauge_{0}, indexed_gauge_{0}, bytes_gauge_{0};
};

}  // namespace pion::store
