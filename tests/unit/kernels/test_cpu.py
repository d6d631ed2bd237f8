"""Unit tests of the numba CPU kernels: exact equality with the torch reference, edge cases, threads.

Sizes here (up to 3e5 items) cross the parallel thresholds, so from the main thread the parallel
versions run; ``test_threads_take_the_serial_path`` runs the same inputs from worker threads.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.strategies import DENSE_DTYPES, SUM_DTYPES, assert_identical, sparse_tensor
from zensync.kernels import cpu, cpu_codec, cpu_select, dispatch, reference
from zensync.sync.partition import make_partition

_NUM_THREADS = 4


# ---------------------------------------------------------------- API


def test_public_api_matches_reference() -> None:
    """Every dispatched op has exactly one numba implementation, with the reference's signature."""
    expected = set(dispatch.__all__) - {"implementation_for", "reset_dispatch_cache"}
    modules = (cpu, cpu_codec, cpu_select)
    assert sorted(name for module in modules for name in module.__all__) == sorted(expected)
    for module in modules:
        for name in module.__all__:
            assert inspect.signature(getattr(module, name)) == inspect.signature(getattr(reference, name)), name
            assert dispatch._impl(torch.device("cpu"), name) is module, name


def test_every_kernel_has_distinct_parallel_and_serial_builds() -> None:
    """Both builds exist and have their own cache files (numba's cache key ignores `parallel`)."""
    kernels = [k for k in vars(cpu).values() if isinstance(k, cpu._Kernel)]
    assert len(kernels) >= 8
    for kernel in kernels:
        assert kernel.parallel.targetoptions.get("parallel")
        assert not kernel.serial.targetoptions.get("parallel")
        assert kernel.parallel.py_func.__qualname__ != kernel.serial.py_func.__qualname__


def test_docstring_examples() -> None:
    x2d = torch.tensor([[0.0, 0.0], [0.0, 1.0], [math.nan, 0.0]])
    assert_identical(cpu.nonzero_items(x2d), torch.tensor([1, 2]))
    part = make_partition(4, 2, seed=0, hashed=False)
    assert part.range_len == 32
    x2d = torch.tensor([[0.0], [1.0], [0.0], [2.0]])
    assert_identical(cpu.bucket_nonzero(x2d, part), (torch.tensor([1, 3]), torch.tensor([1, 3]), torch.tensor([2, 0])))
    summed = cpu.aggregate(torch.tensor([5, 2, 5]), torch.tensor([[1.0], [2.0], [3.0]]))
    assert_identical(summed, (torch.tensor([2, 5]), torch.tensor([[2.0], [4.0]]), torch.tensor([1, 2])))
    words = cpu.bitmap_encode(torch.tensor([0, 33]), 40)
    assert_identical(words, torch.tensor([1, 2], dtype=torch.int32))
    assert_identical(cpu.bitmap_decode(words, 40), torch.tensor([0, 33]))


# ---------------------------------------------------------------- non-zero detection


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_nonzero_special_values(dtype: torch.dtype) -> None:
    """NaN, +-Inf and subnormals are non-zero; -0.0 and 0.0 are zero; rows need one non-zero element."""
    tiny = torch.finfo(dtype).tiny / 4
    x2d = torch.tensor(
        [[0.0, -0.0], [math.nan, 0.0], [-0.0, math.inf], [-math.inf, -0.0], [tiny, 0.0], [-0.0, -0.0], [0.0, -tiny]],
        dtype=dtype,
    )
    assert_identical(cpu.nonzero_items(x2d), torch.tensor([1, 2, 3, 4, 6]))
    assert_identical(cpu.nonzero_items(x2d), reference.nonzero_items(x2d))
    column = x2d[:, :1].contiguous()
    assert_identical(cpu.nonzero_items(column), reference.nonzero_items(column))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_nonzero_integer_dtypes_use_all_bits(dtype: torch.dtype) -> None:
    """For integers every bit counts: the int8 value -128 is only a sign bit and is non-zero."""
    values = [0, 1, 0, -128, 0, 7] if dtype not in (torch.bool, torch.uint8) else [0, 1, 0, 128, 0, 1]
    x2d = torch.tensor(values).to(dtype).reshape(-1, 1)
    assert_identical(cpu.nonzero_items(x2d), reference.nonzero_items(x2d))


