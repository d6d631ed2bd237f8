// Shared launch helpers, a block-wide prefix sum and an ordered stream compaction.
//
// Every kernel in this directory runs on the current CUDA stream of its input's device, uses int64
// indices (tensors beyond 2^31 elements) and is launched only for a non-empty grid.
//
// The ordered compaction ("tiles") is the one primitive behind bitmap decoding, the extraction of
// Zen's hash table and sampled top-k's candidates:
//   Step 1  tile_counts: each block sums counter(i) over its tile of kTile consecutive elements;
//   Step 2  exclusive_offsets: an exclusive prefix sum over tiles (at::cumsum, on the same stream);
//   Step 3  tile_write: each block walks its tile in kThreads-wide rows, a block-wide exclusive sum
//           gives every element its output offset, and writer(i, dst) writes counter(i) outputs
//           from dst on. Outputs therefore come out in input order.
// A layout may cut the input into equal segments (Zen's per-owner regions) so that no tile
// straddles two segments; per-segment totals are then sums of whole tiles.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace zensync_cuda {

constexpr int kThreads = 256;                  // threads per block, every kernel here
constexpr int kWarps = kThreads / 32;          // warps per block (<= 32: one warp scans their totals)
constexpr int64_t kTile = kThreads * 8;        // elements per compaction tile: 8 rows of kThreads
constexpr int64_t kMaxGridStrideBlocks = 1 << 16;  // grid-stride kernels: enough blocks to fill any GPU

static_assert(sizeof(unsigned long long) == sizeof(int64_t), "int64 tensors are read as 64-bit atomics");
static_assert(kWarps <= 32, "block_exclusive_sum scans the warp totals with one warp");

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n elements (n > 0).
inline unsigned int grid_stride_blocks(int64_t n) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(ceil_div(n, kThreads), kMaxGridStrideBlocks)));
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__device__ __forceinline__ long long warp_inclusive_sum(long long value) {
  const int lane = threadIdx.x & 31;
  for (int delta = 1; delta < 32; delta <<= 1) {
    const long long other = __shfl_up_sync(0xffffffffu, value, delta);
    if (lane >= delta) value += other;
  }
  return value;
}

// Exclusive prefix sum of `value` over the threads of the block, in threadIdx order; `total` gets
// the block's sum. Every thread of a kThreads-wide block must call it (it synchronizes the block),
// the same number of times.
__device__ __forceinline__ int64_t block_exclusive_sum(int64_t value, int64_t& total) {
  __shared__ long long warp_totals[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long inclusive = warp_inclusive_sum(value);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    long long scanned = warp_inclusive_sum(lane < kWarps ? warp_totals[lane] : 0);
    if (lane < kWarps) warp_totals[lane] = scanned;  // inclusive over warps
  }
  __syncthreads();
  const long long before = warp == 0 ? 0 : warp_totals[warp - 1];
  total = warp_totals[kWarps - 1];
  __syncthreads();  // everyone has read warp_totals before the next call overwrites it
  return before + inclusive - value;
}

// num_segments segments of segment_len elements each, cut into tiles that never straddle two.
struct TileLayout {
  int64_t segment_len = 0;
  int64_t tiles_per_segment = 0;
  int64_t num_tiles = 0;

  static TileLayout make(int64_t num_segments, int64_t segment_len) {
    TileLayout layout;
    layout.segment_len = segment_len;
    layout.tiles_per_segment = ceil_div(segment_len, kTile);
    layout.num_tiles = num_segments * layout.tiles_per_segment;
    TORCH_CHECK(layout.num_tiles < (int64_t{1} << 31), "zensync_cuda: input too large for one launch (",
                layout.num_tiles, " tiles of ", kTile, " elements)");
    return layout;
  }

  __device__ __forceinline__ void bounds(int64_t tile, int64_t& first, int64_t& last) const {
    const int64_t segment = tile / tiles_per_segment;
    const int64_t local = tile - segment * tiles_per_segment;
    first = segment * segment_len + local * kTile;
    last = segment * segment_len + std::min(segment_len, (local + 1) * kTile);
  }
};

