"""The compressed collectives' registry, and CompressedSync coroutines driven by callbacks on a Lane.

The DDP hook runs ``CompressedSync.sync_async`` coroutines one after another on one ``Lane`` per
rank, driven by the completion callbacks of the collectives they await. Here several of them
(PowerSGD with error feedback over allreduce, top-k over alltoall_allgather, fp16, and a two-level
random-k) are submitted back to back, for several parameters and steps, in a world whose ranks see
random completion delays; every rank's outputs, residuals and traffic must equal, bit for bit,
those of the same calls made blocking and in order in a world without delays, and the ranks must
agree. The coroutines may await only non-blocking collectives: the blocking forms are made to
raise on the lane run's transports.
"""

from __future__ import annotations

import random

import pytest
import torch

from zensync import compress
from zensync.compress import collectives
from zensync.compress.collectives import (
    COMPRESSED_SCHEMES,
    CompressedCollective,
    CompressedSync,
    build_collective,
    collective_names,
    hierarchy,
    register_collective,
)
from zensync.transport import SimulatedWorld, TrafficLog
from zensync.transport.handle import Lane

NUM_RANKS, RANKS_PER_NODE = 4, 2
SEED = 20240612
MAX_DELAY_S = 0.003
"""Upper bound of each rank's random delay before a non-blocking collective (SimulatedWorld)."""
LANE_TIMEOUT_S = 60.0
"""Generous: the whole lane run takes well under a second."""
SHAPE = (37, 5)
"""Uneven chunks and shards for 4 ranks and nodes of 2; PowerSGD:2 compresses it ((37 + 5) * 2 < 185)."""
NAMES, STEPS = ("fc.weight", "fc.bias_like"), 3
CASES = (
    ("powersgd:2", "allreduce", True, False),
    ("topk:0.1", "alltoall_allgather", None, False),
    ("fp16", "allreduce", None, False),
    ("randomk:0.3", "allgather", True, True),
)
"""(compressor spec, collective, error_feedback, two-level): powersgd:2 runs with error feedback."""
BLOCKING_FORMS = ("all_reduce", "all_gather", "all_gather_v", "all_to_all_v", "broadcast", "send_recv", "barrier")


def _grad(rank: int, step: int, case: int, param: int) -> torch.Tensor:
    """Integer-valued data, different for every (rank, step, case, parameter)."""
    gen = torch.Generator().manual_seed(((step * 10 + case) * 10 + param) * 100 + rank)
    return torch.randint(-4, 5, SHAPE, generator=gen).float()


def _calls() -> list[tuple[int, int, int]]:
    """(step, case, parameter) of every call, in the order every rank submits them."""
    return [(s, c, p) for s in range(STEPS) for c in range(len(CASES)) for p in range(len(NAMES))]


def _syncs() -> list[CompressedSync]:
    return [CompressedSync(spec, scheme, error_feedback=ef) for spec, scheme, ef, _ in CASES]


def _residuals(syncs: list[CompressedSync]) -> dict[str, torch.Tensor]:
    out = {}
    for i, sync in enumerate(syncs):
        for memory, side in ((sync.worker_memory, "worker"), (sync.server_memory, "server")):
            out |= {f"{i}/{side}/{name}": memory.residual(name) for name in memory.names()}
    return out


def _traffic(log: TrafficLog) -> dict[str, tuple[int, ...]]:
    """Bytes, messages and calls per phase (not the times)."""
    return {
        phase: (p.bytes_sent, p.bytes_recv, p.control_bytes_sent, p.control_bytes_recv, p.messages_sent, p.num_calls)
        for phase, p in log.phases.items()
    }


def _blocking_body(t):  # type: ignore[no-untyped-def]
    """Every call with the blocking ``sync``, in order."""
    levels = hierarchy(t, RANKS_PER_NODE)
    syncs, log = _syncs(), TrafficLog()
    with t.recording(log):
        outs = [
            syncs[c].sync(_grad(t.rank, s, c, p), t, name=NAMES[p], step=s, hierarchy=levels if CASES[c][3] else None)
            for s, c, p in _calls()
        ]
    return outs, _residuals(syncs), _traffic(log)


def _forbid_blocking(transport) -> None:  # type: ignore[no-untyped-def]
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a coroutine on the Lane called a blocking collective")

    for form in BLOCKING_FORMS:
        setattr(transport, form, refuse)


def _lane_body(t):  # type: ignore[no-untyped-def]
    """Every call submitted as a ``sync_async`` coroutine to one Lane, back to back, then drained."""
    levels = hierarchy(t, RANKS_PER_NODE)
    for transport in (t, levels.intra, levels.inter):
        _forbid_blocking(transport)
    syncs, log, lane = _syncs(), TrafficLog(), Lane()
    with t.recording(log):
        tasks = [
            lane.submit(
                syncs[c].sync_async(
                    _grad(t.rank, s, c, p), t, name=NAMES[p], step=s, hierarchy=levels if CASES[c][3] else None
                )
            )
            for s, c, p in _calls()
        ]
        assert lane.drain(LANE_TIMEOUT_S), f"rank {t.rank}: the lane did not drain"
        outs = [task.wait(LANE_TIMEOUT_S) for task in tasks]
    return outs, _residuals(syncs), _traffic(log)


