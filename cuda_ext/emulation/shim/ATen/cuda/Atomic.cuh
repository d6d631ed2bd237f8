// CUDA emulation (cuda_ext/emulation) of ATen's gpuAtomicAddNoReturn: a native atomic add for float
// and double (std::atomic_ref, C++20), a mutex for the 16-bit types (whose GPU form is a CAS loop).
// Either way each addition is rounded to T, as on the GPU; only the order of additions is free.
#pragma once
#include <atomic>
#include <mutex>
#include <type_traits>

inline std::mutex emu_atomic_add_mutex;

template <class T>
void gpuAtomicAddNoReturn(T* p, T v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    std::atomic_ref<T>(*p).fetch_add(v);
  } else {
    const std::lock_guard<std::mutex> lock(emu_atomic_add_mutex);
    *p = *p + v;
  }
}
