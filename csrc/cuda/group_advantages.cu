// Group-normalised advantages on CUDA. Contiguous groups: one warp per group, two warp-reduced
// passes (sum around the first member, squared deviations) then the advantages. Indexed groups:
// atomics into per-group workspace (pivot = the lowest index of the group, member count, shifted
// sum, squared deviations), one grid-stride pass each, then an elementwise pass. The float atomics
// make the indexed sums' rounding order-dependent; the pivot keeps equal scores at exactly 0.
#include <climits>

#include "megalign/group_advantages.h"

namespace megalign::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

template <typename acc>
__device__ __forceinline__ acc warp_sum(acc x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    contiguous_kernel(const T* __restrict__ scores, int64_t stride, int64_t groups, int64_t size, math::GroupMode mode,
                      acc_t<T> eps, bool unbiased, acc_t<T>* __restrict__ out) {
  using acc = acc_t<T>;
  const int64_t group = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kWarp;  // uniform within a warp
  const int lane = threadIdx.x % kWarp;
  if (group >= groups) return;
  const T* s = scores + group * size * stride;
  acc* o = out + group * size;
  const acc pivot = to_acc(s[0]);
  acc shifted = 0;
  for (int64_t k = lane; k < size; k += kWarp) shifted += to_acc(s[k * stride]) - pivot;
  const acc mean = math::group_mean(pivot, warp_sum(shifted), size);
  acc sq = 0;
  for (int64_t k = lane; k < size; k += kWarp) {
    const acc d = to_acc(s[k * stride]) - mean;
    sq += d * d;
  }
  const acc stdev = math::group_std(warp_sum(sq), size, unbiased);
  for (int64_t k = lane; k < size; k += kWarp)
    o[k] = math::group_advantage(to_acc(s[k * stride]), mean, stdev, size, mode, eps);
}

// Per-group workspace of the indexed path, carved from one buffer (accumulators first for alignment).
template <typename acc>
struct Workspace {
  acc* shifted;
  acc* sq;
  int* first;
  int* count;

  __host__ __device__ Workspace(void* base, int64_t groups)
      : shifted(static_cast<acc*>(base)),
        sq(shifted + groups),
        first(reinterpret_cast<int*>(sq + groups)),
        count(first + groups) {}
};

#define MEGALIGN_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

template <typename acc>
__global__ void init_kernel(Workspace<acc> ws, int64_t groups) {
  MEGALIGN_GRID_STRIDE(g, groups) {
    ws.shifted[g] = 0;
    ws.sq[g] = 0;
    ws.first[g] = INT_MAX;
    ws.count[g] = 0;
  }
}

__device__ __forceinline__ bool in_range(int64_t g, int64_t groups) { return g >= 0 && g < groups; }

template <typename acc>
__global__ void count_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t groups, Workspace<acc> ws) {
  MEGALIGN_GRID_STRIDE(i, n) {
    const int64_t g = ids[i];
    if (!in_range(g, groups)) continue;
    atomicMin(ws.first + g, static_cast<int>(i));
    atomicAdd(ws.count + g, 1);
  }
}

template <typename T>
__device__ __forceinline__ acc_t<T> indexed_pivot(const T* scores, int64_t stride, const Workspace<acc_t<T>>& ws,
                                                  int64_t g) {
  return to_acc(scores[int64_t(ws.first[g]) * stride]);
}

template <typename T>
__device__ __forceinline__ acc_t<T> indexed_mean(const T* scores, int64_t stride, const Workspace<acc_t<T>>& ws,
                                                 int64_t g) {
  return math::group_mean(indexed_pivot(scores, stride, ws, g), ws.shifted[g], ws.count[g]);
}

