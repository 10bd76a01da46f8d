// Work splitting shared by the kl_penalty and policy_loss CPU kernels (private to csrc/cpu).
// Each row of the [rows, cols] view is cut into chunks, so one long row or a 1-D input still
// spreads over the cores; reductions keep one partial per chunk and merge them in chunk order,
// which makes the result independent of the number of threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "megalign/kl_policy_common.h"
#include "megalign/math/kl.h"
#include "megalign/math/policy.h"

namespace megalign::cpu::detail {

constexpr int64_t kChunk = 4096;
constexpr int64_t kParallelMinElements = 1 << 15;

// Offset of element (r, c): the dense row-major index when every operand is dense (lets the
// compiler vectorise), the strided address otherwise.
template <bool Dense>
MEGALIGN_HD_INLINE int64_t offset(const StridedView& v, int64_t r, int64_t c, int64_t cols) {
  return Dense ? r * cols + c : element_offset(v, r, c);
}

// Calls fn(task, row, col_begin, col_end) for every chunk, in parallel for large inputs.
template <typename Fn>
void parallel_chunks(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t per_row = (cols + kChunk - 1) / kChunk;
  const int64_t tasks = rows * per_row;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMinElements)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r = t / per_row;
    const int64_t c0 = (t % per_row) * kChunk;
    fn(t, r, c0, std::min(cols, c0 + kChunk));
  }
}

// fn(partial, row, col_begin, col_end) accumulates one chunk; returns the ordered merge.
template <typename P, typename Fn>
P parallel_reduce_chunks(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t per_row = (cols + kChunk - 1) / kChunk;
  std::vector<P> parts(static_cast<size_t>(rows * per_row));
  parallel_chunks(rows, cols, [&](int64_t t, int64_t r, int64_t c0, int64_t c1) { fn(parts[t], r, c0, c1); });
  P total;
  for (const P& p : parts) total.merge(p);
  return total;
}

// The CPU policy forward's partial: the statistics and the sum of the per-token loss over valid
// tokens (policy_loss_fwd's loss_sum, the reduced loss).
struct PolicyCpuPartial : PolicyPartial<double> {
  double loss = 0;
  void merge(const PolicyCpuPartial& o) {
    PolicyPartial<double>::merge(o);
    loss += o.loss;
  }
};

// Invokes fn(std::integral_constant<KlKind, kind>{}) so the per-element switch folds away.
template <typename Fn>
void dispatch_kl_kind(KlKind kind, Fn&& fn) {
  switch (kind) {
    case KlKind::kK1: fn(std::integral_constant<KlKind, KlKind::kK1>{}); return;
    case KlKind::kAbs: fn(std::integral_constant<KlKind, KlKind::kAbs>{}); return;
    case KlKind::kK2: fn(std::integral_constant<KlKind, KlKind::kK2>{}); return;
    case KlKind::kK3: fn(std::integral_constant<KlKind, KlKind::kK3>{}); return;
    case KlKind::kLowVarKl: fn(std::integral_constant<KlKind, KlKind::kLowVarKl>{}); return;
  }
  throw std::invalid_argument("kl_penalty: unknown kind");
}

}  // namespace megalign::cpu::detail