// tile_counts[t + 1] = sum of counter(i) over tile t; tile_counts[0] = 0.
template <class Counter>
__global__ void __launch_bounds__(kThreads) tile_count_kernel(TileLayout layout, Counter counter, int64_t* tile_counts) {
  int64_t first, last;
  layout.bounds(blockIdx.x, first, last);
  int64_t sum = 0;
  for (int64_t i = first + threadIdx.x; i < last; i += kThreads) sum += counter(i);
  int64_t total;
  block_exclusive_sum(sum, total);
  if (threadIdx.x == 0) tile_counts[blockIdx.x + 1] = total;
}

template <class Counter, class Writer>
__global__ void __launch_bounds__(kThreads)
    tile_write_kernel(TileLayout layout, Counter counter, Writer writer, const int64_t* offsets) {
  int64_t first, last;
  layout.bounds(blockIdx.x, first, last);
  int64_t base = offsets[blockIdx.x];
  // The row loop has the same trip count in every thread, as block_exclusive_sum requires.
  for (int64_t row = first; row < last; row += kThreads) {
    const int64_t i = row + threadIdx.x;
    const int64_t count = i < last ? counter(i) : 0;
    int64_t row_total;
    const int64_t before = block_exclusive_sum(count, row_total);
    if (count > 0) writer(i, base + before);
    base += row_total;
  }
}

// Step 1: per-tile sums (int64, num_tiles + 1 entries, the first 0).
template <class Counter>
at::Tensor tile_counts(const TileLayout& layout, const Counter& counter, const at::TensorOptions& options) {
  at::Tensor counts = at::zeros({layout.num_tiles + 1}, options.dtype(at::kLong));
  if (layout.num_tiles > 0) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    tile_count_kernel<<<static_cast<unsigned int>(layout.num_tiles), kThreads, 0, stream>>>(
        layout, counter, counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return counts;
}

// Step 2: offsets[t] = outputs before tile t; offsets[num_tiles] = the total.
inline at::Tensor exclusive_offsets(const at::Tensor& counts) { return counts.cumsum(0); }

// The total of Step 2 on the host. Host sync.
inline int64_t offsets_total(const at::Tensor& offsets) { return offsets[offsets.numel() - 1].item<int64_t>(); }

// Step 3.
template <class Counter, class Writer>
void tile_write(const TileLayout& layout, const Counter& counter, const Writer& writer, const at::Tensor& offsets) {
  if (layout.num_tiles == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  tile_write_kernel<<<static_cast<unsigned int>(layout.num_tiles), kThreads, 0, stream>>>(
      layout, counter, writer, offsets.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Range check of indices read on the device (bitmap_encode, scatter_add): each thread calls
// outside(value, limit, t) for its element t, which records the lowest such t. The op returns the
// one-element int64 tensor first() beside its result (n while every index was in range), and the
// Python wrapper (zensync/kernels/cuda.py) reads it, one host sync, and raises: no C++ exception on
// the data path (on the lent H200 a C++ exception thrown from this extension after a launch ended the
// process with a segmentation fault instead of reaching Python; cuda_ext/README.md).
struct FirstOutOfRange {
  unsigned long long* first;  // n while every index seen is in range
  __device__ __forceinline__ bool outside(int64_t value, int64_t limit, int64_t t) const {
    if (value >= 0 && value < limit) return false;
    atomicMin(first, static_cast<unsigned long long>(t));
    return true;
  }
};

class OutOfRangeCheck {
 public:
  // For n indices, on the device of `options`.
  OutOfRangeCheck(int64_t n, const at::TensorOptions& options) : first_(at::full({1}, n, options.dtype(at::kLong))) {}
  FirstOutOfRange device() { return {reinterpret_cast<unsigned long long*>(first_.data_ptr<int64_t>())}; }
  // The lowest t with an index out of range, n when there is none (on the device: no sync).
  const at::Tensor& first() const { return first_; }

 private:
  at::Tensor first_;
};

inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
}

inline void check_1d(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", t.sizes());
}

}  // namespace zensync_cuda
