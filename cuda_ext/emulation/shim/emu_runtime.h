// CPU emulation of the CUDA subset that cuda_ext/csrc uses. cuda_ext/emulation/build.py includes it
// first in every rewritten .cu file; its docstring says what is emulated faithfully and what is not.
// Summary of the execution model:
//
//   * a launch (build.py rewrites k<<<grid, block, smem, stream>>>(args) into emu::launch) copies the
//     arguments once on the launching thread, then runs EMU_RESIDENT_BLOCKS groups of OS threads (from
//     a pool kept between launches), one OS thread per CUDA thread of a block. The groups run
//     concurrently, like blocks resident on different SMs: group g plays blocks g, g + R, g + 2R, ...
//     (R = the groups), one after another, thread t of the group playing threadIdx.x == t; a group
//     starts its next block when every thread of it left the last one;
//   * __syncthreads is a real barrier over the block's threads, __shfl_up_sync a real exchange
//     between the 32 threads of a warp (through a per-warp barrier);
//   * atomics are std::atomic_ref operations with memory_order_relaxed, as CUDA's atomic functions
//     order nothing but themselves: under ThreadSanitizer (build.py's "tsan" variant), data passed
//     between threads through an atomic without a barrier is reported as the race it is on a GPU;
//   * __shared__ arrays (build.py rewrites each declaration into emu::shared<T[N], id>()) live in the
//     running block's state: one copy per block, fresh for every block, and filled with 0xA5 bytes at
//     allocation, so a kernel that reads shared memory before writing it reads garbage, as on a GPU;
//   * at the end of each block every thread must have passed the same number of __syncthreads, and
//     every lane of a warp the same number of shuffles, or the launch throws (CUDA leaves such
//     divergence undefined); a thread that returns stops counting at the block and warp barriers,
//     so a divergent kernel is reported instead of deadlocking the others.
//
// Anything outside this subset (other intrinsics, dynamic shared memory, 2-D/3-D launches) fails to
// compile or throws std::runtime_error at launch: extend this file, do not work around it.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
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
// __shared__ declarations are rewritten by build.py (see emu::shared); one left over fails to compile.
#define __shared__ __shared___is_rewritten_by_build_py

#ifndef EMU_RESIDENT_BLOCKS
#define EMU_RESIDENT_BLOCKS 2  // blocks that run at once (build.py passes each variant's value)
#endif

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT
};
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
constexpr int warpSize = 32;

inline thread_local dim3 threadIdx;  // per CUDA thread (each is an OS thread)
inline thread_local dim3 blockIdx;
inline dim3 blockDim;  // per launch; launches are serialized (emu::launch_mutex)
inline dim3 gridDim;

namespace emu {

constexpr unsigned int kWarpSize = 32;
constexpr unsigned int kMaxBlockThreads = 1024;        // CUDA's limit on threads per block
constexpr unsigned int kMaxGridX = 0x7FFFFFFFu;        // CUDA's limit on gridDim.x
constexpr unsigned int kFullMask = 0xFFFFFFFFu;
constexpr int kMaxSharedArrays = 16;                   // __shared__ declarations in the extension
constexpr unsigned char kSharedPoison = 0xA5;          // what shared memory holds before it is written
static_assert(EMU_RESIDENT_BLOCKS >= 1, "EMU_RESIDENT_BLOCKS must be at least 1");

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
  // Shared memory: one lazily made, poisoned array per __shared__ declaration (index = its id).
  std::atomic<unsigned char*> shared[kMaxSharedArrays] = {};
  std::unique_ptr<unsigned char[]> shared_storage[kMaxSharedArrays];
  std::mutex shared_mutex;
};

// What the current OS thread (one CUDA thread) needs inside device code.
struct ThreadState {
  Block* block = nullptr;
  Warp* warp = nullptr;
  long syncs = 0;     // __syncthreads calls in the current block
  long shuffles = 0;  // shuffles in the current block
};
inline thread_local ThreadState tl;

// One launch at a time in the process: blockDim and gridDim are global (inline: one copy for every
// translation unit of the extension).
inline std::mutex launch_mutex;