def _random_delay(rank: int) -> float:
    return random.Random(SEED + rank).random() * MAX_DELAY_S


def test_coroutines_on_a_lane_equal_the_blocking_calls_in_order() -> None:
    expected = SimulatedWorld(NUM_RANKS).run(_blocking_body)
    got = SimulatedWorld(NUM_RANKS, delay_s=_random_delay).run(_lane_body)
    calls = _calls()
    for rank, ((outs, residuals, traffic), (ref_outs, ref_residuals, ref_traffic)) in enumerate(
        zip(got, expected, strict=True)
    ):
        for i, (out, ref) in enumerate(zip(outs, ref_outs, strict=True)):
            where = f"rank {rank}, (step, case, parameter) {calls[i]}"
            assert out.dtype == ref.dtype and torch.equal(out, ref), f"{where}: differs from the blocking run"
            assert torch.equal(out, got[0][0][i]), f"{where}: differs from rank 0"
        assert sorted(residuals) == sorted(ref_residuals), f"rank {rank}"
        assert residuals, "no error-feedback state to compare"
        for key, value in residuals.items():
            assert torch.equal(value, ref_residuals[key]), f"rank {rank}: residual {key} differs"
        assert traffic == ref_traffic, f"rank {rank}: traffic differs"


def test_powersgd_warm_start_follows_the_same_sequence_on_the_lane() -> None:
    """PowerSGD's P-then-Q rounds in one coroutine: the warm-start Qs equal the blocking run's."""

    def body(t, on_lane):  # type: ignore[no-untyped-def]
        sync = CompressedSync("powersgd:2", "allreduce", error_feedback=True)
        coros = [
            sync.sync_async(_grad(t.rank, s, 0, p), t, name=NAMES[p], step=s) for s in range(STEPS) for p in range(2)
        ]
        if on_lane:
            lane = Lane()
            tasks = [lane.submit(coro) for coro in coros]
            for task in tasks:
                task.wait(LANE_TIMEOUT_S)
        else:
            for coro in coros:
                t.run(coro)
        return {name: q.clone() for name, q in sync.compressor.warm_starts().items()}

    expected = SimulatedWorld(NUM_RANKS).run(lambda t: body(t, False))
    got = SimulatedWorld(NUM_RANKS, delay_s=_random_delay).run(lambda t: body(t, True))
    for qs, ref in zip(got, expected, strict=True):
        assert sorted(qs) == sorted(NAMES)
        for name, q in qs.items():
            assert torch.equal(q, ref[name]) and torch.equal(q, got[0][name]), name


# -- the registry ------------------------------------------------------------------------------------------------------
def test_registry_holds_every_scheme_in_order() -> None:
    assert COMPRESSED_SCHEMES == ("allreduce", "allgather", "alltoall_allgather", "gather_broadcast")
    assert collective_names() == tuple(sorted(COMPRESSED_SCHEMES))
    for name in COMPRESSED_SCHEMES:
        collective = build_collective(name)
        assert isinstance(collective, CompressedCollective) and collective.name == name
    assert CompressedSync("topk:0.1", "gather_broadcast").collective.name == "gather_broadcast"


def test_a_collective_must_override_one_of_the_reduce_methods() -> None:
    """``_reduce`` and ``_reduce_into`` each default to the other: a collective with neither is refused."""

    class Neither(CompressedCollective):
        name = "neither"

    with pytest.raises(TypeError, match="Neither must override _reduce or _reduce_into"):
        register_collective(Neither)
    assert "neither" not in collective_names()


def test_unknown_collective_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown compressed collective 'ring'") as caught:
        build_collective("ring")
    assert "valid: allgather, allreduce, alltoall_allgather, gather_broadcast" in str(caught.value)


def test_a_name_registers_once() -> None:
    class Again(CompressedCollective):
        name = "allgather"

        async def _reduce(self, x, transport, codec, *, name, step, want_own):  # type: ignore[no-untyped-def]
            raise AssertionError("never run")

    with pytest.raises(ValueError, match="'allgather' registered twice"):
        register_collective(Again)
    assert collective_names() == tuple(sorted(COMPRESSED_SCHEMES))


def test_public_names_are_the_same_objects_in_both_homes() -> None:
    for name in ("COMPRESSED_SCHEMES", "CompressedSync", "Hierarchy", "Scheme", "hierarchy", "build_collective"):
        assert getattr(compress, name) is getattr(collectives, name), name
