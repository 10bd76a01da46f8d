// Vector kernels of kl_penalty, its masked mean and the fused policy loss for one ISA (included
// by csrc/cpu/isa_*.cpp after simd.h). Same work split as the scalar loops (kl_policy_cpu.h:
// chunks of a row, partials merged in chunk order), same per-token formulas (math/kl.h,
// math/policy.h) evaluated on whole vectors. Operands are unit-stride within a row (isa.h); the
// last partial vector of a chunk is read and written through buffers (simd.h), its missing lanes
// masked out of every statistic.
#pragma once

#include "kl_policy_cpu.h"
#include "simd.h"

namespace megalign::cpu::MEGALIGN_ISA {

using simd::MEGALIGN_ISA::Mask;
using simd::MEGALIGN_ISA::Vec;
using simd::MEGALIGN_ISA::W;
using simd::MEGALIGN_ISA::i32v;

// The lane count of a full vector as a type, so `len == W` is decided at compile time in the loop
// over full vectors (for_vectors) and its loads and stores are plain vector moves.
using Full = std::integral_constant<int64_t, W>;

// Runs body(j, len) over [0, n) one vector at a time: every full vector with len = Full{}, then
// the last, partial one (if any) with its int64_t length, so the loop over full vectors carries
// no per-vector test of the length and no code of the buffered tail loads (as token_logprob's
// rows already did).
template <typename Body>
MEGALIGN_SIMD_FN void for_vectors(int64_t n, Body&& body) {
  int64_t j = 0;
  for (; j + W <= n; j += W) body(j, Full{});
  if (j < n) body(j, n - j);
}

// len lanes from p (len is Full{} but for the last vector of a chunk).
template <typename T, typename L>
MEGALIGN_SIMD_FN Vec ld(const T* p, L len) {
  if constexpr (std::is_same_v<L, Full>) {
    return simd::MEGALIGN_ISA::load(p);
  } else {
    return simd::MEGALIGN_ISA::load_tail(p, len, T{});
  }
}
template <typename M, typename L>
MEGALIGN_SIMD_FN Mask ld_mask(const M* p, L len) {
  if constexpr (std::is_same_v<L, Full>) {
    return simd::MEGALIGN_ISA::load_mask(p);
  } else {
    return simd::MEGALIGN_ISA::load_mask_tail(p, len);
  }
}
template <typename T, typename L>
MEGALIGN_SIMD_FN void st(T* p, Vec v, L len) {
  if constexpr (std::is_same_v<L, Full>) {
    simd::MEGALIGN_ISA::store(p, v);
  } else {
    simd::MEGALIGN_ISA::store_tail(p, v, len);
  }
}

// Element (r, c0) of a unit-stride-in-row operand.
template <typename T>
MEGALIGN_SIMD_FN const T* row_ptr(const StridedView& v, int64_t r, int64_t c0) {
  return static_cast<const T*>(v.data) + r * v.row_stride + c0;
}

// The incoming gradient of one chunk: unit stride, or one value broadcast along the row.
struct GradChunk {
  const float* p;
  bool broadcast;
  GradChunk(const StridedView& g, int64_t r, int64_t c0)
      : p(static_cast<const float*>(g.data) + r * g.row_stride + c0 * g.col_stride), broadcast(g.col_stride == 0) {}
  template <typename L>
  MEGALIGN_SIMD_FN Vec at(int64_t j, L len) const { return broadcast ? Vec(*p) : ld(p + j, len); }
};

// dlogp (null: not wanted) receives d kl / d logp per token, the backward's gradient per unit
// upstream gradient, from the same evaluation of the estimator.
template <typename T, KlKind K>
void kl_fwd(const KlArgs& a, float* out, float* dlogp) {
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
    const T* lp = row_ptr<T>(a.logp, r, c0);
    const T* ref = row_ptr<T>(a.ref_logp, r, c0);
    float* o = out + r * a.cols + c0;
    float* d = dlogp ? dlogp + r * a.cols + c0 : nullptr;
    for_vectors(c1 - c0, [&](int64_t j, auto len) {
      const KlValue<Vec> k = kl_estimate(K, ld(lp + j, len), ld(ref + j, len));
      st(o + j, k.value, len);
      if (d) st(d + j, k.dlogp, len);
    });
  });
}

