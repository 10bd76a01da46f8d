// Group-normalised advantages on the CPU (formulas in math/advantage.h).
//
// Both layouts run the same passes over the scores, loaded once into `out` in the accumulation
// type: the sum of (r - first member) per group, the mean, the sum of squared deviations, the
// scale, and the advantages in place. The per-element passes carry no per-group arithmetic and the
// per-group statistics (divisions, square roots) run in their own loops, so neither waits on the
// other's latency.
//
// Contiguous groups are walked as runs of group_size, with OpenMP across groups for large inputs.
// Groups given by ids: the distinct ids are numbered with a hash map (in order of first
// appearance; no sort, no bucketing of members), looked up once per run of equal ids where the
// ids come in runs (a prompt's samples side by side), once per member where they are scattered,
// and the passes walk the scores the same way. That path is serial: at RL batch sizes (N = 16384
// takes ~0.1 ms) a second thread's wake-up and the merge of two numberings would cost about what
// they save. Results are deterministic and independent of the id values: a group's sums add its
// members in index order, a run's members summed first (in kLanes partial sums from 16 on).
#include "megalign/group_advantages.h"

#include <algorithm>
#include <cstdint>
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

// The first pass over runs [r0, r1) of `walk`: adds each run's sum of (r - first member) and its
// length to its group's sums.
template <typename acc, typename Walk>
void add_shifted_sums(const acc* x, const Walk& walk, int64_t r0, int64_t r1, GroupSums<acc>* sums) {
  for (int64_t r = r0; r < r1; ++r) {
    GroupSums<acc>& s = sums[walk.group(r)];
    const acc first = s.center;
    const int64_t b = walk.begin(r), e = walk.end(r);
    s.sum += lane_sum(x + b, e - b, [first](acc v) { return v - first; });
    s.count += e - b;
  }
}

