// Per-element advantage math shared by the CPU and CUDA kernels (gae, group_advantages).
//
// GAE with skipped positions (verl's multi-turn rule: tool outputs and padding are removed from
// the recursion). Walking t from right to left, the state carried between valid positions is
// (V_next, A_next): the value and advantage of the next valid position (0, 0 past the end). A valid
// position t maps that state to
//     V' = V_t
//     A' = r_t + gamma * V_next - V_t + gamma * lam * A_next      (Schulman et al. 2016, eq. 16)
// and a masked position leaves it unchanged. Both are affine maps of (V, A):
//     V' = p * V_next + v
//     A' = ca * V_next + cb * A_next + e
// (valid: p=0, v=V_t, ca=gamma, cb=gamma*lam, e=r_t-V_t; masked: the identity p=1, cb=1, rest 0).
// Affine maps compose associatively, so a row can be cut into chunks: each chunk is summarised by
// the composition of its maps, a scan over the summaries gives every chunk its incoming state, and
// each chunk then re-walks its elements with gae_step. The CPU kernel walks rows sequentially; the
// CUDA kernel uses this decomposition (and the C++ test runs it on the CPU against the walk).
//
// Group advantages (GRPO, Shao et al. 2024; Dr. GRPO, Liu et al. 2025; RLOO, Ahmadian et al. 2024):
// the group mean is computed around a pivot member (mean = pivot + sum(r - pivot) / n), so a group
// of equal scores has a mean equal to them bit for bit and gets exactly 0, whatever eps is.
#pragma once

#include <cmath>
#include <limits>

#include "megalign/common.h"

namespace megalign::math {

// c * x where a zero coefficient drops x even when x is inf or NaN. The recursion's coefficients
// (gamma, gamma * lam, and p, which is 0 at a valid position) are exact zeros when the quantity
// does not enter: with lam = 0 an advantage does not depend on the next one, and a valid position's
// value replaces the carried one. A product 0 * inf = NaN would instead spread one non-finite score
// over every earlier position of the row, further in the composed maps of the CUDA scan than in
// the walk (the two must agree position for position).
template <typename acc>
MEGALIGN_HD acc coef_mul(acc c, acc x) {
  return c == acc(0) ? acc(0) : c * x;
}

// One GAE step at a valid position: the advantage given the next valid position's value and advantage.
template <typename acc>
MEGALIGN_HD acc gae_step(acc reward, acc value, acc next_value, acc next_adv, acc gamma, acc gamma_lam) {
  return reward + coef_mul(gamma, next_value) - value + coef_mul(gamma_lam, next_adv);
}

// The affine map (V_next, A_next) -> (V', A') of a run of positions, see the file comment.
template <typename acc>
struct GaeMap {
  acc p, v, ca, cb, e;

  MEGALIGN_HD static GaeMap identity() { return GaeMap{acc(1), acc(0), acc(0), acc(1), acc(0)}; }

