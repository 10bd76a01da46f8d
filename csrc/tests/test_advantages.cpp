// The GAE and group-advantage CPU launchers and the shared math (math/advantage.h) against naive
// loops written from the definitions, including the chunked affine-map scan the CUDA kernel runs.
#include "megalign/gae.h"
#include "megalign/group_advantages.h"
#include "megalign/math/advantage.h"
#include "test_util.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

using megalign::DType;
using megalign::Strides2d;
using megalign::math::GaeMap;
using megalign::math::GroupMode;

namespace {

// GAE by the definition: for each valid t, n(t) is the next valid position (none: V = A = 0).
// budget[t] is the running error bound of a recursion that rounds every step (Higham, "Accuracy
// and Stability of Numerical Algorithms", 3.3): each step's rounding, at most a few eps of the
// magnitudes it adds, enters A_t and decays by gamma * lam per step back, so |A_t - A*_t| is
// within a few eps * budget[t] with budget[t] = |r_t| + gamma |V_n| + |V_t| + |A_t| +
// gamma lam budget[n(t)], whatever the evaluation order within a step (FMA or not).
void naive_gae(const std::vector<double>& r, const std::vector<double>& v, const std::vector<bool>& m,
               double gamma, double lam, std::vector<double>& adv, std::vector<double>& ret,
               std::vector<double>& budget) {
  const int64_t T = static_cast<int64_t>(r.size());
  adv.assign(T, 0.0);
  ret.assign(T, 0.0);
  budget.assign(T, 0.0);
  for (int64_t t = T - 1; t >= 0; --t) {
    if (!m[t]) continue;
    int64_t n = t + 1;
    while (n < T && !m[n]) ++n;
    const double vn = n < T ? v[n] : 0.0, an = n < T ? adv[n] : 0.0, bn = n < T ? budget[n] : 0.0;
    adv[t] = r[t] + gamma * vn - v[t] + gamma * lam * an;
    ret[t] = adv[t] + v[t];
    budget[t] = std::fabs(r[t]) + std::fabs(gamma * vn) + std::fabs(v[t]) + std::fabs(adv[t]) + gamma * lam * bn;
  }
}

// The CUDA decomposition on the CPU: chunk maps, an exclusive right-to-left scan of them, then a
// re-walk of each chunk from its incoming state.
void chunked_gae(const std::vector<double>& r, const std::vector<double>& v, const std::vector<bool>& m,
                 double gamma, double lam, int64_t chunk, std::vector<double>& adv, std::vector<double>& ret) {
  const int64_t T = static_cast<int64_t>(r.size());
  const int64_t chunks = (T + chunk - 1) / chunk;
  adv.assign(T, -1.0);
  ret.assign(T, -1.0);
  std::vector<GaeMap<double>> maps(chunks, GaeMap<double>::identity());
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t t = std::min(T, (c + 1) * chunk) - 1; t >= c * chunk; --t)
      maps[c] = megalign::math::gae_compose(GaeMap<double>::step(m[t], r[t], v[t], gamma, gamma * lam), maps[c]);
  GaeMap<double> suffix = GaeMap<double>::identity();  // composition of the chunks right of c
  for (int64_t c = chunks - 1; c >= 0; --c) {
    double next_value = 0, next_adv = 0;
    megalign::math::gae_apply(suffix, next_value, next_adv);
    auto load = [&](int64_t t, bool& valid, double& rt, double& vt) {
      valid = m[t];
      rt = r[t];
      vt = v[t];
    };
    megalign::math::gae_walk(c * chunk, std::min(T, (c + 1) * chunk), gamma, gamma * lam, next_value, next_adv,
                             load, adv.data(), ret.data());
    suffix = megalign::math::gae_compose(maps[c], suffix);
  }
}