// The rest, once the groups [g0, g1) hold their first member's score, the sum of (r - first) and
// their size: replaces the scores x (the accumulation type) in runs [r0, r1) of `walk`, which hold
// every member of those groups, by their advantages.
template <typename acc, typename Walk>
void finish(acc* x, const Walk& walk, int64_t r0, int64_t r1, GroupSums<acc>* sums, int64_t g0, int64_t g1,
            math::GroupMode mode, acc eps, bool unbiased) {
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
// holds 16-24 bytes a score of the largest call so far for contiguous groups, 40-50 for ids.
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
    add_shifted_sums(out, walk, g0, g1, sums);
    finish(out, walk, g0, g1, sums, g0, g1, mode, static_cast<acc>(eps), unbiased);
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
  // The table's hot state. The loops keep it in a local, where the stores through their own
  // pointers cannot alias it (as members they would force a reload after every store).
  struct Table {
    size_t shift, mask;
    Index* slot;     // -1: empty
    int64_t* ids;    // ids[g]: the id numbered g
    int64_t groups;  // ids numbered so far
  };

  // An empty table with room for n ids.
  Table clear(int64_t n) {
    if (group_id_.size() < static_cast<size_t>(n)) group_id_.resize(static_cast<size_t>(n));
    Table t{0, 0, nullptr, group_id_.data(), 0};
    resize(t, kMinBits);
    return t;
  }

  // The number of `id`; an id not seen before gets the next one, and on_group(g) is called.
  template <typename OnGroup>
  Index find_or_add(Table& t, int64_t id, OnGroup on_group) {
    size_t h = hash(id) >> t.shift;
    Index g;
    while ((g = t.slot[h]) >= 0 && t.ids[g] != id) h = (h + 1) & t.mask;
    if (g >= 0) return g;
    g = static_cast<Index>(t.groups);
    t.ids[t.groups++] = id;
    if (2 * static_cast<size_t>(t.groups) > t.mask + 1)
      resize(t, 64 - static_cast<int>(t.shift) + 1);
    else
      t.slot[h] = g;
    on_group(g);
    return g;
  }

 private:
  static constexpr int kMinBits = 8;

  static uint64_t hash(int64_t id) { return static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull; }

  // A table of 2^bits slots holding every id numbered so far.
  void resize(Table& t, int bits) {
    t.shift = static_cast<size_t>(64 - bits);
    t.mask = (size_t(1) << bits) - 1;
    if (slot_number_.size() <= t.mask) slot_number_.resize(t.mask + 1);
    t.slot = slot_number_.data();
    std::fill_n(t.slot, t.mask + 1, Index(-1));
    for (int64_t g = 0; g < t.groups; ++g) {
      size_t h = hash(t.ids[g]) >> t.shift;
      while (t.slot[h] >= 0) h = (h + 1) & t.mask;
      t.slot[h] = static_cast<Index>(g);
    }
  }

  std::vector<Index> slot_number_;
  std::vector<int64_t> group_id_;
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

// The walk is picked from this many leading ids: counting the runs of all 16384 costs ~10% of the
// call. Either walk gives deterministic results; a layout that changes past the leading ids is
// only walked more slowly.
constexpr int64_t kLayoutProbe = 1024;

// True when the ids ids[i * id_stride], i < n, change at more than every other position.
inline bool scattered(const int64_t* ids, int64_t id_stride, int64_t n) {
  int64_t runs = n > 0;
  for (int64_t i = 1; i < n; ++i) runs += ids[i * id_stride] != ids[(i - 1) * id_stride];
  return 2 * runs > n;
}

// Any int64 ids; Index (int32 or int64) holds numbers <= n. The leading ids pick the walk. In runs
// (mean length 2 or more) an id is looked up once per run and the run's first pass follows at
// once. Scattered: one lookup per member, in a loop that touches no per-group sums but a new
// group's, so successive lookups overlap instead of queueing behind the sums' stores; then the
// passes.
template <typename Index, typename T>
void by_id(const T* scores, int64_t stride, const int64_t* ids, int64_t id_stride, int64_t n, math::GroupMode mode,
           double eps, bool unbiased, acc_t<T>* out) {
  using acc = acc_t<T>;
  auto& s = Scratch<Index, acc>::get();
  const auto size = static_cast<size_t>(n);
  GroupSums<acc>* sums = scratch_of(s.sums, size).data();
  load_scores(scores, stride, n, out);
  auto table = s.numbering.clear(n);
  if (scattered(ids, id_stride, std::min(n, kLayoutProbe))) {
    Index* group = scratch_of(s.member_group, size).data();
    for (int64_t i = 0; i < n; ++i)
      group[i] = s.numbering.find_or_add(table, ids[i * id_stride],
                                         [&](Index g) { sums[g] = GroupSums<acc>{out[i], 0, 0}; });
    const Members<Index> walk{group};
    add_shifted_sums(out, walk, 0, n, sums);
    finish(out, walk, 0, n, sums, 0, table.groups, mode, static_cast<acc>(eps), unbiased);
    return;
  }
  Index* start = scratch_of(s.start, size + 1).data();
  Index* run_group = scratch_of(s.run_group, size).data();
  int64_t runs = 0;
  for (int64_t i = 0, j; i < n; i = j, ++runs) {
    const int64_t id = ids[i * id_stride];
    const Index g = s.numbering.find_or_add(table, id, [&](Index g) { sums[g] = GroupSums<acc>{out[i], 0, 0}; });
    for (j = i + 1; j < n && ids[j * id_stride] == id; ++j) {}
    const acc first = sums[g].center;
    sums[g].sum += lane_sum(out + i, j - i, [first](acc v) { return v - first; });
    sums[g].count += j - i;
    start[runs] = static_cast<Index>(i);
    run_group[runs] = g;
  }
  start[runs] = static_cast<Index>(n);
  finish(out, Runs<Index>{start, run_group}, 0, runs, sums, 0, table.groups, mode, static_cast<acc>(eps), unbiased);
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
