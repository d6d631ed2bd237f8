"""Launch an SPMD test function on real processes over gloo, and fail instead of hanging.

``launch(fn, world_size, args, tmp_dir)`` starts ``world_size`` processes. Each one joins a fresh gloo
group on a free localhost TCP port, calls ``fn(rank, world_size, *args)``, and writes what it returned
(or its traceback) to ``tmp_dir/rank<r>.pt``. The parent waits under one deadline for the whole
launch; a child that fails gets its peers a short grace period, then every child still alive is
killed and the launch fails with every rank's traceback. Worker functions must be importable
module-level functions (they are pickled by reference), and return plain data or CPU tensors.

Children come from a fork server (``_START_METHOD``): one single-threaded process, started at the first
launch, that has imported torch and zensync once and forks a fresh child per rank. A spawned child would
import them again, about 5 s of CPU per rank on 2 cores, which was most of a launch's time. A child starts
from the server's state, a fresh interpreter's after those imports, and has nothing of the test process:
no process group, no threads, no CUDA context.

Example::

    results = launch(_battery, world_size=4, args=(cases,), tmp_dir=tmp_path)  # one result per rank
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = [
    "GLOO_TIMEOUT_S",
    "LAUNCH_TIMEOUT_S",
    "LaunchError",
    "free_port",
    "launch",
    "pytest_generate_tests",
    "slow_world",
    "world_size_fixture",
]

GLOO_TIMEOUT_S = 60
"""Collective timeout of every process group: a collective stuck this long raises in the worker."""
LAUNCH_TIMEOUT_S = 150.0
"""Wall-clock budget of one launch (start + init + body). Above GLOO_TIMEOUT_S, so a hung collective
surfaces as the worker's own timeout error (with a traceback) before the parent kills it."""
_PEER_GRACE_S = 10.0
"""After one rank fails, how long its peers get to finish (or fail) before they are killed."""
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
"""world_size processes share the CI machine's few cores: one thread each avoids oversubscription."""
_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
"""How children start: forked from a fork server that preloads ``_PRELOAD`` (spawn where there is none)."""
_PRELOAD = ["torch", "zensync", __name__]
"""Imported once, in the fork server (which imports nothing else of the parent's)."""


class LaunchError(AssertionError):
    """A launch that timed out, crashed, or had a rank raise; the message holds every rank's story."""


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    out: str,
    gloo_timeout_s: float = GLOO_TIMEOUT_S,
) -> None:
    """Child entry point: join the group, run ``fn``, save its outcome, leave the group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=gloo_timeout_s),
        )
        outcome = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        outcome = {"ok": False, "traceback": traceback.format_exc()}
    torch.save(outcome, out + ".tmp")
    os.replace(out + ".tmp", out)  # the parent never reads a half-written file
    if not outcome["ok"]:
        os._exit(1)  # skip teardown: peers may be stuck in a collective with us
    # A peer may still be connecting a group this rank has finished setting up (the last thing a
    # worker did was register a hook, which creates one): leaving now would reset that connection.
    try:
        dist.barrier()
    except BaseException:  # noqa: BLE001 - the outcome is saved; a failed peer is reported by its own
        os._exit(0)
    dist.destroy_process_group()


def _wait(procs: list[multiprocessing.Process], timeout_s: float, peer_grace_s: float) -> str | None:
    """Wait for every child; None when all exited, else why waiting stopped."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > peer_grace_s:
            return f"a rank failed and its peers did not finish within {peer_grace_s:.0f} s"
        if now > deadline:
            return f"the launch did not finish within {timeout_s:.0f} s (hang?)"
        time.sleep(0.05)
    return None


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    tmp_dir: Path,
    *,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    peer_grace_s: float = _PEER_GRACE_S,
    gloo_timeout_s: float = GLOO_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return their results by rank.

    ``gloo_timeout_s`` is the ``timeout`` every rank passes to init_process_group.

    Raises:
        LaunchError: When any rank raised, crashed or was killed, or the launch ran past ``timeout_s``.
    """
    ctx = multiprocessing.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the first launch starts the server
    port = free_port()
    paths = [str(Path(tmp_dir) / f"rank{rank}.pt") for rank in range(world_size)]
    saved_env = {key: os.environ.get(key) for key in _THREAD_ENV}
    os.environ.update(_THREAD_ENV)  # the fork server (started by the first start()) and spawned children inherit it
    procs = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_worker, args=(fn, rank, world_size, port, tuple(args), paths[rank], gloo_timeout_s)
            )
            proc.start()
            procs.append(proc)
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        stopped = _wait(procs, timeout_s, peer_grace_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    return _collect(procs, paths, stopped)


def _collect(procs: list[multiprocessing.Process], paths: list[str], stopped: str | None) -> list[Any]:
    """Every rank's returned value, or a LaunchError that tells each rank's outcome."""
    outcomes: list[dict[str, Any] | None] = []
    for path in paths:
        outcomes.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    if stopped is None and all(o is not None and o["ok"] for o in outcomes):
        return [o["value"] for o in outcomes]  # type: ignore[index]
    lines = [f"gloo launch of {len(procs)} ranks failed: {stopped or 'a rank raised'}"]
    for rank, (proc, outcome) in enumerate(zip(procs, outcomes, strict=True)):
        if outcome is None:
            lines.append(f"--- rank {rank}: no result (exit code {proc.exitcode}; killed or crashed)")
        elif outcome["ok"]:
            lines.append(f"--- rank {rank}: ok")
        else:
            lines.append(f"--- rank {rank}: raised\n{outcome['traceback']}")
    raise LaunchError("\n".join(lines))


# --------------------------------------------------------------------------------------------------
# Class data world_size = [2, 4], as DeepSpeed's DistributedTest: test modules import both names.
def slow_world(world_size: int) -> Any:
    """A class-data world size that runs in the slow tier: ``world_size = [2, slow_world(4)]``.

    For the larger sizes of a class whose smallest size already runs every check in the default tier
    (the tests are marked ``slow``; tests/conftest.py deselects them unless ``-m`` names ``slow``).
    """
    return pytest.param(world_size, marks=pytest.mark.slow, id=f"world{world_size}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Class data ``world_size = [2, 4]`` (as DeepSpeed's DistributedTest) -> one class run per size."""
    sizes = getattr(metafunc.cls, "world_size", None)
    if "world_size" in metafunc.fixturenames and sizes is not None:
        params = [pytest.param(n, id=f"world{n}") if isinstance(n, int) else n for n in sizes]
        metafunc.parametrize("world_size", params, indirect=True, scope="class")


@pytest.fixture(scope="class", name="world_size")
def world_size_fixture(request: pytest.FixtureRequest) -> int:
    """The world size of the running class instance (see ``pytest_generate_tests``)."""
    return request.param
