// bitmap_encode / bitmap_decode on CUDA: Zen's hash-bitmap pull format (reference/zen.md 1.6).
//
// Definition (zensync/kernels/reference.py): int32 words, bit p % 32 of word p / 32 is set for
// each position p; decoding returns the ascending positions of the set bits below `length`.
//
// encode: one thread per position, atomicOr into a uint32 view of the words. Positions outside
//         [0, 32 * num_words) are skipped and the index of the first one is returned beside the
//         words (the Python wrapper raises, as the numba kernel does); duplicates are harmless (OR is
//         idempotent).
// decode: ordered compaction (common.cuh) where word w counts popcount(word) outputs and writes
//         its set bits in ascending order, so the output is sorted without a sort.
#include <torch/library.h>

#include "common.cuh"

namespace zensync_cuda {
namespace {

template <typename index_t>
__global__ void __launch_bounds__(kThreads)
    bitmap_encode_kernel(const index_t* positions, int64_t n, int64_t limit, unsigned int* words,
                         FirstOutOfRange bad) {
  for (int64_t t = global_thread(); t < n; t += grid_threads()) {
    const int64_t p = static_cast<int64_t>(positions[t]);
    if (bad.outside(p, limit, t)) continue;
    atomicOr(words + (p >> 5), 1u << (p & 31));
  }
}

std::tuple<at::Tensor, at::Tensor> bitmap_encode_cuda(const at::Tensor& positions, int64_t length) {
  check_cuda(positions, "bitmap_encode", "positions");
  check_1d(positions, "bitmap_encode", "positions");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                    "bitmap_encode: positions must be int32 or int64, got ", positions.scalar_type());
  TORCH_CHECK_VALUE(length >= 0, "bitmap_encode: length=", length,
                    " must be >= 0 (it is the number of positions the bitmap covers)");
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t num_words = ceil_div(length, 32);
  at::Tensor words = at::zeros({num_words}, positions.options().dtype(at::kInt));
  const int64_t n = positions.numel();
  OutOfRangeCheck check(n, positions.options());
  if (n == 0) return {words, check.first()};
  const at::Tensor pos = positions.contiguous();
  auto* words_ptr = reinterpret_cast<unsigned int*>(words.data_ptr<int32_t>());  // bit 31 is the int32 sign
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (pos.scalar_type() == at::kLong) {
    bitmap_encode_kernel<int64_t><<<grid_stride_blocks(n), kThreads, 0, stream>>>(
        pos.data_ptr<int64_t>(), n, 32 * num_words, words_ptr, check.device());
  } else {
    bitmap_encode_kernel<int32_t><<<grid_stride_blocks(n), kThreads, 0, stream>>>(
        pos.data_ptr<int32_t>(), n, 32 * num_words, words_ptr, check.device());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {words, check.first()};
}

// Set bits of word w that lie below num_bits.
__device__ __forceinline__ unsigned int masked_word(const unsigned int* words, int64_t w, int64_t num_bits) {
  unsigned int word = words[w];
  const int64_t remaining = num_bits - 32 * w;
  if (remaining < 32) word &= (1u << remaining) - 1u;
  return word;
}

struct WordPopcount {
  const unsigned int* words;
  int64_t num_bits;
  __device__ __forceinline__ int64_t operator()(int64_t w) const { return __popc(masked_word(words, w, num_bits)); }
};

struct SetBitWriter {
  const unsigned int* words;
  int64_t num_bits;
  int64_t* out;
  __device__ __forceinline__ void operator()(int64_t w, int64_t dst) const {
    unsigned int word = masked_word(words, w, num_bits);
    while (word != 0u) {
      out[dst++] = 32 * w + (__ffs(word) - 1);  // lowest set bit first: ascending
      word &= word - 1u;
    }
  }
};

at::Tensor bitmap_decode_cuda(const at::Tensor& words, int64_t length) {
  check_cuda(words, "bitmap_decode", "words");
  check_1d(words, "bitmap_decode", "words");
  TORCH_CHECK_VALUE(words.scalar_type() == at::kInt, "bitmap_decode: words must be int32, got ",
                    words.scalar_type());
  TORCH_CHECK_VALUE(length >= 0, "bitmap_decode: length=", length,
                    " must be >= 0 (it is the number of positions the bitmap covers)");
  const c10::cuda::CUDAGuard guard(words.device());
  const at::TensorOptions long_options = words.options().dtype(at::kLong);
  const int64_t num_bits = std::min(length, 32 * words.numel());
  const at::Tensor w = words.contiguous();
  const auto* words_ptr = reinterpret_cast<const unsigned int*>(w.data_ptr<int32_t>());
  const TileLayout layout = TileLayout::make(1, ceil_div(num_bits, 32));
  const WordPopcount counter{words_ptr, num_bits};
  // Step 1 and 2: set bits per tile, exclusive offsets.
  const at::Tensor offsets = exclusive_offsets(tile_counts(layout, counter, long_options));
  at::Tensor out = at::empty({offsets_total(offsets)}, long_options);  // host sync
  // Step 3
  tile_write(layout, counter, SetBitWriter{words_ptr, num_bits, out.data_ptr<int64_t>()}, offsets);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zensync_cuda, CUDA, m) {
  m.impl("bitmap_encode", &bitmap_encode_cuda);
  m.impl("bitmap_decode", &bitmap_decode_cuda);
}

}  // namespace zensync_cuda