// ThreadSanitizer hooks (build.py's "tsan" variant defines __SANITIZE_THREAD__): the pool below hides
// its own synchronization from the sanitizer and declares only the orderings a launch really makes.
#if defined(__SANITIZE_THREAD__)
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
extern "C" void AnnotateIgnoreSyncBegin(const char* file, int line);
extern "C" void AnnotateIgnoreSyncEnd(const char* file, int line);
extern "C" void __tsan_acquire(void* address);
extern "C" void __tsan_release(void* address);
struct Unobserved {  // while it lives, the sanitizer sees no access and no synchronization of this thread
  Unobserved() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
  }
  ~Unobserved() {
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
};
inline void happens_before(void* token) { __tsan_release(token); }
inline void happens_after(void* token) { __tsan_acquire(token); }
#else
struct Unobserved {};
inline void happens_before(void*) {}
inline void happens_after(void*) {}
#endif

// The OS threads that play CUDA threads, kept between launches: starting and joining a few hundred
// threads per launch cost 8 ms here (100 ms under ThreadSanitizer), more than most kernels. run(n, job)
// runs job(0) ... job(n - 1) at once, each on its own thread, and returns when all have returned.
// Callers hold launch_mutex. Never destroyed: the threads wait on their condition variable until the
// process exits.
//
// Orderings, as a kernel launch makes them: everything the caller did before run() happens before
// every job, and every job before run() returns; the jobs of one run are NOT ordered with each
// other. The pool's own mutex would order them whenever a thread wakes after another finished (a
// late thread's lock follows the early one's unlock), which would hide races between blocks from
// ThreadSanitizer. So its bookkeeping is Unobserved, and the two orderings above are declared on
// start_token_ and done_token_ instead.
class ThreadPool {
 public:
  template <class Job>
  void run(unsigned int n, Job& job) {
    happens_before(&start_token_);
    {
      const Unobserved unobserved;
      std::unique_lock<std::mutex> lock(mutex_);
      // A new thread starts from the current generation, so it takes part in the one announced below.
      while (workers_ < n) std::thread(&ThreadPool::work, this, workers_++, generation_).detach();
      job_ = [&job](unsigned int i) { job(i); };
      active_ = n;
      remaining_ = n;
      ++generation_;
      start_.notify_all();
      done_.wait(lock, [this] { return remaining_ == 0; });
      job_ = nullptr;
    }
    happens_after(&done_token_);
  }

 private:
  void work(unsigned int index, unsigned long long seen) {
    for (;;) {
      std::function<void(unsigned int)> job;
      {
        const Unobserved unobserved;
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return generation_ != seen && index < active_; });
        seen = generation_;
        job = job_;
      }
      happens_after(&start_token_);
      job(index);
      happens_before(&done_token_);
      {
        const Unobserved unobserved;
        const std::lock_guard<std::mutex> lock(mutex_);
        job = nullptr;
        if (--remaining_ == 0) done_.notify_one();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::function<void(unsigned int)> job_;
  unsigned int workers_ = 0, active_ = 0, remaining_ = 0;
  unsigned long long generation_ = 0;
  char start_token_ = 0, done_token_ = 0;  // addresses for the declared orderings (see above)
};
inline ThreadPool& thread_pool() {
  static ThreadPool* pool = new ThreadPool;  // NOLINT: deliberately never destroyed (see above)
  return *pool;
}

// The running block's copy of the __shared__ array with this id (build.py numbers the declarations).
// The first thread of the block to reach the declaration makes it; the others wait for it.
template <class Array, int Id>
Array& shared() {
  static_assert(Id >= 0 && Id < kMaxSharedArrays, "raise kMaxSharedArrays");
  static_assert(std::is_trivially_copyable_v<Array>, "__shared__ holds trivially copyable data");
  Block& block = *tl.block;
  unsigned char* bytes = block.shared[Id].load(std::memory_order_acquire);
  if (bytes == nullptr) {
    const std::lock_guard<std::mutex> guard(block.shared_mutex);
    bytes = block.shared[Id].load(std::memory_order_relaxed);
    if (bytes == nullptr) {
      block.shared_storage[Id] = std::make_unique<unsigned char[]>(sizeof(Array));
      bytes = block.shared_storage[Id].get();
      std::memset(bytes, kSharedPoison, sizeof(Array));
      block.shared[Id].store(bytes, std::memory_order_release);
    }
  }
  return *std::launder(reinterpret_cast<Array*>(bytes));
}

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
  const unsigned int groups = std::min<unsigned int>(EMU_RESIDENT_BLOCKS, grid.x);

