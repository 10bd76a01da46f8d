// Group-normalised advantages on the CPU. Both layouts share one per-group routine over a member
// list, run with OpenMP across groups: contiguous groups index members directly; indexed groups
// are first bucketed by a stable counting sort (CSR), so results are deterministic.
#include "megalign/group_advantages.h"

#include <vector>

namespace megalign::cpu {
namespace {

// Groups run in parallel only above this many scores (about 0.4 ms of serial work); see cpu/gae.cpp.
constexpr int64_t kParallelGrain = int64_t(1) << 17;

// Two passes over the members of one group (mean around the first member, then squared
// deviations), then the advantages. member(k) is the index of the k-th member, k < n.
template <typename T, typename Member>
void normalize_group(const T* scores, int64_t stride, int64_t n, Member member, math::GroupMode mode,
                     acc_t<T> eps, bool unbiased, acc_t<T>* out) {
  using acc = acc_t<T>;
  if (n == 0) return;
  auto score = [&](int64_t k) { return to_acc(scores[member(k) * stride]); };
  const acc pivot = score(0);
  acc shifted = 0;
  for (int64_t k = 0; k < n; ++k) shifted += score(k) - pivot;
  const acc mean = math::group_mean(pivot, shifted, n);
  acc sq = 0;
  for (int64_t k = 0; k < n; ++k) {
    const acc d = score(k) - mean;
    sq += d * d;
  }
  const acc stdev = math::group_std(sq, n, unbiased);
  for (int64_t k = 0; k < n; ++k) out[member(k)] = math::group_advantage(score(k), mean, stdev, n, mode, eps);
}

template <typename T>
void contiguous(const T* scores, int64_t stride, int64_t n, int64_t group_size, math::GroupMode mode, double eps,
                bool unbiased, acc_t<T>* out) {
  const int64_t groups = group_size > 0 ? n / group_size : 0;
#pragma omp parallel for schedule(static) if (n >= kParallelGrain)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * group_size;
    normalize_group(scores, stride, group_size, [first](int64_t k) { return first + k; }, mode,
                    static_cast<acc_t<T>>(eps), unbiased, out);
  }
}

template <typename T>
void indexed(const T* scores, int64_t stride, const int64_t* ids, int64_t n, int64_t num_groups,
             math::GroupMode mode, double eps, bool unbiased, acc_t<T>* out) {
  std::vector<int64_t> offset(num_groups + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++offset[ids[i] + 1];
  for (int64_t g = 0; g < num_groups; ++g) offset[g + 1] += offset[g];
  std::vector<int64_t> order(n);
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t i = 0; i < n; ++i) order[fill[ids[i]]++] = i;
  const int64_t* members = order.data();
#pragma omp parallel for schedule(dynamic, 64) if (n >= kParallelGrain)
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t* m = members + offset[g];
    normalize_group(scores, stride, offset[g + 1] - offset[g], [m](int64_t k) { return m[k]; }, mode,
                    static_cast<acc_t<T>>(eps), unbiased, out);
  }
}

}  // namespace

void group_advantages(DType dtype, const void* scores, int64_t stride, int64_t n, int64_t group_size,
                      math::GroupMode mode, double eps, bool unbiased, void* out) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "group_advantages", [&] {
    contiguous(static_cast<const scalar_t*>(scores), stride, n, group_size, mode, eps, unbiased,
               static_cast<acc_t<scalar_t>*>(out));
  });
}

void group_advantages_indexed(DType dtype, const void* scores, int64_t stride, const int64_t* group_ids,
                              int64_t n, int64_t num_groups, math::GroupMode mode, double eps, bool unbiased,
                              void* out) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "group_advantages_indexed", [&] {
    indexed(static_cast<const scalar_t*>(scores), stride, group_ids, n, num_groups, mode, eps, unbiased,
            static_cast<acc_t<scalar_t>*>(out));
  });
}

}  // namespace megalign::cpu
