"""Emulated multi-host clusters on one Linux machine, for network-bound tests of the sync engine.

Each worker runs as its own host in a network namespace; hosts are joined by a bridge in a dedicated
"switch" namespace and every link is shaped with tc (tbf rate, optional netem delay). Per-host
interface byte counters give wire bytes independently of the engine's own accounting. Needs root;
``make_cluster`` falls back to an unshaped ``LoopbackCluster`` (with a warning) where it is missing.
Every run is recorded (``zensync.testbed.runs``), so that leftovers of an owner killed by SIGKILL
(namespaces, workers, temp dirs) are removed by the next start or by ``python -m zensync.testbed cleanup``.

Example::

    from zensync.testbed import make_cluster

    with make_cluster(4, rate="1gbit") as cluster:
        results = cluster.run_workers(argv_for_rank, lambda r: cluster.env_for_torch(r, 29500), timeout_s=120)

CLI: ``python -m zensync.testbed check | cleanup | bench --hosts 4 --rate 1gbit``.
"""

from __future__ import annotations

from zensync.testbed._procs import WorkerError, WorkerResult
from zensync.testbed.cluster import EmulatedCluster
from zensync.testbed.loopback import LoopbackCluster, free_port, make_cluster
from zensync.testbed.netns import available
from zensync.testbed.runs import CleanupReport, cleanup_stale
from zensync.testbed.shaping import parse_rate, parse_time_s

__all__ = [
    "CleanupReport",
    "EmulatedCluster",
    "LoopbackCluster",
    "WorkerError",
    "WorkerResult",
    "available",
    "cleanup_stale",
    "free_port",
    "make_cluster",
    "parse_rate",
    "parse_time_s",
]
