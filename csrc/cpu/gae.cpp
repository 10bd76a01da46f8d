// GAE on the CPU: OpenMP across rows, one reverse walk per row (math/advantage.h gae_walk).
#include "megalign/gae.h"

#include "megalign/math/advantage.h"

namespace megalign::cpu {
namespace {

// Rows run in parallel only above this many elements (about 0.4 ms of serial walk at ~1 ns per
// element): below it a parallel region saves little, and on a loaded machine a thread waiting for
// a core stalls the whole region for a scheduler time slice (measured: 0.1 ms -> 16 ms at B=32, T=4096).
constexpr int64_t kParallelGrain = int64_t(1) << 19;

template <typename T>
void gae_rows(const T* rewards, Strides2d rs, const T* values, Strides2d vs, const bool* mask, Strides2d ms,
              int64_t batch, int64_t steps, double gamma, double lam, acc_t<T>* adv, acc_t<T>* ret) {
  using acc = acc_t<T>;
  const acc g = static_cast<acc>(gamma);
  const acc gl = static_cast<acc>(gamma * lam);
#pragma omp parallel for schedule(static) if (batch > 1 && batch * steps >= kParallelGrain)
  for (int64_t b = 0; b < batch; ++b) {
    const T* r = rewards + b * rs.row;
    const T* v = values + b * vs.row;
    const bool* m = mask + b * ms.row;
    auto load = [&](int64_t t, bool& valid, acc& rt, acc& vt) {
      valid = m[t * ms.col];
      rt = to_acc(r[t * rs.col]);
      vt = to_acc(v[t * vs.col]);
    };
    acc next_value = 0, next_adv = 0;
    math::gae_walk(0, steps, g, gl, next_value, next_adv, load, adv + b * steps, ret + b * steps);
  }
}

}  // namespace

void gae(DType dtype, const void* rewards, Strides2d rs, const void* values, Strides2d vs, const bool* mask,
         Strides2d ms, int64_t batch, int64_t steps, double gamma, double lam, void* advantages, void* returns) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "gae", [&] {
    using acc = acc_t<scalar_t>;
    gae_rows(static_cast<const scalar_t*>(rewards), rs, static_cast<const scalar_t*>(values), vs, mask, ms, batch,
             steps, gamma, lam, static_cast<acc*>(advantages), static_cast<acc*>(returns));
  });
}

}  // namespace megalign::cpu
