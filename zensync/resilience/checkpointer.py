"""Every step's state in the host's memory, replicated to peers in the network's idle time, and
restored after a failure without disk (Gemini, SOSP'23), tied to zensync's sync engine.

Usage on each rank (under ``zensync launch``, which runs the host's checkpoint agent)::

    state = zensync.register(ddp, strategy="auto")
    ckpt = Checkpointer(CheckpointConfig(replicas=1, dcp_dir="/shared/ckpt", dcp_every=500), hook_state=state)
    start = ckpt.restore(model=model, optimizer=opt, zensync=state)  # 0 on a fresh start
    for step in range(start, steps):
        ...  # forward, backward (zensync syncs), optimizer.step()
        ckpt.save(step, model=model, optimizer=opt, zensync=state)
    ckpt.close()

1. ``save`` writes the rank's state into the host's store (``ShardStore``: shared memory, one copy,
   checksummed) and wakes the rank's ``Replicator``, which sends it to ``replicas`` peers on other
   hosts in the idle windows zensync's hook reports (``IdleGate``); of a data parallel job's state,
   only what differs from the peer's own (``dedup``: a rank's residuals, say) travels. Every
   ``dcp_every`` steps the state also goes to disk through torch.distributed.checkpoint.
2. ``restore`` (after a restart; every rank calls it) finds the newest step that every rank can
   restore (``recover.plan_recovery``): from its own host's memory (a worker restarted), from a
   peer's memory (a host replaced: its store is empty), or from the disk checkpoint when memory
   cannot serve every rank. A failure on any rank fails every rank with its type and message.
3. Each step's record (``history``, and ``jsonl_path``) gives the checkpoint's bytes, the bytes the
   save wrote (the blocks that changed: ``dirty.ChangeTracker`` lists the rows the optimizer's steps
   touched, the store hashes the rest) and its time, the replication traffic since the last save
   (bytes, chunks, idle windows used, the longest delay a chunk imposed on a gradient sync) and the
   replica coverage (the newest step whose every shard has its replicas; with ``max_lag_steps``,
   the time the save waited for it); ``recovery`` gives the path restore took, its step, the steps
   lost and its time.

The engine's own state (residuals, seeds, corrections, the step) is part of the state when the hook
state is passed as a part, so a restored run goes on as the uninterrupted one would.

FSDP2 (``fully_shard``): the model's and the optimizer's DTensors are stored as each rank's shard
with its layout and restored as DTensors on the same mesh (``memory.state_of``). ``register_fsdp``'s
state is ``hook_state`` (its sync windows) and a part: the checkpoint keeps its ``local_state_dict``
(each rank's own residuals and PowerSGD bases, no collective), so a restored FSDP run goes on bit for
bit too (tests/distributed/resilience/test_fsdp_memory.py: auto, qsgd, PowerSGD).
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import json
import logging
import os
import pathlib
import time
from typing import Any, Literal

import torch

from zensync.resilience.blocks import warm_up
from zensync.resilience.dirty import ChangeTracker
from zensync.resilience.gate import IdleGate
from zensync.resilience.memory import load_parts, state_of
from zensync.resilience.placement import PLACEMENTS
from zensync.resilience.recover import RecoveryPlan, checks, plan_recovery, without
from zensync.resilience.replicate import Replicator, exchange, pack, unpack
from zensync.resilience.store import ShardStore, flatten, unflatten
from zensync.sync.agreement import describe_failure, gather_messages_async
from zensync.transport import TorchTransport, Transport, transport_for_group
from zensync.transport.dcp import dcp_load_rank, dcp_save_rank, dcp_steps

__all__ = ["ROOT_ENV", "CheckpointConfig", "Checkpointer", "load_dcp_state"]

logger = logging.getLogger(__name__)

ROOT_ENV = "ZENSYNC_CKPT_ROOT"
"""The host's store directory, set by ``zensync launch`` (its agent owns the directory)."""
_PHASE = "checkpoint"
warm_up()  # the store's compiled loops load while the worker starts (restore waits for them)
_VALUES_KEY = "__values__"
_STEP = "step"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """How a job checkpoints into memory."""

    root: str | None = None
    """The host's store directory (a tmpfs); None: ``$ZENSYNC_CKPT_ROOT`` (``zensync launch``), else
    ``/dev/shm/zensync-ckpt-<MASTER_PORT>``."""
    replicas: int = 1
    """Peer hosts holding a copy of each shard (0: this host's memory only)."""
    placement: Literal["group", "ring"] = "group"
    """Gemini's group placement, or a ring (``resilience.placement``)."""
    ranks_per_host: int | None = None
    """Ranks that share a host (and a store); None: ``$LOCAL_WORLD_SIZE`` (torchrun), else 1."""
    chunk_bytes: int = 1 << 20
    """Replication chunk: a sync that begins mid-chunk waits for at most this much on the wire."""
    replicate_every: int = 1
    """Replicate every this many steps (the newest version then): fewer rounds, less CPU and wire per
    step, more steps lost when a host is replaced (a worker restart loses none: every step is local)."""
    max_lag_steps: int | None = None
    """Bound the replica coverage: ``save(step)`` returns only once ``step - max_lag_steps`` (or a
    later step) has all its replicas, so a replaced host loses at most ``max_lag_steps`` saved steps
    besides the one in flight (0: synchronous replication). None: never wait (Gemini's way: the
    coverage lags by the rounds' time, reported per step)."""
    deltas: bool = True
    """Replicate a version as its blocks (rows of a matrix, or whole tensors) that changed since the
    newest complete one: rows no step touched are not sent again (False: whole versions)."""
    dedup: bool = True
    """Send no tensor that the receiving rank holds identically in its own version of the step (their
    digests agree): it copies it from there. Data parallel ranks hold the same model and optimizer
    state, so a DDP job sends only each rank's own state (its engine's residuals, say); the replica is
    still a full, independent copy (False: send every changed tensor)."""
    track_changes: bool = True
    """Know the rows each save must write from the optimizers' steps (``dirty.ChangeTracker``) instead
    of hashing every row: a save then reads only what changed (False: hash every block)."""
    audit_rows: int = 16
    """Random rows of each tracked tensor whose hashes a save checks against the previous version (a
    mismatch: the tensor is hashed whole from then on, with a warning)."""
    keep: int = 2
    """Local versions kept (>= 2: a rank one save ahead still has its peers' step)."""
    dcp_dir: str | None = None
    """Disk checkpoints (torch.distributed.checkpoint), ``<dcp_dir>/step<k>``: restore's fallback."""
    dcp_every: int = 0
    """Save to ``dcp_dir`` every this many steps (0: never; ``restore`` still reads it)."""
    jsonl_path: str | None = None
    """Append each step's record here, per rank (``{rank}`` in the path is replaced)."""
    history_size: int = 1000

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas={self.replicas} must be >= 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r}: choose one of {list(PLACEMENTS)}")
        if self.replicate_every < 1:
            raise ValueError(f"replicate_every={self.replicate_every} must be >= 1")
        if self.max_lag_steps is not None and self.max_lag_steps < self.replicate_every - 1:
            bound = self.replicate_every - 1
            raise ValueError(f"max_lag_steps={self.max_lag_steps} must be >= replicate_every - 1 = {bound}: "
                             f"a round starts only every replicate_every steps")  # fmt: skip
        if self.audit_rows < 0:
            raise ValueError(f"audit_rows={self.audit_rows} must be >= 0")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be >= 1")
        if self.keep < 2:
            raise ValueError(f"keep={self.keep} must be >= 2: after a crash one rank may be a save ahead of another")
        if self.dcp_every < 0 or (self.dcp_every and self.dcp_dir is None):
            raise ValueError(f"dcp_every={self.dcp_every} needs dcp_dir and must be >= 0")

    def store_root(self) -> pathlib.Path:
        root = self.root or os.environ.get(ROOT_ENV)
        return pathlib.Path(root or f"/dev/shm/zensync-ckpt-{os.environ.get('MASTER_PORT', 'local')}")

    def host_ranks(self) -> int:
        return self.ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


