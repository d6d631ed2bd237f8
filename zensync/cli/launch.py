"""``zensync launch`` and ``zensync agent``: the host's checkpoint agent, around torchrun or alone.

    zensync launch [--ckpt-root DIR] [--job-id ID] [--keep-store] -- TORCHRUN_ARGS...
    zensync agent --ckpt-root DIR [--keep-store]

``launch`` starts this host's checkpoint agent (``zensync.resilience.agent``: it owns the
shared-memory store across worker restarts), then runs ``python -m torch.distributed.run
TORCHRUN_ARGS...`` with ``ZENSYNC_CKPT_ROOT`` set for the workers (``Checkpointer`` finds the store
there). torchrun's ``--max-restarts`` restarts failed workers; they restore from the agent's store.
torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless set otherwise (restarts reuse
stale peer addresses with the shared store: pytorch/pytorch#135712).
The exit status is torchrun's; the store is removed when torchrun exits (``--keep-store`` keeps
it). The default directory is ``/dev/shm/zensync-ckpt-<job id>``, the job id from --job-id, else
torchrun's --rdzv-id / --rdzv_id, else ``$TORCHELASTIC_RUN_ID``, else ``local``.

``agent`` holds a store directory until SIGTERM or SIGINT, for hosts whose workers another launcher
starts (export ``ZENSYNC_CKPT_ROOT=DIR`` to them).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from zensync.cli._errors import CommandFailed, UsageError

__all__ = ["AGENT_FLAGS", "LAUNCH_FLAGS", "add_agent", "add_launch"]

_UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1 for torchrun unless the user set it: with the rendezvous store shared with the workers'
process group (torch's default), a restarted worker can read a killed peer's address from the
previous attempt and fail with "connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712;
here 3 of 3 restarts failed with it shared, 0 of 3 with it unshared)."""
AGENT_FLAGS = ("--ckpt-root", "--keep-store")
LAUNCH_FLAGS = (*AGENT_FLAGS, "--job-id")


def add_launch(sub: argparse._SubParsersAction) -> None:
    """Add the ``launch`` subcommand."""
    parser = sub.add_parser("launch", help="torchrun with this host's in-memory checkpoint agent",
                            description=__doc__.split("\n\n")[2] if __doc__ else None)  # fmt: skip
    _store_flags(parser)
    parser.add_argument("--job-id", default=None, help="names the default store directory")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="torchrun's arguments, after --")
    parser.set_defaults(run=_launch, subparser=parser)


def add_agent(sub: argparse._SubParsersAction) -> None:
    """Add the ``agent`` subcommand."""
    parser = sub.add_parser("agent", help="hold this host's checkpoint store until SIGTERM",
                            description=__doc__.split("\n\n")[3] if __doc__ else None)  # fmt: skip
    _store_flags(parser)
    parser.set_defaults(run=_agent, subparser=parser)


def _store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt-root", default=None, help="the store directory (a tmpfs)")
    parser.add_argument("--keep-store", action="store_true", help="leave the shards when the job ends")


def _job_id(args: argparse.Namespace, torchrun: list[str]) -> str:
    if args.job_id:
        return str(args.job_id)
    for i, arg in enumerate(torchrun):
        for flag in ("--rdzv-id", "--rdzv_id"):
            if arg == flag and i + 1 < len(torchrun):
                return torchrun[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return os.environ.get("TORCHELASTIC_RUN_ID", "local")


def _launch(args: argparse.Namespace, _: Any) -> int:
    # imported here: ``import zensync.cli`` must not load the checkpointer (its compiled loops warm up at import)
    from zensync.resilience.agent import AgentBusy, CheckpointAgent, default_root

    torchrun = list(args.torchrun)
    if torchrun[:1] == ["--"]:
        torchrun = torchrun[1:]
    if not torchrun:
        raise UsageError("give torchrun's arguments after --, e.g. zensync launch -- --nproc-per-node 2 train.py")
    root = args.ckpt_root or default_root(_job_id(args, torchrun))
    try:
        agent = CheckpointAgent(root, keep_store=args.keep_store).start()
    except (AgentBusy, OSError) as exc:
        raise CommandFailed(str(exc)) from None
    try:
        env = {_UNSHARED_STORE: "1", **os.environ, **agent.env()}  # the user's setting wins
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun], env=env)
        forward = _forward_signals(proc)
        try:
            return proc.wait()
        finally:
            forward()
    finally:
        agent.stop()


def _forward_signals(proc: subprocess.Popen[bytes]) -> Any:
    """Pass SIGTERM/SIGINT on to torchrun (it stops its workers); returns the restorer."""
    previous = {}

    def handler(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _agent(args: argparse.Namespace, _: Any) -> int:
    from zensync.resilience.agent import AgentBusy, CheckpointAgent

    if not args.ckpt_root:
        raise UsageError("give the store directory: --ckpt-root DIR")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        agent = CheckpointAgent(args.ckpt_root, keep_store=args.keep_store).start()
    except (AgentBusy, OSError) as exc:
        raise CommandFailed(str(exc)) from None
    print(f"zensync agent: holding {agent.root} (export {next(iter(agent.env()))}={agent.root})", flush=True)
    try:
        stop.wait()
    finally:
        agent.stop()
    return 0
