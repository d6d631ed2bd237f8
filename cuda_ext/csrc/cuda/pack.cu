// pack_bits / unpack_bits on CUDA: 1, 2, 4 or 8-bit codes in bytes (sign and low-bit quantizers).
//
// Definition (zensync/kernels/reference.py): code i sits in bits [(i * bits) % 8, + bits) of byte
// (i * bits) / 8, least significant first; only the low `bits` bits of a code count; padding bits
// are zero. A code never straddles two bytes (bits divides 8).
//
// pack:   one thread per output byte, which ORs its 8 / bits codes (no atomics).
// unpack: one thread per output code, which shifts it out of its byte.
#include <torch/library.h>

#include "common.cuh"

namespace zensync_cuda {
namespace {

__global__ void __launch_bounds__(kThreads)
    pack_bits_kernel(const uint8_t* codes, int64_t numel, int bits, int64_t num_bytes, uint8_t* packed) {
  const int per_byte = 8 / bits;
  const unsigned int code_mask = (1u << bits) - 1u;
  for (int64_t b = global_thread(); b < num_bytes; b += grid_threads()) {
    const int64_t first = b * per_byte;
    unsigned int byte = 0u;
    for (int slot = 0; slot < per_byte && first + slot < numel; ++slot) {
      byte |= (static_cast<unsigned int>(codes[first + slot]) & code_mask) << (slot * bits);
    }
    packed[b] = static_cast<uint8_t>(byte);
  }
}

__global__ void __launch_bounds__(kThreads)
    unpack_bits_kernel(const uint8_t* packed, int bits, int64_t numel, uint8_t* codes) {
  const unsigned int code_mask = (1u << bits) - 1u;
  for (int64_t i = global_thread(); i < numel; i += grid_threads()) {
    const int64_t bit = i * bits;
    codes[i] = static_cast<uint8_t>((static_cast<unsigned int>(packed[bit >> 3]) >> (bit & 7)) & code_mask);
  }
}

void check_width(const char* op, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8, op, ": bits=", bits,
                    " must be one of (1, 2, 4, 8)");
}

at::Tensor pack_bits_cuda(const at::Tensor& codes, int64_t bits) {
  check_width("pack_bits", bits);
  check_cuda(codes, "pack_bits", "codes");
  TORCH_CHECK_VALUE((codes.scalar_type() == at::kByte || codes.scalar_type() == at::kBool) && codes.dim() == 1,
                    "pack_bits: codes must be 1-D uint8 or bool, got ", codes.scalar_type(), " of shape ",
                    codes.sizes());
  const c10::cuda::CUDAGuard guard(codes.device());
  const int64_t numel = codes.numel();
  const int64_t num_bytes = ceil_div(numel * bits, 8);
  at::Tensor packed = at::empty({num_bytes}, codes.options().dtype(at::kByte));
  if (num_bytes == 0) return packed;
  const at::Tensor c = codes.contiguous();  // bool is one byte holding 0 or 1
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  pack_bits_kernel<<<grid_stride_blocks(num_bytes), kThreads, 0, stream>>>(
      reinterpret_cast<const uint8_t*>(c.data_ptr()), numel, static_cast<int>(bits), num_bytes,
      packed.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return packed;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, int64_t bits, int64_t numel) {
  check_width("unpack_bits", bits);
  check_cuda(packed, "unpack_bits", "packed");
  const int64_t per_byte = 8 / bits;
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.dim() == 1 && numel >= 0 &&
                        numel <= packed.numel() * per_byte,
                    "unpack_bits: packed must be 1-D uint8 holding at least numel=", numel, " codes of ", bits,
                    " bits, got ", packed.scalar_type(), " of shape ", packed.sizes());
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor codes = at::empty({numel}, packed.options());
  if (numel == 0) return codes;
  const at::Tensor p = packed.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  unpack_bits_kernel<<<grid_stride_blocks(numel), kThreads, 0, stream>>>(p.data_ptr<uint8_t>(), static_cast<int>(bits),
                                                                         numel, codes.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return codes;
}

}  // namespace

TORCH_LIBRARY_IMPL(zensync_cuda, CUDA, m) {
  m.impl("pack_bits", &pack_bits_cuda);
  m.impl("unpack_bits", &unpack_bits_cuda);
}

}  // namespace zensync_cuda