  MEGALIGN_HD static GaeMap step(bool valid, acc reward, acc value, acc gamma, acc gamma_lam) {
    return valid ? GaeMap{acc(0), value, gamma, gamma_lam, reward - value} : identity();
  }
};

// left ∘ right: apply `right` (the later positions) first, then `left`. Associative; exact when
// either side is the identity. Products with a coefficient of `left` go through coef_mul, so a
// non-finite v or e of `right` reaches only the positions that depend on it.
template <typename acc>
MEGALIGN_HD GaeMap<acc> gae_compose(const GaeMap<acc>& left, const GaeMap<acc>& right) {
  return GaeMap<acc>{coef_mul(left.p, right.p),
                     coef_mul(left.p, right.v) + left.v,
                     coef_mul(left.ca, right.p) + coef_mul(left.cb, right.ca),
                     coef_mul(left.cb, right.cb),
                     coef_mul(left.ca, right.v) + coef_mul(left.cb, right.e) + left.e};
}

// The carried state (V, A) after applying `m` to the incoming state (next_value, next_adv).
template <typename acc>
MEGALIGN_HD void gae_apply(const GaeMap<acc>& m, acc& next_value, acc& next_adv) {
  const acc value = coef_mul(m.p, next_value) + m.v;
  next_adv = coef_mul(m.ca, next_value) + coef_mul(m.cb, next_adv) + m.e;
  next_value = value;
}

// Reverse walk over positions [lo, hi) of one row, starting from the state (next_value, next_adv)
// of position hi, writing advantages and returns (0 at masked positions) and leaving the state of
// position lo in (next_value, next_adv). `load(t, valid, r, v)` reads one position.
template <typename acc, typename Load, typename Out>
MEGALIGN_HD void gae_walk(int64_t lo, int64_t hi, acc gamma, acc gamma_lam, acc& next_value, acc& next_adv,
                          Load load, Out* adv_out, Out* ret_out) {
  for (int64_t t = hi - 1; t >= lo; --t) {
    bool valid;
    acc r, v;
    load(t, valid, r, v);
    if (valid) {
      next_adv = gae_step(r, v, next_value, next_adv, gamma, gamma_lam);
      next_value = v;
      adv_out[t] = next_adv;
      ret_out[t] = next_adv + v;
    } else {
      adv_out[t] = Out(0);
      ret_out[t] = Out(0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Group advantages.

enum class GroupMode : int { kGrpo = 0, kDrGrpo = 1, kRloo = 2 };

// Per-group statistics: mean and the baseline-scaling denominator, from the member count, the pivot,
// the sum of (r - pivot) and (second pass) the sum of squared deviations from the mean.
template <typename acc>
MEGALIGN_HD acc group_mean(acc pivot, acc shifted_sum, int64_t n) {
  return n > 0 ? pivot + shifted_sum / acc(n) : acc(0);
}

// Standard deviation from the sum of squared deviations: unbiased (n - 1) or population (n).
template <typename acc>
MEGALIGN_HD acc group_std(acc sq_dev_sum, int64_t n, bool unbiased) {
  const int64_t dof = unbiased ? n - 1 : n;
  return dof > 0 ? std::sqrt(sq_dev_sum / acc(dof)) : acc(0);
}

// The factor that turns a member's deviation r - mean into its advantage, for a group of n:
//   grpo:    1 / (std + eps)            advantage (r - mean) / (std + eps)
//   dr_grpo: 1                          advantage r - mean
//   rloo:    n / (n - 1)                advantage r - mean of the other n-1 members
// A group of one gets 0. In grpo a zero denominator gives 0 (every deviation is then 0, or so small
// that its square underflowed) and the reciprocal is capped at the largest finite value (it
// overflows only for a denormal eps), so for finite scores the advantage is never NaN and a zero
// deviation gives exactly 0, with eps = 0 too. Multiplying by the reciprocal is within an ulp of
// the division and spares the kernels a division per member.
template <typename acc>
MEGALIGN_HD acc group_scale(acc stdev, int64_t n, GroupMode mode, acc eps) {
  if (n <= 1) return acc(0);
  switch (mode) {
    case GroupMode::kGrpo: {
      const acc den = stdev + eps;
      if (!(den > acc(0))) return acc(0);
      const acc inv = acc(1) / den, cap = std::numeric_limits<acc>::max();
      return inv < cap ? inv : cap;
    }
    case GroupMode::kDrGrpo: return acc(1);
    case GroupMode::kRloo: return acc(n) / acc(n - 1);
  }
  return acc(0);
}

// The advantage of a member with score r, given its group's mean and group_scale.
template <typename acc>
MEGALIGN_HD acc group_advantage(acc r, acc mean, acc scale) {
  return (r - mean) * scale;
}

// The same from the group's std and size (one member at a time, as the CUDA kernels run it).
template <typename acc>
MEGALIGN_HD acc group_advantage(acc r, acc mean, acc stdev, int64_t n, GroupMode mode, acc eps) {
  return group_advantage(r, mean, group_scale(stdev, n, mode, eps));
}

}  // namespace megalign::math
