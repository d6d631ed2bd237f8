// bucket_nonzero on CUDA: non-zero detection fused into Zen's hierarchical hashing (OSDI'25 §3.2,
// Algorithm 1; reference/zen.md 1.5), then an ordered extraction grouped by owner.
//
// Definition (zensync/kernels/reference.py: bucket_nonzero): item i (row i of x2d) is non-zero when
// any element is non-zero (NaN counts, -0.0 does not); owner = perm(i) / range_len, where perm is
// the partition's keyed Feistel permutation with cycle walking (identity when not hashed), and
// position = perm(i) - owner * range_len. Items come out grouped by owner (owner 0 first); the
// order within an owner is the hash table's slot order, i.e. arbitrary.
//
// Steps:
//   1. Count the non-zero items (one pass, one host sync) and size the table: per owner a parallel
//      region of r1 = max(32, ceil(2 nnz / num_owners)) slots (the paper's r1 = 2|G|d in total) and
//      a serial region of r2 = max(32, r1 / 10) slots; both can be overridden.
//   2. One thread per item: if non-zero, try slots h_1(i) .. h_k(i) of its owner's parallel region
//      (claim the first empty one), else take the next serial slot from the owner's counter.
//   3. Read the counters (host sync). A counter past r1 + r2 means the serial region overflowed and
//      items were dropped: run Step 2 again with a serial region that cannot overflow.
//   4. Extract: ordered compaction of the filled slots; per-owner counts are sums of whole tiles.
#include <torch/library.h>

#include "common.cuh"

namespace zensync_cuda {
namespace {

constexpr int kMaxFeistelKeys = 8;
constexpr uint32_t kFeistelMul1 = 0x2C1B3C6Du;  // reference.FEISTEL_MUL1
constexpr uint32_t kFeistelMul2 = 0x297A2D39u;  // reference.FEISTEL_MUL2

// reference._round in 32-bit unsigned arithmetic: the reference masks every step to 32 bits.
__device__ __forceinline__ uint32_t feistel_round(uint32_t half, uint32_t key, uint32_t mask) {
  uint32_t x = half ^ key;
  x *= kFeistelMul1;
  x ^= x >> 12;
  x *= kFeistelMul2;
  x ^= x >> 15;
  return x & mask;
}

// perm(i) of reference.permute: Feistel rounds over 2 * half_bits bits until the value is below
// num_items. Cycle walking terminates because item < num_items lies on a cycle of the permutation.
struct Permutation {
  int64_t num_items = 0;
  int32_t half_bits = 1;  // 1..31, so both halves fit uint32
  int32_t num_keys = 0;
  uint32_t keys[kMaxFeistelKeys] = {};
  bool hashed = false;

  __device__ __forceinline__ int64_t operator()(int64_t item) const {
    if (!hashed) return item;
    const uint32_t mask = (uint32_t{1} << half_bits) - 1u;
    uint64_t v = static_cast<uint64_t>(item);
    do {
      uint32_t left = static_cast<uint32_t>(v >> half_bits);
      uint32_t right = static_cast<uint32_t>(v) & mask;
      for (int r = 0; r < num_keys; ++r) {
        const uint32_t next_right = left ^ feistel_round(right, keys[r], mask);
        left = right;
        right = next_right;
      }
      v = (static_cast<uint64_t>(left) << half_bits) | right;
    } while (v >= static_cast<uint64_t>(num_items));
    return static_cast<int64_t>(v);
  }
};

// Row i is non-zero when some element has a set bit outside `mask` (the sign bit for floats, so
// -0.0 is zero and NaN non-zero, exactly x != 0; every bit for integers and bool).
template <typename bits_t>
struct NonzeroRow {
  const bits_t* x;
  int64_t item_numel;
  bits_t mask;

