// The kl_penalty and policy_loss CPU launchers against naive double-precision loops written from
// the formulas (not from math/*.h), on dense and strided views with masks, plus the fp32 exp and
// expm1 of math/kl.h against libm over their whole range.
#include <algorithm>
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include "megalign/kl_penalty.h"
#include "megalign/policy_loss.h"
#include "test_util.h"

using namespace megalign;

namespace {

double naive_kl(int kind, double logp, double ref) {
  const double x = logp - ref, d = ref - logp;
  switch (kind) {
    case 0: return x;
    case 1: return std::fabs(x);
    case 2: return 0.5 * x * x;
    case 3: return std::exp(d) - d - 1.0;
    default: {
      const double dc = std::min(20.0, std::max(-20.0, d));
      return std::min(10.0, std::exp(dc) - dc - 1.0);
    }
  }
}

double naive_kl_dlogp(int kind, double logp, double ref) {
  const double x = logp - ref, d = ref - logp;
  switch (kind) {
    case 0: return 1.0;
    case 1: return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0);
    case 2: return x;
    case 3: return 1.0 - std::exp(d);
    default: {
      if (std::fabs(d) > 20.0 || std::exp(d) - d - 1.0 > 10.0) return 0.0;
      return 1.0 - std::exp(d);
    }
  }
}

void test_exp() {
  for (float x = -87.0f; x < 88.7f; x += 0.0137f) EXPECT_CLOSE(exp_acc(x), std::exp(static_cast<double>(x)), 0, 3e-7);
  EXPECT_TRUE(std::isinf(exp_acc(100.0f)) && exp_acc(-100.0f) == 0.0f && std::isnan(exp_acc(NAN)));
  for (float x = -20.0f; x < 20.0f; x += 0.00731f) {
    const Expm1Split<float> e = expm1_split(x);
    EXPECT_CLOSE(e.em1, std::expm1(static_cast<double>(x)), 1e-30, 5e-7);
    EXPECT_CLOSE(e.excess, std::expm1(static_cast<double>(x)) - x, 1e-30, 2e-6);
    EXPECT_TRUE(e.excess >= 0.0f);
  }
  // expm1 over the whole fp32 range of e^x (one range reduction for both of its cases), and the
  // policy ratio's exp_bounded: exp_acc's value wherever |x| <= 87.
  for (float x = -87.3f; x < 88.7f; x += 0.0311f) {
    EXPECT_CLOSE(expm1_split(x).em1, std::expm1(static_cast<double>(x)), 1e-30, 5e-7);
  }
  EXPECT_TRUE(expm1_split(-100.0f).em1 == -1.0f && std::isinf(expm1_split(89.0f).em1));
  EXPECT_TRUE(std::isnan(expm1_split(NAN).em1) && std::isnan(expm1_split(NAN).excess));
  for (float x = -87.0f; x < 87.0f; x += 0.0137f) EXPECT_TRUE(exp_bounded(x) == exp_acc(x));
}

// Transposed storage: element (r, c) at c*rows + r, a strided (non-dense) view.
template <typename T>
StridedView transposed(const std::vector<T>& v, int64_t rows) {
  return {v.data(), 1, rows};
}

