// CUDA emulation (cuda_ext/emulation) of ATen's gpuAtomicAddNoReturn: a native atomic add for float
// and double, a compare-and-swap loop on the 16 bits for the 16-bit types (as on the GPU). Relaxed,
// like every emulated atomic (shim/emu_runtime.h). Each addition is rounded to T, as on the GPU; only
// the order of additions is free.
#pragma once
#include <atomic>
#include <cstring>
#include <type_traits>

template <class T>
void gpuAtomicAddNoReturn(T* p, T v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
  } else {
    static_assert(sizeof(T) == sizeof(unsigned short) && std::is_trivially_copyable_v<T>, "a 16-bit float type");
    std::atomic_ref<unsigned short> word(*reinterpret_cast<unsigned short*>(p));
    unsigned short old_bits = word.load(std::memory_order_relaxed);
    unsigned short new_bits = 0;
    do {
      T old_value;
      std::memcpy(&old_value, &old_bits, sizeof(T));
      const T sum = static_cast<T>(old_value + v);
      std::memcpy(&new_bits, &sum, sizeof(T));
    } while (!word.compare_exchange_weak(old_bits, new_bits, std::memory_order_relaxed));  // reloads old_bits
  }
}
