// GPU-only pieces shared by the kl_penalty and policy_loss kernels: grid sizing, element
// addressing of [rows, cols] strided views, and the deterministic two-stage reduction (per-block
// partials merged in shared memory, then one block that merges the partials in block order and
// finalises). The per-element math lives in megalign/math/*.h, shared with the CPU kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "megalign/kl_policy_common.h"

namespace megalign::cuda::detail {

constexpr int kThreads = 256;                  // a power of two: block_merge halves it
constexpr int64_t kMaxElementwiseBlocks = 8192;  // grid-stride loops cover the rest
constexpr int64_t kMaxReduceBlocks = 1024;       // bounds the partials the final block merges

inline int grid_blocks(int64_t n, int64_t max_blocks) {
  return n <= 0 ? 0 : static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, max_blocks));
}

// Offset of flat element i = r*cols + c in view v: i itself when every operand is dense.
template <bool Dense>
__device__ __forceinline__ int64_t at(const StridedView& v, int64_t i, int64_t cols) {
  if (Dense) return i;
  const int64_t r = i / cols;
  return element_offset(v, r, i - r * cols);
}

__device__ __forceinline__ int64_t grid_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_step() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Merges one partial per thread (P has merge()); every thread returns the block total. Launch
// with kThreads threads.
template <typename P>
__device__ P block_merge(const P& v) {
  __shared__ alignas(P) unsigned char raw[sizeof(P) * kThreads];
  P* shared = reinterpret_cast<P*>(raw);
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) shared[threadIdx.x].merge(shared[threadIdx.x + s]);
    __syncthreads();
  }
  const P total = shared[0];
  __syncthreads();
  return total;
}

// Stage two: one block merges `count` partials in a fixed order and calls finish(total) once.
template <typename P, typename Finish>
__global__ void merge_partials_kernel(const P* partials, int count, Finish finish) {
  P acc;
  for (int i = threadIdx.x; i < count; i += kThreads) acc.merge(partials[i]);
  const P total = block_merge(acc);
  if (threadIdx.x == 0) finish(total);
}

inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(op) + ": CUDA launch failed: " + cudaGetErrorString(err));
}

}  // namespace megalign::cuda::detail