void test_kl(int64_t rows, int64_t cols, bool strided) {
  std::mt19937 rng(static_cast<unsigned>(rows * 131 + cols));
  std::normal_distribution<double> nd(0.0, 2.0);
  const int64_t n = rows * cols;
  std::vector<double> lp(n), ref(n), grad(n);
  std::vector<uint8_t> mask(n);
  for (int64_t i = 0; i < n; ++i) {
    lp[i] = nd(rng);
    ref[i] = nd(rng);
    grad[i] = nd(rng);
    mask[i] = (rng() % 3) != 0;
  }
  // Strided: the same logical matrix stored transposed.
  auto element = [&](const std::vector<double>& v, int64_t r, int64_t c) { return v[strided ? c * rows + r : r * cols + c]; };
  const StridedView vlp = strided ? transposed(lp, rows) : StridedView{lp.data(), cols, 1};
  const StridedView vref = strided ? transposed(ref, rows) : StridedView{ref.data(), cols, 1};
  const StridedView vmask = strided ? transposed(mask, rows) : StridedView{mask.data(), cols, 1};
  const StridedView vgrad = strided ? transposed(grad, rows) : StridedView{grad.data(), cols, 1};
  for (int kind = 0; kind < 5; ++kind) {
    const KlArgs a{DType::kFloat64, static_cast<KlKind>(kind), rows, cols, vlp, vref};
    std::vector<double> out(n), g(n);
    cpu::kl_penalty_fwd(a, out.data());
    cpu::kl_penalty_bwd(a, vgrad, g.data());
    double sum = 0;
    int64_t count = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const double x = element(lp, r, c), y = element(ref, r, c);
        EXPECT_CLOSE(out[r * cols + c], naive_kl(kind, x, y), 1e-12, 1e-10);
        EXPECT_CLOSE(g[r * cols + c], element(grad, r, c) * naive_kl_dlogp(kind, x, y), 1e-12, 1e-10);
        const bool valid = (strided ? mask[c * rows + r] : mask[r * cols + c]) != 0;
        sum += valid ? naive_kl(kind, x, y) : 0.0;
        count += valid;
      }
    }
    double mean = -1;
    int64_t got_count = -1;
    cpu::kl_masked_mean_fwd(a, {MaskDType::kBool, vmask}, &mean, &got_count);
    EXPECT_TRUE(got_count == count);
    EXPECT_CLOSE(mean, count ? sum / count : 0.0, 1e-12, 1e-10);
    const double gmean = 2.0;
    cpu::kl_masked_mean_bwd(a, {MaskDType::kBool, vmask}, &gmean, &got_count, g.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const bool valid = (strided ? mask[c * rows + r] : mask[r * cols + c]) != 0;
        const double want = valid ? gmean / count * naive_kl_dlogp(kind, element(lp, r, c), element(ref, r, c)) : 0.0;
        EXPECT_CLOSE(g[r * cols + c], want, 1e-12, 1e-10);
      }
    }
  }
}

struct NaiveToken {
  double loss, dlogp, ratio, log_ratio, kl;
  bool clipped, dual;
  // Error budgets of the kernel's loss and d loss / d logp, in units of its eps (EXPECT_ULPS):
  // every term is rounded at its magnitude; the ratio carries exp's ~3 ulp and the rounding of
  // the log-ratio (|log_ratio| eps relative); k3 is accurate to 2e-6 ~ 17 eps relative (test_exp)
  // plus |e^d - 1| |d| from rounding d, and this naive's own e^d - d - 1 cancels by up to
  // e^d + |d| + 1 eps of double.
  double loss_budget, dlogp_budget, kl_budget;
};

NaiveToken naive_policy(double lp, double old, double adv, double ref, bool has_ref, double lo, double hi, double c,
                        double beta) {
  const double diff = lp - old;
  const double log_ratio = std::min(20.0, std::max(-20.0, diff));
  const double ratio = std::exp(log_ratio);
  const double s1 = -adv * ratio;
  const double s2 = -adv * std::min(1.0 + hi, std::max(1.0 - lo, ratio));
  double loss = std::max(s1, s2);
  double d = (s2 > s1 || std::fabs(diff) > 20.0) ? 0.0 : s1;
  bool dual = false;
  if (c > 0 && adv < 0 && loss > -adv * c) {
    loss = -adv * c;
    d = 0.0;
    dual = true;
  }
  const double kl = has_ref ? naive_kl(3, lp, ref) : 0.0;
  // The surrogate's factor: the ratio, its clamp bound or the dual-clip constant, whichever is used.
  const double factor = dual ? c : (s2 > s1 ? std::min(1.0 + hi, std::max(1.0 - lo, ratio)) : ratio);
  double loss_budget = std::fabs(adv) * factor * (4 + std::fabs(log_ratio));
  double dlogp_budget = d != 0.0 ? std::fabs(adv) * ratio * (4 + std::fabs(log_ratio)) : 0.0;
  const double kd = std::fabs(ref - lp), ed = std::exp(ref - lp);
  const double kl_budget = has_ref ? 17 * kl + std::fabs(ed - 1) * kd + ed + kd + 1 : 0.0;
  if (beta > 0) {
    loss += beta * kl;
    d += beta * naive_kl_dlogp(3, lp, ref);
    loss_budget += beta * kl_budget;
    dlogp_budget += beta * (4 * ed + kd + 1);
  }
  return {loss, d, ratio, log_ratio, kl, s2 > s1, dual, loss_budget + std::fabs(loss), dlogp_budget + std::fabs(d),
          kl_budget};
}

