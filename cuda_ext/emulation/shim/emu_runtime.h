// CPU emulation of the CUDA subset that cuda_ext/csrc uses. cuda_ext/emulation/build.py includes it
// first in every rewritten .cu file; its docstring says what is emulated faithfully and what is not.
// Summary of the execution model:
//
//   * a launch (build.py rewrites k<<<grid, block, smem, stream>>>(args) into emu::launch) copies the
//     arguments once on the launching thread, then starts one OS thread per CUDA thread of a block;
//   * blocks run one after another, in blockIdx order, on those same threads: thread t plays
//     threadIdx.x == t in every block, and the next block starts when every thread left the last;
//   * __syncthreads is a real barrier over the block's threads, __shfl_up_sync a real exchange
//     between the 32 threads of a warp (through a per-warp barrier), atomics are std::atomic_ref;
//   * __shared__ variables are function-local static variables: one copy, which is the running block's
//     shared memory because blocks run one at a time and launches are serialized by a mutex;
//   * at the end of each block every thread must have passed the same number of __syncthreads, and
//     every lane of a warp the same number of shuffles, or the launch throws (CUDA leaves such
//     divergence undefined); a thread that returns stops counting at the block and warp barriers,
//     so a divergent kernel is reported instead of deadlocking the others.
//
// Anything outside this subset (other intrinsics, dynamic shared memory, 2-D/3-D launches) fails to
// compile or throws std::runtime_error at launch: extend this file, do not work around it.
#pragma once

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------------- qualifiers and built-in variables

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // see the header comment: one copy, owned by the running block

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT
};
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
constexpr int warpSize = 32;

inline thread_local dim3 threadIdx;  // per CUDA thread (each is an OS thread)
inline thread_local dim3 blockIdx;
inline dim3 blockDim;  // per launch; launches are serialized
inline dim3 gridDim;

namespace emu {

constexpr unsigned int kWarpSize = 32;
constexpr unsigned int kMaxBlockThreads = 1024;        // CUDA's limit on threads per block
constexpr unsigned int kMaxGridX = 0x7FFFFFFFu;        // CUDA's limit on gridDim.x
constexpr unsigned int kFullMask = 0xFFFFFFFFu;

// The synchronization state of one block; a fresh one is made before every block.
struct Warp {
  std::barrier<> barrier{kWarpSize};
  unsigned long long lanes[kWarpSize] = {};  // the values being shuffled, as raw bytes
};
struct Block {
  explicit Block(unsigned int threads) : barrier(threads) {
    for (unsigned int w = 0; w < threads / kWarpSize; ++w) warps.push_back(std::make_unique<Warp>());
  }
  std::barrier<> barrier;  // __syncthreads
  std::vector<std::unique_ptr<Warp>> warps;
};

// What the current OS thread (one CUDA thread) needs inside device code.
struct ThreadState {
  Block* block = nullptr;
  Warp* warp = nullptr;
  long syncs = 0;     // __syncthreads calls in the current block
  long shuffles = 0;  // shuffles in the current block
};
inline thread_local ThreadState tl;

// One launch at a time in the process: blockDim, gridDim and the __shared__ static variables are
// global (inline: one copy for every translation unit of the extension).
inline std::mutex launch_mutex;

// Device code reports misuse by throwing; the launch catches it and rethrows on the caller.
inline void require(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("CUDA emulation: ") + what);
}

