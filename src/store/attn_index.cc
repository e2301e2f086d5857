#include "store/attn_index.h"

#include <hnswlib/hnswlib.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/vector_distance.h"

namespace pion::store {

std::string_view IndexMetricName(IndexMetric m) {
  switch (m) {
    case IndexMetric::kIp:
      return "ip";
    case IndexMetric::kL2:
      return "l2";
    case IndexMetric::kCos:
      return "cos";
  }
  return "ip";
}

// ---- Rows ----------------------------------------------------------------------------------

uint64_t IndexRows::ChunksFor(uint64_t more) const {
  const uint64_t have = chunks_.size() * uint64_t{kChunkRows};
  const uint64_t need = n_ + more;
  return need <= have ? 0 : (need - have + kChunkRows - 1) / kChunkRows;
}

uint64_t IndexRows::bytes() const { return chunks_.size() * chunk_bytes(); }

Status IndexRows::Reserve(uint64_t n) {
  const uint64_t more = ChunksFor(n);
  std::vector<std::shared_ptr<Chunk>> fresh;
  for (uint64_t i = 0; i < more; ++i) {
    auto mem = BufferAllocator::Default()->Allocate(chunk_bytes());
    if (!mem.ok()) return mem.status();
    auto c = std::make_shared<Chunk>();
    c->mem = std::move(mem).value();
    uint8_t* p = c->mem->data();  // 64-byte aligned; each part stays 8-byte aligned
    c->positions = reinterpret_cast<int64_t*>(p);
    c->keys = reinterpret_cast<float*>(p + size_t{kChunkRows} * sizeof(int64_t));
    c->values = c->keys + size_t{kChunkRows} * key_dim_;
    fresh.push_back(std::move(c));
  }
  for (auto& c : fresh) chunks_.push_back(std::move(c));
  return Status::Ok();
}

void IndexRows::Append(const float* keys, const float* values, uint64_t n, int64_t start_pos) {
  assert(ChunksFor(n) == 0);
  uint64_t done = 0;
  while (done < n) {
    Chunk& c = *chunks_[n_ / kChunkRows];
    const uint64_t at = n_ % kChunkRows;
    const uint64_t take = std::min<uint64_t>(n - done, kChunkRows - at);
    std::memcpy(c.keys + at * key_dim_, keys + done * key_dim_, take * key_dim_ * sizeof(float));
    std::memcpy(c.values + at * value_dim_, values + done * value_dim_,
                take * value_dim_ * sizeof(float));
    for (uint64_t i = 0; i < take; ++i) {
      c.positions[at + i] = start_pos + static_cast<int64_t>(done + i);
    }
    n_ += take;
    done += take;
  }
}

// ---- The graph -----------------------------------------------------------------------------

// Inner product is searched as L2 over keys augmented with one coordinate,
// sqrt(max‖k‖² − ‖k‖²), and queries augmented with 0: ‖q' − k'‖² = ‖q‖² + max‖k‖² − 2·q·k, so
// the nearest augmented key is the largest inner product (a proper metric for the graph, where
// a raw inner-product graph loses recall on clustered keys).
struct BuiltIndex::Graph {
  std::unique_ptr<hnswlib::SpaceInterface<float>> space;
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> hnsw;
  uint32_t dim = 0;      // of the vectors in the graph
  double max_norm2 = 0;  // inner product: max ‖k‖² over the rows
  // Rows spread over the session (up to 256): a query's layer-0 beam starts from the nearest of
  // them when it is nearer than where the descent through the upper layers ended — on clustered
  // keys the descent can end in another cluster, and the beam then misses the query's own.
  std::vector<hnswlib::tableint> seeds;
};

BuiltIndex::~BuiltIndex() = default;

namespace {

// hnswlib's space interface over the distance kernels (kernels/vector_distance.h), which keep
// several sums in the CPU's widest vectors where hnswlib's own spaces keep one SSE sum.
class VectorSpace final : public hnswlib::SpaceInterface<float> {
 public:
  VectorSpace(size_t dim, hnswlib::DISTFUNC<float> distance) : dim_(dim), distance_(distance) {}
  size_t get_data_size() override { return dim_ * sizeof(float); }
  hnswlib::DISTFUNC<float> get_dist_func() override { return distance_; }
  void* get_dist_func_param() override { return &dim_; }

