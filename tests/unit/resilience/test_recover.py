"""zensync.resilience.recover.plan_recovery: exact plans for each source (every rank's own memory, a peer's replica
for a replaced host, disk when memory cannot serve every rank or is older, a fresh start when nothing was saved) and
the error naming the ranks no one can serve; for random holdings, the step is the newest held for every rank and each
sender really holds the shard it sends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience import RecoveryPlan, plan_recovery
from zensync.resilience.recover import checks, without


def _reports(*holdings: dict[int, list[int]]) -> list[dict]:
    """One report per rank, from {rank whose shard is held: verified steps}."""
    return [{"have": {str(rank): steps for rank, steps in held.items()}} for held in holdings]


def test_every_rank_restores_its_own_newest_common_step() -> None:
    reports = _reports({0: [3, 4], 1: [3]}, {1: [3, 4], 0: [3]})
    assert plan_recovery(reports, []) == RecoveryPlan("local", 4, {}, 0)
    ahead = _reports({0: [4, 5]}, {1: [3, 4]}, {2: [4]})  # rank 0 saved step 5 before the failure
    assert plan_recovery(ahead, []) == RecoveryPlan("local", 4, {}, 1)
    assert plan_recovery(_reports({0: [0]}, {1: [0]}), []) == RecoveryPlan("local", 0, {}, 0)


def test_a_replaced_hosts_shard_comes_from_a_peer() -> None:
    # ring m=1 over 4 hosts: host h keeps host h-1's shard; host 2 was replaced, its shard is on host 3
    reports = _reports({0: [6, 7], 3: [6, 7]}, {1: [6, 7], 0: [6, 7]}, {}, {3: [6, 7], 2: [6, 7]})
    assert plan_recovery(reports, []) == RecoveryPlan("peers", 7, {2: 3}, 0)
    # the replica holds only step 6: everyone goes back to 6, and step 7 is lost
    reports[3]["have"]["2"] = [6]
    assert plan_recovery(reports, [5]) == RecoveryPlan("peers", 6, {2: 3}, 1)


def test_the_lowest_numbered_holder_sends() -> None:
    # rank 1 kept only step 2 of its own; ranks 2 and 3 both hold its step 3, and the lower one sends
    reports = _reports({0: [2, 3]}, {1: [2]}, {2: [2, 3], 1: [3]}, {1: [2, 3], 3: [2, 3]})
    assert plan_recovery(reports, []) == RecoveryPlan("peers", 3, {1: 2}, 0)
    replaced = _reports({0: [3], 1: [3]}, {}, {2: [3], 1: [3]}, {3: [3]})
    assert plan_recovery(replaced, []) == RecoveryPlan("peers", 3, {1: 0}, 0)


def test_disk_serves_when_memory_cannot_or_is_older() -> None:
    lost_host = _reports({0: [8, 9]}, {})  # rank 1's shard is nowhere in memory
    assert plan_recovery(lost_host, [4, 8, 6]) == RecoveryPlan("dcp", 8, {}, 1)
    older = _reports({0: [2, 3]}, {1: [3]})
    assert plan_recovery(older, [5]) == RecoveryPlan("dcp", 5, {}, 0)  # disk newer than memory's step 3
    assert plan_recovery(older, [3]) == RecoveryPlan("local", 3, {}, 0)  # a tie: memory wins
    assert plan_recovery(older, [1, 2]) == RecoveryPlan("local", 3, {}, 0)
    assert plan_recovery(_reports({}, {}), [7]) == RecoveryPlan("dcp", 7, {}, 0)  # every host replaced


def test_nothing_saved_anywhere_is_a_fresh_start_unless_required() -> None:
    assert plan_recovery(_reports({}, {}, {}), []) == RecoveryPlan("fresh", None, {}, 0)
    assert plan_recovery([], []) == RecoveryPlan("fresh", None)
    with pytest.raises(FileNotFoundError, match=r"ranks \[0, 1\] have none"):
        plan_recovery(_reports({}, {}), [], required=True)


def test_a_rank_no_one_can_serve_is_named() -> None:
    with pytest.raises(FileNotFoundError, match=r"ranks \[1, 3\] have none in any host's memory"):
        plan_recovery(_reports({0: [5], 2: [5]}, {}, {2: [5], 0: [5]}, {}), [])
    with pytest.raises(FileNotFoundError, match=r"ranks \[0, 1\] have no step in common"):
        plan_recovery(_reports({0: [1, 2]}, {1: [3]}), [])


@st.composite
def holdings(draw) -> tuple[list[dict[int, list[int]]], list[int]]:
    """Each rank's own versions (or a replaced host: nothing) and random replicas of other ranks' versions."""
    n = draw(st.integers(1, 6))
    steps = st.lists(st.integers(0, 6), unique=True, max_size=4)
    held: list[dict[int, list[int]]] = []
    for rank in range(n):
        if draw(st.integers(0, 5)) == 0:
            held.append({})  # a replaced host
            continue
        mine = {rank: sorted(draw(steps))}
        for other in draw(st.lists(st.integers(0, n - 1), unique=True, max_size=2)):
            mine.setdefault(other, sorted(draw(steps)))
        held.append(mine)
    return held, draw(st.lists(st.integers(0, 6), max_size=3))


@settings(max_examples=300, deadline=None)
@given(case=holdings())
def test_the_plan_is_the_newest_step_served_for_every_rank(case: tuple[list[dict[int, list[int]]], list[int]]) -> None:
    held, dcp = case
    n = len(held)
    holders = [{s for h in held for s in h.get(r, [])} for r in range(n)]  # rank -> steps someone holds
    common = set.intersection(*holders)
    seen = max(set.union(*holders), default=None)
    try:
        plan = plan_recovery(_reports(*held), dcp)
    except FileNotFoundError as exc:
        assert not common and not dcp and seen is not None
        missing = [r for r in range(n) if not holders[r]]
        assert str(missing or list(range(n))) in str(exc)
        return
    if plan.source in ("local", "peers"):
        assert plan.step in common and plan.step == max(common)  # no newer step is held for every rank
        assert not dcp or plan.step >= max(dcp)
        assert (plan.source == "peers") == bool(plan.senders)
        for rank in range(n):
            if rank in plan.senders:
                sender = plan.senders[rank]
                assert sender != rank and plan.step in held[sender].get(rank, [])
                assert sender == min(h for h in range(n) if plan.step in held[h].get(rank, []))
            else:
                assert plan.step in held[rank].get(rank, [])  # it restores its own shard
        assert plan.lost_steps == seen - plan.step
    elif plan.source == "dcp":
        assert plan.step == max(dcp) and (not common or max(common) < plan.step) and plan.senders == {}
        assert plan.lost_steps == max(0, (seen if seen is not None else plan.step) - plan.step)
    else:
        assert plan == RecoveryPlan("fresh", None) and seen is None and not dcp


def test_replicas_of_ranks_outside_this_world_are_ignored() -> None:
    # a store keeps replicas of a larger earlier job's rank 5 (and a stray "-1"): they serve no one here
    plan = plan_recovery([{"have": {"0": [3], "5": [3], "-1": [3]}}, {"have": {"1": [3]}}], [])
    assert plan == RecoveryPlan("local", 3, {}, 0)
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\]"):
        plan_recovery([{"have": {"0": [3], "-1": [3]}}, {"have": {}}], [])


def test_each_host_checks_the_versions_it_serves() -> None:
    """``checks``: a rank checks its own version of the plan's step unless a peer sends it, and the
    shards it sends; nothing for a plan from disk or a fresh start."""
    peers = RecoveryPlan("peers", 7, {2: 3, 0: 3}, 0)
    assert [checks(peers, r) for r in range(4)] == [[], [1], [], [3, 0, 2]]
    assert checks(RecoveryPlan("local", 4, {}, 0), 2) == [2]
    assert checks(RecoveryPlan("dcp", 4), 0) == [] and checks(RecoveryPlan("fresh", None), 0) == []


def test_a_corrupt_version_struck_from_the_reports_moves_the_plan() -> None:
    """Rank 1's own step 4 found corrupt: its replica on host 0 serves it; that one corrupt too:
    every rank goes back to step 3."""
    reports = _reports({0: [3, 4], 1: [3, 4]}, {1: [3, 4], 0: [3, 4]})
    assert plan_recovery(without(reports, {(1, 1, 4)}), []) == RecoveryPlan("peers", 4, {1: 0}, 0)
    assert plan_recovery(without(reports, {(1, 1, 4), (0, 1, 4)}), []) == RecoveryPlan("local", 3, {}, 1)
    assert without(reports, set()) is reports and reports[1]["have"]["1"] == [3, 4]  # the input is kept
