"""Bad ``sparse_allreduce`` input on real gloo ranks: every rank raises ValueError, promptly.

Each world size launches once and runs every case in turn; after each bad call the ranks make a
valid call, which must still match ``torch.distributed.all_reduce`` (the group is not left broken).
"""

from __future__ import annotations

import time

import pytest
import torch

import zensync
from tests.distributed._launch import launch, pytest_generate_tests, slow_world, world_size_fixture  # noqa: F401 - class data world_size

ERROR_DEADLINE_S = 20.0
"""A bad call must fail on every rank well inside gloo's 60 s collective timeout; 20 s leaves room
for a loaded CI machine while still catching a rank that waited for a peer's timeout."""


def _bad_call(name: str, rank: int, world_size: int) -> tuple[object, dict]:
    """(tensor, keyword arguments) that rank ``rank`` passes in the bad-input case ``name``."""
    last = world_size - 1
    x = torch.arange(12, dtype=torch.float32) % 3
    kwargs = {}
    if name == "shape_differs":
        x = x[:11] if rank == 0 else x[:10]
    elif name == "shape_differs_empty_rows":
        x = torch.zeros(0, 4) if rank == 0 else x.view(3, 4)
    elif name == "too_many_dims_on_one_rank":
        x = x[:1].view((1,) * 9) if rank == 1 else x
    elif name == "row_granularity_on_1d":
        kwargs["granularity"] = "row"
    elif name == "shape_differs_same_numel":
        x = x if rank == 0 else x.view(3, 4)
    elif name == "dtype_differs":
        x = x.double() if rank == 0 else x
    elif name == "int64_on_one_rank":
        x = x.long() if rank == last else x
    elif name == "int64_on_all_ranks":
        x = x.long()
    elif name == "sparse_coo_on_one_rank":
        x = x.to_sparse() if rank == 1 else x
    elif name == "not_a_tensor_on_one_rank":
        x = x.tolist() if rank == 1 else x
    elif name == "unknown_scheme_on_one_rank":
        kwargs["scheme"] = "zenn" if rank == 1 else "zen"
    elif name == "average_differs":
        kwargs["average"] = rank == 0
    elif name == "granularity_differs":
        x, kwargs["granularity"] = x.view(3, 4), "element" if rank == 0 else "row"
    elif name == "h0_seed_differs":
        kwargs["options"] = zensync.SyncOptions(h0_seed=rank)
    else:
        raise AssertionError(f"unknown bad-input case {name!r}")
    return x, kwargs


BAD_CASES = {
    # name: (words the message must contain, the rank it must name or None)
    "shape_differs": (("shape",), None),
    "shape_differs_same_numel": (("shape",), None),
    "shape_differs_empty_rows": (("shape",), None),
    "too_many_dims_on_one_rank": (("dimensions",), 1),
    "row_granularity_on_1d": (("row", "dimensions"), 0),
    "dtype_differs": (("dtype",), None),
    "int64_on_one_rank": (("int64", "supported"), "last"),
    "int64_on_all_ranks": (("int64", "supported"), 0),
    "sparse_coo_on_one_rank": (("layout", "sparse_coo"), None),
    "not_a_tensor_on_one_rank": (("torch.Tensor",), 1),
    "unknown_scheme_on_one_rank": (("scheme",), 1),
    "average_differs": (("average",), None),
    "granularity_differs": (("granularity",), None),
    "h0_seed_differs": (("h0_seed",), None),
}


def _valid_call(rank: int, world_size: int, group=None) -> dict:
    """A valid zen call after an error: recovered is True when it equals dist.all_reduce."""
    import torch.distributed as dist

    x = torch.zeros(64)
    x[rank :: world_size + 1] = rank + 1
    try:
        out = zensync.sparse_allreduce(x, group=group, scheme="zen")
    except Exception as exc:  # noqa: BLE001 - reported by test_group_usable_after_error
        return {"recovered": False, "recovery_error": f"{type(exc).__name__}: {exc}"}
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    return {"recovered": torch.equal(out, ref)}


def _attempt(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"type": None, "message": "returned normally", "seconds": time.monotonic() - start}


def _bad_input_worker(rank: int, world_size: int, names: list[str]) -> dict[str, dict]:
    import torch.distributed as dist

    records = {}
    broken = None  # once a recovery call fails the ranks may be out of step: run nothing more
    for name in names:
        if broken is not None:
            records[name] = {"type": None, "message": f"not run: group broken after {broken!r}", "recovered": False}
            continue
        x, kwargs = _bad_call(name, rank, world_size)
        records[name] = _attempt(lambda: zensync.sparse_allreduce(x, **kwargs))  # noqa: B023 - called at once
        records[name].update(_valid_call(rank, world_size))
        broken = None if records[name]["recovered"] else name
    # A group this rank is not in: a local error for ranks 1.., a working 1-rank group for rank 0.
    solo = dist.new_group([0])
    x = torch.tensor([0.0, 2.0, 0.0, -1.0])
    if rank == 0:
        outs = {s: zensync.sparse_allreduce(x, group=solo, scheme=s) for s in zensync.SCHEMES}
        records["solo_group"] = {"type": None, "all_equal_input": all(torch.equal(o, x) for o in outs.values())}
    else:
        records["solo_group"] = _attempt(lambda: zensync.sparse_allreduce(x, group=solo))
    records["solo_group"].update(_valid_call(rank, world_size))
    return records


class TestGlooBadInput:
    """Bad arguments on some or all ranks: ValueError everywhere, promptly, and no broken group."""

    world_size = [2, slow_world(4)]

    @pytest.fixture(scope="class")
    @classmethod
    def outcomes(cls, world_size, tmp_path_factory):
        names = list(BAD_CASES)
        return launch(_bad_input_worker, world_size, (names,), tmp_path_factory.mktemp(f"bad{world_size}"))

    @pytest.mark.parametrize("name", list(BAD_CASES))
    def test_every_rank_raises_value_error(self, outcomes, world_size, name):
        words, named_rank = BAD_CASES[name]
        named_rank = world_size - 1 if named_rank == "last" else named_rank
        for rank, records in enumerate(outcomes):
            got = records[name]
            assert got["type"] == "ValueError", f"rank {rank}: {got['type']}: {got['message']}"
            for word in words:
                assert word in got["message"], f"rank {rank}: {word!r} not in {got['message']!r}"
            if named_rank is not None:
                assert f"rank {named_rank}" in got["message"], f"rank {rank}: {got['message']!r}"
            assert got["seconds"] < ERROR_DEADLINE_S, f"rank {rank} took {got['seconds']:.1f} s to raise"

    @pytest.mark.parametrize("name", [*BAD_CASES, "solo_group"])
    def test_group_usable_after_error(self, outcomes, name):
        assert all(records[name]["recovered"] for records in outcomes), [r[name] for r in outcomes]

    def test_group_without_caller(self, outcomes):
        assert outcomes[0]["solo_group"]["all_equal_input"], "rank 0 alone in its group must get its input back"
        for rank, records in enumerate(outcomes[1:], start=1):
            got = records["solo_group"]
            assert got["type"] == "ValueError", f"rank {rank}: {got['type']}: {got['message']}"
            assert "not a member" in got["message"], got["message"]
