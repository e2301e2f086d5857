// What the GPU bench tools (pion-gpu-attn-bench, pion-gpu-decode-patterns) share: CK, which
// exits with the call and CUDA's message when a runtime call fails, and gpu_stream.cu's
// ceilings — the plain streaming read of `bytes` and an empty kernel (the launch floor).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// A streaming read of `bytes` at p over the `sms` multiprocessors, in form `kind`
// (gpu_stream.cu: 0 evict-first 16-byte loads, 1 and 2 four or eight non-coherent loads in
// flight a thread). kStreamKinds forms.
inline constexpr int kStreamKinds = 3;
void LaunchStreamRead(const void* p, size_t bytes, uint32_t* sink, int sms, cudaStream_t s,
                      int kind = 0);
// An empty kernel on `blocks` blocks of 128 threads.
void LaunchEmpty(int blocks, cudaStream_t s);
