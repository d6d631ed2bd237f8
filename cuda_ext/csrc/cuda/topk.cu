// topk and sampled_topk on CUDA: exact radix select, then an ordered compaction.
//
// Definition (zensync/kernels/reference.py: topk): the ascending positions of the k largest entries
// of a 1-D float tensor, in the order "numbers as usual, -0.0 == 0.0, NaN above everything"; ties
// at the k-th value go to the lowest positions. k >= numel selects everything, k == 0 nothing.
//
// topk:
//   1. Order-preserving keys of the raw bits (order_key): comparing keys as unsigned integers is
//      comparing values in the order above, and equal values have equal keys.
//   2. Radix select, 8 bits per pass from the most significant digit: a histogram of the digit
//      over the entries that match the digits chosen so far (shared-memory counts, one global atomic
//      per block and digit), then on the host (one sync per pass) the digit that holds the k-th
//      largest key. After the last pass `kth` is the k-th largest key and `take` how many of the
//      entries equal to it belong to the top k (1 <= take <= ties).
//   3. Ordered compaction: per tile, the counts of keys > kth and == kth; exclusive sums over
//      tiles; then every key > kth and the first `take` keys == kth (in position order) are written
//      at their rank among the selected, so the output is ascending without a sort.
//
// sampled_topk (reference.sampled_topk, DGC's threshold selection with exact-k output): count the
// entries >= threshold (NaN always passes; one pass and one sync per threshold), relaxing the
// threshold while fewer than k pass; compact the candidates (positions and values, in order), run
// topk on the candidate values and map the result back. The result equals topk(magnitudes, k)
// whatever the threshold: once k entries pass, every entry of the top k (ties included) passes.
#include <torch/library.h>

#include "common.cuh"

