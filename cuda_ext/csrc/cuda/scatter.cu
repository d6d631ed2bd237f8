// scatter_add on CUDA: sparse (index, value) payload -> dense tensor, duplicates summed.
//
// Definition (zensync/kernels/reference.py: scatter_add): numel zeros of values' dtype plus each
// value at its index. One thread per pair, gpuAtomicAddNoReturn (ATen's atomics: native for
// float32/float64, the half/bfloat16 forms for 16-bit types). Duplicate indices are summed in an
// unspecified order, as index_add_ does on CUDA; integer-valued data sums exactly in any order.
// Indices outside [0, numel) are skipped and the index of the first is returned beside the result;
// the Python wrapper raises ValueError (one host sync, the reference's range check also syncs).
#include <ATen/cuda/Atomic.cuh>
#include <torch/library.h>

#include "common.cuh"

namespace zensync_cuda {
namespace {

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    scatter_add_kernel(const index_t* indices, const scalar_t* values, int64_t n, int64_t numel, scalar_t* out,
                       FirstOutOfRange bad) {
  for (int64_t t = global_thread(); t < n; t += grid_threads()) {
    const int64_t index = static_cast<int64_t>(indices[t]);
    if (bad.outside(index, numel, t)) continue;
    gpuAtomicAddNoReturn(out + index, values[t]);
  }
}

template <typename scalar_t, typename index_t>
void launch(const at::Tensor& indices, const at::Tensor& values, int64_t numel, at::Tensor& out,
            FirstOutOfRange bad) {
  const int64_t n = values.numel();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  scatter_add_kernel<scalar_t, index_t><<<grid_stride_blocks(n), kThreads, 0, stream>>>(
      indices.data_ptr<index_t>(), values.data_ptr<scalar_t>(), n, numel, out.data_ptr<scalar_t>(), bad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void dispatch_index(const at::Tensor& indices, const at::Tensor& values, int64_t numel, at::Tensor& out,
                    FirstOutOfRange bad) {
  if (indices.scalar_type() == at::kLong) {
    launch<scalar_t, int64_t>(indices, values, numel, out, bad);
  } else {
    launch<scalar_t, int32_t>(indices, values, numel, out, bad);
  }
}

std::tuple<at::Tensor, at::Tensor> scatter_add_cuda(const at::Tensor& indices, const at::Tensor& values,
                                                     int64_t numel) {
  check_cuda(indices, "scatter_add", "indices");
  check_cuda(values, "scatter_add", "values");
  TORCH_CHECK(indices.device() == values.device(), "scatter_add: indices on ", indices.device(),
              " and values on ", values.device(), " must be on one device");
  TORCH_CHECK_VALUE(indices.dim() == 1 && values.dim() == 1 && indices.numel() == values.numel(),
                    "scatter_add: indices and values must be 1-D of equal length, got ", indices.sizes(), " and ",
                    values.sizes());
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
                    "scatter_add: indices must be int32 or int64, got ", indices.scalar_type());
  TORCH_CHECK_VALUE(numel >= 0, "scatter_add: numel=", numel, " must be >= 0");
  const at::ScalarType dtype = values.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                    "scatter_add: values must be float16, bfloat16, float32 or float64, got ", dtype);
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor out = at::zeros({numel}, values.options());
  const int64_t n = values.numel();
  OutOfRangeCheck check(n, indices.options());
  if (n == 0) return {out, check.first()};
  const at::Tensor idx = indices.contiguous();
  const at::Tensor val = values.contiguous();
  switch (dtype) {
    case at::kHalf:
      dispatch_index<at::Half>(idx, val, numel, out, check.device());
      break;
    case at::kBFloat16:
      dispatch_index<at::BFloat16>(idx, val, numel, out, check.device());
      break;
    case at::kFloat:
      dispatch_index<float>(idx, val, numel, out, check.device());
      break;
    default:  // kDouble, checked above
      dispatch_index<double>(idx, val, numel, out, check.device());
      break;
  }
  return {out, check.first()};
}

}  // namespace

TORCH_LIBRARY_IMPL(zensync_cuda, CUDA, m) { m.impl("scatter_add", &scatter_add_cuda); }

}  // namespace zensync_cuda