def test_unsupported_dtype_falls_back_to_reference() -> None:
    x2d = torch.tensor([[0j, 0j], [0j, -0.0 + 1j], [0.0 - 0.0j, 0j]], dtype=torch.complex64)
    assert_identical(cpu.nonzero_items(x2d), reference.nonzero_items(x2d))


@pytest.mark.parametrize("shape", [(0, 1), (0, 5), (1, 1), (1, 3), (7, 0), (64, 1), (65, 2)])
def test_nonzero_tiny_and_empty_shapes(shape: tuple[int, int]) -> None:
    for x2d in (torch.zeros(shape), torch.ones(shape)):
        assert_identical(cpu.nonzero_items(x2d), reference.nonzero_items(x2d))


# ---------------------------------------------------------------- bucketing


@pytest.mark.parametrize(
    ("num_items", "item_numel", "dtype"), [(150_000, 1, torch.float32), (60_000, 3, torch.bfloat16)]
)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("num_owners", [1, 9])
@pytest.mark.parametrize("hashed", [True, False])
def test_bucket_nonzero_large(
    num_items: int,
    item_numel: int,
    dtype: torch.dtype,
    density: float,
    num_owners: int,
    hashed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parallel builds with their default chunk sizes (thresholds lowered so these sizes qualify)."""
    monkeypatch.setattr(cpu, "_PARALLEL_MIN_SCAN", 0)
    monkeypatch.setattr(cpu, "_PARALLEL_MIN_HASH", 0)
    x2d = sparse_tensor(num_items, item_numel, dtype, density, seed=num_owners, special_fraction=0.001)
    part = make_partition(num_items, num_owners, seed=11, hashed=hashed)
    assert_identical(cpu.bucket_nonzero(x2d, part), reference.bucket_nonzero(x2d, part))


@pytest.mark.parametrize("owner", [0, 4, 8])
def test_bucket_nonzero_all_in_one_owner(owner: int) -> None:
    """Adversarial skew at scale: the non-zero items are exactly one owner's perm-space range."""
    part = make_partition(150_001, 9, seed=3)
    base, length = part.owner_range(owner)
    x2d = torch.zeros(part.num_items, 1)
    x2d[cpu.unpermute(torch.arange(base, base + length), part)] = 1.0
    items, positions, counts = cpu.bucket_nonzero(x2d, part)
    assert_identical((items, positions, counts), reference.bucket_nonzero(x2d, part))
    assert counts.tolist() == [length if j == owner else 0 for j in range(9)]
    assert_identical(positions.sort().values, torch.arange(length))


def test_bucket_nonzero_rejects_more_items_than_the_partition() -> None:
    with pytest.raises(ValueError, match="num_items"):
        cpu.bucket_nonzero(torch.ones(10, 1), make_partition(9, 2, seed=0))


# ---------------------------------------------------------------- permutation


@pytest.mark.parametrize("num_items", [1, 2, 3, 31, 32, 33, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2**61 + 5])
def test_permute_is_a_bijection_on_small_ranges(num_items: int, seed: int) -> None:
    part = make_partition(num_items, 3, seed=seed)
    items = torch.arange(num_items)
    perm = cpu.permute(items, part)
    assert_identical(perm, reference.permute(items, part))
    assert_identical(perm.sort().values, items)
    assert_identical(cpu.unpermute(perm, part), items)
    assert_identical(cpu.unpermute(items, part), reference.unpermute(items, part))


@pytest.mark.parametrize("num_items", [2**31 - 1, 2**31 + 1, 2**33 + 12_345, 2**62 - 1])
def test_permute_beyond_int32_round_trips(num_items: int) -> None:
    """Huge item spaces (half_bits up to 31): a few indices, no tensor of num_items."""
    part = make_partition(num_items, 7, seed=99)
    generator = torch.Generator().manual_seed(num_items % 2**31)
    edges = torch.tensor([0, 1, 2**31 - 2, num_items // 2, num_items - 2, num_items - 1])
    items = torch.cat([edges, torch.randint(0, num_items, (200,), generator=generator)]).unique()
    perm = cpu.permute(items, part)
    assert_identical(perm, reference.permute(items, part))
    assert bool(((perm >= 0) & (perm < num_items)).all())
    assert perm.unique().numel() == items.numel()
    assert_identical(cpu.unpermute(perm, part), items)
    assert_identical(cpu.permute(cpu.unpermute(items, part), part), items)


def test_permute_identity_and_shape_when_not_hashed() -> None:
    part = make_partition(100, 3, seed=0, hashed=False)
    items = torch.tensor([[5, 7], [99, 0]], dtype=torch.int32)
    assert_identical(cpu.permute(items, part), reference.permute(items, part))
    assert_identical(cpu.unpermute(items, part), items.to(torch.int64))


def test_permute_rejects_items_outside_the_partition() -> None:
    part = make_partition(100, 3, seed=0)
    for bad in ([-1], [100], [3, 2**40]):
        with pytest.raises(ValueError, match="num_items=100"):
            cpu.permute(torch.tensor(bad), part)
        with pytest.raises(ValueError, match="num_items=100"):
            cpu.unpermute(torch.tensor(bad), part)


# ---------------------------------------------------------------- aggregation


def _values(k: int, item_numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over 12 decades, so any change of summation order changes the bits."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 6, max(k, 1), dtype=torch.float64)[torch.randperm(k, generator=generator)]
    return (torch.randn(k, item_numel, generator=generator, dtype=torch.float64) * scale.unsqueeze(1)).to(dtype)


@pytest.mark.parametrize("dtype", SUM_DTYPES)
@pytest.mark.parametrize("item_numel", [1, 3])
@pytest.mark.parametrize("num_distinct", [1, 10, 5_000, None])
def test_aggregate_duplicates_and_unique(dtype: torch.dtype, item_numel: int, num_distinct: int | None) -> None:
    k = 200_000
    generator = torch.Generator().manual_seed(7)
    if num_distinct is None:  # all unique, spread over a range 3x wider than k
        positions = torch.randperm(k, generator=generator) * 3
    else:
        positions = torch.randint(0, num_distinct, (k,), generator=generator) * 1_000_003
    values = _values(k, item_numel, dtype, seed=item_numel)
    assert_identical(cpu.aggregate(positions, values), reference.aggregate(positions, values))


def test_aggregate_huge_positions_allocate_only_order_k() -> None:
    """Positions near 2^62 (and negative ones): any table sized by the position value would not fit."""
    generator = torch.Generator().manual_seed(1)
    positions = torch.randint(2**62 - 2**20, 2**62, (50_000,), generator=generator)
    positions[::7] = -(2**61)
    values = _values(positions.numel(), 2, torch.float32, seed=2)
    assert_identical(cpu.aggregate(positions, values), reference.aggregate(positions, values))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_aggregate_half_dtypes_fall_back_to_reference(dtype: torch.dtype) -> None:
    positions = torch.tensor([3, 1, 3, 3])
    values = torch.tensor([[0.1], [0.2], [0.3], [1000.0]], dtype=dtype)
    assert_identical(cpu.aggregate(positions, values), reference.aggregate(positions, values))


def test_aggregate_empty_and_special_values() -> None:
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))
    assert_identical(cpu.aggregate(*empty), reference.aggregate(*empty))
    positions = torch.tensor([9, 9, 4, 4, 2, 2, 2], dtype=torch.int32)
    values = torch.tensor([[-0.0], [-0.0], [math.nan], [1.0], [math.inf], [-math.inf], [1.0]], dtype=torch.float64)
    assert_identical(cpu.aggregate(positions, values), reference.aggregate(positions, values))


def test_aggregate_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="positions"):
        cpu.aggregate(torch.tensor([1, 2, 3]), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="positions"):
        cpu.aggregate(torch.tensor([1, 2]), torch.zeros(2))


# ---------------------------------------------------------------- bitmaps


@pytest.mark.parametrize("length", [0, 1, 31, 32, 33, 1000, 300_001])
@pytest.mark.parametrize("density", [0.0, 0.01, 1.0])
def test_bitmap_round_trip(length: int, density: float) -> None:
    positions = reference.nonzero_items(sparse_tensor(length, 1, torch.float32, density, seed=length))
    words = cpu.bitmap_encode(positions, length)
    assert_identical(words, reference.bitmap_encode(positions, length))
    assert_identical(cpu.bitmap_decode(words, length), positions)
    for shorter in {0, length // 2, max(0, length - 1)}:
        assert_identical(cpu.bitmap_decode(words, shorter), reference.bitmap_decode(words, shorter))
    assert_identical(cpu.bitmap_decode(words[1:], length), reference.bitmap_decode(words[1:], length))


def test_bitmap_sign_bit_and_duplicates() -> None:
    positions = torch.tensor([31, 31, 63, 0, 95])
    words = cpu.bitmap_encode(positions, 96)
    assert_identical(words, reference.bitmap_encode(positions, 96))
    assert_identical(cpu.bitmap_decode(words, 96), torch.tensor([0, 31, 63, 95]))


def test_bitmap_rejects_bad_positions_and_lengths() -> None:
    with pytest.raises(IndexError, match="outside"):
        cpu.bitmap_encode(torch.tensor([64]), 40)
    with pytest.raises(IndexError, match="outside"):
        cpu.bitmap_encode(torch.tensor([-1]), 40)
    with pytest.raises(ValueError, match="length=-1"):
        cpu.bitmap_decode(torch.zeros(2, dtype=torch.int32), -1)


# ---------------------------------------------------------------- threads


def _run_all(inputs: dict[str, object]) -> tuple[object, ...]:
    x2d, part, positions, values = inputs["x2d"], inputs["part"], inputs["positions"], inputs["values"]
    items = cpu.nonzero_items(x2d)
    words = cpu.bitmap_encode(items, x2d.shape[0])
    return (
        items,
        cpu.bucket_nonzero(x2d, part),
        cpu.permute(items, part),
        cpu.unpermute(items, part),
        cpu.aggregate(positions, values),
        words,
        cpu.bitmap_decode(words, x2d.shape[0]),
    )


def test_threads_take_the_serial_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels called from several threads at once run serial builds and return the main thread's results."""
    num_items = 300_000
    part = make_partition(num_items, 9, seed=5)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, part.range_len, (100_000,), generator=generator)
    inputs = {
        "x2d": sparse_tensor(num_items, 1, torch.float32, 0.05, seed=1),
        "part": part,
        "positions": positions,
        "values": _values(positions.numel(), 2, torch.float32, seed=3),
    }
    picks: list[tuple[bool, bool]] = []
    original_pick = cpu._Kernel.pick

    def spy(self: cpu._Kernel, parallel: bool) -> object:
        picks.append((threading.current_thread() is threading.main_thread(), parallel))
        return original_pick(self, parallel)

    monkeypatch.setattr(cpu._Kernel, "pick", spy)
    expected = _run_all(inputs)
    assert any(main and parallel for main, parallel in picks), "main thread should use the parallel builds"
    results: list[tuple[object, ...] | BaseException] = [RuntimeError("thread did not run")] * _NUM_THREADS
    barrier = threading.Barrier(_NUM_THREADS)

    def work(slot: int) -> None:
        barrier.wait()
        try:
            results[slot] = _run_all(inputs)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread below
            results[slot] = error

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(_NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert_identical(result, expected)
    worker_picks = [parallel for main, parallel in picks if not main]
    assert worker_picks and not any(worker_picks), "worker threads must use the serial builds"


@pytest.fixture
def fresh_dispatch(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``monkeypatch`` with an empty dispatch cache before and after: the test's environment and stubs are
    read afresh, and none of its choices outlive it (the cache is cleared before monkeypatch undoes)."""
    dispatch.reset_dispatch_cache()
    yield monkeypatch
    dispatch.reset_dispatch_cache()


def test_dispatch_routes_by_device_and_falls_back(fresh_dispatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take numba; CUDA tensors take cuda_ext only for its ops and only when it loads;
    ZENSYNC_KERNELS=reference forces the torch definitions everywhere."""
    from zensync.kernels import cuda

    monkeypatch = fresh_dispatch

    assert dispatch.implementation_for(torch.device("cpu"), "topk") == "cpu"
    # Small exact selections run the torch reference on CPU (faster there); the other ops never do.
    assert dispatch.implementation_for(torch.device("cpu"), "topk", 64) == "reference"
    assert dispatch.implementation_for(torch.device("cpu"), "topk", 1 << 15) == "cpu"
    assert dispatch.implementation_for(torch.device("cpu"), "topk", (1 << 15) - 1) == "reference"
    assert dispatch.implementation_for(torch.device("cpu"), "sampled_topk", 64) == "cpu"
    assert dispatch.implementation_for(torch.device("cpu"), "scatter_add", 64) == "cpu"
    monkeypatch.setattr(cuda, "available", lambda: False)
    dispatch.reset_dispatch_cache()
    assert dispatch.implementation_for(torch.device("cuda"), "topk") == "reference"
    monkeypatch.setattr(cuda, "available", lambda: True)
    dispatch.reset_dispatch_cache()
    assert dispatch.implementation_for(torch.device("cuda"), "topk") == "cuda"
    assert dispatch.implementation_for(torch.device("cuda"), "topk", 64) == "cuda"
    assert dispatch._impl(torch.device("cuda"), "scatter_add") is cuda
    assert dispatch.implementation_for(torch.device("cuda"), "aggregate") == "reference"  # no CUDA kernel
    assert dispatch.implementation_for(torch.device("meta"), "topk") == "reference"
    monkeypatch.setenv("ZENSYNC_KERNELS", "reference")
    dispatch.reset_dispatch_cache()
    assert dispatch.implementation_for(torch.device("cpu"), "topk") == "reference"
    assert dispatch.implementation_for(torch.device("cuda"), "topk") == "reference"
    monkeypatch.setenv("ZENSYNC_KERNELS", "fastest")
    dispatch.reset_dispatch_cache()
    with pytest.raises(ValueError, match="ZENSYNC_KERNELS='fastest' is not one of"):
        dispatch.implementation_for(torch.device("cpu"), "topk")


def test_dispatch_resolves_once_and_reset_rereads_the_environment(fresh_dispatch: pytest.MonkeyPatch) -> None:
    """The module behind an (op, device type, size class) is resolved once: later calls neither read
    ZENSYNC_KERNELS nor import, until ``reset_dispatch_cache``."""
    monkeypatch = fresh_dispatch
    cpu_device = torch.device("cpu")
    first = dispatch._impl(cpu_device, "topk", 1 << 20)
    assert first is cpu_select and dispatch._impl(cpu_device, "topk", 1 << 21) is first  # same size class
    assert dispatch._impl(cpu_device, "topk", 64) is reference  # the small class is its own entry
    monkeypatch.setenv("ZENSYNC_KERNELS", "reference")
    assert dispatch._impl(cpu_device, "topk", 1 << 20) is first  # cached: the change is not seen yet
    assert dispatch.implementation_for(cpu_device, "topk") == "cpu"
    dispatch.reset_dispatch_cache()
    assert dispatch._impl(cpu_device, "topk", 1 << 20) is reference
    assert dispatch.topk(torch.tensor([1.0, 3.0, 2.0]), 1).tolist() == [1]
    monkeypatch.setenv("ZENSYNC_KERNELS", "auto")
    dispatch.reset_dispatch_cache()
    assert dispatch._impl(cpu_device, "topk", 1 << 20) is cpu_select
    assert dispatch._resolve.cache_info().currsize == 1


def test_bitmap_positions_beyond_int32() -> None:
    """A range longer than 2**31 (a 268 MB bitmap): positions past int32 encode and decode exactly.
    The torch reference would need a 2**31-element bool tensor, so the expected words are written out."""
    length = 2**31 + 100
    positions = torch.tensor([0, 2**31 - 1, 2**31, 2**31 + 99])
    words = cpu.bitmap_encode(positions, length)
    assert words.numel() == -(-length // 32)
    nonzero = words.nonzero().squeeze(1)
    assert_identical(nonzero, torch.tensor([0, (2**31 - 1) // 32, 2**31 // 32, (2**31 + 99) // 32]))
    assert_identical(words[nonzero], torch.tensor([1, -(2**31), 1, 1 << 3], dtype=torch.int32))
    assert_identical(cpu.bitmap_decode(words, length), positions)
    with pytest.raises(IndexError, match="outside"):
        cpu.bitmap_encode(torch.tensor([length + 32]), length)