 private:
  size_t dim_;
  hnswlib::DISTFUNC<float> distance_;
};

void Normalize(const float* in, uint32_t d, float* out) {
  double s = 0;
  for (uint32_t j = 0; j < d; ++j) s += double{in[j]} * in[j];
  const float inv = s > 0 ? static_cast<float>(1.0 / std::sqrt(s)) : 0.f;
  for (uint32_t j = 0; j < d; ++j) out[j] = in[j] * inv;
}

}  // namespace

StatusOr<std::shared_ptr<const BuiltIndex>> BuiltIndex::Build(const IndexParams& p, IndexRows rows,
                                                              uint64_t generation,
                                                              const ParallelRun& parallel) {
  const auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<BuiltIndex> idx(new BuiltIndex());
  idx->params_ = p;
  idx->rows_ = std::move(rows);
  idx->generation_ = generation;
  const uint64_t n = idx->rows_.size();
  auto g = std::make_unique<Graph>();
  const bool ip = p.metric == IndexMetric::kIp;
  g->dim = p.key_dim + (ip ? 1 : 0);
  g->space = std::make_unique<VectorSpace>(g->dim, p.metric == IndexMetric::kCos
                                                       ? kernels::InnerProductDistance()
                                                       : kernels::L2SquaredDistance());
  if (ip) {
    for (uint64_t i = 0; i < n; ++i) {
      double s = 0;
      for (uint32_t j = 0; j < p.key_dim; ++j)
        s += double{idx->rows_.Key(i)[j]} * idx->rows_.Key(i)[j];
      g->max_norm2 = std::max(g->max_norm2, s);
    }
  }
  try {
    g->hnsw = std::make_unique<hnswlib::HierarchicalNSW<float>>(
        g->space.get(), std::max<uint64_t>(n, 1), p.m, p.ef_construction, /*seed=*/100);
  } catch (const std::exception& e) {
    return Status(ErrorKind::kOom, std::string("cannot allocate the HNSW graph: ") + e.what());
  }
  hnswlib::HierarchicalNSW<float>* h = g->hnsw.get();
  const IndexRows& r = idx->rows_;
  const bool cos = p.metric == IndexMetric::kCos;
  const double max_norm2 = g->max_norm2;
  // Row i as the graph's vector (normalised for cos, augmented for ip; buf: g->dim floats).
  auto insert = [&](uint64_t i, float* buf) {
    if (cos) {
      Normalize(r.Key(i), p.key_dim, buf);
      h->addPoint(buf, i);
    } else if (ip) {
      const float* key = r.Key(i);
      double s = 0;
      for (uint32_t j = 0; j < p.key_dim; ++j) s += double{key[j]} * key[j];
      std::memcpy(buf, key, p.key_dim * sizeof(float));
      buf[p.key_dim] = static_cast<float>(std::sqrt(std::max(0.0, max_norm2 - s)));
      h->addPoint(buf, i);
    } else {
      h->addPoint(r.Key(i), i);
    }
  };
  // The first row alone (it becomes the entry point), then the rest claimed in small batches
  // by every thread the pool gives (as hnswlib's own parallel add_items claims rows), so no
  // thread idles while another finishes a large piece.
  std::vector<float> first(g->dim);
  if (n > 0) insert(0, first.data());
  constexpr uint64_t kBatch = 16;
  const uint64_t batches = n > 1 ? (n - 1 + kBatch - 1) / kBatch : 0;
  std::atomic<uint64_t> next{1};
  parallel(std::min<uint64_t>(batches, 256), [&](size_t) {
    std::vector<float> buf(g->dim);
    for (uint64_t a; (a = next.fetch_add(kBatch, std::memory_order_relaxed)) < n;) {
      for (uint64_t i = a, b = std::min(n, a + kBatch); i < b; ++i) insert(i, buf.data());
    }
  });
  for (uint64_t i = 0, count = std::min<uint64_t>(256, n); i < count; ++i) {
    g->seeds.push_back(static_cast<hnswlib::tableint>(h->label_lookup_.at(n * i / count)));
  }
  idx->graph_ = std::move(g);
  idx->bytes_ = n * (h->size_data_per_element_ + h->size_links_per_element_ / 2) +
                n * sizeof(void*) + h->max_elements_ * sizeof(hnswlib::labeltype);
  const auto t1 = std::chrono::steady_clock::now();
  idx->build_ms_ = std::chrono::duration<double, std::milli>(t1 - t0).count();
  idx->Calibrate(parallel);
  idx->calibrate_ms_ =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  return std::shared_ptr<const BuiltIndex>(std::move(idx));
}

float BuiltIndex::Score(const float* q, const float* k) const {
  const uint32_t d = params_.key_dim;
  double s = 0;
  if (params_.metric == IndexMetric::kL2) {
    for (uint32_t j = 0; j < d; ++j) s -= double{q[j] - k[j]} * (q[j] - k[j]);
    return static_cast<float>(s);
  }
  double qq = 0, kk = 0;
  for (uint32_t j = 0; j < d; ++j) {
    s += double{q[j]} * k[j];
    qq += double{q[j]} * q[j];
    kk += double{k[j]} * k[j];
  }
  if (params_.metric == IndexMetric::kCos) {
    return qq > 0 && kk > 0 ? static_cast<float>(s / std::sqrt(qq * kk)) : 0.f;
  }
  return static_cast<float>(s);
}

std::vector<BuiltIndex::Hit> BuiltIndex::Search(const float* q, uint32_t k, uint32_t ef) const {
  hnswlib::HierarchicalNSW<float>* h = graph_->hnsw.get();
  std::vector<Hit> out;
  if (h->cur_element_count == 0 || k == 0) return out;
  std::vector<float> qn;
  const float* qv = q;
  if (params_.metric == IndexMetric::kCos) {
    qn.resize(params_.key_dim);
    Normalize(q, params_.key_dim, qn.data());
    qv = qn.data();
  } else if (params_.metric == IndexMetric::kIp) {
    qn.assign(q, q + params_.key_dim);
    qn.push_back(0.f);
    qv = qn.data();
  }
  // Greedy descent through the upper layers, then a beam of max(ef, k) on layer 0.
  hnswlib::tableint cur = h->enterpoint_node_;
  float best = h->fstdistfunc_(qv, h->getDataByInternalId(cur), h->dist_func_param_);
  for (int level = h->maxlevel_; level > 0; --level) {
    for (bool moved = true; moved;) {
      moved = false;
      auto* list = reinterpret_cast<unsigned int*>(h->get_linklist(cur, level));
      const int size = h->getListCount(list);
      const auto* next = reinterpret_cast<const hnswlib::tableint*>(list + 1);
      for (int i = 0; i < size; ++i) {
        const float d = h->fstdistfunc_(qv, h->getDataByInternalId(next[i]), h->dist_func_param_);
        if (d < best) {
          best = d;
          cur = next[i];
          moved = true;
        }
      }
    }
  }
  for (hnswlib::tableint seed : graph_->seeds) {
    const float d = h->fstdistfunc_(qv, h->getDataByInternalId(seed), h->dist_func_param_);
    if (d < best) {
      best = d;
      cur = seed;
    }
  }
  auto top = h->searchBaseLayerST<false>(cur, qv, std::max<size_t>(ef, k));
  while (top.size() > k) top.pop();
  out.resize(top.size());
  for (size_t i = out.size(); i-- > 0; top.pop()) {
    const uint32_t id = static_cast<uint32_t>(h->getExternalLabel(top.top().second));
    out[i] = {id, Score(q, rows_.Key(id))};
  }
  return out;
}

std::vector<BuiltIndex::Hit> BuiltIndex::BruteForce(const float* q, uint32_t k) const {
  return std::move(BruteForceBatch(&q, 1, k).front());
}

std::vector<std::vector<BuiltIndex::Hit>> BuiltIndex::BruteForceBatch(const float* const* qs,
                                                                      size_t m, uint32_t k) const {
  const uint64_t n = rows_.size();
  const uint32_t d = params_.key_dim;
  std::vector<std::vector<Hit>> out(m);
  if (n == 0 || k == 0) return out;
  // A float score that orders like Score: ip q·k; cos q·k/‖k‖ (‖q‖ is common); l2 2q·k − ‖k‖².
  // Keys a block at a time (it stays in cache while every query reads it); q·k in float by the
  // SIMD kernel.
  const kernels::VectorDistanceFn dot = kernels::DotProduct();
  const size_t dim = d;
  constexpr uint64_t kBlock = 64;
  std::vector<std::vector<std::pair<float, uint32_t>>> cand(m);
  for (auto& c : cand) c.resize(n);
  float kk[kBlock];
  for (uint64_t b = 0; b < n; b += kBlock) {
    const uint64_t e = std::min(n, b + kBlock);
    if (params_.metric != IndexMetric::kIp) {
      for (uint64_t i = b; i < e; ++i) kk[i - b] = dot(rows_.Key(i), rows_.Key(i), &dim);
    }
    for (size_t j = 0; j < m; ++j) {
      for (uint64_t i = b; i < e; ++i) {
        float s = dot(qs[j], rows_.Key(i), &dim);
        if (params_.metric == IndexMetric::kCos) {
          s = kk[i - b] > 0 ? s / std::sqrt(kk[i - b]) : 0.f;
        } else if (params_.metric == IndexMetric::kL2) {
          s = 2 * s - kk[i - b];
        }
        cand[j][i] = {s, static_cast<uint32_t>(i)};
      }
    }
  }
  // The float scores can differ from the double ones in their last bits: keep a margin of
  // candidates, then order those exactly.
  const size_t keep = std::min<size_t>(n, size_t{k} * 2 + 16);
  for (size_t j = 0; j < m; ++j) {
    std::nth_element(cand[j].begin(), cand[j].begin() + (keep - 1), cand[j].end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    std::vector<Hit>& all = out[j];
    all.resize(keep);
    for (size_t i = 0; i < keep; ++i) {
      all[i] = {cand[j][i].second, Score(qs[j], rows_.Key(cand[j][i].second))};
    }
    std::sort(all.begin(), all.end(), [](const Hit& x, const Hit& y) {
      return x.score > y.score || (x.score == y.score && x.id < y.id);
    });
    all.resize(std::min<size_t>(k, all.size()));
  }
  return out;
}

void BuiltIndex::Calibrate(const ParallelRun& parallel) {
  const uint64_t n = rows_.size();
  const uint32_t d = params_.key_dim;
  const uint32_t k = static_cast<uint32_t>(std::min<uint64_t>(32, n));
  if (n == 0) return;
  // Probes: up to 64 stored keys, and twice as many random directions scaled to the keys' mean
  // norm (a search's misses there come in rare, deep failures: many probes see them).
  const uint32_t per_kind = static_cast<uint32_t>(std::min<uint64_t>(64, n));
  double norm = 0;
  for (uint32_t s = 0; s < per_kind; ++s) {
    const float* key = rows_.Key(n * s / per_kind);
    double kk = 0;
    for (uint32_t j = 0; j < d; ++j) kk += double{key[j]} * key[j];
    norm += std::sqrt(kk) / per_kind;
  }
  uint64_t x = 0x9E3779B97F4A7C15ull ^ n;
  auto uniform = [&x] {  // SplitMix64 -> (0, 1)
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (static_cast<double>((z ^ (z >> 31)) >> 11) + 0.5) / 9007199254740992.0;
  };
  // probes[0, per_kind): the stored keys; the rest: the random directions.
  std::vector<std::vector<float>> probes;
  std::vector<std::vector<float>> directions;
  for (uint32_t s = 0; s < 2 * per_kind; ++s) {
    if (s < per_kind) {
      const float* key = rows_.Key(n * s / per_kind);
      probes.emplace_back(key, key + d);
    }
    std::vector<float> g(d);
    double gg = 0;
    for (uint32_t j = 0; j < d; ++j) {  // Box-Muller
      g[j] = static_cast<float>(std::sqrt(-2 * std::log(uniform())) *
                                std::cos(6.283185307179586 * uniform()));
      gg += double{g[j]} * g[j];
    }
    const float scale = gg > 0 ? static_cast<float>(norm / std::sqrt(gg)) : 0.f;
    for (float& v : g) v *= scale;
    directions.push_back(std::move(g));
  }
  for (auto& g : directions) probes.push_back(std::move(g));
  const size_t count = probes.size();
  std::vector<const float*> qs(count);
  for (size_t i = 0; i < count; ++i) qs[i] = probes[i].data();
  // The exact answers: groups of probes, each group in one pass over the keys, in parallel.
  std::vector<std::vector<Hit>> truth(count);
  constexpr size_t kGroup = 16;
  parallel((count + kGroup - 1) / kGroup, [&](size_t group) {
    const size_t a = group * kGroup, b = std::min(count, a + kGroup);
    auto got = BruteForceBatch(qs.data() + a, b - a, k);
    for (size_t i = a; i < b; ++i) truth[i] = std::move(got[i - a]);
  });
  // What a query's exact scan costs alone (what a query without EF would otherwise pay): the
  // median of a few scans, one at a time.
  constexpr size_t kScanSamples = 7;
  std::vector<double> scans;
  for (size_t i = 0; i < std::min(kScanSamples, count); ++i) {
    const auto s0 = std::chrono::steady_clock::now();
    (void)BruteForce(qs[i * count / std::min(kScanSamples, count)], k);
    scans.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
  }
  std::nth_element(scans.begin(), scans.begin() + scans.size() / 2, scans.end());
  const double scan_s = scans[scans.size() / 2];
  plan_ = Plan{true, 0, 1.0};
  std::vector<double> recall(count), seconds(count);
  constexpr size_t kPiece = 8;  // probes a parallel piece searches
  // Recall@k of every probe at one beam; returns the worse kind's mean recall and its lower
  // bound (mean − 2 standard errors), and the probes' mean search time.
  struct Measured {
    double worst, worst_bound, search_s;
  };
  auto measure = [&](uint32_t beam) {
    parallel((count + kPiece - 1) / kPiece, [&](size_t piece) {
      for (size_t p = piece * kPiece; p < std::min(count, (piece + 1) * kPiece); ++p) {
        const auto s0 = std::chrono::steady_clock::now();
        auto got = Search(qs[p], k, beam);
        seconds[p] = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
        uint32_t found = 0;
        for (const Hit& e : truth[p]) {
          for (const Hit& h : got) {
            if (h.id == e.id) {
              ++found;
              break;
            }
          }
        }
        recall[p] = truth[p].empty() ? 1.0 : double(found) / truth[p].size();
      }
    });
    Measured m{1.0, 1.0, 0};
    for (int kind = 0; kind < 2; ++kind) {
      const size_t a = kind == 0 ? 0 : per_kind, b = kind == 0 ? per_kind : count;
      double sum = 0, sum2 = 0;
      for (size_t p = a; p < b; ++p) {
        sum += recall[p];
        sum2 += recall[p] * recall[p];
        m.search_s += seconds[p] / count;
      }
      const size_t c = b - a;
      const double mean = sum / c;
      const double var = c > 1 ? std::max(0.0, (sum2 - sum * mean) / (c - 1)) : 0.0;
      const double bound = mean - 2 * std::sqrt(var / c);
      if (bound < m.worst_bound) m.worst_bound = bound, m.worst = mean;
    }
    return m;
  };
  constexpr uint32_t kFirstDefaultBeam = 80;
  // The narrowest beam a query can ask for (EF below k searches with k): measured too, so that
  // the receipt of a narrow EF reports its own recall rather than a wider beam's.
  if (k < kFirstDefaultBeam && k < n) recall_by_ef_.push_back({k, measure(k).worst});
  for (uint64_t ef = std::max<uint32_t>(k, kFirstDefaultBeam);; ef *= 2) {
    const uint32_t beam = static_cast<uint32_t>(std::min<uint64_t>(ef, n));
    const Measured m = measure(beam);
    recall_by_ef_.push_back({beam, m.worst});
    if (m.search_s >= scan_s) break;  // wider beams only cost more than the exact scan
    if (m.worst_bound >= kTargetRecall) {
      plan_ = Plan{false, beam, m.worst};
      break;
    }
    if (beam >= n) break;
  }
}

double BuiltIndex::RecallAt(uint32_t ef) const {
  if (recall_by_ef_.empty()) return 1.0;
  double r = recall_by_ef_.front().second;
  for (const auto& [beam, recall] : recall_by_ef_) {
    if (beam <= ef) r = recall;
  }
  return r;
}

void AttendRows(const IndexRows& rows, const float* q, const std::vector<uint32_t>& ids, float* out,
                float* lse) {
  const uint32_t dk = rows.key_dim(), dv = rows.value_dim();
  std::fill(out, out + dv, 0.f);
  if (ids.empty()) {
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  std::vector<double> s(ids.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < ids.size(); ++i) {
    const float* k = rows.Key(ids[i]);
    double dot = 0;
    for (uint32_t j = 0; j < dk; ++j) dot += double{q[j]} * k[j];
    s[i] = dot * scale;
    mx = std::max(mx, s[i]);
  }
  std::vector<double> acc(dv, 0.0);
  double l = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const double p = std::exp(s[i] - mx);
    l += p;
    const float* v = rows.Value(ids[i]);
    for (uint32_t j = 0; j < dv; ++j) acc[j] += p * v[j];
  }
  for (uint32_t j = 0; j < dv; ++j) out[j] = static_cast<float>(acc[j] / l);
  *lse = static_cast<float>(mx + std::log(l));
}

// ---- Sessions ------------------------------------------------------------------------------

StatusOr<IndexSession*> IndexStore::Create(const TenantKey& sid, const IndexParams& p) {
  auto [it, added] = sessions_.try_emplace(sid);
  if (!added) {
    return Error("attention session '" + sid.name.substr(0, 128) +
                 "' already exists; ATTEND.DROP it first");
  }
  it->second = std::make_unique<IndexSession>();
  it->second->params = p;
  it->second->rows = IndexRows(p.key_dim, p.value_dim);
  Gauges();
  return it->second.get();
}

IndexSession* IndexStore::Find(const TenantKey& sid) {
  auto it = sessions_.find(sid);
  return it == sessions_.end() ? nullptr : it->second.get();
}

Status IndexStore::Append(IndexSession& s, const float* keys, const float* values, uint64_t n,
                          int64_t start_pos) {
  const uint64_t more = s.rows.ChunksFor(n) * s.rows.chunk_bytes();
  if (more > 0 && budget_.reserve) {
    Status st = budget_.reserve(more);
    if (!st.ok()) return st;
  }
  if (Status st = s.rows.Reserve(n); !st.ok()) {
    if (more > 0 && budget_.release) budget_.release(more);
    return st;
  }
  s.charged_rows += more;
  s.rows.Append(keys, values, n, start_pos);
  Gauges();
  return Status::Ok();
}

Status IndexStore::Publish(IndexSession& s, std::shared_ptr<const BuiltIndex> index) {
  const uint64_t bytes = index->bytes();
  if (bytes > s.charged_index && budget_.reserve) {
    Status st = budget_.reserve(bytes - s.charged_index);
    if (!st.ok()) return st;
  } else if (bytes < s.charged_index && budget_.release) {
    budget_.release(s.charged_index - bytes);
  }
  s.charged_index = bytes;
  s.index = std::move(index);
  Gauges();
  return Status::Ok();
}

bool IndexStore::Drop(const TenantKey& sid) {
  auto it = sessions_.find(sid);
  if (it == sessions_.end()) return false;
  if (budget_.release) budget_.release(it->second->charged_rows + it->second->charged_index);
  sessions_.erase(it);
  Gauges();
  return true;
}

void IndexStore::Gauges() {
  uint64_t rows = 0, indexed = 0, bytes = 0;
  for (const auto& [k, s] : sessions_) {
    rows += s->rows.size();
    indexed += s->index ? s->index->rows().size() : 0;
    bytes += s->charged_rows + s->charged_index;
  }
  sessions_gauge_.store(sessions_.size(), std::memory_order_relaxed);
  rows_gauge_.store(rows, std::memory_order_relaxed);
  indexed_gauge_.store(indexed, std::memory_order_relaxed);
  bytes_gauge_.store(bytes, std::memory_order_relaxed);
}

}  // namespace pion::store
