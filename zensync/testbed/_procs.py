"""Process handling shared by both clusters: start one worker per host, wait under a deadline, kill.

``ClusterBase`` holds everything that does not depend on where a host lives: the ``run_workers``
loop, tracking and killing spawned process groups, temp dirs that live as long as the run, the run's
record (``zensync.testbed.runs``: what a later process removes if this one is SIGKILLed) and the
torch.distributed environment. Subclasses say how to start a process on host i (``popen``) and what
its address and interface are.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from zensync.testbed import runs

__all__ = ["ClusterBase", "WorkerError", "WorkerResult"]

logger = logging.getLogger(__name__)

PEER_GRACE_S = 5.0
"""After one worker fails, how long its peers get to finish before they are killed (a peer of a
dead rank usually hangs in a collective)."""
STDERR_TAIL_CHARS = 2000
"""How much of each failing rank's stderr the error message quotes."""
POLL_S = 0.05
"""Seconds between two looks at the workers in ``run_workers``."""


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerResult:
    """What one worker process did (a ``subprocess.CompletedProcess`` with its rank and wall time)."""

    rank: int
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


class WorkerError(RuntimeError):
    """Some workers failed or timed out; the message holds each failing rank's stderr tail."""

    def __init__(self, message: str, results: list[WorkerResult]) -> None:
        super().__init__(message)
        self.results = results


