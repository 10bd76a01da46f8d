// Per-token clipped policy-gradient surrogate of PPO/GRPO, shared by the CPU and CUDA kernels.
//
//   log_ratio = clamp(logp - old_logp, -20, 20)     (as verl: keeps exp finite)
//   ratio     = exp(log_ratio)
//   surr1     = -A * ratio
//   surr2     = -A * clamp(ratio, 1 - eps_low, 1 + eps_high)   (PPO, Schulman et al. 2017;
//                                                               asymmetric "clip-higher": DAPO)
//   l         = max(surr1, surr2)
//   if A < 0 and dual clip c:  l = min(l, -A * c)               (dual-clip PPO, Ye et al. 2020)
//   loss      = l + beta * k3(logp, ref_logp)                   (GRPO's KL term, math/kl.h)
//
// Gradient w.r.t. logp (old_logp, A, ref_logp are constants of the RL step): -A * ratio when the
// unclipped branch is used and the log-ratio clamp is inactive, 0 when the clipped or dual-clipped
// branch is used (it is constant in logp there: surr2 > surr1 strictly implies ratio outside the
// clip range), plus beta * dk3/dlogp. This equals torch autograd of the same expression.
//
// Statistics follow verl's compute_policy_loss: pg_clipfrac counts surr2 > surr1, the dual-clip
// fraction counts A < 0 and l > -A*c, ppo_kl is the mean of -log_ratio (the clamped value).
#pragma once

#include <cstdint>

#include "megalign/common.h"
#include "megalign/math/kl.h"

namespace megalign {

constexpr double kPolicyLogRatioBound = 20.0;

// Indices into the fp32 statistics vector returned by policy_loss_fwd.
enum PolicyStat : int {
  kStatCount = 0,       // number of valid tokens
  kStatClipFrac,        // fraction of valid tokens where surr2 > surr1
  kStatDualClipFrac,    // fraction of valid tokens where the dual clip bound is used
  kStatApproxKl,        // mean over valid tokens of old_logp - logp (clamped log-ratio)
  kStatRatioMin,        // min ratio over valid tokens (1 when there are none)
  kStatRatioMax,        // max ratio over valid tokens (1 when there are none)
  kStatKlMean,          // mean k3(logp, ref_logp) over valid tokens (0 without ref_logp)
  kNumPolicyStats
};

// Coefficients in the accumulation type. dual_clip <= 0 disables the dual clip.
template <typename A>
struct PolicyCoeffs {
  A eps_low, eps_high, dual_clip, beta;
};

template <typename A>
struct PolicyToken {
  A loss;
  A dlogp;
  A log_ratio;
  A ratio;
  A kl;  // k3(logp, ref_logp); 0 without a reference
  mask_of<A> clipped;
  mask_of<A> dual_clipped;
};

template <typename A>
MEGALIGN_HD_INLINE PolicyToken<A> policy_token(A logp, A old_logp, A adv, bool has_ref, A ref_logp,
                                        const PolicyCoeffs<A>& p) {
  const A bound = A(kPolicyLogRatioBound);
  const A diff = logp - old_logp;
  const A log_ratio = clamp_acc(diff, -bound, bound);
  const A ratio = exp_bounded(log_ratio);  // |log_ratio| <= 20
  const A surr1 = -adv * ratio;
  const A surr2 = -adv * clamp_acc(ratio, A(1) - p.eps_low, A(1) + p.eps_high);
  const mask_of<A> clipped = surr2 > surr1;
  const A surr = select_acc(clipped, surr2, surr1);
  // Written as selects, without branches, so the CPU loops vectorise.
  const A surr3 = -adv * p.dual_clip;
  const mask_of<A> dual = (p.dual_clip > A(0)) & (adv < A(0)) & (surr > surr3);
  const mask_of<A> live = (!clipped) & (!dual) & (log_ratio == diff);  // the log-ratio clamp is inactive
  const KlValue<A> k3 = kl_k3(logp, select_acc(has_ref, ref_logp, logp));
  const mask_of<A> penalise = mask_of<A>(has_ref) & (p.beta > A(0));
  const A kl = select_acc(has_ref, k3.value, A(0));
  const A loss = select_acc(dual, surr3, surr) + select_acc(penalise, p.beta * k3.value, A(0));
  const A dlogp = select_acc(live, surr1, A(0)) + select_acc(penalise, p.beta * k3.dlogp, A(0));
  return {loss, dlogp, log_ratio, ratio, kl, clipped, dual};
}

// Running statistics over valid tokens, summed in S (fp32 on the GPU, fp64 on the CPU) with exact
// integer counts; merged in a fixed order so results are reproducible.
template <typename S>
struct PolicyPartial {
  int64_t count = 0;
  int64_t clipped = 0;
  int64_t dual_clipped = 0;
  S neg_log_ratio = S(0);
  S kl = S(0);
  S ratio_min = S(1e30);  // ratios lie in [e^-20, e^20]
  S ratio_max = S(0);

  template <typename A>
  MEGALIGN_HD_INLINE void add(const PolicyToken<A>& t) {
    ++count;
    clipped += t.clipped ? 1 : 0;
    dual_clipped += t.dual_clipped ? 1 : 0;
    neg_log_ratio -= S(t.log_ratio);
    kl += S(t.kl);
    ratio_min = S(t.ratio) < ratio_min ? S(t.ratio) : ratio_min;
    ratio_max = S(t.ratio) > ratio_max ? S(t.ratio) : ratio_max;
  }

  MEGALIGN_HD_INLINE void merge(const PolicyPartial& o) {
    count += o.count;
    clipped += o.clipped;
    dual_clipped += o.dual_clipped;
    neg_log_ratio += o.neg_log_ratio;
    kl += o.kl;
    ratio_min = o.ratio_min < ratio_min ? o.ratio_min : ratio_min;
    ratio_max = o.ratio_max > ratio_max ? o.ratio_max : ratio_max;
  }

  // Writes the kNumPolicyStats values. No valid token: count 0, fractions and means 0, ratio
  // min/max 1 (the ratio at logp == old_logp), never NaN.
  MEGALIGN_HD_INLINE void finalize(float* stats) const {
    const bool any = count > 0;
    const double n = any ? static_cast<double>(count) : 1.0;
    stats[kStatCount] = static_cast<float>(count);
    stats[kStatClipFrac] = static_cast<float>(static_cast<double>(clipped) / n);
    stats[kStatDualClipFrac] = static_cast<float>(static_cast<double>(dual_clipped) / n);
    stats[kStatApproxKl] = static_cast<float>(static_cast<double>(neg_log_ratio) / n);
    stats[kStatRatioMin] = any ? static_cast<float>(ratio_min) : 1.0f;
    stats[kStatRatioMax] = any ? static_cast<float>(ratio_max) : 1.0f;
    stats[kStatKlMean] = static_cast<float>(static_cast<double>(kl) / n);
  }
};

}  // namespace megalign