void test_gae_hand_worked() {
  // r = [1, 5, 2, 3], V = [0.5, 9, 1, 2], mask = [1, 0, 1, 1], gamma = 0.5, lam = 0.5 (gamma*lam = 0.25).
  // t=3: A = 3 + 0 - 2 + 0 = 1, R = 3.  t=2: A = 2 + 0.5*2 - 1 + 0.25*1 = 2.25, R = 3.25.
  // t=1 masked: 0, 0.  t=0 (next valid is 2): A = 1 + 0.5*1 - 0.5 + 0.25*2.25 = 1.5625, R = 2.0625.
  const float r[4] = {1, 5, 2, 3}, v[4] = {0.5f, 9, 1, 2};
  const bool m[4] = {true, false, true, true};
  float adv[4], ret[4];
  megalign::cpu::gae(DType::kFloat32, r, {4, 1}, v, {4, 1}, m, {4, 1}, 1, 4, 0.5, 0.5, adv, ret);
  const float want_adv[4] = {1.5625f, 0, 2.25f, 1}, want_ret[4] = {2.0625f, 0, 3.25f, 3};
  for (int t = 0; t < 4; ++t) {
    EXPECT_CLOSE(adv[t], want_adv[t], 1e-6, 1e-6);
    EXPECT_CLOSE(ret[t], want_ret[t], 1e-6, 1e-6);
  }
}

void test_gae_random() {
  std::mt19937 rng(1);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> unif;
  const int64_t B = 7, T = 301;
  const double params[][2] = {{1.0, 1.0}, {0.99, 0.95}, {0.0, 0.95}, {0.99, 0.0}};
  for (const auto& gl : params) {
    // Row kinds: dense, random holes, leading+trailing padding, all masked, single valid position.
    std::vector<double> r(B * T), v(B * T);
    std::vector<bool> m(B * T);
    for (int64_t i = 0; i < B * T; ++i) {
      r[i] = normal(rng);
      v[i] = normal(rng);
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        bool valid = true;
        if (b == 1 || b == 5) valid = unif(rng) < 0.6;
        if (b == 2) valid = t >= 17 && t < T - 40 && (t % 9 != 4);
        if (b == 3) valid = false;
        if (b == 4) valid = t == 150;
        m[b * T + t] = valid;
      }
    std::vector<double> rd(r), vd(v);
    std::vector<float> rf(r.begin(), r.end()), vf(v.begin(), v.end());
    std::unique_ptr<bool[]> mb(new bool[B * T]);
    for (int64_t i = 0; i < B * T; ++i) mb[i] = m[i];
    std::vector<double> adv64(B * T), ret64(B * T);
    std::vector<float> adv32(B * T), ret32(B * T);
    megalign::cpu::gae(DType::kFloat64, rd.data(), {T, 1}, vd.data(), {T, 1}, mb.get(), {T, 1}, B, T, gl[0], gl[1],
                       adv64.data(), ret64.data());
    megalign::cpu::gae(DType::kFloat32, rf.data(), {T, 1}, vf.data(), {T, 1}, mb.get(), {T, 1}, B, T, gl[0], gl[1],
                       adv32.data(), ret32.data());
    for (int64_t b = 0; b < B; ++b) {
      std::vector<double> rr(r.begin() + b * T, r.begin() + (b + 1) * T), vv(v.begin() + b * T, v.begin() + (b + 1) * T);
      std::vector<bool> mm(m.begin() + b * T, m.begin() + (b + 1) * T);
      std::vector<double> adv, ret, budget, cadv, cret;
      naive_gae(rr, vv, mm, gl[0], gl[1], adv, ret, budget);
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_CLOSE(adv64[b * T + t], adv[t], 1e-10, 1e-10);
        EXPECT_CLOSE(ret64[b * T + t], ret[t], 1e-10, 1e-10);
        // The returns add V_t to A_t: one more rounding at |A_t| + |V_t|.
        EXPECT_ULPS(adv32[b * T + t], adv[t], 2, kEpsFloat, budget[t]);
        EXPECT_ULPS(ret32[b * T + t], ret[t], 2, kEpsFloat, budget[t] + std::fabs(ret[t]) + std::fabs(vv[t]));
      }
      for (int64_t chunk : {1, 2, 7, 64, 1000}) {
        chunked_gae(rr, vv, mm, gl[0], gl[1], chunk, cadv, cret);
        for (int64_t t = 0; t < T; ++t) {
          EXPECT_CLOSE(cadv[t], adv[t], 1e-9, 1e-9);
          EXPECT_CLOSE(cret[t], ret[t], 1e-9, 1e-9);
        }
      }
    }
  }
}

