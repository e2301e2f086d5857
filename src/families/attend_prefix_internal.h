// Helpers shared by the ATTEND.PREFIX command files (attend_prefix_family.cc: slots, STORE,
// STORE FROM, LOOKUP, DROP, INFO; attend_prefix_query.cc: the QUERY forms and how a query runs;
// attend_prefix_mla.cc: the MLA query forms). Not a public interface.
#pragma once

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attention/cost_model.h"
#include "attention/executor.h"
#include "attention/slot_store.h"
#include "common/buffer.h"
#include "common/status.h"
#include "kernels/attention.h"
#include "proto/cmd_args.h"
#include "residency/gpu_replica.h"
#include "residency/tier.h"
#include "server/command.h"

namespace pion::server {
class Server;
}

namespace pion::families::attend {

// The head dims every backend supports.
inline constexpr uint32_t kHeadDims[] = {32, 64, 96, 128, 160, 192, 256, 512};
inline constexpr uint32_t kMaxHeads = 1024;
inline constexpr uint32_t kMaxRows = 1u << 26;  // tokens per slot
inline constexpr uint32_t kMaxLayer = 1u << 20;

Status ParseLayer(std::string_view text, uint32_t* out);
// "<what> must be in [1, max], got x".
Status ParseCount(std::string_view text, std::string_view what, uint32_t max, uint32_t* out);
// D: one of kHeadDims.
Status ParseHeadDim(std::string_view text, uint32_t* out);

// "<what> must be <formula> = <expected> bytes (<shape>), got <got>".
Status CheckBlobSize(std::string_view what, std::string_view formula, uint64_t expected,
                     uint64_t got);

// The slot for (sid, layer) on the calling shard, or kMiss naming both.
StatusOr<attention::SlotRef> FindSlot(server::CommandContext& ctx, std::string_view sid,
                                      uint32_t layer);

// The backend that computes ATTEND.PREFIX queries (--attention-backend).
const kernels::AttentionKernels& Kernels(server::Server& srv);
std::string_view BackendName(server::Server& srv);

void RegisterQueryCommands(server::Server& srv);
// The MLA query forms (attend_prefix_mla.cc).
void RegisterMlaQueryCommands(server::Server& srv);

// ---- a query on its way to the compute pool (attend_prefix_query.cc) ----------------------------

// A query parsed and validated on the slot's shard.
struct QueryJob {
  attention::SlotRef slot;
  // The bytes it computes over, held for the job's life: host blocks (K, V) for the CPU
  // kernels, or a pin on the GPU replica.
  BufferRef k, v;
  std::shared_ptr<residency::GpuPin> gpu;
  const char* tier = "host";
  std::string fallback;  // why it computed elsewhere than asked ("" when it did not)
  residency::Deadline deadline = residency::kNoDeadline;
  attention::Plan plan;
  std::vector<BufferRef> hold;  // argument buffers the plan points into
  std::vector<int32_t> head_map;
  std::shared_ptr<attention::Summaries> summaries;
  // What the cost model expects of it (Admit): its key, work and seconds once started (0:
  // nothing comparable measured yet), and whether it runs on the shard thread.
  attention::CostKey key;
  attention::Work work;
  double estimate = 0;
  bool inline_run = false;
  size_t out_rows = 0;
  bool with_lse = false;
  bool receipt = false;
  bool audit = false;  // AUDIT: the receipt also has the exact omitted mass
  // When it was handed to the compute pool (queue_us in the receipt); unset when it ran inline.
  std::optional<std::chrono::steady_clock::time_point> submitted;
};

// Positions stay far from int64 overflow: QPOS + M, and position − window, are always exact.
constexpr int64_t kMaxPosition = int64_t{1} << 62;

// The optional tail: [<fa_window>] [QPOS <p>] [SELECT mean|quest] [SHARED] [RECENT <blocks>]
// [RECEIPT] [AUDIT].
struct Tail {
  int64_t window = 0;
  std::optional<int64_t> qpos;
  kernels::BlockSelector selector = kernels::BlockSelector::kMean;
  bool shared = false;
  uint32_t recent = 0;  // RECENT <blocks> (the sparse-auto forms)
  bool receipt = false;
  bool audit = false;  // AUDIT: a receipt with the exact omitted mass (implies RECEIPT)
};

// `admission`: the DEADLINE / ALLOW APPROX options the command also takes, for the error.
// allow_audit: the per-head forms take AUDIT (the MLA forms do not).
Status ParseTail(const proto::CmdArgs& args, size_t i, bool allow_qpos, bool allow_select,
                 bool allow_audit, std::string_view admission, Tail* t);
// Takes argument i as a Buffer the job keeps (adopted when it was received into its own).
StatusOr<BufferRef> Take(proto::CmdArgs& args, size_t i, QueryJob* job);
template <typename T>
const T* As(const BufferRef& b) {
  return reinterpret_cast<const T*>(b->data());
}
// Validates `lists` index lists of a sparse query (list i: rows[i·kmax, i·kmax + counts[i]))
// against a slot of n rows: each count in [0, kmax], each index in [0, n) and not repeated
// within its list. `owner` names what a list belongs to in the error ("head", "token").
Status CheckIndexLists(const int32_t* rows, const int32_t* counts, uint32_t lists, uint32_t kmax,
                       uint32_t n, std::string_view owner);
// "(name=v name=v ...)" for size errors.
std::string Shape(std::initializer_list<std::pair<const char*, uint64_t>> dims);
// Runs the job: brings the slot's bytes where it computes (parking the command while they are
// promoted), admits it against its deadline, then computes it on the shard thread when small,
// else on the compute pool; the reply is written when it finishes. Runs on the slot's shard.
void Submit(server::CommandContext& ctx, std::shared_ptr<QueryJob> job);

}  // namespace pion::families::attend
