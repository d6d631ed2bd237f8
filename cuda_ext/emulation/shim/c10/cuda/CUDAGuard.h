// CUDA emulation (cuda_ext/emulation): there is one "device", the CPU, so the guard does nothing.
#pragma once
#include <c10/core/Device.h>

namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace c10::cuda
