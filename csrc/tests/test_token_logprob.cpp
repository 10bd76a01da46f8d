// token_logprob CPU launchers against a naive double-precision loop (within fp32 error budgets in
// ulps, which hold on any vector ISA), and exp_acc's accuracy.
#include "megalign/token_logprob.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "megalign/math/token_logprob.h"
#include "test_util.h"

namespace {

// fp32 error budgets, in units of eps, of the kernels' results: each term is rounded once at its
// magnitude, and the sums s = sum e^{z-m} and t = sum e^{z-m} (z-m) over V logits are accurate to
// ~sqrt(V) eps relative (recursive summation in any number of vector lanes, with rounding errors
// of random sign; V eps is the worst case), which moves log s and t / s by that much.
struct Budget {
  double lse, logp, entropy;
};

Budget budget(double m, double lse, double h, double z_t, int64_t v) {
  const double log_s = lse - m, t_s = h - log_s, sum = std::sqrt(static_cast<double>(v));
  return {std::fabs(m) + log_s + sum, std::fabs(z_t - m) + log_s + sum, log_s + t_s + sum * (1 + t_s)};
}

struct Naive {
  std::vector<double> logp, lse, entropy, grad;
  std::vector<Budget> budget;      // per row
  std::vector<double> grad_budget; // per element, in eps
};

// log_softmax in double, straight from the definitions, of z = x * (1 / temp) rounded to fp32 as
// the kernel does; grad of sum(wl * logp + we * H).
Naive naive(const std::vector<float>& xs, int64_t n, int64_t v, const std::vector<int64_t>& tgt,
            double temp, const std::vector<double>& wl, const std::vector<double>& we) {
  std::vector<double> x(xs.size());
  const float inv_t = static_cast<float>(1.0 / temp);
  for (size_t i = 0; i < xs.size(); ++i) x[i] = static_cast<double>(xs[i] * inv_t) * temp;
  Naive out;
  out.grad.assign(n * v, 0.0);
  out.grad_budget.assign(n * v, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    if (tgt[r] == -100) {
      out.logp.push_back(0); out.lse.push_back(0); out.entropy.push_back(0); out.budget.push_back({1, 1, 1});
      continue;
    }
    double m = -INFINITY;
    for (int64_t j = 0; j < v; ++j) m = std::max(m, x[r * v + j] / temp);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(x[r * v + j] / temp - m);
    const double lse = m + std::log(s);
    double h = 0;
    for (int64_t j = 0; j < v; ++j) {
      const double lp = x[r * v + j] / temp - lse;
      if (std::isfinite(lp)) h -= std::exp(lp) * lp;
    }
    out.logp.push_back(x[r * v + tgt[r]] / temp - lse);
    out.lse.push_back(lse);
    out.entropy.push_back(h);
    const Budget b = budget(m, lse, h, x[r * v + tgt[r]] / temp, v);
    out.budget.push_back(b);
    // The backward reads lse and H as saved in fp32, within their budgets; grad_j moves by
    // p_j (|wl| + |we| |lp_j + H|) per unit of lse and by |we| p_j per unit of H, and is rounded.
    for (int64_t j = 0; j < v; ++j) {
      const double lp = x[r * v + j] / temp - lse;
      const double p = std::exp(lp);
      double g = wl[r] * ((j == tgt[r]) - p);
      if (p > 0) g += we[r] * (-p * (lp + h));
      out.grad[r * v + j] = g / temp;
      const double finite_lp = p > 0 ? lp : 0.0;
      const double per_lse = p * (std::fabs(wl[r]) + std::fabs(we[r]) * (std::fabs(finite_lp + h) + 1));
      out.grad_budget[r * v + j] =
          (per_lse * b.lse + std::fabs(we[r]) * p * b.entropy + std::fabs(wl[r]) + std::fabs(g)) / temp;
    }
  }
  return out;
}

void test_exp_acc() {
  // Relative error against double exp over the normal range, sampled densely.
  double worst = 0;
  for (double x = -87.3; x <= 88.7; x += 1e-4) {
    const float xf = static_cast<float>(x);
    const double want = std::exp(static_cast<double>(xf));
    const double got = megalign::exp_acc(xf);
    worst = std::max(worst, std::fabs(got - want) / want);
  }
  std::printf("exp_acc max relative error %.3g (%.2f ulp)\n", worst, worst / 5.96e-8);
  EXPECT_TRUE(worst < 3 * 5.96e-8);  // within a few ulp
  EXPECT_TRUE(megalign::exp_acc(0.0f) == 1.0f);
  EXPECT_TRUE(megalign::exp_acc(-INFINITY) == 0.0f);
  EXPECT_TRUE(megalign::exp_acc(-1e4f) == 0.0f);
  EXPECT_TRUE(megalign::exp_acc(-FLT_MAX) == 0.0f);
  EXPECT_TRUE(megalign::exp_acc(-88.0f) < 1.2e-38f);
  EXPECT_TRUE(std::isinf(megalign::exp_acc(89.0f)));
  EXPECT_TRUE(std::isinf(megalign::exp_acc(INFINITY)));
  EXPECT_TRUE(std::isnan(megalign::exp_acc(NAN)));
  EXPECT_CLOSE(megalign::exp_acc(88.7f), std::exp(static_cast<double>(88.7f)), 0, 3e-7);  // k = 128
}

// The softmax kernels' exp (x <= ln2/2 only) is exp_acc's arithmetic with 2^k in one factor:
// the same bits wherever it is used, 0 below ln FLT_MIN and for -inf, NaN for NaN.
void test_exp_nonpos() {
  int64_t differ = 0;
  for (double x = -100.0; x <= 0.3465; x += 1e-4) {
    const float xf = static_cast<float>(x);
    differ += megalign::exp_nonpos_f32(xf) != megalign::exp_acc(xf);
  }
  EXPECT_TRUE(differ == 0);
  EXPECT_TRUE(megalign::exp_nonpos_f32(0.0f) == 1.0f);
  EXPECT_TRUE(megalign::exp_nonpos_f32(-INFINITY) == 0.0f);
  EXPECT_TRUE(megalign::exp_nonpos_f32(-FLT_MAX) == 0.0f);
  EXPECT_TRUE(std::isnan(megalign::exp_nonpos_f32(NAN)));
}

void test_merge() {
  using S = megalign::math::SoftmaxStats<double>;
  // Merging {1, 2} with {3, -inf} equals the direct statistics of {1, 2, 3, -inf}.
  const S a{2.0, 1.0 + std::exp(-1.0), -std::exp(-1.0)};
  const S b{3.0, 1.0, 0.0};
  const S ab = megalign::math::merge_stats(a, b);
  double s = 0, t = 0;
  for (double z : {1.0, 2.0, 3.0}) { s += std::exp(z - 3.0); t += std::exp(z - 3.0) * (z - 3.0); }
  EXPECT_CLOSE(ab.m, 3.0, 0, 0);
  EXPECT_CLOSE(ab.s, s, 1e-15, 1e-14);
  EXPECT_CLOSE(ab.t, t, 1e-15, 1e-14);
  const S e = megalign::math::empty_stats<double>();
  const S ae = megalign::math::merge_stats(e, a);
  EXPECT_CLOSE(ae.s, a.s, 0, 0);
  EXPECT_CLOSE(ae.t, a.t, 0, 0);
  const S ee = megalign::math::merge_stats(e, e);
  EXPECT_TRUE(ee.s == 0 && ee.t == 0 && std::isinf(ee.m));
}

void test_launchers(int64_t n, int64_t v, double temp) {
  std::mt19937 rng(static_cast<unsigned>(n * 1000 + v));
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_int_distribution<int64_t> id(0, v - 1);
  std::vector<float> x(n * v);
  for (auto& e : x) e = normal(rng);
  std::vector<int64_t> tgt(n);
  for (auto& e : tgt) e = id(rng);
  if (n > 2) tgt[1] = -100;
  if (n > 3) for (int64_t j = 0; j < v; j += 2) x[3 * v + j] = -INFINITY;
  if (n > 3 && v > 1) tgt[3] = 1;
  if (n > 4) for (int64_t j = 0; j < v; ++j) x[4 * v + j] += 1e4f;
  std::vector<double> wl(n), we(n);
  for (int64_t r = 0; r < n; ++r) { wl[r] = normal(rng); we[r] = normal(rng); }
  const Naive want = naive(x, n, v, tgt, temp, wl, we);

  std::vector<float> partials(4 * n), logp(n), lse(n), ent(n);
  const int64_t bad = megalign::cpu::token_logprob_partials(
      megalign::DType::kFloat32, x.data(), n, v, v, tgt.data(), 0, v, 1.0 / temp, -100, true,
      partials.data());
  EXPECT_TRUE(bad == -1);
  megalign::cpu::token_logprob_finalize(megalign::DType::kFloat32, partials.data(), n, logp.data(),
                                        lse.data(), ent.data());
  // Against the double oracle, within a few times their fp32 error budgets (Budget); measured on
  // AVX2 and SSE2 builds: <= 0.6, 1.2, 0.4 and (the gradient below) 0.4 budgets.
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_ULPS(lse[r], want.lse[r], 4, kEpsFloat, want.budget[r].lse);
    EXPECT_ULPS(logp[r], want.logp[r], 4, kEpsFloat, want.budget[r].logp);
    EXPECT_ULPS(ent[r], want.entropy[r], 2, kEpsFloat, want.budget[r].entropy);
  }
  std::vector<float> gl(wl.begin(), wl.end()), ge(we.begin(), we.end()), grad(n * v);
  megalign::cpu::token_logprob_backward(megalign::DType::kFloat32, x.data(), n, v, v, tgt.data(),
                                        lse.data(), ent.data(), gl.data(), ge.data(), 0,
                                        1.0 / temp, -100, grad.data(), v);
  // Row 4 has logits ~1e4: lse is saved in fp32 (ulp 1e-3 there), so p_j = e^{z_j - lse} in the
  // backward carries that error; grad_budget accounts for it (Naive).
  for (int64_t i = 0; i < n * v; ++i) EXPECT_ULPS(grad[i], want.grad[i], 2, kEpsFloat, want.grad_budget[i]);

  // Out-of-range targets are reported (first bad row) and their rows are NaN.
  if (n > 2) {
    tgt[2] = v;
    EXPECT_TRUE(megalign::cpu::token_logprob_partials(megalign::DType::kFloat32, x.data(), n, v, v,
                                                      tgt.data(), 0, v, 1.0, -100, false,
                                                      partials.data()) == 2);
    EXPECT_TRUE(std::isnan(partials[8]));
  }
}

}  // namespace

int main() {
  test_exp_acc();
  test_exp_nonpos();
  test_merge();
  test_launchers(1, 1, 1.0);
  test_launchers(6, 2, 1.0);
  test_launchers(7, 5003, 0.7);
  test_launchers(5, 20000, 1.3);
  TEST_MAIN_RETURN();
}