namespace zensync_cuda {
namespace {

constexpr int kDigitBits = 8;
constexpr int kDigits = 1 << kDigitBits;

// Step 1. NaN -> the largest key; -0.0 and 0.0 -> the same key; negative x -> ~bits (a larger
// magnitude gives a smaller key); non-negative x -> bits | sign (above every negative).
template <typename bits_t>
__device__ __forceinline__ uint64_t order_key(bits_t bits, bits_t inf_bits) {
  constexpr bits_t kSign = static_cast<bits_t>(bits_t{1} << (8 * sizeof(bits_t) - 1));
  const bits_t magnitude = static_cast<bits_t>(bits & static_cast<bits_t>(~kSign));
  if (magnitude > inf_bits) return static_cast<bits_t>(~bits_t{0});  // NaN, any payload or sign
  if (magnitude == 0) return kSign;                                  // -0.0 == 0.0
  if ((bits & kSign) != 0) return static_cast<bits_t>(~bits);
  return static_cast<bits_t>(bits | kSign);
}

// Step 2: hist[d] += entries whose key matches `prefix` on `prefix_mask` and has digit d at `shift`.
template <typename bits_t>
__global__ void __launch_bounds__(kThreads)
    radix_histogram_kernel(const bits_t* x, int64_t n, bits_t inf_bits, uint64_t prefix, uint64_t prefix_mask,
                           int shift, unsigned long long* hist) {
  __shared__ unsigned int local[kDigits];
  for (int d = threadIdx.x; d < kDigits; d += kThreads) local[d] = 0u;
  __syncthreads();
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const uint64_t key = order_key(x[i], inf_bits);
    if ((key & prefix_mask) == prefix) atomicAdd(local + ((key >> shift) & (kDigits - 1)), 1u);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kDigits; d += kThreads) {
    if (local[d] != 0u) atomicAdd(hist + d, static_cast<unsigned long long>(local[d]));
  }
}

template <typename bits_t>
struct Selection {
  const bits_t* x;
  bits_t inf_bits;
  uint64_t kth;
  __device__ __forceinline__ int64_t above(int64_t i) const { return order_key(x[i], inf_bits) > kth ? 1 : 0; }
  __device__ __forceinline__ int64_t tied(int64_t i) const { return order_key(x[i], inf_bits) == kth ? 1 : 0; }
};

// Step 3a: above_counts[t + 1] and tie_counts[t + 1] for tile t.
template <typename bits_t>
__global__ void __launch_bounds__(kThreads)
    select_count_kernel(TileLayout layout, Selection<bits_t> sel, int64_t* above_counts, int64_t* tie_counts) {
  int64_t first, last;
  layout.bounds(blockIdx.x, first, last);
  int64_t above = 0, tied = 0;
  for (int64_t i = first + threadIdx.x; i < last; i += kThreads) {
    above += sel.above(i);
    tied += sel.tied(i);
  }
  int64_t above_total, tied_total;
  block_exclusive_sum(above, above_total);
  block_exclusive_sum(tied, tied_total);
  if (threadIdx.x == 0) {
    above_counts[blockIdx.x + 1] = above_total;
    tie_counts[blockIdx.x + 1] = tied_total;
  }
}

// Step 3b: the selected entries before i are the keys > kth before i plus min(ties before i, take).
template <typename bits_t>
__global__ void __launch_bounds__(kThreads)
    select_write_kernel(TileLayout layout, Selection<bits_t> sel, const int64_t* above_offsets,
                        const int64_t* tie_offsets, int64_t take, int64_t* out) {
  int64_t first, last;
  layout.bounds(blockIdx.x, first, last);
  int64_t above_base = above_offsets[blockIdx.x];
  int64_t tie_base = tie_offsets[blockIdx.x];
  for (int64_t row = first; row < last; row += kThreads) {  // same trip count in every thread
    const int64_t i = row + threadIdx.x;
    const int64_t above = i < last ? sel.above(i) : 0;
    const int64_t tied = i < last ? sel.tied(i) : 0;
    int64_t above_row, tied_row;
    const int64_t above_before = above_base + block_exclusive_sum(above, above_row);
    const int64_t ties_before = tie_base + block_exclusive_sum(tied, tied_row);
    if (above) {
      out[above_before + std::min(ties_before, take)] = i;
    } else if (tied && ties_before < take) {
      out[above_before + ties_before] = i;
    }
    above_base += above_row;
    tie_base += tied_row;
  }
}

template <typename bits_t>
at::Tensor radix_topk(const at::Tensor& x, int64_t k, bits_t inf_bits) {
  const at::TensorOptions long_options = x.options().dtype(at::kLong);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  const auto* bits = reinterpret_cast<const bits_t*>(x.data_ptr());
  // Step 2
  at::Tensor hist = at::empty({kDigits}, long_options);
  uint64_t prefix = 0, prefix_mask = 0;
  int64_t take = k;  // still to select among the entries that match `prefix`
  for (int shift = 8 * static_cast<int>(sizeof(bits_t)) - kDigitBits; shift >= 0; shift -= kDigitBits) {
    hist.zero_();
    radix_histogram_kernel<bits_t><<<grid_stride_blocks(n), kThreads, 0, stream>>>(
        bits, n, inf_bits, prefix, prefix_mask, shift, reinterpret_cast<unsigned long long*>(hist.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor host_hist = hist.cpu();  // host sync
    const int64_t* counts = host_hist.data_ptr<int64_t>();
    int digit = kDigits - 1;
    for (; digit > 0 && counts[digit] < take; --digit) take -= counts[digit];
    TORCH_INTERNAL_ASSERT(counts[digit] >= take && take >= 1, "topk: radix select lost the k-th key");
    prefix |= static_cast<uint64_t>(digit) << shift;
    prefix_mask |= static_cast<uint64_t>(kDigits - 1) << shift;
  }
  // Step 3
  const Selection<bits_t> sel{bits, inf_bits, prefix};
  const TileLayout layout = TileLayout::make(1, n);
  at::Tensor above_counts = at::zeros({layout.num_tiles + 1}, long_options);
  at::Tensor tie_counts = at::zeros({layout.num_tiles + 1}, long_options);
  const unsigned int blocks = static_cast<unsigned int>(layout.num_tiles);  // n > k >= 1, so >= 1 tile
  select_count_kernel<bits_t><<<blocks, kThreads, 0, stream>>>(layout, sel, above_counts.data_ptr<int64_t>(),
                                                                tie_counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor above_offsets = exclusive_offsets(above_counts);
  const at::Tensor tie_offsets = exclusive_offsets(tie_counts);
  at::Tensor out = at::empty({k}, long_options);
  select_write_kernel<bits_t><<<blocks, kThreads, 0, stream>>>(
      layout, sel, above_offsets.data_ptr<int64_t>(), tie_offsets.data_ptr<int64_t>(), take, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void check_magnitudes(const at::Tensor& magnitudes, const char* op, int64_t k) {
  check_cuda(magnitudes, op, "magnitudes");
  check_1d(magnitudes, op, "magnitudes");
  const at::ScalarType dtype = magnitudes.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble, op,
                    ": magnitudes must be float16, bfloat16, float32 or float64, got ", dtype);
  TORCH_CHECK_VALUE(k >= 0, op, ": k=", k, " must be >= 0 (how many elements to select)");
}

at::Tensor topk_cuda(const at::Tensor& magnitudes, int64_t k) {
  check_magnitudes(magnitudes, "topk", k);
  const c10::cuda::CUDAGuard guard(magnitudes.device());
  const at::TensorOptions long_options = magnitudes.options().dtype(at::kLong);
  const int64_t n = magnitudes.numel();
  if (k >= n) return at::arange(n, long_options);
  if (k == 0) return at::empty({0}, long_options);
  const at::Tensor x = magnitudes.contiguous();
  switch (x.scalar_type()) {
    case at::kHalf:
      return radix_topk<uint16_t>(x, k, 0x7C00);
    case at::kBFloat16:
      return radix_topk<uint16_t>(x, k, 0x7F80);
    case at::kFloat:
      return radix_topk<uint32_t>(x, k, 0x7F800000u);
    default:  // kDouble, by check_magnitudes
      return radix_topk<uint64_t>(x, k, 0x7FF0000000000000ull);
  }
}

// Candidates of sampled_topk: x >= threshold (compared exactly, in double) or NaN.
template <typename scalar_t>
struct Candidate {
  const scalar_t* x;
  double threshold;
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    const double v = static_cast<double>(static_cast<float>(x[i]));
    return (v >= threshold || v != v) ? 1 : 0;
  }
};

template <>
__device__ __forceinline__ int64_t Candidate<double>::operator()(int64_t i) const {
  const double v = x[i];
  return (v >= threshold || v != v) ? 1 : 0;
}

template <typename scalar_t>
struct CandidateWriter {
  const scalar_t* x;
  int64_t* positions;
  scalar_t* values;
  __device__ __forceinline__ void operator()(int64_t i, int64_t dst) const {
    positions[dst] = i;
    values[dst] = x[i];
  }
};

template <typename scalar_t>
at::Tensor sampled(const at::Tensor& x, int64_t k, double threshold, double relax_factor, int64_t max_tries) {
  const at::TensorOptions long_options = x.options().dtype(at::kLong);
  const TileLayout layout = TileLayout::make(1, x.numel());
  const scalar_t* data = x.data_ptr<scalar_t>();
  for (int64_t attempt = 0; attempt < max_tries; ++attempt) {
    const Candidate<scalar_t> candidate{data, threshold};
    const at::Tensor offsets = exclusive_offsets(tile_counts(layout, candidate, long_options));
    const int64_t passed = offsets_total(offsets);  // host sync
    if (passed >= k) {
      at::Tensor positions = at::empty({passed}, long_options);
      at::Tensor values = at::empty({passed}, x.options());
      tile_write(layout, candidate,
                 CandidateWriter<scalar_t>{data, positions.data_ptr<int64_t>(), values.data_ptr<scalar_t>()},
                 offsets);
      return positions.index_select(0, topk_cuda(values, k));  // both ascending: the result is too
    }
    threshold *= relax_factor;
  }
  return topk_cuda(x, k);
}

at::Tensor sampled_topk_cuda(const at::Tensor& magnitudes, int64_t k, double threshold, double relax_factor,
                             int64_t max_tries) {
  check_magnitudes(magnitudes, "sampled_topk", k);
  TORCH_CHECK_VALUE(relax_factor > 0.0 && relax_factor < 1.0, "sampled_topk: relax_factor=", relax_factor,
                    " must be in (0, 1): it lowers the threshold");
  const c10::cuda::CUDAGuard guard(magnitudes.device());
  if (k == 0 || k >= magnitudes.numel()) return topk_cuda(magnitudes, k);
  const at::Tensor x = magnitudes.contiguous();
  switch (x.scalar_type()) {
    case at::kHalf:
      return sampled<at::Half>(x, k, threshold, relax_factor, max_tries);
    case at::kBFloat16:
      return sampled<at::BFloat16>(x, k, threshold, relax_factor, max_tries);
    case at::kFloat:
      return sampled<float>(x, k, threshold, relax_factor, max_tries);
    default:  // kDouble, by check_magnitudes
      return sampled<double>(x, k, threshold, relax_factor, max_tries);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zensync_cuda, CUDA, m) {
  m.impl("topk", &topk_cuda);
  m.impl("sampled_topk", &sampled_topk_cuda);
}

}  // namespace zensync_cuda
