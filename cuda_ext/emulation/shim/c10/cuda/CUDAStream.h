// CUDA emulation (cuda_ext/emulation): launches are synchronous, so the current stream is a null handle.
#pragma once
#include <c10/core/Device.h>

namespace c10::cuda {
struct EmulatedStream {
  operator cudaStream_t() const { return nullptr; }  // NOLINT: converts implicitly, as CUDAStream does
};
inline EmulatedStream getCurrentCUDAStream(c10::DeviceIndex = -1) { return {}; }
}  // namespace c10::cuda