void test_gae_strided() {
  // A transposed [T, B] buffer read as [B, T] (column stride B) matches the contiguous result.
  const int64_t B = 3, T = 5;
  std::vector<float> r(B * T), v(B * T), rt(B * T), vt(B * T);
  std::unique_ptr<bool[]> m(new bool[B * T]), mt(new bool[B * T]);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      r[b * T + t] = rt[t * B + b] = 0.25f * static_cast<float>(b + t);
      v[b * T + t] = vt[t * B + b] = 0.5f * static_cast<float>(t) - static_cast<float>(b);
      m[b * T + t] = mt[t * B + b] = (b + t) % 3 != 1;
    }
  std::vector<float> a1(B * T), r1(B * T), a2(B * T), r2(B * T);
  megalign::cpu::gae(DType::kFloat32, r.data(), {T, 1}, v.data(), {T, 1}, m.get(), {T, 1}, B, T, 0.9, 0.8,
                     a1.data(), r1.data());
  megalign::cpu::gae(DType::kFloat32, rt.data(), {1, B}, vt.data(), {1, B}, mt.get(), {1, B}, B, T, 0.9, 0.8,
                     a2.data(), r2.data());
  for (int64_t i = 0; i < B * T; ++i) {
    EXPECT_TRUE(a1[i] == a2[i]);
    EXPECT_TRUE(r1[i] == r2[i]);
  }
}

void test_compose_associative() {
  std::mt19937 rng(2);
  std::normal_distribution<double> normal;
  auto random_map = [&](int kind) {
    return GaeMap<double>::step(kind != 0, normal(rng), normal(rng), 0.9, 0.9 * 0.7);
  };
  for (int i = 0; i < 100; ++i) {
    const GaeMap<double> a = random_map(i % 2), b = random_map(i % 3), c = random_map(i % 5);
    const auto x = megalign::math::gae_compose(megalign::math::gae_compose(a, b), c);
    const auto y = megalign::math::gae_compose(a, megalign::math::gae_compose(b, c));
    EXPECT_CLOSE(x.p, y.p, 1e-12, 1e-12);
    EXPECT_CLOSE(x.v, y.v, 1e-12, 1e-12);
    EXPECT_CLOSE(x.ca, y.ca, 1e-12, 1e-12);
    EXPECT_CLOSE(x.cb, y.cb, 1e-12, 1e-12);
    EXPECT_CLOSE(x.e, y.e, 1e-12, 1e-12);
  }
}