template <typename T>
T to_storage(double v) {
  return from_acc<T>(static_cast<acc_t<T>>(v));
}

// Machine epsilon of the storage type T and of its accumulation type.
template <typename T>
constexpr double storage_eps() {
  return std::is_same<T, bf16>::value ? kEpsBf16 : std::is_same<T, double>::value ? kEpsDouble : kEpsFloat;
}

template <typename T>
void test_policy(DType dtype, int64_t rows, int64_t cols, double dual_clip, double beta, bool has_ref) {
  const double eps = storage_eps<acc_t<T>>();
  std::mt19937 rng(static_cast<unsigned>(rows * 7 + cols));
  std::normal_distribution<double> nd(0.0, 1.0);
  const int64_t n = rows * cols;
  std::vector<T> lp(n), old(n), adv(n), ref(n);
  std::vector<float> mask(n);
  std::vector<acc_t<T>> grad(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x = -1.0 + 0.5 * nd(rng);
    lp[i] = to_storage<T>(x);
    old[i] = to_storage<T>(i % 17 == 0 ? x + 50.0 * (i % 2 ? 1 : -1) : x + 0.3 * nd(rng));
    adv[i] = to_storage<T>(nd(rng));
    ref[i] = to_storage<T>(x + 0.3 * nd(rng));
    mask[i] = (rng() % 4) ? 1.0f : 0.0f;
    grad[i] = static_cast<acc_t<T>>(nd(rng));
  }
  auto dense = [&](const auto& v) { return StridedView{v.data(), cols, 1}; };
  const PolicyLossArgs a{dtype, MaskDType::kFloat32, rows, cols, dense(lp), dense(old), dense(adv), dense(mask),
                         has_ref ? dense(ref) : StridedView{}, 0.2, 0.28, dual_clip, beta};
  std::vector<acc_t<T>> loss(n);
  std::vector<T> g(n);
  float stats[kNumPolicyStats];
  cpu::policy_loss_fwd(a, loss.data(), stats);
  cpu::policy_loss_bwd(a, dense(grad), g.data());
  double count = 0, clipped = 0, dual = 0, nlr = 0, nlr_abs = 0, kl = 0, kl_budget = 0, rmin = 1e300, rmax = -1e300;
  for (int64_t i = 0; i < n; ++i) {
    const NaiveToken t = naive_policy(to_acc(lp[i]), to_acc(old[i]), to_acc(adv[i]), to_acc(ref[i]), has_ref, 0.2,
                                      0.28, dual_clip, beta);
    const bool valid = mask[i] != 0.0f;
    EXPECT_ULPS(loss[i], valid ? t.loss : 0.0, 2, eps, t.loss_budget);
    // The gradient is also rounded to T (bf16: 2^-7 relative).
    const double want_g = valid ? grad[i] * t.dlogp : 0.0;
    EXPECT_ULPS(to_acc(g[i]), want_g, 2, eps,
                std::fabs(grad[i]) * t.dlogp_budget + storage_eps<T>() / eps * std::fabs(want_g));
    if (!valid) continue;
    count += 1;
    clipped += t.clipped;
    dual += t.dual;
    nlr -= t.log_ratio;
    nlr_abs += std::fabs(t.log_ratio);
    kl += t.kl;
    kl_budget += t.kl_budget;
    rmin = std::min(rmin, t.ratio);
    rmax = std::max(rmax, t.ratio);
  }
  // The statistics are fp32 whatever T; their sums run in acc_t<T> over chunks of tokens (error
  // ~sqrt(count) eps relative to the sum of magnitudes) and are merged in double.
  const double sum_ulps = (std::sqrt(count) + 2) * eps / kEpsFloat;
  EXPECT_CLOSE(stats[kStatCount], count, 0, 0);
  EXPECT_ULPS(stats[kStatClipFrac], clipped / count, 1, kEpsFloat, clipped / count);
  EXPECT_ULPS(stats[kStatDualClipFrac], dual / count, 1, kEpsFloat, dual / count);
  EXPECT_ULPS(stats[kStatApproxKl], nlr / count, 2, kEpsFloat, std::fabs(nlr / count) + sum_ulps * nlr_abs / count);
  EXPECT_ULPS(stats[kStatKlMean], kl / count, 2, kEpsFloat, kl / count + sum_ulps * kl_budget / count);
  EXPECT_ULPS(stats[kStatRatioMin], rmin, 2, kEpsFloat, rmin * (4 + std::fabs(std::log(rmin))));
  EXPECT_ULPS(stats[kStatRatioMax], rmax, 2, kEpsFloat, rmax * (4 + std::fabs(std::log(rmax))));
  // The reduced loss (loss_sum, no per-token loss stored): the sum of the per-token losses above, in
  // acc_t<T> within a chunk; the statistics are the same.
  double sum = 0, sum_abs = 0;
  for (const auto l : loss) {
    sum += l;
    sum_abs += std::fabs(l);
  }
  double loss_sum = -1;
  float stats_sum[kNumPolicyStats];
  cpu::policy_loss_fwd(a, nullptr, stats_sum, nullptr, &loss_sum);
  EXPECT_ULPS(loss_sum, sum, 2, eps, std::fabs(sum) + sum_ulps * sum_abs * kEpsFloat / eps);
  for (int i = 0; i < kNumPolicyStats; ++i) EXPECT_CLOSE(stats_sum[i], stats[i], 0, 0);
}