class Checkpointer:
    """One rank's in-memory checkpoints (module docstring).

    Args:
        config: The job's ``CheckpointConfig`` (the same on every rank).
        hook_state: zensync's hook state (``register``'s or ``register_fsdp``'s): its sync windows
            gate replication (None: replication runs whenever a version is saved).
        transport: The ranks checkpointing together; None: the default process group. The
            checkpointer talks on a group of its own over the same ranks (``duplicate``), and its
            replication thread on another.
    """

    def __init__(self, config: CheckpointConfig | None = None, *, hook_state: Any = None,
                 transport: Transport | None = None) -> None:  # fmt: skip
        self.config = config or CheckpointConfig()
        base = transport if transport is not None else transport_for_group(None)
        self.transport = base.duplicate() if hasattr(base, "duplicate") else base
        self.rank = self.transport.rank
        self.store = ShardStore(self.config.store_root(), keep=self.config.keep)
        self.gate = IdleGate()
        if hook_state is not None:
            hook_state.add_sync_listener(self.gate)
        self.replicator: Replicator | None = None
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.config.history_size)
        self.recovery: dict[str, Any] | None = None
        """How ``restore`` got its state: {"source", "step", "lost_steps", "seconds", "fetched_bytes", and the
        seconds of its phases: "plan_s" (every rank's report gathered), "fetch_s" (peers' shards: of it,
        "pack_s" packing the shards this rank sends, "exchange_s" the exchange, "unpack_s" checking and
        keeping the ones it receives), "load_s"}."""
        self._jsonl = self.config.jsonl_path.replace("{rank}", str(self.rank)) if self.config.jsonl_path else None
        self._saved: int | None = None
        """The newest step saved (its version may still be completed on the replication thread)."""
        self.tracker = ChangeTracker() if self.config.track_changes else None

    # -- restore -----------------------------------------------------------------------------------
    def restore(self, require: bool | None = None, **parts: Any) -> int:
        """Load the newest state every rank can restore into ``parts``; returns the next step to run
        (0: nothing saved). A collective of every rank; starts replication afterwards.

        Args:
            require: A checkpoint must exist (nothing anywhere is an error, not a fresh start); None:
                required when torchrun restarted the workers (``$TORCHELASTIC_RESTART_COUNT`` > 0).
                Required on any rank is required on all.
            parts: What to load: the parts ``save`` was given, by the same names.

        Raises:
            FileNotFoundError: On every rank, when some rank's state is nowhere (memory or disk), or
                nothing is anywhere and a checkpoint is required.
            KeyError, ValueError: On every rank, when a rank's part is not in its checkpoint or
                cannot take it (the failing rank's type and message).
        """
        warm_up(wait=True)
        started_s = time.perf_counter()
        if require is None:
            require = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        plan, seen = self._plan(require)  # its errors are raised on every rank alike
        planned_s = time.perf_counter()
        failure, fetched, fetched_s, phases = None, 0, planned_s, dict[str, float]()
        try:
            fetched, phases = self._fetch(plan)
            fetched_s = time.perf_counter()
            if plan.step is not None:
                load_parts(self._state_at(plan, seen), parts)
                self.store.discard_after(plan.step)  # saved after it: a future the run no longer has
        except (FileNotFoundError, KeyError, ValueError, RuntimeError, OSError) as exc:
            failure = exc
        loaded_s = time.perf_counter()
        self._agree(failure)
        self.recovery = {"source": plan.source, "step": plan.step, "lost_steps": plan.lost_steps,
                         "seconds": time.perf_counter() - started_s, "fetched_bytes": fetched,
                         "plan_s": planned_s - started_s, "fetch_s": fetched_s - planned_s,
                         "load_s": loaded_s - fetched_s, **phases}  # fmt: skip
        if self.rank == 0:
            logger.info("zensync checkpoint: restored %s", self.recovery)
        self._start_replication()
        return 0 if plan.step is None else plan.step + 1

    def _plan(self, required: bool) -> tuple[RecoveryPlan, dict[Any, Any]]:
        """Every rank's report gathered, and the plan all compute alike (recover.plan_recovery), once
        every version it uses is intact: each rank checks the ones its host serves (``recover.checks``)
        and all agree; a version found corrupt is struck and the plan computed again. Returns it with
        the files this rank checked (the load hashes them no more)."""
        seen: dict[Any, Any] = {}  # a replica linking this rank's own files is checked once
        try:  # this rank's stores: an error here still joins the gather (its peers must not wait)
            disk = dcp_steps(self.config.dcp_dir) if self.config.dcp_dir else []
            have = {str(r): [v.step for v in self.store.versions(r)] for r in self.store.ranks()}
            report: dict[str, Any] = {"have": have, "dcp": disk, "required": required}
        except OSError as exc:
            report = {"error": describe_failure(exc).decode(errors="replace")}
        reports = self._gather_json(report)
        _raise_failures([(r, rep["error"]) for r, rep in enumerate(reports) if "error" in rep], None)
        # one rank's requirement is every rank's: torchrun counts a restart only on the host whose
        # worker failed (a healthy host restarted for the new membership says 0), and ranks that
        # planned otherwise would part, some raising and some training
        required = any(rep["required"] for rep in reports)
        common_disk = sorted(set(reports[0]["dcp"]).intersection(*(r["dcp"] for r in reports[1:])))
        failed: set[tuple[int, int, int]] = set()  # (holder, rank, step) found corrupt
        while True:  # each pass strikes at least one version: it ends
            plan = plan_recovery(without(reports, failed), common_disk, required)
            step = plan.step
            if step is None or plan.source == "dcp":  # alike on every rank: memory is not read
                return plan, seen
            corrupt = [r for r in checks(plan, self.rank) if not self.store.intact(r, step, seen)]
            found = {(holder, r, step) for holder, ranks in enumerate(self._gather_json(corrupt)) for r in ranks}
            if not found:
                return plan, seen
            failed |= found

    def _gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON ``value``, in rank order."""
        mine = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        return [json.loads(bytes(t.tolist())) for t in self.transport.all_gather_v(mine)]

    def _fetch(self, plan: RecoveryPlan) -> tuple[int, dict[str, float]]:
        """The shards peers send (plan.senders), kept in this host's store; returns the bytes received
        and the seconds of the fetch's phases (``recovery``)."""
        if plan.source != "peers":
            return 0, {}
        assert plan.step is not None
        started_s = time.perf_counter()
        blobs = {r: pack(self.store, r, plan.step) for r, holder in plan.senders.items() if holder == self.rank}
        packed_s = time.perf_counter()
        arrived = exchange(self.transport, blobs)
        exchanged_s = time.perf_counter()
        for _, data in arrived:
            unpack(self.store, data)
        phases = {"pack_s": packed_s - started_s, "exchange_s": exchanged_s - packed_s,
                  "unpack_s": time.perf_counter() - exchanged_s}  # fmt: skip
        return sum(data.numel() for _, data in arrived), phases

    def _state_at(self, plan: RecoveryPlan, seen: dict[Any, Any]) -> dict[str | int, Any]:
        assert plan.step is not None
        if plan.source != "dcp":
            return self.store.load(self.rank, plan.step, seen)
        assert self.config.dcp_dir is not None
        state = load_dcp_state(pathlib.Path(self.config.dcp_dir) / f"step{plan.step}", self._torch())
        if not any(v.step >= plan.step for v in self.store.versions(self.rank)):
            self.store.save(self.rank, plan.step, dict(state))  # type: ignore[arg-type]  # memory holds it again
        return state

    def _agree(self, failure: BaseException | None) -> None:
        """Raise every failing rank's error on every rank (the first's type), or return: step 2 of
        the one agreement protocol (``zensync.sync.agreement``)."""
        said = self.transport.run(gather_messages_async(self.transport, describe_failure(failure), phase=_PHASE))
        _raise_failures([(r, message) for r, message in enumerate(said) if message], failure)

    def _start_replication(self) -> None:
        if self.config.replicas == 0 or self.replicator is not None:
            return
        # every rank starts from the same complete step (a replaced host has none; the others may
        # have marked a step it lacks): rounds are due alike, and saves that wait (max_lag_steps) wait alike
        marked = self.store.complete_step(self.rank)
        said = self.transport.all_gather(torch.tensor([-1 if marked is None else marked], dtype=torch.int64))
        agreed = min(int(t) for t in said)
        own = self.transport.duplicate() if hasattr(self.transport, "duplicate") else self.transport
        self.replicator = Replicator(
            self.store, own, m=self.config.replicas, placement=self.config.placement,
            ranks_per_host=self.config.host_ranks(), chunk_bytes=self.config.chunk_bytes, gate=self.gate,
            deltas=self.config.deltas, dedup=self.config.dedup, every=self.config.replicate_every,
            complete_step=None if agreed < 0 else agreed,
        )  # fmt: skip

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int, **parts: Any) -> dict[str, Any]:
        """Save ``parts``' state as the version of ``step`` (after its optimizer step); returns the
        step's record (module docstring, 3). Replication follows in the background.

        Raises:
            RuntimeError: Before ``restore`` (it agrees on where the run starts and starts replication).
            ValueError: For a part named "step", or a state the store refuses (``store.flatten``).
        """
        if self.recovery is None:
            raise RuntimeError("Checkpointer.save before restore(): call restore(...) once at start (0: fresh run)")
        if _STEP in parts:
            raise ValueError(f"a part may not be named {_STEP!r}: the checkpoint keeps the step under it")
        started_s = time.perf_counter()
        state: dict[str, Any] = {name: state_of(part) for name, part in parts.items()}
        state[_STEP] = step
        # the changed blocks written and hashed now; the manifest on the replication thread (if any)
        changed, flat = None, flatten(state, check=False)  # the store encodes (and checks) the values
        if self.tracker is not None:
            self.tracker.attach(parts)
            changed = self.tracker.changes(flat[0])
        pending = self.store.write(self.rank, step, state, changed=changed, since=self._saved,
                                   audit_rows=self.config.audit_rows, flat=flat)  # fmt: skip
        if self.tracker is not None:
            for key in pending.violations:
                self.tracker.disable(key)
            self.tracker.saved()
        if self.replicator is None:
            self.store.finish(pending)
        info = pending.info
        self._saved = step
        saved_s = time.perf_counter() - started_s
        if self.config.dcp_every and step % self.config.dcp_every == 0:
            self._save_dcp(step, state)
        record: dict[str, Any] = {"step": step, "bytes": info.nbytes, "written_bytes": pending.written,
                                  "listed": len(changed or {}), "save_s": saved_s,
                                  "dcp_s": time.perf_counter() - started_s - saved_s}  # fmt: skip
        if self.replicator is not None:
            traffic = self.replicator.take_step()
            error = self.replicator.error
            record.update(replicated_bytes=traffic.sent_bytes, chunks=traffic.chunks,
                          forced_chunks=traffic.forced_chunks, windows_used=len(traffic.windows),
                          max_delay_s=traffic.max_delay_s, completed=traffic.completed,
                          sent_fractions=traffic.sent_fractions, donated_fractions=traffic.donated_fractions,
                round_s=traffic.round_s, round_cpu_s=traffic.round_cpu_s, complete_step=traffic.complete_step,
                          replication_error=None if error is None else repr(error))  # fmt: skip
            self.replicator.notify(step, pending)
            if self.config.max_lag_steps is not None and step >= self.config.max_lag_steps:
                waited_s = time.perf_counter()
                record["lag_bound_met"] = self.replicator.wait_complete(step - self.config.max_lag_steps)
                record["lag_wait_s"] = time.perf_counter() - waited_s
        self.history.append(record)
        if self._jsonl is not None:
            with open(self._jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def _save_dcp(self, step: int, state: dict[str, Any]) -> None:
        assert self.config.dcp_dir is not None
        tensors, values = flatten(state)
        tensors[_VALUES_KEY] = torch.frombuffer(bytearray(json.dumps(values).encode()), dtype=torch.uint8)
        dcp_save_rank(pathlib.Path(self.config.dcp_dir) / f"step{step}", tensors, self._torch())

    def _torch(self) -> TorchTransport:
        """The checkpointer's transport, for torch.distributed.checkpoint (which needs a process group)."""
        if not isinstance(self.transport, TorchTransport):
            raise ValueError(f"dcp_dir needs a torch.distributed transport, not {type(self.transport).__name__}")
        return self.transport

    def wait_replicated(self, timeout_s: float | None = None) -> bool:
        """Block until the newest saved step has all its replicas (before a planned stop, say);
        False when replication ended (``Replicator.error``) or ``timeout_s`` passed first."""
        if self.replicator is None or self._saved is None:
            return self.replicator is None and self.config.replicas == 0
        return self.replicator.wait_complete(self._saved, timeout_s)

    def close(self) -> None:
        """Stop replication (every rank calls it: its last round is a collective); every saved version
        is complete once it returns."""
        if self.replicator is not None:
            self.replicator.close()
            self.replicator = None
        if self.tracker is not None:
            self.tracker.close()


def load_dcp_state(
    path: str | pathlib.Path, transport: TorchTransport | None, rank: int | None = None
) -> dict[str | int, Any]:
    """A rank's state from a disk checkpoint ``Checkpointer`` saved (``dcp_every``): a collective of
    ``transport``'s ranks, or with ``transport`` None rank ``rank``'s alone (``dcp_load_rank``)."""
    flat: dict[str, Any] = dict(dcp_load_rank(path, transport, rank))
    values = flat.pop(_VALUES_KEY)
    flat.update(json.loads(bytes(values.tolist())))
    return unflatten(flat)


def _raise_failures(failing: list[tuple[int, str]], cause: BaseException | None) -> None:
    """Raise the ranks' errors ("Type: message" each, ``describe_failure``'s) here, as the first one's type."""
    if failing:
        named = getattr(builtins, failing[0][1].split(":", 1)[0], None)  # a builtin exception keeps its type
        kind = named if isinstance(named, type) and issubclass(named, Exception) else RuntimeError
        told = "; ".join(f"rank {r}: {message}" for r, message in failing)
        raise kind(f"zensync checkpoint restore failed on rank(s) {[r for r, _ in failing]}: {told}") from cause