  std::atomic<bool> failed{false};  // device code threw: skip the remaining work
  std::exception_ptr thrown;
  std::string count_error;  // the first barrier/shuffle count mismatch, of any group
  std::mutex report_mutex;  // guards thrown and count_error

  // Step 1: per group, the running block's state and the hand-over between its blocks (next_block
  // runs once all the group's threads are done with a block, before any starts the next).
  struct Group {
    explicit Group(unsigned int threads)
        : current(std::make_unique<Block>(threads)), syncs(threads), shuffles(threads) {}
    std::unique_ptr<Block> current;
    std::vector<long> syncs, shuffles;
  };
  std::vector<std::unique_ptr<Group>> group_state;
  for (unsigned int g = 0; g < groups; ++g) group_state.push_back(std::make_unique<Group>(threads));
  auto next_block_of = [&](Group& group) {
    return [&group, &count_error, &report_mutex, threads]() noexcept {
      const char* error = nullptr;
      for (unsigned int t = 0; t < threads && error == nullptr; ++t) {
        if (group.syncs[t] != group.syncs[0]) error = "__syncthreads count differs within a block";
        if (group.shuffles[t] != group.shuffles[t - t % kWarpSize]) error = "shuffle count differs within a warp";
      }
      if (error != nullptr) {
        const std::lock_guard<std::mutex> guard(report_mutex);
        if (count_error.empty()) count_error = error;
      }
      group.current = std::make_unique<Block>(threads);
    };
  };
  using NextBlock = decltype(next_block_of(*group_state[0]));
  std::vector<std::unique_ptr<std::barrier<NextBlock>>> between_blocks;
  for (unsigned int g = 0; g < groups; ++g) {
    between_blocks.push_back(std::make_unique<std::barrier<NextBlock>>(threads, next_block_of(*group_state[g])));
  }
  auto stopped = [&]() {
    if (failed.load(std::memory_order_acquire)) return true;
    const std::lock_guard<std::mutex> guard(report_mutex);
    return !count_error.empty();
  };

  // Step 2: thread t of group g plays threadIdx.x == t in blocks g, g + groups, g + 2 groups, ...
  auto run_thread = [&](unsigned int g, unsigned int t) {
    Group& group = *group_state[g];
    for (unsigned int b = g; b < grid.x; b += groups) {
      Block& blk = *group.current;  // made by next_block, before the barrier released this thread
      threadIdx = dim3{t};
      blockIdx = dim3{b};
      tl = ThreadState{&blk, blk.warps[t / kWarpSize].get(), 0, 0};
      if (!stopped()) {
        try {
          kernel(args...);
        } catch (...) {
          const std::lock_guard<std::mutex> guard(report_mutex);
          if (!thrown) thrown = std::current_exception();
          failed.store(true, std::memory_order_release);
        }
      }
      group.syncs[t] = tl.syncs;
      group.shuffles[t] = tl.shuffles;
      tl.warp->barrier.arrive_and_drop();  // an exited thread no longer holds its warp
      blk.barrier.arrive_and_drop();       // nor its block
      between_blocks[g]->arrive_and_wait();
    }
    tl = ThreadState{};
  };
  auto job = [&](unsigned int i) { run_thread(i / threads, i % threads); };
  thread_pool().run(groups * threads, job);

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
// Relaxed, as CUDA's: an atomic orders nothing but itself (see the header comment).

inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected, unsigned long long desired) {
  std::atomic_ref<unsigned long long>(*p).compare_exchange_strong(expected, desired, std::memory_order_relaxed);
  return expected;  // the old value, whether or not the swap happened
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v, std::memory_order_relaxed);
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_add(v, std::memory_order_relaxed);
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_or(v, std::memory_order_relaxed);
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long> a(*p);
  unsigned long long old = a.load(std::memory_order_relaxed);
  while (v < old && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {  // a failed exchange reloads old
  }
  return old;
}

// ---------------------------------------------------------------- integer intrinsics

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __ffs(unsigned int x) { return __builtin_ffs(static_cast<int>(x)); }