// Runs kernel(args...) on a grid.x x block.x grid as described in the header comment. The launch is
// synchronous (streams are ignored) and throws std::runtime_error for an invalid configuration, for
// an exception in device code and for a barrier or shuffle count that differs within a block/warp.
template <class Kernel, class... Args>
void launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t /*stream: launches are synchronous*/,
            Kernel kernel, Args... args /* copied once, here, as CUDA copies kernel parameters */) {
  if (grid.x == 0 || grid.x > kMaxGridX || grid.y != 1 || grid.z != 1 || block.x == 0 ||
      block.x > kMaxBlockThreads || block.x % kWarpSize != 0 || block.y != 1 || block.z != 1 || shared_bytes != 0) {
    throw std::runtime_error("CUDA emulation: unsupported launch <<<" + std::to_string(grid.x) + ", " +
                             std::to_string(block.x) + ", " + std::to_string(shared_bytes) +
                             ">>> (1-D only, block a multiple of 32 up to 1024, no dynamic shared memory)");
  }
  const std::lock_guard<std::mutex> lock(launch_mutex);
  blockDim = block;
  gridDim = grid;
  const unsigned int threads = block.x;

  // Step 1: per-block state, and the hand-over between blocks (runs once all threads are done).
  std::unique_ptr<Block> current = std::make_unique<Block>(threads);
  std::vector<long> syncs(threads), shuffles(threads);
  std::string count_error;           // written only by next_block (no thread runs then)
  std::atomic<bool> failed{false};   // device code threw: skip the remaining work
  std::exception_ptr thrown;
  std::mutex thrown_mutex;
  auto next_block = [&]() noexcept {
    for (unsigned int t = 0; t < threads && count_error.empty(); ++t) {
      if (syncs[t] != syncs[0]) count_error = "__syncthreads count differs within a block";
      if (shuffles[t] != shuffles[t - t % kWarpSize]) count_error = "shuffle count differs within a warp";
    }
    current = std::make_unique<Block>(threads);
  };
  std::barrier<decltype(next_block)> between_blocks(threads, next_block);

  // Step 2: thread t plays threadIdx.x == t in every block, in blockIdx order.
  auto run_thread = [&](unsigned int t) {
    for (unsigned int b = 0; b < grid.x; ++b) {
      Block& blk = *current;  // made by next_block, before the barrier released this thread
      threadIdx = dim3{t};
      blockIdx = dim3{b};
      tl = ThreadState{&blk, blk.warps[t / kWarpSize].get(), 0, 0};
      if (!failed.load() && count_error.empty()) {
        try {
          kernel(args...);
        } catch (...) {
          const std::lock_guard<std::mutex> guard(thrown_mutex);
          if (!thrown) thrown = std::current_exception();
          failed.store(true);
        }
      }
      syncs[t] = tl.syncs;
      shuffles[t] = tl.shuffles;
      tl.warp->barrier.arrive_and_drop();  // an exited thread no longer holds its warp
      blk.barrier.arrive_and_drop();       // nor its block
      between_blocks.arrive_and_wait();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned int t = 0; t < threads; ++t) workers.emplace_back(run_thread, t);
  for (std::thread& worker : workers) worker.join();

  // Step 3: report on the launching thread.
  if (thrown) std::rethrow_exception(thrown);
  if (!count_error.empty()) throw std::runtime_error("CUDA emulation: " + count_error);
}

}  // namespace emu

// ---------------------------------------------------------------- barriers and warp shuffles

inline void __syncthreads() {
  ++emu::tl.syncs;
  emu::tl.block->barrier.arrive_and_wait();
}

// value of lane (lane - delta), or the caller's own value for lane < delta. Full warps only.
template <class T>
T __shfl_up_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(unsigned long long));
  emu::require(mask == emu::kFullMask && width == warpSize, "only full-warp __shfl_up_sync is emulated");
  ++emu::tl.shuffles;
  emu::Warp& warp = *emu::tl.warp;
  const unsigned int lane = threadIdx.x % emu::kWarpSize;
  std::memcpy(&warp.lanes[lane], &value, sizeof(T));
  warp.barrier.arrive_and_wait();  // every lane has published its value
  T result = value;
  if (lane >= delta) std::memcpy(&result, &warp.lanes[lane - delta], sizeof(T));
  warp.barrier.arrive_and_wait();  // every lane has read before the next shuffle overwrites
  return result;
}

// ---------------------------------------------------------------- atomics (return the old value)

inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected, unsigned long long desired) {
  std::atomic_ref<unsigned long long>(*p).compare_exchange_strong(expected, desired);
  return expected;  // the old value, whether or not the swap happened
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_add(v);
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_or(v);
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long> a(*p);
  unsigned long long old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {  // a failed exchange reloads old
  }
  return old;
}

// ---------------------------------------------------------------- integer intrinsics

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __ffs(unsigned int x) { return __builtin_ffs(static_cast<int>(x)); }
