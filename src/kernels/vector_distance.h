// Distances between two fp32 vectors for nearest-neighbour graphs: the ATTEND.* index
// (store/attn_index.cc) builds and searches its hnswlib graph with them. hnswlib's own loops are
// SSE with one running sum (every add waits on the previous one) and leave the elements past the
// last multiple of 16 to a second, scalar call; these keep four sums in the widest vectors the
// CPU has (Highway, runtime dispatch: AVX-512, AVX2 with FMA, SSE4, …) and take the tail in the
// same call. Sums are in float, in another order than hnswlib's, so results differ from its
// in the last bits.
//
// The functions have the calling convention of hnswlib's distance callbacks (DISTFUNC<float>):
// the two vectors (unaligned is fine) and a pointer to their length in elements (a size_t).
// Thread-safe.
#pragma once

namespace pion::kernels {

using VectorDistanceFn = float (*)(const void* a, const void* b, const void* dim);

// Σ (a_j − b_j)² (hnswlib's L2Space).
VectorDistanceFn L2SquaredDistance();
// 1 − Σ a_j · b_j (hnswlib's InnerProductSpace).
VectorDistanceFn InnerProductDistance();
// Σ a_j · b_j — not a distance (larger is nearer): the exact scans' float scores.
VectorDistanceFn DotProduct();

}  // namespace pion::kernels
