// CPU kernels of token_logprob: OpenMP across rows, one pass over each row's logits, nothing of
// size N x V allocated. fp32, bf16 and fp16 logits run the vector rows of the CPU's ISA
// (token_logprob_simd.h, chosen at run time: isa.h); fp64 logits (gradcheck, oracles) run the
// scalar rows below. Both share the row loops of token_logprob_rows.h.
//
// Forward: each row is walked in chunks of kChunk logits that stay in L1: a max pass, then an
// exp pass accumulating s and t relative to the chunk max, then a merge of the chunk's
// (m, s, t) into the row's (math/token_logprob.h).
// Backward: one pass per row recomputing p_j = e^{z_j - lse} from the saved lse.
#include "megalign/token_logprob.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "isa.h"
#include "megalign/math/token_logprob.h"
#include "token_logprob_rows.h"

namespace megalign::cpu {
namespace {

using math::SoftmaxStats;

constexpr int64_t kChunk = 2048;

template <bool WithEntropy>
SoftmaxStats<double> row_stats_f64(const double* x, int64_t vocab, double inv_t) {
  SoftmaxStats<double> row = math::empty_stats<double>();
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const double* xc = x + c0;
    const int64_t n = std::min(kChunk, vocab - c0);
    double cm = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) cm = std::max(cm, xc[j] * inv_t);
    if (cm == -std::numeric_limits<double>::infinity()) continue;  // all -inf: contributes nothing
    double s = 0, t = 0;
    if (WithEntropy) {
      for (int64_t j = 0; j < n; ++j) math::accumulate(xc[j] * inv_t, cm, s, t);
    } else {
      for (int64_t j = 0; j < n; ++j) s += std::exp(xc[j] * inv_t - cm);
    }
    row = math::merge_stats(row, SoftmaxStats<double>{cm, s, t});
  }
  return row;
}

template <bool WithEntropy>
void row_grad_f64(const double* x, double* g, int64_t vocab, double inv_t, double lse, double h,
                  double g_logp, double g_ent) {
  for (int64_t j = 0; j < vocab; ++j) {
    g[j] = math::logit_grad<WithEntropy>(x[j] * inv_t, lse, h, g_logp, g_ent, false);
  }
}


template <typename A>
void finalize_impl(const A* partials, int64_t n_rows, A* logp, A* lse, A* entropy) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const A* p = partials + 4 * r;
    const math::RowResult<A> res = math::finalize_row<A>({p[0], p[1], p[3]}, p[2]);
    logp[r] = res.logp;
    lse[r] = res.lse;
    if (entropy) entropy[r] = res.entropy;
  }
}

}  // namespace

int64_t token_logprob_partials(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                               int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                               bool with_entropy, void* partials) {
  if (dtype != DType::kFloat64) {
    return isa_kernels().token_logprob_partials(dtype, logits, n_rows, vocab, row_stride, targets,
                                                vocab_start, vocab_size, inv_temperature,
                                                ignore_index, with_entropy, partials);
  }
  const auto* x = static_cast<const double*>(logits);
  auto* out = static_cast<double*>(partials);
  return with_entropy ? detail::partials_rows(x, n_rows, vocab, row_stride, targets, vocab_start, vocab_size,
                                              inv_temperature, ignore_index, out, row_stats_f64<true>)
                      : detail::partials_rows(x, n_rows, vocab, row_stride, targets, vocab_start, vocab_size,
                                              inv_temperature, ignore_index, out, row_stats_f64<false>);
}

void token_logprob_finalize(DType dtype, const void* partials, int64_t n_rows, void* logp,
                            void* lse, void* entropy) {
  if (dtype == DType::kFloat64) {
    finalize_impl(static_cast<const double*>(partials), n_rows, static_cast<double*>(logp),
                  static_cast<double*>(lse), static_cast<double*>(entropy));
  } else {
    finalize_impl(static_cast<const float*>(partials), n_rows, static_cast<float*>(logp),
                  static_cast<float*>(lse), static_cast<float*>(entropy));
  }
}

void token_logprob_backward(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                            int64_t row_stride, const int64_t* targets, const void* lse,
                            const void* entropy, const void* grad_logp, const void* grad_entropy,
                            int64_t vocab_start, double inv_temperature, int64_t ignore_index,
                            void* grad, int64_t grad_row_stride) {
  if (dtype != DType::kFloat64) {
    isa_kernels().token_logprob_backward(dtype, logits, n_rows, vocab, row_stride, targets, lse, entropy,
                                         grad_logp, grad_entropy, vocab_start, inv_temperature,
                                         ignore_index, grad, grad_row_stride);
    return;
  }
  const auto b = BackwardRows<double>::cast(logits, grad, lse, entropy, grad_logp, grad_entropy,
                                            inv_temperature);
  if (entropy != nullptr) {
    detail::backward_rows<double, true>(b, n_rows, vocab, row_stride, targets, vocab_start, ignore_index,
                                        grad_row_stride, row_grad_f64<true>);
  } else {
    detail::backward_rows<double, false>(b, n_rows, vocab, row_stride, targets, vocab_start, ignore_index,
                                         grad_row_stride, row_grad_f64<false>);
  }
}

}  // namespace megalign::cpu
