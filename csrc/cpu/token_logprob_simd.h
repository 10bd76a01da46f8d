// Vector rows of token_logprob for one ISA (included by csrc/cpu/isa_*.cpp after simd.h): fp32,
// bf16 and fp16 logits, converted to fp32 lanes as they are loaded.
//
// Forward, per chunk of kChunk logits (8 KiB of fp32, so the exp pass reads it from L1): a max
// pass with four independent vector maxima, then an exp pass evaluating math::accumulate (the
// same formula as the GPU's) on whole vectors with two independent (s, t) accumulators, then the
// chunk's lanes are summed in order and merged into the row (math::merge_stats). The last partial
// vector of a chunk is read through a buffer whose missing lanes are -inf, which adds nothing.
// Backward: math::logit_grad on whole vectors; the target's term is added by the row loop.
#pragma once

#include "simd.h"
#include "token_logprob_rows.h"

namespace megalign::cpu::MEGALIGN_ISA {

using simd::MEGALIGN_ISA::load;
using simd::MEGALIGN_ISA::load_tail;
using simd::MEGALIGN_ISA::store;
using simd::MEGALIGN_ISA::store_tail;
using simd::MEGALIGN_ISA::Vec;
using simd::MEGALIGN_ISA::W;

constexpr int64_t kTlChunk = 2048;

template <typename T> T minus_inf();
template <> inline float minus_inf<float>() { return -std::numeric_limits<float>::infinity(); }
template <> inline bf16 minus_inf<bf16>() { return bf16{0xFF80u}; }
template <> inline fp16 minus_inf<fp16>() { return fp16{0xFC00u}; }

template <typename T, bool WithEntropy>
math::SoftmaxStats<float> row_stats(const T* x, int64_t vocab, float inv_t) {
  using simd::MEGALIGN_ISA::hmax;
  using simd::MEGALIGN_ISA::hsum;
  using simd::MEGALIGN_ISA::vmax;
  const Vec vinv(inv_t);
  const T fill = minus_inf<T>();
  math::SoftmaxStats<float> row = math::empty_stats<float>();
  for (int64_t c0 = 0; c0 < vocab; c0 += kTlChunk) {
    const T* xc = x + c0;
    const int64_t n = std::min(kTlChunk, vocab - c0);
    const int64_t full = n - n % W;
    Vec m0(-INFINITY), m1(-INFINITY), m2(-INFINITY), m3(-INFINITY);
    int64_t j = 0;
    for (; j + 4 * W <= full; j += 4 * W) {
      m0 = vmax(m0, load(xc + j));
      m1 = vmax(m1, load(xc + j + W));
      m2 = vmax(m2, load(xc + j + 2 * W));
      m3 = vmax(m3, load(xc + j + 3 * W));
    }
    for (; j < full; j += W) m0 = vmax(m0, load(xc + j));
    if (full < n) m1 = vmax(m1, load_tail(xc + full, n - full, fill));
    // Scaling by 1/temperature > 0 keeps the arg max: one multiply per chunk instead of per logit.
    const float cm = hmax(vmax(vmax(m0, m1), vmax(m2, m3))) * inv_t;
    if (cm == -INFINITY) continue;  // all -inf: contributes nothing
    const Vec vm(cm);
    Vec s0(0.0f), s1(0.0f), t0(0.0f), t1(0.0f);
    j = 0;
    for (; j + 2 * W <= full; j += 2 * W) {
      math::accumulate(load(xc + j) * vinv, vm, s0, t0);
      math::accumulate(load(xc + j + W) * vinv, vm, s1, t1);
    }
    for (; j < full; j += W) math::accumulate(load(xc + j) * vinv, vm, s0, t0);
    if (full < n) math::accumulate(load_tail(xc + full, n - full, fill) * vinv, vm, s1, t1);
    const float t = WithEntropy ? hsum(t0 + t1) : 0.0f;
    row = math::merge_stats(row, math::SoftmaxStats<float>{cm, hsum(s0 + s1), t});
  }
  return row;
}

template <typename T, bool WithEntropy>
void row_grad(const T* x, T* g, int64_t vocab, float inv_t, float lse, float h, float g_logp, float g_ent) {
  const Vec vinv(inv_t), vlse(lse), vh(h), vgl(g_logp), vge(g_ent);
  const int64_t full = vocab - vocab % W;
  for (int64_t j = 0; j < full; j += W) {
    store(g + j, math::logit_grad<WithEntropy>(load(x + j) * vinv, vlse, vh, vgl, vge, false));
  }
  if (full < vocab) {
    const Vec z = load_tail(x + full, vocab - full, minus_inf<T>()) * vinv;
    store_tail(g + full, math::logit_grad<WithEntropy>(z, vlse, vh, vgl, vge, false), vocab - full);
  }
}

template <typename T, bool WithEntropy>
int64_t tl_partials(const void* logits, int64_t n_rows, int64_t vocab, int64_t row_stride, const int64_t* targets,
                    int64_t vocab_start, int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                    void* partials) {
  return detail::partials_rows(static_cast<const T*>(logits), n_rows, vocab, row_stride, targets, vocab_start,
                               vocab_size, static_cast<float>(inv_temperature), ignore_index,
                               static_cast<float*>(partials), row_stats<T, WithEntropy>);
}

int64_t token_logprob_partials(DType dtype, const void* logits, int64_t n_rows, int64_t vocab, int64_t row_stride,
                               const int64_t* targets, int64_t vocab_start, int64_t vocab_size,
                               double inv_temperature, int64_t ignore_index, bool with_entropy, void* partials) {
  int64_t bad = -1;
  MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob_partials", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      bad = with_entropy ? tl_partials<scalar_t, true>(logits, n_rows, vocab, row_stride, targets, vocab_start,
                                                        vocab_size, inv_temperature, ignore_index, partials)
                         : tl_partials<scalar_t, false>(logits, n_rows, vocab, row_stride, targets, vocab_start,
                                                         vocab_size, inv_temperature, ignore_index, partials);
    } else {
      throw std::invalid_argument("token_logprob_partials: the vector kernels take no float64 logits");
    }
  });
  return bad;
}

void token_logprob_backward(DType dtype, const void* logits, int64_t n_rows, int64_t vocab, int64_t row_stride,
                            const int64_t* targets, const void* lse, const void* entropy, const void* grad_logp,
                            const void* grad_entropy, int64_t vocab_start, double inv_temperature,
                            int64_t ignore_index, void* grad, int64_t grad_row_stride) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob_backward", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const auto b = BackwardRows<scalar_t>::cast(logits, grad, lse, entropy, grad_logp, grad_entropy,
                                                  inv_temperature);
      if (entropy != nullptr) {
        detail::backward_rows<scalar_t, true>(b, n_rows, vocab, row_stride, targets, vocab_start, ignore_index,
                                              grad_row_stride, row_grad<scalar_t, true>);
      } else {
        detail::backward_rows<scalar_t, false>(b, n_rows, vocab, row_stride, targets, vocab_start, ignore_index,
                                               grad_row_stride, row_grad<scalar_t, false>);
      }
    } else {
      throw std::invalid_argument("token_logprob_backward: the vector kernels take no float64 logits");
    }
  });
}

}  // namespace megalign::cpu::MEGALIGN_ISA
