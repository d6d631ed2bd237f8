// Self-test of the CUDA emulation runtime (shim/emu_runtime.h): each check is a property the
// emulation claims in build.py's docstring. CUDA syntax, but compiled only by the emulator:
// build.py's run_selftest includes emu_runtime.h, turns the launches into emu::launch and compiles
// this file alone (no torch), e.g. by tests/emulated/test_cuda_emulated.py. Prints "ok" and exits 0
// when every check passes, else prints the failed check and exits 1.
//
// `selftest fault NAME` instead runs one kernel with a deliberate fault (run_fault below): built with
// the sanitizer of build.py's SANITIZERS that lists NAME, each must be reported. That shows the
// sanitizers see such faults through the runtime, and the plain checks, which no sanitizer reports,
// that the runtime itself is race-free and in bounds.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kThreads = 64;  // two warps
constexpr int kBlocks = 3;

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

// Launches `launch_it`, which must throw std::runtime_error mentioning `expected`.
template <class F>
void check_throws(F launch_it, const char* expected, const char* what) {
  try {
    launch_it();
  } catch (const std::runtime_error& error) {
    check(std::strstr(error.what(), expected) != nullptr, what);
    return;
  }
  check(false, what);
}

// Inclusive prefix sum over each warp with __shfl_up_sync, as common.cuh's warp_inclusive_sum.
__global__ void warp_scan_kernel(long long* out) {
  long long value = threadIdx.x + 1;
  for (int delta = 1; delta < 32; delta <<= 1) {
    const long long other = __shfl_up_sync(0xffffffffu, value, delta);
    if ((threadIdx.x & 31) >= delta) value += other;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

// Reverses each block's slice through shared memory: wrong without a real barrier.
__global__ void reverse_kernel(const int* in, int* out) {
  __shared__ int slice[kThreads];
  slice[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slice[blockDim.x - 1 - threadIdx.x];
}

// Half the threads return before a barrier the others pass (undefined in CUDA): the launch must
// report it, not deadlock, because an exited thread stops counting at the barrier.
__global__ void early_exit_kernel() {
  if (threadIdx.x % 2 == 1) return;
  __syncthreads();
}

// A barrier only some threads reach (undefined behaviour in CUDA): the launch must throw.
__global__ void divergent_barrier_kernel() {
  if (threadIdx.x < 32) __syncthreads();
  __syncthreads();
}

__global__ void partial_mask_kernel() { __shfl_up_sync(0x0000ffffu, 1, 1); }

// Every thread adds 1 and races for slot threadIdx.x % 4: one CAS winner per slot and launch.
__global__ void atomics_kernel(unsigned long long* total, unsigned long long* slots, unsigned int* winners) {
  atomicAdd(total, 1ull);
  if (atomicCAS(slots + threadIdx.x % 4, 0ull, 1ull + threadIdx.x) == 0ull) atomicAdd(winners, 1u);
}

__global__ void empty_kernel() {}

// Reads shared memory before anything wrote it: sees the runtime's poison, not a previous block's data.
__global__ void uninitialized_shared_kernel(unsigned int* out) {
  __shared__ unsigned int scratch[kThreads];
  out[blockIdx.x * blockDim.x + threadIdx.x] = scratch[threadIdx.x];
  __syncthreads();
  scratch[threadIdx.x] = 7u;
}

// Block 1 waits for a flag that block 0 raises: finishes only if two blocks run at once.
__global__ void blocks_at_once_kernel(unsigned int* flag) {
  if (threadIdx.x != 0) return;
  if (blockIdx.x == 0) {
    atomicAdd(flag, 1u);
  } else {
    while (atomicAdd(flag, 0u) == 0u) std::this_thread::yield();
  }
}

// ---- deliberate faults (`selftest fault NAME`). Data races, one per way to get CUDA's ordering wrong:

// reverse_kernel without its barrier: threads read slots their neighbours write.
__global__ void fault_missing_barrier_kernel(const int* in, int* out) {
  __shared__ int slice[kThreads];
  slice[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  out[blockIdx.x * blockDim.x + threadIdx.x] = slice[blockDim.x - 1 - threadIdx.x];
}

// Thread 0 of every block writes the same global word: a race between blocks.
__global__ void fault_between_blocks_kernel(int* out) {
  if (threadIdx.x == 0) out[0] = static_cast<int>(blockIdx.x);
}

// Message passing through an atomic: thread 1 waits until thread 0's atomicAdd shows, then reads the
// data thread 0 wrote before it. Correct with release/acquire, a race with CUDA's relaxed atomics.
__global__ void fault_atomic_as_fence_kernel(int* data, unsigned int* flag) {
  if (threadIdx.x == 0) {
    data[0] = 42;
    atomicAdd(flag, 1u);
  } else if (threadIdx.x == 1) {
    while (atomicAdd(flag, 0u) == 0u) std::this_thread::yield();
    data[1] = data[0];
  }
}

// Zen's slot claim as the paper writes it (write the tag, read it back), by every thread on one slot.
__global__ void fault_write_then_reread_kernel(unsigned long long* slot, unsigned int* claimed) {
  const unsigned long long tag = 1ull + blockIdx.x * blockDim.x + threadIdx.x;
  if (*slot == 0ull) {
    *slot = tag;
    if (*slot == tag) atomicAdd(claimed, 1u);
  }
}

// Memory errors and undefined arithmetic:
// the last thread reads one element past the end of its input (a classic tile-bound off-by-one).
__global__ void fault_out_of_bounds_kernel(const int* in, int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = in[i] + (i == n - 1 ? in[i + 1] : 0);
}

// A tiled copy whose last tile ignores the input's end (n is not a multiple of the tile).
__global__ void fault_past_the_tile_kernel(const int* in, int* out, int n) {
  const int tile = static_cast<int>(blockDim.x);
  const int first = blockIdx.x * tile;
  const int last = first + tile;  // should be min(first + tile, n)
  for (int i = first + threadIdx.x; i < last; i += tile) out[i % n] = in[i];
}

// A position computed in 32 bits that overflows (as `block * kTile` would past 2^31 elements).
__global__ void fault_signed_overflow_kernel(int* out) {
  const int scale = 0x40000000 + static_cast<int>(threadIdx.x);
  out[threadIdx.x % 4] = scale * (2 + static_cast<int>(blockIdx.x));
}

int run_fault(const std::string& name) {
  const int n = kBlocks * kThreads;
  std::vector<int> in(n, 1), out(n, 0);
  std::vector<int> short_in(n - 5, 1);  // not a multiple of the block: the last tile is partial
  unsigned int flag = 0;
  unsigned long long slot = 0;
  if (name == "missing_barrier") {
    fault_missing_barrier_kernel<<<kBlocks, kThreads, 0, nullptr>>>(in.data(), out.data());
  } else if (name == "between_blocks") {
    fault_between_blocks_kernel<<<kBlocks, kThreads, 0, nullptr>>>(out.data());
  } else if (name == "atomic_as_fence") {
    fault_atomic_as_fence_kernel<<<1, kThreads, 0, nullptr>>>(out.data(), &flag);
  } else if (name == "write_then_reread") {
    fault_write_then_reread_kernel<<<kBlocks, kThreads, 0, nullptr>>>(&slot, &flag);
  } else if (name == "out_of_bounds") {
    fault_out_of_bounds_kernel<<<kBlocks, kThreads, 0, nullptr>>>(in.data(), out.data(), n);
  } else if (name == "past_the_tile") {
    fault_past_the_tile_kernel<<<kBlocks, kThreads, 0, nullptr>>>(short_in.data(), out.data(), n - 5);
  } else if (name == "signed_overflow") {
    fault_signed_overflow_kernel<<<kBlocks, kThreads, 0, nullptr>>>(out.data());
  } else {
    std::printf("unknown fault %s\n", name.c_str());
    return 2;
  }
  std::printf("ran %s\n", name.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "fault") return run_fault(argv[2]);
  const int n = kBlocks * kThreads;
  std::vector<long long> scan(n);
  warp_scan_kernel<<<kBlocks, kThreads, 0, nullptr>>>(scan.data());
  bool scan_ok = true;
  for (int i = 0; i < n; ++i) {
    const long long lane_value = i % kThreads % 32 + 1 + (i % kThreads / 32) * 32;  // threadIdx.x + 1
    const long long first = lane_value - i % 32;                                  // the warp's lane 0 value
    scan_ok = scan_ok && scan[i] == (first + lane_value) * (i % 32 + 1) / 2;
  }
  check(scan_ok, "__shfl_up_sync gives each warp's inclusive prefix sum");

  std::vector<int> in(n), out(n, -1);
  for (int i = 0; i < n; ++i) in[i] = i;
  reverse_kernel<<<kBlocks, kThreads, 0, nullptr>>>(in.data(), out.data());
  bool reverse_ok = true;
  for (int i = 0; i < n; ++i) reverse_ok = reverse_ok && out[i] == (i / kThreads + 1) * kThreads - 1 - i % kThreads;
  check(reverse_ok, "__syncthreads orders shared-memory writes before reads in every block");

  unsigned long long total = 0, slots[4] = {};
  unsigned int winners = 0;
  atomics_kernel<<<kBlocks, kThreads, 0, nullptr>>>(&total, slots, &winners);
  check(total == static_cast<unsigned long long>(n) && winners == 4, "atomicAdd counts all, atomicCAS has one winner");

  check_throws([] { early_exit_kernel<<<kBlocks, kThreads, 0, nullptr>>>(); }, "__syncthreads count",
               "a thread that returns before a barrier is reported, without a deadlock");
  check_throws([] { divergent_barrier_kernel<<<kBlocks, kThreads, 0, nullptr>>>(); }, "__syncthreads count",
               "a barrier reached by part of a block is reported");
  check_throws([] { partial_mask_kernel<<<1, kThreads, 0, nullptr>>>(); }, "full-warp",
               "device-code errors reach the launching thread");
  check_throws([] { empty_kernel<<<1, 48, 0, nullptr>>>(); }, "unsupported launch",
               "a block size that is not a multiple of 32 is rejected");
  check_throws([] { empty_kernel<<<0, kThreads, 0, nullptr>>>(); }, "unsupported launch", "an empty grid is rejected");

  std::vector<unsigned int> garbage(n, 0u);
  uninitialized_shared_kernel<<<kBlocks, kThreads, 0, nullptr>>>(garbage.data());
  bool poisoned = true;
  for (unsigned int value : garbage) poisoned = poisoned && value == 0xA5A5A5A5u;
  check(poisoned, "shared memory holds the poison, never a previous block's values, until written");

  unsigned int flag = 0;
  blocks_at_once_kernel<<<2, kThreads, 0, nullptr>>>(&flag);  // hangs if blocks ran one after another
  check(flag == 1u, "two blocks of a launch run at once");

  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
