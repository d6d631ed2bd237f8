"""The per-host checkpoint agent: the process that owns the host's shard store across worker restarts.

Workers write their shards straight into the store's shared-memory files (``ShardStore``: one copy,
no serialisation) and read them back after a restart; the memory itself is tmpfs pages, which
outlive any process. What the agent adds is ownership:

- it creates the store under a job-specific directory and exports it to the workers
  (``ZENSYNC_CKPT_ROOT``), so a restarted worker finds its host's shards and a worker of another
  job never reads them;
- it holds an exclusive lock on the directory: a second agent for the same directory fails at
  once with the holder's pid, instead of two jobs pruning each other's versions;
- it lives as long as the job (``zensync launch`` wraps torchrun, whose restarts replace the
  workers but not the agent) and removes the store when the job ends, giving the memory back; a
  host whose agent is gone (the host replaced) starts with an empty store, and its workers'
  ``Checkpointer.restore`` fetches their shards from the peers.

Example::

    with CheckpointAgent("/dev/shm/zensync-job42") as agent:
        subprocess.run([...torchrun...], env={**os.environ, ROOT_ENV: str(agent.root)})
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import time
from types import TracebackType
from typing import IO

from zensync.resilience.checkpointer import ROOT_ENV

__all__ = ["ROOT_ENV", "AgentBusy", "CheckpointAgent", "default_root"]

_LOCK = "agent.lock"
_INFO = "agent.json"


class AgentBusy(RuntimeError):
    """Another live agent holds the store directory."""


def default_root(job_id: str) -> pathlib.Path:
    """The store directory of job ``job_id`` on this host (tmpfs)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)
    return pathlib.Path("/dev/shm") / f"zensync-ckpt-{safe}"


class CheckpointAgent:
    """Owner of one host's store directory (module docstring).

    Args:
        root: The store directory (created).
        keep_store: Leave the shards in place when the agent stops (default: removed, memory freed).
    """

    def __init__(self, root: str | os.PathLike[str], keep_store: bool = False) -> None:
        self.root, self.keep_store = pathlib.Path(root), keep_store
        self._lock: IO[str] | None = None

    def start(self) -> CheckpointAgent:
        """Create and lock the directory; write ``agent.json`` (pid, start time).

        Raises:
            AgentBusy: If a live agent holds it.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / _LOCK, "a+")  # noqa: SIM115 - held open while the agent lives (the flock)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            holder = self.info()
            raise AgentBusy(f"{self.root} is held by another zensync checkpoint agent ({holder}); "
                            f"give this job its own --ckpt-root") from None  # fmt: skip
        self._lock = lock
        (self.root / _INFO).write_text(json.dumps({"pid": os.getpid(), "started": time.time()}))
        return self

    def info(self) -> dict[str, object]:
        """What ``agent.json`` says (empty when unreadable)."""
        try:
            return dict(json.loads((self.root / _INFO).read_text()))
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        """Release the directory; remove the store unless ``keep_store``."""
        if self._lock is None:
            return
        if not self.keep_store:
            shutil.rmtree(self.root, ignore_errors=True)
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None

    def env(self) -> dict[str, str]:
        """The variables a worker needs to find the store."""
        return {ROOT_ENV: str(self.root)}

    def __enter__(self) -> CheckpointAgent:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
