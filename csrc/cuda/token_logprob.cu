// CUDA kernels of token_logprob (no torch headers; launchers in megalign/token_logprob.h).
//
// Forward (partials): one block per row. Each thread walks its share of the row in 16-byte
// vectors (8 bf16/fp16, 4 fp32, 2 fp64), UNROLL loads in flight, with streaming loads (the logits
// are read once). Per vector it takes the local max, rebases its running (m, s, t) once if the
// max grew, then adds the vector's logits (math::accumulate): about one exp per element. The
// threads' statistics are merged with math::merge_stats by warp shuffles and then across warps
// through shared memory. A scalar head (up to the first 16-byte boundary) and tail cover rows
// that are not 16-byte aligned or not a multiple of the vector width.
// Backward: one block per row, the same vector walk, writing p-based gradients with 16-byte
// stores when the gradient row has the logits row's alignment (scalar otherwise).
// Every index is bounded by the row length; target ids are only compared, and read only after
// the range check, so no input makes a kernel read out of bounds.
#include <cstdint>

#include "megalign/math/token_logprob.h"
#include "megalign/token_logprob.h"

namespace megalign::cuda {
namespace {

using math::SoftmaxStats;

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T> struct Pack {
  static constexpr int kVec = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[kVec];
  };
};

// z = logit / temperature, rounded once. A plain product would let nvcc contract it into the
// subtraction that follows (z - m, z - lse) as one FMA with the unrounded product, so the max
// logit would no longer give exactly 0 against the rounded m or lse it was stored as (seen on an
// H200: a one-logit row's gradient 2.8e-7 instead of 0).
__device__ __forceinline__ float scaled(float x, float inv_t) { return __fmul_rn(x, inv_t); }
__device__ __forceinline__ double scaled(double x, double inv_t) { return __dmul_rn(x, inv_t); }
template <typename T> __device__ __forceinline__ acc_t<T> scaled(T x, acc_t<T> inv_t) { return scaled(to_acc(x), inv_t); }

template <typename T> __device__ __forceinline__ int64_t head_elems(const T* p, int64_t vocab) {
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16);
  const int64_t head = ((16 - misalign) % 16) / static_cast<int64_t>(sizeof(T));
  return head < vocab ? head : vocab;
}

template <typename A> __device__ __forceinline__ SoftmaxStats<A> warp_merge(SoftmaxStats<A> st) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const SoftmaxStats<A> o{__shfl_xor_sync(kFullMask, st.m, off), __shfl_xor_sync(kFullMask, st.s, off),
                            __shfl_xor_sync(kFullMask, st.t, off)};
    st = math::merge_stats(st, o);
  }
  return st;
}

// Merge of every thread's statistics; the result is valid in thread 0.
template <typename A> __device__ SoftmaxStats<A> block_merge(SoftmaxStats<A> st) {
  __shared__ A sm[kMaxThreads / 32], ss[kMaxThreads / 32], st_[kMaxThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  st = warp_merge(st);
  if (lane == 0) {
    sm[warp] = st.m;
    ss[warp] = st.s;
    st_[warp] = st.t;
  }
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x / 32;
    st = lane < n_warps ? SoftmaxStats<A>{sm[lane], ss[lane], st_[lane]} : math::empty_stats<A>();
    st = warp_merge(st);
  }
  return st;
}

// Running statistics of one thread; m = -inf until a finite logit is seen.
template <typename A, bool WithEntropy> struct ThreadStats {
  A m = -INFINITY, s = 0, t = 0;

  __device__ __forceinline__ void rebase_to(A new_m) {
    if (new_m > m) {
      const SoftmaxStats<A> r = math::rebase_stats(SoftmaxStats<A>{m, s, t}, new_m);
      m = r.m;
      s = r.s;
      t = r.t;
    }
  }
  __device__ __forceinline__ void add(A z) {
    // m = -inf: every logit so far is -inf (adds nothing) or NaN, which the maxima skip; s then
    // carries the NaN so that the row's log-prob and entropy are NaN, as on the CPU.
    if (m == -INFINITY) {
      if (z != z) s = z;
      return;
    }
    if (WithEntropy) {
      math::accumulate(z, m, s, t);
    } else {
      s += math::kernel_exp(z - m);
    }
  }
};

