// The 16-bit conversions in common.h: the software fp16 path (used by compilers without
// _Float16) must agree bit for bit with the compiler's _Float16, and bf16 rounding must be
// round-to-nearest-even.
#define MEGALIGN_SOFT_FP16 1
#include "megalign/common.h"
#include "test_util.h"

#include <cstring>
#include <random>

using megalign::bf16;
using megalign::fp16;

int main() {
#if defined(__FLT16_MAX__)
  // Every half bit pattern -> float.
  for (uint32_t b = 0; b < 65536; ++b) {
    const fp16 h{static_cast<uint16_t>(b)};
    _Float16 ref;
    std::memcpy(&ref, &h.bits, 2);
    const float want = static_cast<float>(ref);
    const float got = megalign::to_acc(h);
    if (!(std::isnan(want) && std::isnan(got))) EXPECT_TRUE(megalign::float_bits(got) == megalign::float_bits(want));
  }
  // Floats across the whole half range (normal, subnormal, overflow, ties) -> half.
  std::mt19937 rng(0);
  std::uniform_int_distribution<uint32_t> any(0, 0xFFFFFFFFu);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = any(rng);
    if (i % 2) u = (u & 0x87FFFFFFu) | 0x30000000u;  // concentrate on exponents near the half range
    const float f = megalign::bits_float(u);
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    EXPECT_TRUE(megalign::from_acc<fp16>(f).bits == want);
  }
#endif
  // bf16: exact values, ties to even, NaN stays NaN.
  EXPECT_TRUE(megalign::from_acc<bf16>(1.0f).bits == 0x3F80);
  EXPECT_TRUE(megalign::from_acc<bf16>(megalign::bits_float(0x3F808000u)).bits == 0x3F80);  // tie -> even
  EXPECT_TRUE(megalign::from_acc<bf16>(megalign::bits_float(0x3F818000u)).bits == 0x3F82);  // tie -> even
  EXPECT_TRUE(megalign::from_acc<bf16>(megalign::bits_float(0x3F808001u)).bits == 0x3F81);
  EXPECT_TRUE(std::isnan(megalign::to_acc(megalign::from_acc<bf16>(NAN))));
  EXPECT_CLOSE(megalign::to_acc(bf16{0xC2F7}), -123.5, 0, 0);
  TEST_MAIN_RETURN();
}