  __device__ __forceinline__ int64_t operator()(int64_t row) const {
    const bits_t* p = x + row * item_numel;
    for (int64_t e = 0; e < item_numel; ++e) {
      if ((p[e] & mask) != 0) return 1;
    }
    return 0;
  }
};

// h_j(i): a splitmix64 finalizer of (i, j, seed); any cheap well-mixed function works, the slot
// choice only affects collisions (reference/zen.md 1.5: the second-level hashes may differ by rank).
__device__ __forceinline__ uint64_t slot_hash(int64_t item, int j, uint64_t seed) {
  uint64_t z = static_cast<uint64_t>(item) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(j + 1) * 0xD1B54A32D192ED03ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct TableShape {
  int64_t r1;               // parallel slots per owner
  int64_t slots_per_owner;  // r1 + r2
};

// Step 2. table: num_owners x slots_per_owner slots holding item + 1 (0 = empty); counters[p]
// starts at r1 and hands out serial slots of owner p.
template <typename bits_t>
__global__ void __launch_bounds__(kThreads)
    hash_insert_kernel(NonzeroRow<bits_t> nonzero, int64_t num_rows, Permutation perm, int64_t range_len,
                       TableShape shape, int num_hashes, uint64_t seed, unsigned long long* table,
                       unsigned long long* counters) {
  for (int64_t i = global_thread(); i < num_rows; i += grid_threads()) {
    if (!nonzero(i)) continue;
    const int64_t owner = perm(i) / range_len;
    unsigned long long* region = table + owner * shape.slots_per_owner;
    const unsigned long long tag = static_cast<unsigned long long>(i) + 1ull;
    // The paper writes the slot and re-reads it to detect a concurrent writer. Under the CUDA
    // memory model two plain stores to one slot race (a thread can re-read its own value before
    // another thread overwrites it, and that item is lost); atomicCAS(empty -> tag) is the
    // lock-free form of the same check: exactly one thread claims an empty slot.
    bool placed = false;
    for (int j = 0; j < num_hashes && !placed; ++j) {
      const int64_t slot = static_cast<int64_t>(slot_hash(i, j, seed) % static_cast<uint64_t>(shape.r1));
      placed = atomicCAS(region + slot, 0ull, tag) == 0ull;
    }
    if (!placed) {
      // Serial region: counters hand out distinct slots; past the end the item is dropped here and
      // Step 3 sees the counter beyond slots_per_owner and runs Step 2 again with more room.
      const unsigned long long slot = atomicAdd(counters + owner, 1ull);
      if (slot < static_cast<unsigned long long>(shape.slots_per_owner)) region[slot] = tag;
    }
  }
}

struct FilledSlot {
  const unsigned long long* table;
  __device__ __forceinline__ int64_t operator()(int64_t slot) const { return table[slot] != 0ull ? 1 : 0; }
};

struct SlotWriter {
  const unsigned long long* table;
  int64_t slots_per_owner;
  int64_t range_len;
  Permutation perm;
  int64_t* items;
  int64_t* positions;

  __device__ __forceinline__ void operator()(int64_t slot, int64_t dst) const {
    const int64_t item = static_cast<int64_t>(table[slot]) - 1;
    const int64_t owner = slot / slots_per_owner;
    items[dst] = item;
    positions[dst] = perm(item) - owner * range_len;
  }
};

struct HashArgs {
  Permutation perm;
  int64_t num_owners;
  int64_t range_len;
  int num_hashes;
  uint64_t seed;
};

// Steps 2 and 3 for one table shape; returns the counters on the host (host sync).
template <typename bits_t>
at::Tensor hash_into(const NonzeroRow<bits_t>& nonzero, int64_t num_rows, const HashArgs& args, TableShape shape,
                     at::Tensor& table) {
  const at::TensorOptions options = table.options();
  table = at::zeros({args.num_owners * shape.slots_per_owner}, options);
  at::Tensor counters = at::full({args.num_owners}, shape.r1, options);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  hash_insert_kernel<bits_t><<<grid_stride_blocks(num_rows), kThreads, 0, stream>>>(
      nonzero, num_rows, args.perm, args.range_len, shape, args.num_hashes, args.seed,
      reinterpret_cast<unsigned long long*>(table.data_ptr<int64_t>()),
      reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return counters.cpu();  // host sync
}

template <typename bits_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> bucket(const at::Tensor& x2d, bits_t mask, const HashArgs& args,
                                                      int64_t parallel_slots, int64_t serial_slots) {
  const at::TensorOptions long_options = x2d.options().dtype(at::kLong);
  const int64_t num_rows = x2d.size(0);
  const NonzeroRow<bits_t> nonzero{reinterpret_cast<const bits_t*>(x2d.data_ptr()), x2d.size(1), mask};
  // Step 1
  const TileLayout rows = TileLayout::make(1, num_rows);
  const int64_t nnz = offsets_total(exclusive_offsets(tile_counts(rows, nonzero, long_options)));  // host sync
  if (nnz == 0) {
    return {at::empty({0}, long_options), at::empty({0}, long_options), at::zeros({args.num_owners}, long_options)};
  }
  const int64_t r1 = parallel_slots > 0 ? parallel_slots : std::max<int64_t>(32, ceil_div(2 * nnz, args.num_owners));
  const int64_t r2 = serial_slots > 0 ? serial_slots : std::max<int64_t>(32, r1 / 10);
  // Steps 2 and 3
  at::Tensor table = at::empty({0}, long_options);
  TableShape shape{r1, r1 + r2};
  at::Tensor counters = hash_into(nonzero, num_rows, args, shape, table);
  const int64_t largest_demand = counters.max().item<int64_t>() - r1;  // serial slots the busiest owner asked for
  if (largest_demand > r2) {
    // Which items lose the CAS races in the parallel region depends on timing, so the next run's
    // serial demand may differ from this one. No owner has more than r1 + largest_demand items
    // (at most r1 placed in parallel, the rest asked for serial slots), so that serial region
    // cannot overflow whatever the races.
    shape.slots_per_owner = r1 + r1 + largest_demand;
    counters = hash_into(nonzero, num_rows, args, shape, table);
    TORCH_INTERNAL_ASSERT(counters.max().item<int64_t>() <= shape.slots_per_owner,
                          "bucket_nonzero: the serial region overflowed twice");
  }
  // Step 4
  const TileLayout slots = TileLayout::make(args.num_owners, shape.slots_per_owner);
  const auto* table_ptr = reinterpret_cast<const unsigned long long*>(table.data_ptr<int64_t>());
  const FilledSlot filled{table_ptr};
  const at::Tensor counts_per_tile = tile_counts(slots, filled, long_options);
  const at::Tensor offsets = exclusive_offsets(counts_per_tile);
  const int64_t total = offsets_total(offsets);  // host sync
  TORCH_INTERNAL_ASSERT(total == nnz, "bucket_nonzero: hashed ", total, " of ", nnz, " non-zero items");
  at::Tensor items = at::empty({nnz}, long_options);
  at::Tensor positions = at::empty({nnz}, long_options);
  const SlotWriter writer{table_ptr, shape.slots_per_owner, args.range_len, args.perm,
                          items.data_ptr<int64_t>(), positions.data_ptr<int64_t>()};
  tile_write(slots, filled, writer, offsets);
  at::Tensor counts = counts_per_tile.slice(0, 1).view({args.num_owners, slots.tiles_per_segment}).sum(1);
  return {items, positions, counts};
}

Permutation make_permutation(int64_t num_items, int64_t half_bits, at::IntArrayRef keys, bool hashed) {
  Permutation perm;
  perm.num_items = num_items;
  perm.hashed = hashed;
  if (hashed) {
    TORCH_CHECK_VALUE(half_bits >= 1 && half_bits <= 31, "bucket_nonzero: half_bits=", half_bits,
                      " must be in [1, 31]");
    TORCH_CHECK_VALUE(num_items <= (int64_t{1} << (2 * half_bits)), "bucket_nonzero: num_items=", num_items,
                      " exceeds the permutation's domain of 2^(2 * half_bits)");
    TORCH_CHECK_VALUE(keys.size() <= static_cast<size_t>(kMaxFeistelKeys), "bucket_nonzero: ", keys.size(),
                      " Feistel keys, at most ", kMaxFeistelKeys, " supported");
    perm.half_bits = static_cast<int32_t>(half_bits);
    perm.num_keys = static_cast<int32_t>(keys.size());
    for (size_t r = 0; r < keys.size(); ++r) {
      TORCH_CHECK_VALUE(keys[r] >= 0 && keys[r] <= 0xFFFFFFFFll, "bucket_nonzero: key ", keys[r], " is not 32-bit");
      perm.keys[r] = static_cast<uint32_t>(keys[r]);
    }
  }
  return perm;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bucket_nonzero_cuda(
    const at::Tensor& x2d, int64_t num_items, int64_t num_owners, int64_t range_len, int64_t half_bits,
    at::IntArrayRef keys, bool hashed, int64_t num_hashes, int64_t parallel_slots, int64_t serial_slots,
    int64_t seed) {
  check_cuda(x2d, "bucket_nonzero", "x2d");
  TORCH_CHECK_VALUE(x2d.dim() == 2, "bucket_nonzero: x2d must be 2-D (items, item_numel), got shape ", x2d.sizes());
  TORCH_CHECK_VALUE(num_owners >= 1 && range_len >= 1, "bucket_nonzero: num_owners=", num_owners,
                    " and range_len=", range_len, " must be >= 1");
  TORCH_CHECK_VALUE(num_owners * range_len >= num_items, "bucket_nonzero: num_owners=", num_owners,
                    " times range_len=", range_len, " must cover num_items=", num_items);
  TORCH_CHECK_VALUE(x2d.size(0) <= num_items, "bucket_nonzero: x2d has ", x2d.size(0),
                    " items, more than num_items=", num_items);
  TORCH_CHECK_VALUE(num_hashes >= 1 && num_hashes <= 64, "bucket_nonzero: num_hashes=", num_hashes,
                    " must be in [1, 64]");
  TORCH_CHECK_VALUE(parallel_slots >= 0 && serial_slots >= 0, "bucket_nonzero: parallel_slots=", parallel_slots,
                    " and serial_slots=", serial_slots, " must be >= 0 (0 = automatic)");
  const HashArgs args{make_permutation(num_items, half_bits, keys, hashed), num_owners, range_len,
                      static_cast<int>(num_hashes), static_cast<uint64_t>(seed)};
  const c10::cuda::CUDAGuard guard(x2d.device());
  const at::Tensor x = x2d.contiguous();
  const bool is_float = x.is_floating_point();
  switch (x.scalar_type()) {
    case at::kHalf:
    case at::kBFloat16:
    case at::kShort:
      return bucket<uint16_t>(x, is_float ? 0x7FFF : 0xFFFF, args, parallel_slots, serial_slots);
    case at::kFloat:
    case at::kInt:
      return bucket<uint32_t>(x, is_float ? 0x7FFFFFFFu : 0xFFFFFFFFu, args, parallel_slots, serial_slots);
    case at::kDouble:
    case at::kLong:
      return bucket<uint64_t>(x, is_float ? 0x7FFFFFFFFFFFFFFFull : ~0ull, args, parallel_slots, serial_slots);
    case at::kBool:
    case at::kByte:
    case at::kChar:
      return bucket<uint8_t>(x, 0xFF, args, parallel_slots, serial_slots);
    default:
      break;
  }
  TORCH_CHECK_VALUE(false, "bucket_nonzero: unsupported dtype ", x.scalar_type(),
                    " (float16/bfloat16/float32/float64, bool, int8/16/32/64 or uint8)");
  return {};
}

}  // namespace

TORCH_LIBRARY_IMPL(zensync_cuda, CUDA, m) { m.impl("bucket_nonzero", &bucket_nonzero_cuda); }

}  // namespace zensync_cuda