// Non-finite scores with lam = 0 or gamma = 0: a coefficient that is exactly 0 drops the term
// (math::coef_mul), so a NaN or inf reaches only the positions whose advantage depends on it, in
// the walk (the CPU kernel) and in the chunked scan of composed maps (the CUDA kernel) alike.
// r = 1 and V = 0.5 everywhere, the row fully valid; position k gets a non-finite reward or value.
void test_gae_nonfinite_stays_local() {
  const int64_t T = 37, k = 20;
  const double bad_values[] = {std::nan(""), INFINITY, -INFINITY};
  const double params[][2] = {{0.9, 0.0}, {0.0, 0.95}, {0.0, 0.0}};
  const std::vector<bool> m(T, true);
  for (const double bad : bad_values)
    for (const auto& gl : params)
      for (const bool in_value : {false, true}) {
        std::vector<double> r(T, 1.0), v(T, 0.5);
        (in_value ? v : r)[k] = bad;
        // Which positions the definition makes non-finite: A_k always; A_{k-1} reads V_k (gamma > 0).
        auto expect_finite = [&](int64_t t) { return !(t == k || (in_value && gl[0] != 0.0 && t == k - 1)); };
        std::vector<double> adv(T), ret(T);
        std::unique_ptr<bool[]> mb(new bool[T]);
        for (int64_t t = 0; t < T; ++t) mb[t] = true;
        megalign::cpu::gae(DType::kFloat64, r.data(), {T, 1}, v.data(), {T, 1}, mb.get(), {T, 1}, 1, T, gl[0], gl[1],
                           adv.data(), ret.data());
        for (int64_t t = 0; t < T; ++t) EXPECT_TRUE(std::isfinite(adv[t]) == expect_finite(t));
        for (int64_t chunk : {1, 3, 8, 64}) {
          std::vector<double> cadv, cret;
          chunked_gae(r, v, m, gl[0], gl[1], chunk, cadv, cret);
          for (int64_t t = 0; t < T; ++t) {
            EXPECT_TRUE(std::isfinite(cadv[t]) == expect_finite(t));
            EXPECT_CLOSE(cadv[t], adv[t], 1e-12, 1e-12);
            EXPECT_CLOSE(cret[t], ret[t], 1e-12, 1e-12);
          }
        }
      }
}

// Naive group advantages from the textbook formulas, in double.
double naive_advantage(const std::vector<double>& members, double r, GroupMode mode, double eps, bool unbiased) {
  const double n = static_cast<double>(members.size());
  if (members.size() <= 1) return 0.0;
  double mean = 0, var = 0;
  for (double x : members) mean += x / n;
  for (double x : members) var += (x - mean) * (x - mean);
  var /= unbiased ? n - 1 : n;
  if (mode == GroupMode::kDrGrpo) return r - mean;
  if (mode == GroupMode::kRloo) return r - (mean * n - r) / (n - 1);
  return (r - mean) / (std::sqrt(var) + eps);
}

void test_group_hand_worked() {
  // scores [1, 0, 0, 0, 0, 0]: mean 1/6, deviations 5/6 and -1/6, sum of squares 5/6; eps 1e-4.
  // Population std sqrt(5/36) = sqrt(5)/6, unbiased std sqrt(1/6). The fp32 kernel is within a
  // few ulp of these exact values (a mean, a sum of squares, a sqrt and a division, each rounded).
  const float s[6] = {1, 0, 0, 0, 0, 0};
  float out[6];
  const double pop = std::sqrt(5.0) / 6.0 + 1e-4, unb = std::sqrt(1.0 / 6.0) + 1e-4;
  megalign::cpu::group_advantages(DType::kFloat32, s, 1, 6, 6, GroupMode::kGrpo, 1e-4, false, out);
  EXPECT_ULPS(out[0], (5.0 / 6.0) / pop, 4, kEpsFloat, (5.0 / 6.0) / pop);
  EXPECT_ULPS(out[3], (-1.0 / 6.0) / pop, 4, kEpsFloat, (1.0 / 6.0) / pop);
  megalign::cpu::group_advantages(DType::kFloat32, s, 1, 6, 6, GroupMode::kGrpo, 1e-4, true, out);
  EXPECT_ULPS(out[0], (5.0 / 6.0) / unb, 4, kEpsFloat, (5.0 / 6.0) / unb);
  EXPECT_ULPS(out[5], (-1.0 / 6.0) / unb, 4, kEpsFloat, (1.0 / 6.0) / unb);
  // rloo: 1 - 0 = 1 and 0 - 1/5 = -0.2; dr_grpo: 1 - 1/6 and -1/6.
  megalign::cpu::group_advantages(DType::kFloat32, s, 1, 6, 6, GroupMode::kRloo, 0, true, out);
  EXPECT_ULPS(out[0], 1.0, 4, kEpsFloat, 1.0);
  EXPECT_ULPS(out[1], -0.2, 4, kEpsFloat, 0.2);
  megalign::cpu::group_advantages(DType::kFloat32, s, 1, 6, 6, GroupMode::kDrGrpo, 0, true, out);
  EXPECT_ULPS(out[0], 5.0 / 6.0, 4, kEpsFloat, 5.0 / 6.0);
  EXPECT_ULPS(out[2], -1.0 / 6.0, 4, kEpsFloat, 1.0 / 6.0);
}

