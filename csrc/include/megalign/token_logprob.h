// Launchers of the token_logprob kernels over raw memory (no torch types).
//
// Layout shared by every launcher: logits are N rows of `vocab` elements of `dtype`, row r at
// logits + r * row_stride elements, unit stride within a row; they are one vocab shard whose
// first id is vocab_start (0 and the full vocabulary when unsharded). Targets are N global ids.
// Statistics are in z = logits * inv_temperature.
//
// partials: N x 4 fp32 (fp64 when dtype is fp64) rows (m, s, z_target or 0, t), see
// math/token_logprob.h. Rows whose target equals ignore_index are skipped and get the statistic
// of a single zero logit (0, 1, 0, 0). A row whose target is out of range (negative, or
// >= vocab_size when vocab_size >= 0) gets NaN partials.
#pragma once

#include <cstdint>

#include "megalign/common.h"

namespace megalign::cpu {

// Fills partials and returns the first row with an out-of-range target, or -1.
int64_t token_logprob_partials(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                               int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                               bool with_entropy, void* partials);

// Full-row statistics -> logp, lse and (when entropy is non-null) entropy, each N values of the
// accumulation type. Ignored rows (partials 0, 1, 0, 0) come out as logp = lse = entropy = 0.
void token_logprob_finalize(DType dtype, const void* partials, int64_t n_rows, void* logp,
                            void* lse, void* entropy);

// Writes dL/dlogits of the shard into grad (N rows at grad + r * grad_row_stride; grad may be
// logits itself for the in-place backward). lse, entropy, grad_logp, grad_entropy hold N values
// of the accumulation type; entropy and grad_entropy are both null or both set. Ignored rows get
// zeros.
void token_logprob_backward(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                            int64_t row_stride, const int64_t* targets, const void* lse,
                            const void* entropy, const void* grad_logp, const void* grad_entropy,
                            int64_t vocab_start, double inv_temperature, int64_t ignore_index,
                            void* grad, int64_t grad_row_stride);

}  // namespace megalign::cpu

#if defined(MEGALIGN_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace megalign::cuda {

// Same contracts as the CPU launchers, on device memory, enqueued on `stream`. Out-of-range
// targets are not reported (no host sync): their rows get NaN.
cudaError_t token_logprob_partials(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                                   int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                   int64_t vocab_size, double inv_temperature,
                                   int64_t ignore_index, bool with_entropy, void* partials,
                                   cudaStream_t stream);

cudaError_t token_logprob_finalize(DType dtype, const void* partials, int64_t n_rows, void* logp,
                                   void* lse, void* entropy, cudaStream_t stream);

cudaError_t token_logprob_backward(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                                   int64_t row_stride, const int64_t* targets, const void* lse,
                                   const void* entropy, const void* grad_logp,
                                   const void* grad_entropy, int64_t vocab_start,
                                   double inv_temperature, int64_t ignore_index, void* grad,
                                   int64_t grad_row_stride, cudaStream_t stream);

}  // namespace megalign::cuda
#endif
