// GAE on CUDA as a scan, not one thread walking T. One block per row; the row is processed in
// tiles of kThreads * kItems positions from right to left. In a tile, thread i owns the i-th chunk
// of kItems positions counted from the tile's right edge, composes the affine maps of its chunk
// (math/advantage.h), and a block-wide exclusive scan of the chunk maps (cub::BlockScan, in
// right-to-left order) gives each chunk its incoming (V_next, A_next); each thread then re-walks its
// chunk with gae_step. The tile's total map carries the state into the next tile to the left.
#include <cub/block/block_scan.cuh>

#include "megalign/gae.h"
#include "megalign/math/advantage.h"

namespace megalign::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int64_t kTile = int64_t(kThreads) * kItems;

// Scan operator in right-to-left order: `right` is the aggregate of the chunks already scanned (to
// the right in time), `left` the next chunk; the result applies `right` first.
template <typename acc>
struct ComposeLeftward {
  __device__ math::GaeMap<acc> operator()(const math::GaeMap<acc>& right, const math::GaeMap<acc>& left) const {
    return math::gae_compose(left, right);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gae_kernel(const T* __restrict__ rewards, Strides2d rs, const T* __restrict__ values, Strides2d vs,
               const bool* __restrict__ mask, Strides2d ms, int64_t steps, acc_t<T> gamma, acc_t<T> gamma_lam,
               acc_t<T>* __restrict__ adv, acc_t<T>* __restrict__ ret) {
  using acc = acc_t<T>;
  using Map = math::GaeMap<acc>;
  using Scan = cub::BlockScan<Map, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;

  const int64_t row = blockIdx.x;
  rewards += row * rs.row;
  values += row * vs.row;
  mask += row * ms.row;
  adv += row * steps;
  ret += row * steps;
  auto load = [&](int64_t t, bool& valid, acc& r, acc& v) {
    valid = mask[t * ms.col];
    r = to_acc(rewards[t * rs.col]);
    v = to_acc(values[t * vs.col]);
  };

  // (V_next, A_next) at the right edge of the current tile; identical in every thread.
  acc tile_value = 0, tile_adv = 0;
  for (int64_t tile = (steps + kTile - 1) / kTile - 1; tile >= 0; --tile) {
    const int64_t tile_lo = tile * kTile;
    const int64_t tile_hi = steps < tile_lo + kTile ? steps : tile_lo + kTile;
    const int64_t hi = tile_hi - int64_t(threadIdx.x) * kItems;  // may be <= tile_lo: an empty chunk
    const int64_t lo = hi - kItems > tile_lo ? hi - kItems : tile_lo;

    Map chunk = Map::identity();
    for (int64_t t = hi - 1; t >= lo; --t) {
      bool valid;
      acc r, v;
      load(t, valid, r, v);
      chunk = math::gae_compose(Map::step(valid, r, v, gamma, gamma_lam), chunk);
    }
    Map incoming, total;
    Scan(scan_storage).ExclusiveScan(chunk, incoming, Map::identity(), ComposeLeftward<acc>(), total);

    acc next_value = tile_value, next_adv = tile_adv;
    math::gae_apply(incoming, next_value, next_adv);
    math::gae_walk(lo, hi, gamma, gamma_lam, next_value, next_adv, load, adv, ret);
    math::gae_apply(total, tile_value, tile_adv);
    __syncthreads();  // scan_storage is reused by the next tile
  }
}

}  // namespace

void gae(DType dtype, const void* rewards, Strides2d rs, const void* values, Strides2d vs, const bool* mask,
         Strides2d ms, int64_t batch, int64_t steps, double gamma, double lam, void* advantages, void* returns,
         cudaStream_t stream) {
  if (batch == 0 || steps == 0) return;
  MEGALIGN_DISPATCH_FLOAT(dtype, "gae", [&] {
    using acc = acc_t<scalar_t>;
    gae_kernel<scalar_t><<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(rewards), rs, static_cast<const scalar_t*>(values), vs, mask, ms, steps,
        static_cast<acc>(gamma), static_cast<acc>(gamma * lam), static_cast<acc*>(advantages),
        static_cast<acc*>(returns));
  });
}

}  // namespace megalign::cuda