// kSquares = false: shifted[g] += r - pivot;  kSquares = true (after the first pass): sq[g] += (r - mean)^2.
template <typename T, bool kSquares>
__global__ void accumulate_kernel(const T* __restrict__ scores, int64_t stride, const int64_t* __restrict__ ids,
                                  int64_t n, int64_t groups, Workspace<acc_t<T>> ws) {
  MEGALIGN_GRID_STRIDE(i, n) {
    const int64_t g = ids[i];
    if (!in_range(g, groups)) continue;
    const acc_t<T> x = to_acc(scores[i * stride]);
    if (kSquares) {
      const acc_t<T> d = x - indexed_mean(scores, stride, ws, g);
      atomicAdd(ws.sq + g, d * d);
    } else {
      atomicAdd(ws.shifted + g, x - indexed_pivot(scores, stride, ws, g));
    }
  }
}

template <typename T>
__global__ void advantage_kernel(const T* __restrict__ scores, int64_t stride, const int64_t* __restrict__ ids,
                                 int64_t n, int64_t groups, Workspace<acc_t<T>> ws, math::GroupMode mode,
                                 acc_t<T> eps, bool unbiased, acc_t<T>* __restrict__ out) {
  MEGALIGN_GRID_STRIDE(i, n) {
    const int64_t g = ids[i];
    if (!in_range(g, groups)) {
      out[i] = 0;
      continue;
    }
    const int64_t size = ws.count[g];
    out[i] = math::group_advantage(to_acc(scores[i * stride]), indexed_mean(scores, stride, ws, g),
                                   math::group_std(ws.sq[g], size, unbiased), size, mode, eps);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

void group_advantages(DType dtype, const void* scores, int64_t stride, int64_t n, int64_t group_size,
                      math::GroupMode mode, double eps, bool unbiased, void* out, cudaStream_t stream) {
  if (n == 0 || group_size <= 0) return;
  const int64_t groups = n / group_size;
  const int64_t blocks = (groups * kWarp + kThreads - 1) / kThreads;
  MEGALIGN_DISPATCH_FLOAT(dtype, "group_advantages", [&] {
    using acc = acc_t<scalar_t>;
    contiguous_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(scores), stride, groups, group_size, mode, static_cast<acc>(eps), unbiased,
        static_cast<acc*>(out));
  });
}

size_t group_advantages_indexed_workspace_bytes(DType dtype, int64_t num_groups) {
  const size_t acc_bytes = dtype == DType::kFloat64 ? sizeof(double) : sizeof(float);
  return static_cast<size_t>(num_groups) * (2 * acc_bytes + 2 * sizeof(int));
}

void group_advantages_indexed(DType dtype, const void* scores, int64_t stride, const int64_t* group_ids,
                              int64_t n, int64_t num_groups, math::GroupMode mode, double eps, bool unbiased,
                              void* workspace, void* out, cudaStream_t stream) {
  if (n == 0) return;
  if (n > INT_MAX) throw std::invalid_argument("group_advantages_indexed: more than 2^31 - 1 scores");
  MEGALIGN_DISPATCH_FLOAT(dtype, "group_advantages_indexed", [&] {
    using acc = acc_t<scalar_t>;
    const auto* s = static_cast<const scalar_t*>(scores);
    const Workspace<acc> ws(workspace, num_groups);
    if (num_groups > 0) init_kernel<acc><<<grid_for(num_groups), kThreads, 0, stream>>>(ws, num_groups);
    count_kernel<acc><<<grid_for(n), kThreads, 0, stream>>>(group_ids, n, num_groups, ws);
    accumulate_kernel<scalar_t, false><<<grid_for(n), kThreads, 0, stream>>>(s, stride, group_ids, n, num_groups, ws);
    accumulate_kernel<scalar_t, true><<<grid_for(n), kThreads, 0, stream>>>(s, stride, group_ids, n, num_groups, ws);
    advantage_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(s, stride, group_ids, n, num_groups, ws, mode,
                                                                     static_cast<acc>(eps), unbiased,
                                                                     static_cast<acc*>(out));
  });
}

}  // namespace megalign::cuda
