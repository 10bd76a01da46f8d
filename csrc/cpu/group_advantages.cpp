// Group-normalised advantages on the CPU (formulas in math/advantage.h).
//
// Both layouts run the same passes over the scores, loaded once into `out` in the accumulation
// type: the sum of (r - first member) per group, the mean, the sum of squared deviations, the
// scale, and the advantages in place. The per-element passes carry no per-group arithmetic and the
// per-group statistics (divisions, square roots) run in their own loops, so neither waits on the
// other's latency.
//
// Contiguous groups are walked as runs of group_size, with OpenMP across groups for large inputs.
// Groups given by ids: a first serial pass numbers the distinct ids with a hash map (in order of
// first appearance; no sort, no bucketing of members), then the passes walk the scores in runs of
// equal ids, or member by member where runs are short (scattered ids). That path is serial: at
// RL batch sizes (N = 16384 takes ~0.1 ms) a second thread's wake-up and the merge of two
// numberings would cost about what they save. Results are deterministic and independent of the id values: a
// group's sums always add its members in index order, runs of 16 or more in kLanes interleaved
// partial sums.
#include "megalign/group_advantages.h"

#include <algorithm>
#include <climits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace megalign::cpu {
namespace {

// Groups run in parallel only above this many scores (about 0.4 ms of serial work); see cpu/gae.cpp.
constexpr int64_t kParallelGrain = int64_t(1) << 17;

// Independent partial sums in long runs, so the adds pipeline (and vectorise) instead of waiting
// on one another; combined in a fixed order, so results are deterministic.
constexpr int kLanes = 8;

template <typename T>
void load_scores(const T* scores, int64_t stride, int64_t n, acc_t<T>* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = to_acc(scores[i * stride]);
}

// sum_k f(x[k]) over k < n: in kLanes interleaved partial sums from two rounds of lanes on, in one
// chain below.
template <typename acc, typename F>
acc lane_sum(const acc* x, int64_t n, F f) {
  acc total = 0;
  int64_t k = 0;
  if (n >= 2 * kLanes) {
    acc part[kLanes] = {};
    for (; k + kLanes <= n; k += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += f(x[k + l]);
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) part[l] += part[l + w];
    total = part[0];
  }
  for (; k < n; ++k) total += f(x[k]);
  return total;
}

// Per-group state. center: the first member's score, then the mean; sum: the sum of (r - first),
// then of (r - mean)^2, then the group's scale (math::group_scale); count: the members.
template <typename acc>
struct GroupSums {
  acc center;
  acc sum;
  int64_t count;
};

// How the passes walk the scores: as runs r in [0, count), run r being the scores [begin(r), end(r))
// of group group(r). Within a run a group's sum stays in registers; member by member, each add
// waits on the previous member's store to the same group, several times slower when a prompt's
// samples sit next to each other (as verl lays them out). With scattered ids the run loop costs
// more than it saves.
struct Blocks {  // contiguous groups of `size`
  int64_t size;
  int64_t group(int64_t r) const { return r; }
  int64_t begin(int64_t r) const { return r * size; }
  int64_t end(int64_t r) const { return (r + 1) * size; }
};

template <typename Index>
struct Runs {  // runs of equal ids: run r is [start[r], start[r + 1]) of group run_group[r]
  const Index* start;
  const Index* run_group;
  Index group(int64_t r) const { return run_group[r]; }
  int64_t begin(int64_t r) const { return start[r]; }
  int64_t end(int64_t r) const { return start[r + 1]; }
};

template <typename Index>
struct Members {  // member i of group member_group[i]
  const Index* member_group;
  Index group(int64_t i) const { return member_group[i]; }
  int64_t begin(int64_t i) const { return i; }
  int64_t end(int64_t i) const { return i + 1; }
};

// Replaces the scores x (the accumulation type) in runs [r0, r1) of `walk` by their advantages.
// Those runs hold every member of the groups [g0, g1), whose sums hold the first member's score
// and zeros.
template <typename acc, typename Walk>
void normalize(acc* x, const Walk& walk, int64_t r0, int64_t r1, GroupSums<acc>* sums, int64_t g0, int64_t g1,
               math::GroupMode mode, acc eps, bool unbiased) {
  for (int64_t r = r0; r < r1; ++r) {
    GroupSums<acc>& s = sums[walk.group(r)];
    const acc first = s.center;
    const int64_t b = walk.begin(r), e = walk.end(r);
    s.sum += lane_sum(x + b, e - b, [first](acc v) { return v - first; });
    s.count += e - b;
  }
  for (GroupSums<acc>* s = sums + g0; s < sums + g1; ++s) {
    s->center = math::group_mean(s->center, s->sum, s->count);
    s->sum = 0;
  }
  for (int64_t r = r0; r < r1; ++r) {
    GroupSums<acc>& s = sums[walk.group(r)];
    const acc mean = s.center;
    const int64_t b = walk.begin(r), e = walk.end(r);
    s.sum += lane_sum(x + b, e - b, [mean](acc v) { return (v - mean) * (v - mean); });
  }
  for (GroupSums<acc>* s = sums + g0; s < sums + g1; ++s)
    s->sum = math::group_scale(math::group_std(s->sum, s->count, unbiased), s->count, mode, eps);
  for (int64_t r = r0; r < r1; ++r) {
    const GroupSums<acc>& s = sums[walk.group(r)];
    const acc mean = s.center, scale = s.sum;
    for (int64_t k = walk.begin(r); k < walk.end(r); ++k) x[k] = math::group_advantage(x[k], mean, scale);
  }
}

// Working memory is kept per thread from call to call (vectors that only grow): freshly allocated,
// it comes from mmap at these sizes and its page faults cost more than the whole computation. It
// holds 16-24 bytes a score of the largest call so far for contiguous groups, 40-100 for ids
// (the most when every id is distinct).
template <typename T>
std::vector<T>& scratch_of(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v;
}

template <typename T>
void contiguous(const T* scores, int64_t stride, int64_t n, int64_t size, math::GroupMode mode, double eps,
                bool unbiased, acc_t<T>* out) {
  using acc = acc_t<T>;
  thread_local std::vector<GroupSums<acc>> sums_scratch;
  const int64_t groups = size > 0 ? n / size : 0;
  if (size == 1) {  // every group a lone member
    std::fill_n(out, n, acc(0));
    return;
  }
  GroupSums<acc>* sums = scratch_of(sums_scratch, static_cast<size_t>(groups)).data();
  const Blocks walk{size};
#pragma omp parallel if (n >= kParallelGrain)
  {
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t threads = 1, t = 0;
#endif
    const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    load_scores(scores + g0 * size * stride, stride, (g1 - g0) * size, out + g0 * size);
    for (int64_t g = g0; g < g1; ++g) sums[g] = GroupSums<acc>{out[g * size], 0, 0};
    normalize(out, walk, g0, g1, sums, g0, g1, mode, static_cast<acc>(eps), unbiased);
  }
}

// Numbers distinct int64 ids 0, 1, 2, ... in order of first appearance: open addressing with
// linear probing in a power-of-two table of numbers kept at most half full (doubled and refilled
// as ids arrive, so its size follows the number of groups, not of scores). A slot holds only the
// number; the id is compared through the list of numbered ids, so a slot is 4 bytes (16 KiB for
// 2048 groups) and few cache lines are missed when the call starts with cold caches, as it does
// between the other ops of a training step. Fibonacci hashing spreads structured ids
// (consecutive, multiples of a stride, huge or negative values). The tables only grow: a
// numbering is kept per thread and reused from call to call.
template <typename Index>
class IdNumbering {
 public:
  // Sets number[i] to the number of ids[i * id_stride], i < n, calls on_group(g, i) when member i
  // starts group g, and counts the runs of equal ids. Returns the number of groups.
  template <typename OnGroup>
  int64_t run(const int64_t* ids, int64_t id_stride, int64_t n, Index* number, OnGroup on_group, int64_t& runs) {
    if (group_id_.size() < static_cast<size_t>(n)) group_id_.resize(static_cast<size_t>(n));
    int64_t groups = 0;
    resize(kMinBits, 0);
    // The table in locals: stores to number[] could alias the members.
    int shift = 64 - bits_;
    size_t mask = mask_;
    Index* slot_number = slot_number_.data();
    const int64_t* group_id = group_id_.data();
    Index previous = -1;
    runs = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = ids[i * id_stride];
      size_t h = hash(id) >> shift;
      Index g;
      while ((g = slot_number[h]) >= 0 && group_id[g] != id) h = (h + 1) & mask;
      if (g < 0) {
        g = static_cast<Index>(groups);
        group_id_[groups++] = id;
        if (2 * groups > static_cast<int64_t>(mask + 1)) {
          resize(bits_ + 1, groups);
          shift = 64 - bits_;
          mask = mask_;
          slot_number = slot_number_.data();
        } else {
          slot_number[h] = g;
        }
        on_group(g, i);
      }
      runs += g != previous;
      previous = g;
      number[i] = g;
    }
    return groups;
  }