void test_group_random() {
  std::mt19937 rng(3);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int64_t> pick(0, 9);
  const int64_t N = 240;
  std::vector<double> s(N);
  for (auto& x : s) x = 3.0 + normal(rng);
  for (int64_t i = 40; i < 48; ++i) s[i] = 0.1;  // a contiguous group of 8 equal scores (groups of 8)
  std::vector<int64_t> ids(N);
  for (auto& g : ids) g = pick(rng);
  ids[7] = 10;  // group 10 has one member
  for (GroupMode mode : {GroupMode::kGrpo, GroupMode::kDrGrpo, GroupMode::kRloo})
    for (bool unbiased : {true, false}) {
      std::vector<double> out(N), outi(N);
      for (int64_t G : {1, 8, 240}) {
        megalign::cpu::group_advantages(DType::kFloat64, s.data(), 1, N, G, mode, 1e-6, unbiased, out.data());
        for (int64_t i = 0; i < N; ++i) {
          const int64_t first = (i / G) * G;
          std::vector<double> members(s.begin() + first, s.begin() + first + G);
          EXPECT_CLOSE(out[i], naive_advantage(members, s[i], mode, 1e-6, unbiased), 1e-9, 1e-9);
        }
        if (G == 8)
          for (int64_t i = 40; i < 48; ++i) EXPECT_TRUE(out[i] == 0.0);
      }
      megalign::cpu::group_advantages_by_id(DType::kFloat64, s.data(), 1, ids.data(), 1, N, mode, 1e-6, unbiased,
                                            outi.data());
      for (int64_t i = 0; i < N; ++i) {
        std::vector<double> members;
        for (int64_t j = 0; j < N; ++j)
          if (ids[j] == ids[i]) members.push_back(s[j]);
        EXPECT_CLOSE(outi[i], naive_advantage(members, s[i], mode, 1e-6, unbiased), 1e-9, 1e-9);
      }
      EXPECT_TRUE(outi[7] == 0.0);
    }
  // Equal scores with eps = 0: exactly 0, not 0/0.
  const float eq[5] = {0.3f, 0.3f, 0.3f, 0.3f, 0.3f};
  float out[5];
  megalign::cpu::group_advantages(DType::kFloat32, eq, 1, 5, 5, GroupMode::kGrpo, 0.0, true, out);
  for (float x : out) EXPECT_TRUE(x == 0.0f);
}


// The advantages by the definition, for groups given by ids[i] (any values).
std::vector<double> naive_by_id(const std::vector<double>& s, const std::vector<int64_t>& ids, GroupMode mode,
                                double eps, bool unbiased) {
  std::vector<double> want(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    std::vector<double> members;
    for (size_t j = 0; j < s.size(); ++j)
      if (ids[j] == ids[i]) members.push_back(s[j]);
    want[i] = naive_advantage(members, s[i], mode, eps, unbiased);
  }
  return want;
}