void test_policy_empty_mask() {
  const float lp[3] = {0.f, 1.f, 2.f}, zero_mask[3] = {0.f, 0.f, 0.f};
  const StridedView v{lp, 3, 1};
  const PolicyLossArgs a{DType::kFloat32, MaskDType::kFloat32, 1, 3, v, v, v, {zero_mask, 3, 1}, {}, 0.2, 0.2, 3.0, 0.0};
  float loss[3] = {9.f, 9.f, 9.f}, stats[kNumPolicyStats];
  double loss_sum = 9.0;
  cpu::policy_loss_fwd(a, loss, stats, nullptr, &loss_sum);
  const float want[kNumPolicyStats] = {0.f, 0.f, 0.f, 0.f, 1.f, 1.f, 0.f};
  for (int i = 0; i < kNumPolicyStats; ++i) EXPECT_CLOSE(stats[i], want[i], 0, 0);
  for (float l : loss) EXPECT_CLOSE(l, 0.0, 0, 0);
  EXPECT_CLOSE(loss_sum, 0.0, 0, 0);
}

}  // namespace

int main() {
  test_exp();
  for (bool strided : {false, true}) {
    test_kl(1, 1, strided);
    test_kl(3, 17, strided);
    test_kl(2, 9000, strided);  // rows split into several chunks
  }
  for (double c : {0.0, 3.0}) {
    for (bool has_ref : {false, true}) {
      const double beta = has_ref ? 0.1 : 0.0;
      test_policy<double>(DType::kFloat64, 3, 5000, c, beta, has_ref);
      test_policy<float>(DType::kFloat32, 4, 777, c, beta, has_ref);
      test_policy<bf16>(DType::kBFloat16, 2, 300, c, beta, has_ref);
    }
  }
  test_policy_empty_mask();
  TEST_MAIN_RETURN();
}
