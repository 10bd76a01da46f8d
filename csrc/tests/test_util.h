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

#define TEST_MAIN_RETURN()                                                    \
  do {                                                                        \
    if (megalign_test::failures()) {                                          \
      std::fprintf(stderr, "%d check(s) failed\n", megalign_test::failures()); \
      return 1;                                                               \
    }                                                                         \
    std::printf("all checks passed\n");                                       \
    return 0;                                                                 \
  } while (0)
