"""Run records: what each cluster owns, so that the leftovers of a dead owner can be found and removed.

A process killed with SIGKILL runs no teardown: its namespaces (with a worker still inside), the
processes it started in their own sessions and its temp dirs stay behind. So every cluster writes a
small record, before it creates anything, to ``state_dir()/<run id>.json``, and rewrites it whenever
it starts a worker or makes a temp dir::

    {
        "version": 1,
        "run_id": "zs4242a7-14242",
        "owner": {"pid": 14242, "start_ticks": 7731042},
        "namespaces": ["zs4242a7-14242-sw", "zs4242a7-14242-h0"],
        "links": [{"namespace": "zs4242a7-14242-sw", "name": "br0", "kind": "bridge"}, ...],
        "temp_dirs": ["/tmp/zensync-demo-x1y2z3"],
        "workers": [{"pid": 14260, "start_ticks": 7731100}],
    }

A process is identified by its pid *and* its start time (field 22 of ``/proc/<pid>/stat``, clock
ticks since boot), so a recycled pid never makes a dead run look alive, and cleanup never kills an
unrelated process that happens to hold a recorded worker's pid.

``cleanup_stale()`` runs at every cluster start and from ``python -m zensync.testbed cleanup``. For each
record whose owner is gone it:

1. kills the recorded workers that are still the same processes (their whole process group);
2. kills every process inside the run's namespaces (``ip netns pids``), deletes its bridge and veths,
   then the namespaces;
3. removes its temp dirs (only directories named ``zensync-*``);
4. deletes the record.

Namespaces that match ``netns.NAME_PATTERN`` but have no record (a crash before the record was
written, or an older zensync) are deleted when the pid in their name no longer exists. Records whose
owner is alive, and namespaces without a record whose pid exists, are never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from zensync.testbed import netns

try:
    import fcntl
except ImportError:  # not POSIX: cleanups are not serialised between processes there
    fcntl = None  # type: ignore[assignment]

__all__ = ["CleanupReport", "ProcessId", "RunRecord", "cleanup_stale", "state_dir"]

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
TEMP_DIR_PREFIX = "zensync-"
"""Cleanup removes only recorded directories whose name starts with this (a guard against a bad record)."""
_EXIT_WAIT_S = 5.0
"""How long cleanup waits for SIGKILLed processes to be gone (they release their namespace on exit)."""


def state_dir() -> pathlib.Path:
    """The directory of run records: ``<tempdir>/zensync-runs-<uid>``, mode 0700, created if missing.

    Raises:
        RuntimeError: If the path exists but is not a directory owned by this user (e.g. a symlink).
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = pathlib.Path(tempfile.gettempdir()) / f"zensync-runs-{uid}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != uid):
        raise RuntimeError(f"{path} must be a directory owned by uid {uid} (zensync's run records); remove it")
    return path


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessId:
    """A process as pid plus start time, so a recycled pid is not mistaken for the process recorded."""

    pid: int
    start_ticks: int | None
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); None where /proc is not available."""

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The process ``pid`` now, or None if there is none (a zombie counts as gone)."""
        try:
            text = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return None if pathlib.Path("/proc/self/stat").exists() else _without_proc(pid)
        except ProcessLookupError:
            return None
        # Field 2 (comm) is parenthesised and may hold spaces or ')': fields 3.. follow the last ')'.
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):  # field 3, state: exited, not yet reaped
            return None
        return cls(pid, int(fields[22 - 3]))

    def alive(self) -> bool:
        """Whether this very process still runs (same pid and same start time)."""
        now = ProcessId.of(self.pid)
        return now is not None and (self.start_ticks is None or now.start_ticks == self.start_ticks)

    def to_json(self) -> dict[str, int | None]:
        """``{"pid": ..., "start_ticks": ...}``."""
        return {"pid": self.pid, "start_ticks": self.start_ticks}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessId:
        """The inverse of ``to_json``."""
        ticks = data.get("start_ticks")
        return cls(int(data["pid"]), None if ticks is None else int(ticks))


def _without_proc(pid: int) -> ProcessId | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ProcessId(pid, None)