template <typename T, bool WithEntropy>
__global__ void __launch_bounds__(kMaxThreads)
partials_kernel(const T* __restrict__ logits, int64_t vocab, int64_t row_stride,
                const int64_t* __restrict__ targets, int64_t vocab_start, int64_t vocab_size,
                acc_t<T> inv_t, int64_t ignore_index, acc_t<T>* __restrict__ out) {
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kVec;
  const int64_t r = blockIdx.x;
  const int64_t target = targets[r];
  A* o = out + 4 * r;
  if (math::target_out_of_range(target, ignore_index, vocab_size)) {
    if (threadIdx.x == 0) o[0] = o[1] = o[2] = o[3] = static_cast<A>(NAN);
    return;
  }
  if (target == ignore_index) {
    if (threadIdx.x == 0) {
      o[0] = 0; o[1] = 1; o[2] = 0; o[3] = 0;
    }
    return;
  }
  const T* x = logits + r * row_stride;
  ThreadStats<A, WithEntropy> ts;
  const int64_t head = head_elems(x, vocab);
  const int64_t n_vec = (vocab - head) / kVec;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
    const A z = scaled(x[j], inv_t);
    ts.rebase_to(z);
    ts.add(z);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x + head);
  for (int64_t base = threadIdx.x; base < n_vec; base += static_cast<int64_t>(blockDim.x) * kUnroll) {
    Pack<T> pk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n_vec) pk[u].raw = __ldcs(xv + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + static_cast<int64_t>(u) * blockDim.x >= n_vec) break;
      A z[kVec];
      A lm = -INFINITY;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        z[k] = scaled(pk[u].v[k], inv_t);
        lm = z[k] > lm ? z[k] : lm;
      }
      ts.rebase_to(lm);
#pragma unroll
      for (int k = 0; k < kVec; ++k) ts.add(z[k]);
    }
  }
  for (int64_t j = head + n_vec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
    const A z = scaled(x[j], inv_t);
    ts.rebase_to(z);
    ts.add(z);
  }
  const SoftmaxStats<A> st = block_merge(SoftmaxStats<A>{ts.m, ts.s, WithEntropy ? ts.t : A(0)});
  if (threadIdx.x == 0) {
    const int64_t local = target - vocab_start;
    o[0] = st.m;
    o[1] = st.s;
    o[2] = (local >= 0 && local < vocab) ? scaled(x[local], inv_t) : A(0);
    o[3] = st.t;
  }
}

template <typename A>
__global__ void finalize_kernel(const A* __restrict__ partials, int64_t n_rows, A* __restrict__ logp,
                                A* __restrict__ lse, A* __restrict__ entropy) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < n_rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const A* p = partials + 4 * r;
    const math::RowResult<A> res = math::finalize_row<A>({p[0], p[1], p[3]}, p[2]);
    logp[r] = res.logp;
    lse[r] = res.lse;
    if (entropy != nullptr) entropy[r] = res.entropy;
  }
}

template <typename T, bool WithEntropy>
__global__ void __launch_bounds__(kMaxThreads)
backward_kernel(BackwardRows<T> b, int64_t vocab, int64_t row_stride,
                const int64_t* __restrict__ targets, int64_t vocab_start, int64_t ignore_index,
                int64_t grad_row_stride) {
  // logits and grad may alias (in-place backward): each element is read before it is written,
  // by the same thread.
  using A = acc_t<T>;
  constexpr int kVec = Pack<T>::kVec;
  const int64_t r = blockIdx.x;
  const T* x = b.logits + r * row_stride;
  T* g = b.grad + r * grad_row_stride;
  const bool ignored = targets[r] == ignore_index;
  const A inv_t = b.inv_t;
  const A row_lse = b.lse[r];
  const A row_h = WithEntropy ? b.entropy[r] : A(0);
  const A gl = b.grad_logp[r] * inv_t;
  const A ge = WithEntropy ? b.grad_entropy[r] * inv_t : A(0);
  const int64_t local = targets[r] - vocab_start;
  auto value = [&](T xj, int64_t j) -> T {
    if (ignored) return from_acc<T>(A(0));
    return from_acc<T>(math::logit_grad<WithEntropy>(scaled(xj, inv_t), row_lse, row_h, gl, ge, j == local));
  };
  const bool same_alignment = reinterpret_cast<uintptr_t>(x) % 16 == reinterpret_cast<uintptr_t>(g) % 16;
  const int64_t head = same_alignment ? head_elems(x, vocab) : vocab;
  const int64_t n_vec = (vocab - head) / kVec;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) g[j] = value(x[j], j);
  const uint4* xv = reinterpret_cast<const uint4*>(x + head);
  uint4* gv = reinterpret_cast<uint4*>(g + head);
  for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
    Pack<T> in, res;
    in.raw = xv[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) res.v[k] = value(in.v[k], head + i * kVec + k);
    __stcs(gv + i, res.raw);
  }
  for (int64_t j = head + n_vec * kVec + threadIdx.x; j < vocab; j += blockDim.x) g[j] = value(x[j], j);
}

