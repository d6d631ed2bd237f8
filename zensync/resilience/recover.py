"""Where a restarted job's state comes from: the step every rank can restore, and who serves it.

Every rank reports the complete versions its host's store holds, of its own shard and of the
peers' shards it keeps replicas of (``Report``); every rank computes the same ``RecoveryPlan``
from all reports (``plan_recovery``), so no rank decides apart. Only the versions a plan uses are
then checked against their checksums (``checks``: each rank's own, and the shards it sends); a
version that fails is struck from the reports (``without``) and the plan computed again, on every
rank alike (``Checkpointer.restore``):

- the step restored is the newest step whose shard exists, verified, somewhere for *every* rank
  (memory: "local" when each rank has its own, "peers" when a rank's host was replaced and a peer
  sends it);
- when memory cannot serve every rank, the newest complete checkpoint on disk ("dcp") when one is
  as new (or newer);
- "fresh" when nothing was ever saved anywhere and the caller does not require a checkpoint (a
  restart does: all memory and disk lost is an error, not a fresh start); otherwise every rank
  raises the same FileNotFoundError naming the ranks no one can serve.

``lost_steps`` counts the steps saved somewhere beyond the one restored (the work lost to the
failure, beside the step that was in flight).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

__all__ = ["RecoveryPlan", "checks", "plan_recovery", "without"]

Source = Literal["local", "peers", "dcp", "fresh"]

Report = dict[str, Any]
"""One rank's ``{"have": {"<rank>": [steps]}}``, as JSON."""


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """What every rank restores, and from where."""

    source: Source
    step: int | None
    """The step restored (None: a fresh start)."""
    senders: dict[int, int] = dataclasses.field(default_factory=dict)
    """Rank whose shard a peer sends -> that peer ("peers" only)."""
    lost_steps: int = 0
    """Steps saved somewhere (any rank, any store) after ``step``."""


def plan_recovery(reports: list[Report], dcp_steps: list[int], required: bool = False) -> RecoveryPlan:
    """The plan of the module docstring from every rank's report and the complete checkpoints on disk
    (``required``: a fresh start is an error).

    Raises:
        FileNotFoundError: If some rank's state is nowhere (memory or disk) while others' are.
    """
    n = len(reports)
    available: list[dict[int, int]] = [{} for _ in range(n)]  # rank -> {step: lowest holder}
    own: list[set[int]] = [set() for _ in range(n)]  # rank -> the steps its own host holds
    for holder in range(n):
        for key, steps in reports[holder]["have"].items():
            rank = int(key)
            if not 0 <= rank < n:  # a replica of a rank of another (larger) job left in a store
                continue
            for step in steps:
                available[rank].setdefault(int(step), holder)
                if rank == holder:
                    own[rank].add(int(step))
    seen = max((s for held in available for s in held), default=None)
    common = set(available[0]).intersection(*available[1:]) if n else set()
    memory = max(common, default=None)
    disk = max(dcp_steps, default=None)
    if memory is not None and (disk is None or memory >= disk):
        senders = {r: available[r][memory] for r in range(n) if memory not in own[r]}
        source: Source = "peers" if senders else "local"
        return RecoveryPlan(source, memory, senders, max(0, (seen or memory) - memory))
    if disk is not None:
        return RecoveryPlan("dcp", disk, {}, max(0, (seen or disk) - disk))
    if seen is None and not required:
        return RecoveryPlan("fresh", None)
    missing = [r for r in range(n) if not available[r]]
    partial = [r for r in range(n) if r not in missing]
    raise FileNotFoundError(
        f"no step's checkpoint is held for every rank: ranks {missing or partial} have "
        f"{'none' if missing else 'no step in common with the others'} in any host's memory, and no "
        f"torch.distributed.checkpoint on disk is given (dcp_dir) or complete"
    )


def checks(plan: RecoveryPlan, rank: int) -> list[int]:
    """The ranks whose version of ``plan.step`` this ``rank``'s host must find intact before the plan
    holds: its own (unless a peer sends it) and the shards it sends; none for a disk or fresh plan."""
    if plan.step is None or plan.source == "dcp":
        return []
    return ([] if rank in plan.senders else [rank]) + sorted(r for r, holder in plan.senders.items() if holder == rank)


def without(reports: list[Report], failed: set[tuple[int, int, int]]) -> list[Report]:
    """``reports`` less the versions found corrupt: (holder, rank, step) each."""
    if not failed:
        return reports
    out = []
    for holder, report in enumerate(reports):
        have = {key: [s for s in steps if (holder, int(key), int(s)) not in failed]
                for key, steps in report["have"].items()}  # fmt: skip
        out.append({**report, "have": have})
    return out