 private:
  static constexpr int kMinBits = 8;

  static uint64_t hash(int64_t id) { return static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull; }

  // A table of 2^bits slots holding the first `groups` ids numbered.
  void resize(int bits, int64_t groups) {
    bits_ = bits;
    mask_ = (size_t(1) << bits) - 1;
    if (slot_number_.size() <= mask_) slot_number_.resize(mask_ + 1);
    std::fill_n(slot_number_.begin(), mask_ + 1, Index(-1));
    for (int64_t g = 0; g < groups; ++g) {
      size_t h = hash(group_id_[g]) >> (64 - bits);
      while (slot_number_[h] >= 0) h = (h + 1) & mask_;
      slot_number_[h] = static_cast<Index>(g);
    }
  }

  int bits_ = 0;
  size_t mask_ = 0;
  std::vector<Index> slot_number_;  // -1: empty
  std::vector<int64_t> group_id_;   // group_id_[g]: the id numbered g
};

template <typename Index, typename acc>
struct Scratch {
  IdNumbering<Index> numbering;
  std::vector<Index> member_group, start, run_group;
  std::vector<GroupSums<acc>> sums;

  static Scratch& get() {
    thread_local Scratch s;
    return s;
  }
};

// Any int64 ids; Index (int32 or int64) holds numbers <= n. The numbering pass touches no
// per-group sums but a new group's, so the lookups of successive members overlap instead of
// queueing behind the sums' stores.
template <typename Index, typename T>
void by_id(const T* scores, int64_t stride, const int64_t* ids, int64_t id_stride, int64_t n, math::GroupMode mode,
           double eps, bool unbiased, acc_t<T>* out) {
  using acc = acc_t<T>;
  auto& s = Scratch<Index, acc>::get();
  const auto size = static_cast<size_t>(n);
  Index* group = scratch_of(s.member_group, size).data();
  GroupSums<acc>* sums = scratch_of(s.sums, size).data();
  load_scores(scores, stride, n, out);
  int64_t runs;
  const int64_t groups = s.numbering.run(
      ids, id_stride, n, group, [&](Index g, int64_t i) { sums[g] = GroupSums<acc>{out[i], 0, 0}; }, runs);
  if (2 * runs > n) {
    normalize(out, Members<Index>{group}, 0, n, sums, 0, groups, mode, static_cast<acc>(eps), unbiased);
    return;
  }
  Index* start = scratch_of(s.start, size + 1).data();
  Index* run_group = scratch_of(s.run_group, size).data();
  for (int64_t i = 0, r = 0; i < n; ++i)
    if (i == 0 || group[i] != group[i - 1]) {
      start[r] = static_cast<Index>(i);
      run_group[r++] = group[i];
    }
  start[runs] = static_cast<Index>(n);
  normalize(out, Runs<Index>{start, run_group}, 0, runs, sums, 0, groups, mode, static_cast<acc>(eps), unbiased);
}

}  // namespace

void group_advantages(DType dtype, const void* scores, int64_t stride, int64_t n, int64_t group_size,
                      math::GroupMode mode, double eps, bool unbiased, void* out) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "group_advantages", [&] {
    contiguous(static_cast<const scalar_t*>(scores), stride, n, group_size, mode, eps, unbiased,
               static_cast<acc_t<scalar_t>*>(out));
  });
}

void group_advantages_by_id(DType dtype, const void* scores, int64_t stride, const int64_t* ids, int64_t id_stride,
                            int64_t n, math::GroupMode mode, double eps, bool unbiased, void* out) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "group_advantages_by_id", [&] {
    const auto* s = static_cast<const scalar_t*>(scores);
    auto* o = static_cast<acc_t<scalar_t>*>(out);
    if (n <= INT32_MAX)
      by_id<int32_t>(s, stride, ids, id_stride, n, mode, eps, unbiased, o);
    else
      by_id<int64_t>(s, stride, ids, id_stride, n, mode, eps, unbiased, o);
  });
}

}  // namespace megalign::cpu