class ClusterBase(abc.ABC):
    """Process bookkeeping common to ``EmulatedCluster`` and ``LoopbackCluster``."""

    interface: str = "lo"
    """Interface name gloo binds to on every host (GLOO_SOCKET_IFNAME)."""

    def __init__(self, num_hosts: int) -> None:
        self.num_hosts = num_hosts
        self._procs: list[subprocess.Popen[Any]] = []
        self._record: runs.RunRecord | None = None

    @property
    @abc.abstractmethod
    def run_id(self) -> str:
        """Unique name of this run (``<prefix>-<pid>``): its record's name in ``runs.state_dir()``."""

    def _start_record(
        self, namespaces: Sequence[str] = (), links: Sequence[tuple[str, str, str]] = ()
    ) -> runs.RunRecord:
        """Remove the leftovers of dead runs, then record this one (before it creates anything)."""
        if self._record is None:
            report = runs.cleanup_stale()
            if report:
                logger.warning("leftovers of dead zensync runs found at start: %s", report.summary())
            self._record = runs.RunRecord(self.run_id, namespaces=namespaces, links=links)
        return self._record

    def _close_record(self) -> None:
        """Delete the record (call once everything it names is gone)."""
        if self._record is not None:
            self._record.close()
            self._record = None

    @contextlib.contextmanager
    def temp_dir(self, prefix: str = "zensync-") -> Iterator[pathlib.Path]:
        """A temp dir for the duration of the block, recorded with the run so that it does not outlive a
        SIGKILLed owner (``runs.cleanup_stale`` removes it). ``prefix`` must start with 'zensync-'."""
        if not prefix.startswith(runs.TEMP_DIR_PREFIX):
            raise ValueError(f"prefix={prefix!r} must start with {runs.TEMP_DIR_PREFIX!r} (cleanup removes only those)")
        record = self._start_record()
        path = tempfile.mkdtemp(prefix=prefix)
        try:
            record.add_temp_dir(path)
            yield pathlib.Path(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
            if self._record is not None:
                self._record.forget_temp_dir(path)

    @abc.abstractmethod
    def host_ip(self, i: int) -> str:
        """IPv4 address of host ``i``."""

    @abc.abstractmethod
    def _wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``i``."""

    @abc.abstractmethod
    def counters(self) -> list[tuple[int, int]] | None:
        """(tx_bytes, rx_bytes) of each host's interface, or None where the cluster cannot see them."""

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.num_hosts:
            raise ValueError(f"host index {i} out of range: this cluster has num_hosts={self.num_hosts}")

    def popen(
        self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` with the parent's environment plus ``env``.

        The process gets its own session (process group) so teardown can kill it with its children,
        and is added to the run's record. Keyword arguments go to ``subprocess.Popen``.
        """
        self._check_host(i)
        full_env = {**os.environ, **(env or {})}
        kw.setdefault("start_new_session", True)
        wrapped = self._wrap(i, argv)
        record = self._start_record()
        proc = subprocess.Popen(wrapped, env=full_env, **kw)
        self._procs.append(proc)
        record.add_worker(proc.pid)
        return proc

    def command_for(self, i: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``i``, for a launcher that starts it itself
        (mpiexec's MPMD line: experiments/zen_mpi_cluster.py); ``popen`` starts and records one."""
        self._check_host(i)
        return self._wrap(i, argv)

    def env_for_torch(self, i: int, master_port: int, ranks_per_host: int = 1) -> dict[str, str]:
        """torch.distributed env:// variables for rank ``i`` (``ranks_per_host`` ranks per host,
        consecutive ranks on the same host, master on host 0)."""
        self._check_host(i // ranks_per_host)
        return {
            "MASTER_ADDR": self.host_ip(0),
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": self.interface,
            "RANK": str(i),
            "WORLD_SIZE": str(self.num_hosts * ranks_per_host),
            "LOCAL_RANK": str(i % ranks_per_host),
        }

    def run_workers(
        self,
        argv_for_rank: Callable[[int], list[str]],
        env_for_rank: Callable[[int], Mapping[str, str]] | None = None,
        timeout_s: float = 300.0,
        on_poll: Callable[[], None] | None = None,
        ranks_per_host: int = 1,
    ) -> list[WorkerResult]:
        """Run ``ranks_per_host`` processes per host, wait for all, and return their results in rank order.

        Step 1: start ``argv_for_rank(r)`` on host ``r // ranks_per_host`` with ``env_for_rank(r)``
        added to the environment (ranks of one host talk over its loopback, unshaped).
        Step 2: wait until all exit, one fails (peers then get ``PEER_GRACE_S``), or ``timeout_s`` passes;
        ``on_poll()`` is called every ``POLL_S`` meanwhile (e.g. to show the workers' progress).
        Step 3: kill every process still alive; raise ``WorkerError`` unless all exited with status 0.

        Raises:
            WorkerError: On a timeout or a non-zero exit, with each failing rank's stderr tail.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host={ranks_per_host!r}: must be >= 1")
        world = self.num_hosts * ranks_per_host
        with self.temp_dir(prefix="zensync-testbed-") as tmp:
            outs = [open(os.path.join(tmp, f"rank{r}.out"), "w+b") for r in range(world)]  # noqa: SIM115
            errs = [open(os.path.join(tmp, f"rank{r}.err"), "w+b") for r in range(world)]  # noqa: SIM115
            try:
                started = time.monotonic()
                procs = [
                    self.popen(
                        r // ranks_per_host,
                        argv_for_rank(r),
                        env_for_rank(r) if env_for_rank else None,
                        stdout=outs[r],
                        stderr=errs[r],
                        stdin=subprocess.DEVNULL,
                    )
                    for r in range(world)
                ]
                timed_out = _wait_all(procs, started + timeout_s, on_poll)
                _kill_all(procs)
                self._forget(procs)
                results = [_result(r, p, outs[r], errs[r], time.monotonic() - started) for r, p in enumerate(procs)]
            finally:
                for f in outs + errs:
                    f.close()
        _raise_on_failure(results, timed_out, timeout_s)
        return results

    def _kill_spawned(self) -> None:
        """SIGKILL every process group this cluster started and reap them."""
        _kill_all(self._procs)
        self._forget(list(self._procs))

    def _forget(self, procs: list[subprocess.Popen[Any]]) -> None:
        """Drop reaped processes from the bookkeeping and the record."""
        if not procs:
            return
        self._procs = [p for p in self._procs if p not in procs]
        if self._record is not None:
            self._record.forget_workers(p.pid for p in procs)


def _wait_all(procs: list[subprocess.Popen[Any]], deadline: float, on_poll: Callable[[], None] | None) -> bool:
    """Wait for all ``procs``, calling ``on_poll`` each round; True if the deadline passed first."""
    failed_at: float | None = None
    while True:
        if on_poll is not None:
            on_poll()
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > PEER_GRACE_S:
            return False
        if now > deadline:
            return True
        time.sleep(POLL_S)


def _kill_all(procs: list[subprocess.Popen[Any]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("process %s did not exit 10 s after SIGKILL", proc.pid)


def _result(rank: int, proc: subprocess.Popen[Any], out: Any, err: Any, wall_s: float) -> WorkerResult:
    out.seek(0)
    err.seek(0)
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    return WorkerResult(
        rank=rank,
        args=[str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)],
        returncode=code,
        stdout=out.read().decode(errors="replace"),
        stderr=err.read().decode(errors="replace"),
        wall_s=wall_s,
    )


def _raise_on_failure(results: list[WorkerResult], timed_out: bool, timeout_s: float) -> None:
    failed = [r for r in results if r.returncode != 0]
    if not failed and not timed_out:
        return
    head = f"workers timed out after {timeout_s:.1f} s and were killed" if timed_out else "workers failed"
    lines = [f"{head}; failing ranks: {[r.rank for r in failed]}"]
    for r in failed:
        tail = r.stderr[-STDERR_TAIL_CHARS:].rstrip() or "(no stderr)"
        lines.append(f"--- rank {r.rank} exit {r.returncode}: {' '.join(r.args)}\n{tail}")
    raise WorkerError("\n".join(lines), results)
