"""Resilience: checkpoints kept in memory (issue 18).

- ``store``: a host's versioned checkpoint shards in shared memory (``ShardStore``).
- ``memory``: one rank's model, optimizer and engine state saved there every step and restored
  after a restart (``MemoryCheckpoint``).
- ``replicate``: each rank's newest shard copied to peers' stores, a replaced host's fetched back.
"""

from zensync.resilience.memory import MemoryCheckpoint
from zensync.resilience.replicate import fetch, replicate, ring_peers
from zensync.resilience.store import CorruptShard, ShardInfo, ShardStore

__all__ = ["CorruptShard", "MemoryCheckpoint", "ShardInfo", "ShardStore", "fetch", "replicate", "ring_peers"]
