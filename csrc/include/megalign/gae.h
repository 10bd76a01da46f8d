// Launchers of the GAE kernels (see math/advantage.h for the recursion and the skip rule).
//
// rewards and values are [B, T] of `dtype` with element strides `rs` / `vs`; mask is [B, T] bool
// (true = valid) with strides `ms`. advantages and returns are written contiguous [B, T] in the
// accumulation type (float32, or float64 for float64 inputs); masked positions get 0.
#pragma once

#include <cstdint>

#include "megalign/common.h"

namespace megalign {

// Element strides of a [B, T] operand.
struct Strides2d {
  int64_t row;
  int64_t col;
};

namespace cpu {
void gae(DType dtype, const void* rewards, Strides2d rs, const void* values, Strides2d vs, const bool* mask,
         Strides2d ms, int64_t batch, int64_t steps, double gamma, double lam, void* advantages, void* returns);
}  // namespace cpu

}  // namespace megalign

#if defined(MEGALIGN_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace megalign::cuda {
// One block per row; each row is scanned tile by tile with a block-wide scan of affine maps.
void gae(DType dtype, const void* rewards, Strides2d rs, const void* values, Strides2d vs, const bool* mask,
         Strides2d ms, int64_t batch, int64_t steps, double gamma, double lam, void* advantages, void* returns,
         cudaStream_t stream);
}  // namespace megalign::cuda
#endif