// Arbitrary ids in the layouts the kernel walks differently: scattered (member by member), runs of
// equal ids (short, long, and one id in several runs), all distinct (the hash table grows many
// times); sparse, negative and huge values, including ids that differ only in high bits.
void test_group_by_id_layouts() {
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  const int64_t pool[] = {-5, 0, 3, 7, 9, 1000, int64_t(1) << 40, (int64_t(1) << 40) + 1, INT64_MIN, INT64_MAX};
  const int64_t N = 700;
  std::vector<double> s(N);
  for (auto& x : s) x = 2.0 + normal(rng);
  std::vector<std::vector<int64_t>> layouts;
  std::vector<int64_t> ids(N);
  for (auto& g : ids) g = pool[rng() % 10];
  layouts.push_back(ids);  // scattered
  for (int64_t i = 0, run = 0; i < N; ++run)
    for (int64_t k = 0, len = 1 + static_cast<int64_t>(rng() % 40); k < len && i < N; ++k) ids[i++] = pool[run % 10];
  layouts.push_back(ids);  // runs of 1..40, each id in several runs
  for (int64_t i = 0; i < N; ++i) ids[i] = (i / 20) * 7919 - 100000;
  layouts.push_back(ids);  // contiguous runs of 20
  for (int64_t i = 0; i < N; ++i) ids[i] = (i % 3 == 0) ? i * 1000003 : -(i << 33);
  layouts.push_back(ids);  // all distinct
  for (const auto& layout : layouts)
    for (GroupMode mode : {GroupMode::kGrpo, GroupMode::kDrGrpo, GroupMode::kRloo})
      for (bool unbiased : {true, false}) {
        std::vector<double> out(N);
        megalign::cpu::group_advantages_by_id(DType::kFloat64, s.data(), 1, layout.data(), 1, N, mode, 1e-6, unbiased,
                                              out.data());
        const std::vector<double> want = naive_by_id(s, layout, mode, 1e-6, unbiased);
        for (int64_t i = 0; i < N; ++i) EXPECT_CLOSE(out[i], want[i], 1e-9, 1e-9);
        // The result does not depend on the id values: a one-to-one relabelling gives the same bits.
        std::vector<int64_t> relabelled(layout);
        for (auto& g : relabelled)  // an odd multiplier and a complement: a bijection of int64
          g = static_cast<int64_t>(~(static_cast<uint64_t>(g) * 0x5851F42D4C957F2Dull));
        std::vector<double> again(N);
        megalign::cpu::group_advantages_by_id(DType::kFloat64, s.data(), 1, relabelled.data(), 1, N, mode, 1e-6,
                                              unbiased, again.data());
        for (int64_t i = 0; i < N; ++i) EXPECT_TRUE(again[i] == out[i]);
      }
  // float32 scores with fp32 arithmetic, against the fp64 definition.
  std::vector<float> s32(s.begin(), s.end());
  std::vector<double> s32d(s32.begin(), s32.end());
  std::vector<float> out32(N);
  megalign::cpu::group_advantages_by_id(DType::kFloat32, s32.data(), 1, layouts[0].data(), 1, N, GroupMode::kGrpo,
                                        1e-6, true, out32.data());
  const std::vector<double> want32 = naive_by_id(s32d, layouts[0], GroupMode::kGrpo, 1e-6, true);
  for (int64_t i = 0; i < N; ++i) EXPECT_CLOSE(out32[i], want32[i], 1e-5, 1e-5);
}

// The walk is picked from the leading ids (the first 1024): layouts that change after them, runs
// then scattered ids and the reverse, give the definition's numbers too.
void test_group_mixed_layouts() {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  const int64_t N = 2500, half = 1300;
  std::vector<double> s(N);
  for (auto& x : s) x = normal(rng);
  std::vector<int64_t> runs_first(N), scattered_first(N);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t run = i / 7 * 31, scattered = static_cast<int64_t>(rng() % 300) * 31;  // shared ids
    runs_first[i] = i < half ? run : scattered;
    scattered_first[i] = i < half ? scattered : run;
  }
  for (const auto* ids : {&runs_first, &scattered_first}) {
    std::vector<double> out(N);
    megalign::cpu::group_advantages_by_id(DType::kFloat64, s.data(), 1, ids->data(), 1, N, GroupMode::kGrpo, 1e-6,
                                          true, out.data());
    const std::vector<double> want = naive_by_id(s, *ids, GroupMode::kGrpo, 1e-6, true);
    for (int64_t i = 0; i < N; ++i) EXPECT_CLOSE(out[i], want[i], 1e-9, 1e-9);
  }
}

