"""Resilience: checkpoints kept in memory (issue 18). ``store``: a host's versioned shards in shared memory."""

from zensync.resilience.store import CorruptShard, ShardInfo, ShardStore

__all__ = ["CorruptShard", "ShardInfo", "ShardStore"]