template <typename T, KlKind K>
void kl_bwd(const KlArgs& a, const StridedView& grad, T* grad_logp) {
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
    const T* lp = row_ptr<T>(a.logp, r, c0);
    const T* ref = row_ptr<T>(a.ref_logp, r, c0);
    const GradChunk g(grad, r, c0);
    T* o = grad_logp + r * a.cols + c0;
    for_vectors(c1 - c0, [&](int64_t j, auto len) {
      st(o + j, g.at(j, len) * kl_estimate(K, ld(lp + j, len), ld(ref + j, len)).dlogp, len);
    });
  });
}

// dlogp (null: not wanted) receives valid ? d kl / d logp : 0 per token (not yet divided by the
// count, which is known only after the reduction).
template <typename T, typename M, KlKind K>
KlMeanPartial<double> kl_masked_sum(const KlArgs& a, const KlMaskArg& m, float* dlogp) {
  return detail::parallel_reduce_chunks<KlMeanPartial<double>>(
      a.rows, a.cols, [&](KlMeanPartial<double>& part, int64_t r, int64_t c0, int64_t c1) {
        const T* lp = row_ptr<T>(a.logp, r, c0);
        const T* ref = row_ptr<T>(a.ref_logp, r, c0);
        const M* mk = row_ptr<M>(m.mask, r, c0);
        float* d = dlogp ? dlogp + r * a.cols + c0 : nullptr;
        Vec sum(0.0f);
        i32v count{};
        for_vectors(c1 - c0, [&](int64_t j, auto len) {
          const Mask valid = ld_mask(mk + j, len);
          const KlValue<Vec> k = kl_estimate(K, ld(lp + j, len), ld(ref + j, len));
          sum += select_acc(valid, k.value, Vec(0.0f));
          if (d) st(d + j, select_acc(valid, k.dlogp, Vec(0.0f)), len);
          count -= valid.m;  // a set lane is -1
        });
        part.merge(KlMeanPartial<double>{simd::MEGALIGN_ISA::hsum(sum), simd::MEGALIGN_ISA::hcount(count)});
      });
}

template <typename T, typename M, KlKind K>
void kl_masked_bwd(const KlArgs& a, const KlMaskArg& m, float scale, T* grad_logp) {
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
    const T* lp = row_ptr<T>(a.logp, r, c0);
    const T* ref = row_ptr<T>(a.ref_logp, r, c0);
    const M* mk = row_ptr<M>(m.mask, r, c0);
    T* o = grad_logp + r * a.cols + c0;
    const Vec vs(scale);
    for_vectors(c1 - c0, [&](int64_t j, auto len) {
      const Vec g = vs * kl_estimate(K, ld(lp + j, len), ld(ref + j, len)).dlogp;
      st(o + j, select_acc(ld_mask(mk + j, len), g, Vec(0.0f)), len);
    });
  });
}

// The policy-loss operands of one chunk.
template <typename T, typename M>
struct PolicyChunk {
  const T *lp, *old, *adv, *ref;
  const M* mask;
  PolicyChunk(const PolicyLossArgs& a, int64_t r, int64_t c0)
      : lp(row_ptr<T>(a.logp, r, c0)), old(row_ptr<T>(a.old_logp, r, c0)), adv(row_ptr<T>(a.advantages, r, c0)),
        ref(a.ref_logp.data ? row_ptr<T>(a.ref_logp, r, c0) : nullptr), mask(row_ptr<M>(a.mask, r, c0)) {}
  template <bool HasRef, typename L>
  MEGALIGN_SIMD_FN PolicyToken<Vec> token(int64_t j, L len, const PolicyCoeffs<Vec>& p) const {
    const Vec r = HasRef ? ld(ref + j, len) : Vec(0.0f);
    return policy_token(ld(lp + j, len), ld(old + j, len), ld(adv + j, len), HasRef, r, p);
  }
};