template <typename T> int threads_for(int64_t vocab) {
  const int64_t vecs = (vocab + Pack<T>::kVec - 1) / Pack<T>::kVec;
  int threads = 32;
  while (threads < kMaxThreads && threads < vecs) threads *= 2;
  return threads;
}

bool grid_ok(int64_t n_rows) { return n_rows <= 2147483647LL; }

}  // namespace

cudaError_t token_logprob_partials(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                                   int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                   int64_t vocab_size, double inv_temperature,
                                   int64_t ignore_index, bool with_entropy, void* partials,
                                   cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  if (!grid_ok(n_rows)) return cudaErrorInvalidValue;
  MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob_partials", [&] {
    using A = acc_t<scalar_t>;
    const auto* x = static_cast<const scalar_t*>(logits);
    auto* out = static_cast<A*>(partials);
    const A inv_t = static_cast<A>(inv_temperature);
    const int threads = threads_for<scalar_t>(vocab);
    if (with_entropy) {
      partials_kernel<scalar_t, true><<<static_cast<unsigned>(n_rows), threads, 0, stream>>>(
          x, vocab, row_stride, targets, vocab_start, vocab_size, inv_t, ignore_index, out);
    } else {
      partials_kernel<scalar_t, false><<<static_cast<unsigned>(n_rows), threads, 0, stream>>>(
          x, vocab, row_stride, targets, vocab_start, vocab_size, inv_t, ignore_index, out);
    }
  });
  return cudaGetLastError();
}

cudaError_t token_logprob_finalize(DType dtype, const void* partials, int64_t n_rows, void* logp,
                                   void* lse, void* entropy, cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks64 = (n_rows + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65535 ? blocks64 : 65535);
  if (dtype == DType::kFloat64) {
    finalize_kernel<double><<<blocks, threads, 0, stream>>>(
        static_cast<const double*>(partials), n_rows, static_cast<double*>(logp),
        static_cast<double*>(lse), static_cast<double*>(entropy));
  } else {
    finalize_kernel<float><<<blocks, threads, 0, stream>>>(
        static_cast<const float*>(partials), n_rows, static_cast<float*>(logp),
        static_cast<float*>(lse), static_cast<float*>(entropy));
  }
  return cudaGetLastError();
}

cudaError_t token_logprob_backward(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                                   int64_t row_stride, const int64_t* targets, const void* lse,
                                   const void* entropy, const void* grad_logp,
                                   const void* grad_entropy, int64_t vocab_start,
                                   double inv_temperature, int64_t ignore_index, void* grad,
                                   int64_t grad_row_stride, cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  if (!grid_ok(n_rows)) return cudaErrorInvalidValue;
  MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob_backward", [&] {
    const auto b = BackwardRows<scalar_t>::cast(logits, grad, lse, entropy, grad_logp, grad_entropy,
                                                inv_temperature);
    const dim3 grid(static_cast<unsigned>(n_rows));
    const int threads = threads_for<scalar_t>(vocab);
    if (entropy != nullptr) {
      backward_kernel<scalar_t, true><<<grid, threads, 0, stream>>>(
          b, vocab, row_stride, targets, vocab_start, ignore_index, grad_row_stride);
    } else {
      backward_kernel<scalar_t, false><<<grid, threads, 0, stream>>>(
          b, vocab, row_stride, targets, vocab_start, ignore_index, grad_row_stride);
    }
  });
  return cudaGetLastError();
}

}  // namespace megalign::cuda
