// The GPU executor: runs one ATTEND.PREFIX plan over a slot's device copy with the CUDA kernels
// (kernels/cuda/cuda_attention.h) — the same forms, semantics and receipt as Run() on the CPU
// (executor.h), on the calling thread's compute stream:
//
//   upload Q (and the fused suffix, caller lists) through pinned scratch
//   → wait on the slot copy's ready event → split-K partial kernels (dense, or sparse over row
//   lists that top_k and sparse-auto select on the GPU) → combine into output and LSE
//   → download output, LSE and the few numbers the receipt needs → synchronize.
#pragma once

#include "attention/executor.h"
#include "attention/slot_store.h"
#include "residency/gpu_replica.h"

namespace pion::attention {

// `copy` is the slot's GPU replica (K is block 0, V block 1), pinned by the caller for the
// duration. `summaries` (the
// sparse-auto forms) are the slot's summaries for plan.block, filled on the GPU by the first
// query that needs them. out/lse are host memory as in Run(). MLA plans and slots are refused
// (kErr): they are computed on the CPU (RunMla) until a CUDA MLA kernel exists.
Status RunGpu(Plan plan, const Slot& slot, const residency::GpuReplica& copy, Summaries* summaries,
              float* out, float* lse, Receipt* receipt);

}  // namespace pion::attention
