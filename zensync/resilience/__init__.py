"""Resilience: checkpoints kept in memory and replicated to peers in the network's idle time (issue 18).

- ``store``: a host's versioned checkpoint shards in shared memory (``ShardStore``).
- ``memory``: one rank's model, optimizer and engine state saved there and restored (``MemoryCheckpoint``).
- ``placement``: which hosts hold each shard's replicas (Gemini's groups, or a ring).
- ``gate``: the idle windows zensync's hook reports (``IdleGate``).
- ``replicate``: the background thread that copies each new version to peers in those windows.
- ``recover``: the step every rank can restore after a failure, and who serves it.
- ``checkpointer``: the job-level API (``Checkpointer``): save every step, restore from memory, a peer
  or disk, with per-step records.
- ``agent``: the per-host process that owns the store across worker restarts (``zensync launch``).
"""

from zensync.resilience.checkpointer import ROOT_ENV, CheckpointConfig, Checkpointer
from zensync.resilience.gate import IdleGate
from zensync.resilience.memory import MemoryCheckpoint
from zensync.resilience.placement import PLACEMENTS, replica_peers, replica_sources
from zensync.resilience.recover import RecoveryPlan, plan_recovery
from zensync.resilience.replicate import Replicator
from zensync.resilience.store import CorruptShard, ShardInfo, ShardStore

__all__ = [
    "PLACEMENTS",
    "ROOT_ENV",
    "CheckpointConfig",
    "Checkpointer",
    "CorruptShard",
    "IdleGate",
    "MemoryCheckpoint",
    "RecoveryPlan",
    "Replicator",
    "ShardInfo",
    "ShardStore",
    "plan_recovery",
    "replica_peers",
    "replica_sources",
]
