// Launchers of the group-normalised advantage kernels (formulas in math/advantage.h).
//
// scores is [N] of `dtype` with element stride `stride`; out is contiguous [N] in the accumulation
// type (float32, or float64 for float64 scores). Groups are contiguous runs of group_size
// (N % group_size == 0), or given by an int64 id per score: any values on the CPU
// (group_advantages_by_id), dense ids group_ids[N] in [0, num_groups) on CUDA
// (group_advantages_indexed).
#pragma once

#include <cstddef>
#include <cstdint>

#include "megalign/common.h"
#include "megalign/math/advantage.h"

namespace megalign::cpu {
void group_advantages(DType dtype, const void* scores, int64_t stride, int64_t n, int64_t group_size,
                      math::GroupMode mode, double eps, bool unbiased, void* out);
// ids[i * id_stride] is score i's group id, any int64 value; the kernel numbers the distinct ids
// itself (a hash map), so callers need not make them dense.
void group_advantages_by_id(DType dtype, const void* scores, int64_t stride, const int64_t* ids, int64_t id_stride,
                            int64_t n, math::GroupMode mode, double eps, bool unbiased, void* out);
}  // namespace megalign::cpu

#if defined(MEGALIGN_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace megalign::cuda {
// One warp per group.
void group_advantages(DType dtype, const void* scores, int64_t stride, int64_t n, int64_t group_size,
                      math::GroupMode mode, double eps, bool unbiased, void* out, cudaStream_t stream);

// Bytes of device workspace group_advantages_indexed needs (per-group counters and sums).
size_t group_advantages_indexed_workspace_bytes(DType dtype, int64_t num_groups);

// Atomics into per-group pivots, counts and sums, then an elementwise pass. n < 2^31.
void group_advantages_indexed(DType dtype, const void* scores, int64_t stride, const int64_t* group_ids,
                              int64_t n, int64_t num_groups, math::GroupMode mode, double eps, bool unbiased,
                              void* workspace, void* out, cudaStream_t stream);
}  // namespace megalign::cuda
#endif