inline PolicyCoeffs<Vec> vector_coeffs(const PolicyLossArgs& a) {
  const PolicyCoeffs<float> p = policy_coeffs<float>(a);
  return {Vec(p.eps_low), Vec(p.eps_high), Vec(p.dual_clip), Vec(p.beta)};
}

// dlogp (null: not wanted) receives d loss / d logp per token (0 at masked tokens); loss (null:
// not wanted) the per-token loss, whose sum over valid tokens the partial always holds.
template <typename T, typename M, bool HasRef>
detail::PolicyCpuPartial policy_fwd(const PolicyLossArgs& a, float* loss, float* dlogp) {
  using simd::MEGALIGN_ISA::vmax;
  using simd::MEGALIGN_ISA::vmin;
  const PolicyCoeffs<Vec> p = vector_coeffs(a);
  return detail::parallel_reduce_chunks<detail::PolicyCpuPartial>(
      a.rows, a.cols, [&](detail::PolicyCpuPartial& part, int64_t r, int64_t c0, int64_t c1) {
        const PolicyChunk<T, M> in(a, r, c0);
        float* o = loss ? loss + r * a.cols + c0 : nullptr;
        float* d = dlogp ? dlogp + r * a.cols + c0 : nullptr;
        i32v count{}, clipped{}, dual{};
        Vec neg_log_ratio(0.0f), kl(0.0f), loss_sum(0.0f), ratio_min(1e30f), ratio_max(0.0f);
        for_vectors(c1 - c0, [&](int64_t j, auto len) {
          const Mask valid = ld_mask(in.mask + j, len);
          const PolicyToken<Vec> t = in.template token<HasRef>(j, len, p);
          const Vec l = select_acc(valid, t.loss, Vec(0.0f));
          if (o) st(o + j, l, len);
          loss_sum += l;
          if (d) st(d + j, select_acc(valid, t.dlogp, Vec(0.0f)), len);
          const Mask valid_clipped = valid & t.clipped;
          const Mask valid_dual = valid & t.dual_clipped;
          count -= valid.m;  // a set lane is -1
          clipped -= valid_clipped.m;
          dual -= valid_dual.m;
          neg_log_ratio -= select_acc(valid, t.log_ratio, Vec(0.0f));
          kl += select_acc(valid, t.kl, Vec(0.0f));
          ratio_min = select_acc(valid, vmin(ratio_min, t.ratio), ratio_min);
          ratio_max = select_acc(valid, vmax(ratio_max, t.ratio), ratio_max);
        });
        detail::PolicyCpuPartial chunk;
        chunk.count = simd::MEGALIGN_ISA::hcount(count);
        chunk.clipped = simd::MEGALIGN_ISA::hcount(clipped);
        chunk.dual_clipped = simd::MEGALIGN_ISA::hcount(dual);
        chunk.neg_log_ratio = simd::MEGALIGN_ISA::hsum(neg_log_ratio);
        chunk.kl = simd::MEGALIGN_ISA::hsum(kl);
        chunk.ratio_min = simd::MEGALIGN_ISA::hmin(ratio_min);
        chunk.ratio_max = simd::MEGALIGN_ISA::hmax(ratio_max);
        chunk.loss = simd::MEGALIGN_ISA::hsum(loss_sum);
        part.merge(chunk);
      });
}

template <typename T, typename M, bool HasRef>
void policy_bwd(const PolicyLossArgs& a, const StridedView& grad, T* grad_logp) {
  const PolicyCoeffs<Vec> p = vector_coeffs(a);
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
    const PolicyChunk<T, M> in(a, r, c0);
    const GradChunk g(grad, r, c0);
    T* o = grad_logp + r * a.cols + c0;
    for_vectors(c1 - c0, [&](int64_t j, auto len) {
      const Vec d = g.at(j, len) * in.template token<HasRef>(j, len, p).dlogp;
      st(o + j, select_acc(ld_mask(in.mask + j, len), d, Vec(0.0f)), len);
    });
  });
}