// Strided scores and ids read the same elements as contiguous ones: the same bits come out.
void test_group_strided() {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal;
  const int64_t N = 300;
  std::vector<float> s(3 * N), dense(N);
  std::vector<int64_t> ids(2 * N), dense_ids(N);
  for (int64_t i = 0; i < N; ++i) {
    dense[i] = s[3 * i] = normal(rng);
    dense_ids[i] = ids[2 * i] = static_cast<int64_t>(rng() % 37) * 1001;
  }
  for (int64_t i = 0; i < N; ++i) ids[2 * i + 1] = -1;  // never read
  std::vector<float> strided(N), contiguous(N);
  megalign::cpu::group_advantages_by_id(DType::kFloat32, s.data(), 3, ids.data(), 2, N, GroupMode::kGrpo, 1e-6, true,
                                        strided.data());
  megalign::cpu::group_advantages_by_id(DType::kFloat32, dense.data(), 1, dense_ids.data(), 1, N, GroupMode::kGrpo,
                                        1e-6, true, contiguous.data());
  for (int64_t i = 0; i < N; ++i) EXPECT_TRUE(strided[i] == contiguous[i]);
  megalign::cpu::group_advantages(DType::kFloat32, s.data(), 3, N, 20, GroupMode::kRloo, 0, false, strided.data());
  megalign::cpu::group_advantages(DType::kFloat32, dense.data(), 1, N, 20, GroupMode::kRloo, 0, false,
                                  contiguous.data());
  for (int64_t i = 0; i < N; ++i) EXPECT_TRUE(strided[i] == contiguous[i]);
}

// Degenerate groups never give NaN: equal scores and lone members give exactly 0 with eps = 0, in
// both walks of ids and in long contiguous groups (the interleaved sums); deviations whose squares
// underflow (std = 0) give 0 with eps = 0 and stay finite with a denormal eps.
void test_group_degenerate() {
  const int64_t N = 64;
  std::vector<float> eq(N, 0.7f), out(N);
  std::vector<int64_t> runs(N), scattered(N);
  for (int64_t i = 0; i < N; ++i) {
    runs[i] = i / 32;
    scattered[i] = i % 5 == 4 ? 100 + i : i % 3;  // every fifth member alone
  }
  for (GroupMode mode : {GroupMode::kGrpo, GroupMode::kDrGrpo, GroupMode::kRloo}) {
    for (const auto* ids : {&runs, &scattered}) {
      megalign::cpu::group_advantages_by_id(DType::kFloat32, eq.data(), 1, ids->data(), 1, N, mode, 0.0, true,
                                            out.data());
      for (float x : out) EXPECT_TRUE(x == 0.0f);
    }
    megalign::cpu::group_advantages(DType::kFloat32, eq.data(), 1, N, 32, mode, 0.0, false, out.data());
    for (float x : out) EXPECT_TRUE(x == 0.0f);
  }
  const float tiny[4] = {0.0f, 1e-30f, 0.0f, 1e-30f};  // (1e-30 / 2)^2 underflows to 0 in float32
  float adv[4];
  megalign::cpu::group_advantages(DType::kFloat32, tiny, 1, 4, 4, GroupMode::kGrpo, 0.0, true, adv);
  for (float x : adv) EXPECT_TRUE(x == 0.0f);
  megalign::cpu::group_advantages(DType::kFloat32, tiny, 1, 4, 4, GroupMode::kGrpo, 1e-45, true, adv);
  for (float x : adv) EXPECT_TRUE(std::isfinite(x));
  EXPECT_TRUE(adv[1] > 0.0f && adv[0] < 0.0f);
}

}  // namespace

int main() {
  test_gae_hand_worked();
  test_gae_random();
  test_gae_strided();
  test_compose_associative();
  test_gae_nonfinite_stays_local();
  test_group_hand_worked();
  test_group_random();
  test_group_by_id_layouts();
  test_group_mixed_layouts();
  test_group_strided();
  test_group_degenerate();
  TEST_MAIN_RETURN();
}