class RunRecord:
    """The record of one run owned by this process; every change is written at once (atomically).

    Args:
        run_id: Unique name of the run (``<prefix>-<pid>``); the record is ``state_dir()/<run_id>.json``.
        namespaces: Namespaces the run is about to create.
        links: (namespace, interface name, kind) of the bridge and veths it is about to create.
    """

    __slots__ = ("_closed", "_data", "_lock", "path")

    def __init__(
        self, run_id: str, *, namespaces: Iterable[str] = (), links: Iterable[tuple[str, str, str]] = ()
    ) -> None:
        owner = ProcessId.of(os.getpid())
        assert owner is not None, "this process must exist"
        self.path = state_dir() / f"{run_id}.json"
        self._lock = threading.Lock()
        self._closed = False
        self._data: dict[str, Any] = {
            "version": RECORD_VERSION,
            "run_id": run_id,
            "owner": owner.to_json(),
            "command": " ".join(sys.argv)[:500],
            "created_unix_s": time.time(),
            "namespaces": list(namespaces),
            "links": [{"namespace": ns, "name": name, "kind": kind} for ns, name, kind in links],
            "temp_dirs": [],
            "workers": [],
        }
        self._write()

    def add_worker(self, pid: int) -> None:
        """Record a started worker process (skipped if it has already exited)."""
        proc = ProcessId.of(pid)
        if proc is not None:
            with self._lock:
                self._data["workers"].append(proc.to_json())
                self._write()

    def forget_workers(self, pids: Iterable[int]) -> None:
        """Drop workers that have exited and been reaped (the file is rewritten only if one was recorded)."""
        gone = set(pids)
        with self._lock:
            kept = [w for w in self._data["workers"] if w["pid"] not in gone]
            if len(kept) != len(self._data["workers"]):
                self._data["workers"] = kept
                self._write()

    def add_temp_dir(self, path: str) -> None:
        """Record a temp dir (its name must start with ``TEMP_DIR_PREFIX``)."""
        if not os.path.basename(path).startswith(TEMP_DIR_PREFIX):
            raise ValueError(f"temp dir {path!r}: its name must start with {TEMP_DIR_PREFIX!r} to be cleaned up")
        with self._lock:
            self._data["temp_dirs"].append(os.path.abspath(path))
            self._write()

    def forget_temp_dir(self, path: str) -> None:
        """Drop a temp dir that was removed (the file is rewritten only if it was recorded)."""
        with self._lock:
            kept = [p for p in self._data["temp_dirs"] if p != os.path.abspath(path)]
            if len(kept) != len(self._data["temp_dirs"]):
                self._data["temp_dirs"] = kept
                self._write()

    def close(self) -> None:
        """Delete the record (the run has torn down everything it names)."""
        with self._lock:
            self._closed = True
            self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        if self._closed:  # a late update (a temp dir removed after the cluster closed) must not revive it
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self._data, indent=1))
        os.replace(tmp, self.path)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CleanupReport:
    """What ``cleanup_stale`` removed."""

    runs: list[str]
    """Run ids of the dead runs whose records were removed."""
    namespaces: list[str]
    processes: list[int]
    """Pids killed: recorded workers and processes found inside the namespaces."""
    temp_dirs: list[str]

    def __bool__(self) -> bool:
        return bool(self.runs or self.namespaces or self.processes or self.temp_dirs)

    def summary(self) -> str:
        """One line for humans, e.g. 'removed 1 dead run(s), 3 namespace(s), 1 process(es), 2 temp dir(s)'."""
        counts = [
            f"{len(self.runs)} dead run(s)",
            f"{len(self.namespaces)} namespace(s)",
            f"{len(self.processes)} process(es)",
            f"{len(self.temp_dirs)} temp dir(s)",
        ]
        names = self.runs + [n for n in self.namespaces if not any(n.startswith(r) for r in self.runs)]
        return "removed " + ", ".join(counts) + (": " + ", ".join(names) if names else "")


def cleanup_stale() -> CleanupReport:
    """Remove everything recorded by runs whose owner is dead, and orphan zensync namespaces (module docstring).

    Returns:
        What was removed (empty when there were no leftovers).
    """
    report = CleanupReport(runs=[], namespaces=[], processes=[], temp_dirs=[])
    with _cleanup_lock():
        existing = set(netns.list_namespaces()) if _can_manage_namespaces() else set()
        recorded: set[str] = set()
        for path in sorted(state_dir().glob("*.json")):
            record = _read_record(path)
            if record is None:
                continue
            recorded.update(record["namespaces"])
            if not ProcessId.from_json(record["owner"]).alive():
                _remove_run(record, existing, report)
                path.unlink(missing_ok=True)
                report.runs.append(record["run_id"])
        # Namespaces without a record: their name carries the owner's pid (no start time to compare).
        orphans = []
        for name in sorted(existing - recorded):
            match = netns.NAME_PATTERN.match(name)
            if match and ProcessId.of(int(match.group(2))) is None:
                orphans.append(name)
        _delete_namespaces(orphans, report)
    return report


def _remove_run(record: dict[str, Any], existing: set[str], report: CleanupReport) -> None:
    """Steps 1-3 of the module docstring for one dead run's record."""
    # Step 1: recorded workers, verified by start time, with their process groups.
    killed = [w.pid for w in map(ProcessId.from_json, record["workers"]) if w.alive() and _kill_group(w.pid)]
    _wait_gone(killed)
    report.processes.extend(killed)
    # Step 2: processes inside the namespaces, the bridge and veths, the namespaces themselves.
    for link in record["links"]:
        if link["namespace"] in existing:
            netns.run_cmd(["ip", "-n", link["namespace"], "link", "del", link["name"]], check=False)
    _delete_namespaces([name for name in reversed(record["namespaces"]) if name in existing], report)
    # Step 3: temp dirs (only zensync's, only directories).
    for path in record["temp_dirs"]:
        if os.path.basename(path).startswith(TEMP_DIR_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            report.temp_dirs.append(path)


def _delete_namespaces(names: list[str], report: CleanupReport) -> None:
    """Delete ``names`` (killing the processes inside), then wait once for those processes to be gone."""
    inside = []
    for name in names:
        inside += netns.delete_namespace(name)
        report.namespaces.append(name)
    _wait_gone(inside)
    report.processes.extend(inside)


def _kill_group(pid: int) -> bool:
    """SIGKILL ``pid`` and, if it leads one, its process group; False if it was already gone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    while any(ProcessId.of(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _read_record(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads(path.read_text())
        if record.get("version") != RECORD_VERSION:
            raise ValueError(f"version {record.get('version')!r} is not {RECORD_VERSION}")
        ProcessId.from_json(record["owner"])
        for key in ("namespaces", "links", "temp_dirs", "workers"):
            if not isinstance(record[key], list):
                raise TypeError(f"{key} is not a list")
        record.setdefault("run_id", path.stem)
    except FileNotFoundError:  # removed by its owner meanwhile
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("skipping unreadable run record %s (%s); delete it by hand if its run is gone", path, err)
        return None
    return record


def _can_manage_namespaces() -> bool:
    return sys.platform == "linux" and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") is not None


@contextlib.contextmanager
def _cleanup_lock() -> Iterator[None]:
    """Serialise cleanups between processes (two starting clusters would otherwise race on one run)."""
    if fcntl is None:
        yield
        return
    with open(state_dir() / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