// ---- launchers (isa.h: fp32 / bf16 / fp16, unit-stride rows)

// Invokes fn with scalar_t bound to the element type of an fp32 / bf16 / fp16 dtype.
template <typename Fn>
void dispatch_f32_lanes(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); return;
    case DType::kBFloat16: fn(bf16{}); return;
    case DType::kFloat16: fn(fp16{}); return;
    default: throw std::invalid_argument(std::string(op) + ": the vector kernels take float32, bfloat16 or float16");
  }
}

void kl_penalty_fwd(const KlArgs& a, void* out, void* dlogp) {
  dispatch_f32_lanes(a.dtype, "kl_penalty_fwd", [&](auto t) {
    detail::dispatch_kl_kind(a.kind, [&](auto kind) {
      kl_fwd<decltype(t), decltype(kind)::value>(a, static_cast<float*>(out), static_cast<float*>(dlogp));
    });
  });
}

void kl_penalty_bwd(const KlArgs& a, const StridedView& grad, void* grad_logp) {
  dispatch_f32_lanes(a.dtype, "kl_penalty_bwd", [&](auto t) {
    detail::dispatch_kl_kind(a.kind, [&](auto kind) {
      kl_bwd<decltype(t), decltype(kind)::value>(a, grad, static_cast<decltype(t)*>(grad_logp));
    });
  });
}

void kl_masked_mean_fwd(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count, void* dlogp) {
  dispatch_f32_lanes(a.dtype, "kl_masked_mean_fwd", [&](auto t) {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_fwd", [&] {
      detail::dispatch_kl_kind(a.kind, [&](auto kind) {
        const KlMeanPartial<double> total =
            kl_masked_sum<decltype(t), mask_t, decltype(kind)::value>(a, m, static_cast<float*>(dlogp));
        *static_cast<float*>(mean) = static_cast<float>(total.mean());
        *count = total.count;
      });
    });
  });
}

void kl_masked_mean_bwd(const KlArgs& a, const KlMaskArg& m, const void* grad_mean, const int64_t* count,
                        void* grad_logp) {
  // With no valid token every gradient is 0; the guard only avoids dividing by zero.
  const float scale = *static_cast<const float*>(grad_mean) / static_cast<float>(*count > 0 ? *count : 1);
  dispatch_f32_lanes(a.dtype, "kl_masked_mean_bwd", [&](auto t) {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_bwd", [&] {
      detail::dispatch_kl_kind(a.kind, [&](auto kind) {
        kl_masked_bwd<decltype(t), mask_t, decltype(kind)::value>(a, m, scale,
                                                                   static_cast<decltype(t)*>(grad_logp));
      });
    });
  });
}

void policy_loss_fwd(const PolicyLossArgs& a, void* loss, float* stats, void* dlogp, double* loss_sum) {
  dispatch_f32_lanes(a.dtype, "policy_loss_fwd", [&](auto t) {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_fwd", [&] {
      dispatch_bool(a.ref_logp.data != nullptr, [&](auto has_ref) {
        const detail::PolicyCpuPartial total = policy_fwd<decltype(t), mask_t, decltype(has_ref)::value>(
            a, static_cast<float*>(loss), static_cast<float*>(dlogp));
        total.finalize(stats);
        if (loss_sum) *loss_sum = total.loss;
      });
    });
  });
}

void policy_loss_bwd(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp) {
  dispatch_f32_lanes(a.dtype, "policy_loss_bwd", [&](auto t) {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_bwd", [&] {
      dispatch_bool(a.ref_logp.data != nullptr, [&](auto has_ref) {
        policy_bwd<decltype(t), mask_t, decltype(has_ref)::value>(a, grad, static_cast<decltype(t)*>(grad_logp));
      });
    });
  });
}

}  // namespace megalign::cpu::MEGALIGN_ISA
