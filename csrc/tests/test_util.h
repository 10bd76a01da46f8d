// A few assertion helpers for the C++ tests: no test framework to download, and each failure
// prints file, line and the values compared. main() returns the failure count, which ctest reads.
#pragma once

#include <cmath>
#include <cstdio>

namespace megalign_test {
inline int& failures() {
  static int n = 0;
  return n;
}
}  // namespace megalign_test

#define EXPECT_TRUE(cond)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);   \
      ++megalign_test::failures();                                               \
    }                                                                            \
  } while (0)

// |a - b| <= atol + rtol * |b|, with NaN == NaN and equal infinities accepted.
#define EXPECT_CLOSE(a, b, atol, rtol)                                                           \
  do {                                                                                           \
    const double _a = static_cast<double>(a), _b = static_cast<double>(b);                       \
    const bool _same = (_a == _b) || (std::isnan(_a) && std::isnan(_b));                         \
    if (!_same && !(std::fabs(_a - _b) <= (atol) + (rtol) * std::fabs(_b))) {                   \
      std::fprintf(stderr, "%s:%d: %s = %.10g, expected %s = %.10g\n", __FILE__, __LINE__, #a, \
                   _a, #b, _b);                                                                  \
      ++megalign_test::failures();                                                               \
    }                                                                                            \
  } while (0)

// Machine epsilons (the gap between 1 and the next value) of the storage types, for EXPECT_ULPS.
constexpr double kEpsFloat = 1.1920928955078125e-07;  // 2^-23
constexpr double kEpsDouble = 2.220446049250313e-16;  // 2^-52
constexpr double kEpsBf16 = 0.0078125;                // 2^-7

// A result of `eps` precision against a double-precision oracle, within `ulps` units of eps at
// `scale`: |a - b| <= ulps * eps * scale, where scale is the magnitude the computation rounds at
// (the result itself, or the larger partial results it is formed from; the test says which).
// Such a bound holds on any vector ISA, where a fixed absolute tolerance is either loose or
// breaks when FMA contraction or another summation order moves a result by a few ulp. NaN == NaN
// and equal infinities are accepted. A failure prints the error in those units.
#define EXPECT_ULPS(a, b, ulps, eps, scale)                                                        \
  do {                                                                                             \
    const double _a = static_cast<double>(a), _b = static_cast<double>(b);                         \
    const double _unit = (eps) * static_cast<double>(scale);                                       \
    const bool _same = (_a == _b) || (std::isnan(_a) && std::isnan(_b));                           \
    if (!_same && !(std::fabs(_a - _b) <= (ulps) * _unit)) {                                       \
      std::fprintf(stderr, "%s:%d: %s = %.10g, expected %s = %.10g: %.3g units of %.3g, > %g\n",  \
                   __FILE__, __LINE__, #a, _a, #b, _b, std::fabs(_a - _b) / _unit, _unit,          \
                   static_cast<double>(ulps));                                                     \
      ++megalign_test::failures();                                                                 \
    }                                                                                              \
  } while (0)

#define TEST_MAIN_RETURN()                                                    \
  do {                                                                        \
    if (megalign_test::failures()) {                                          \
      std::fprintf(stderr, "%d check(s) failed\n", megalign_test::failures()); \
      return 1;                                                               \
    }                                                                         \
    std::printf("all checks passed\n");                                       \
    return 0;                                                                 \
  } while (0)
