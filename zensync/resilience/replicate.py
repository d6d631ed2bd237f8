"""Each rank's checkpoint shards copied to peers' stores in the network's idle windows (Gemini, Sec. 5).

``Replicator`` is a background thread of each rank, with a transport of its own (its own process
group, with the user's timeout: its collectives never interleave with the gradients'). A save hands
it the version it wrote (``ShardStore.write``: the changed blocks, hashed), which the thread
completes first (the manifest: off the training thread). Every ``every`` saved steps it starts a
*round*, a collective of every rank's replicator:

1. The ranks agree (one all-gather) on the round: each gives its newest local step (pinned until
   the round ends: a save on the main thread cannot reuse it, and it is the next round's base), the
   complete step it can send and apply deltas against, and its tensors' *digests* in that version
   (``blocks.entry_digests``). The round replicates the newest step every rank has (ranks save in
   lockstep, so it is the step just saved, or the one before on a rank one save ahead); no new
   common step: nothing moves.
2. Each rank packs that version for each peer as bytes: a JSON header, the manifest, then the blocks
   whose hashes changed since the common base with their indices and hashes (``pack_delta``), or
   every block when there is no base (no pickle crosses hosts). A tensor whose digest equals the
   peer's own tensor's at that step is not sent: the peer copies it from its own version (data
   parallel ranks hold the same model and optimizer state, so of a DDP job's shard only what is
   the rank's own travels: its engine's residuals, say). The ranks then exchange the packs' sizes.
   When every shard matches each of its peers' own wholly (a DDP job's), the agreement also carried
   each rank's manifest (while ``world_size`` manifests fit ``AGREEMENT_MANIFEST_BYTES``): each peer
   keeps its replica as links to its own version's files under that manifest, and step 3 is skipped.
3. The shards move in chunks of ``chunk_bytes``, one all-to-all per chunk, each rank sending to its
   ``m`` placement peers (``placement.replica_peers``). Before each chunk the thread waits until the
   gate (``gate.IdleGate``) is idle, so checkpoint traffic flows between a step's last bucket and
   the next step's first one; a chunk in flight when a sync begins delays it by at most one chunk's
   wire time, which the gate measures. A chunk that waited ``GATE_PATIENCE_S`` for a busy sync goes
   anyway (counted as forced): that sync may wait on a rank whose save waits for this round.
4. A peer keeps a replica only once it verifies (each block against its hash as it is written, the
   table against the manifest's hash: ``ShardStore.put_delta``); then the
   ranks agree whether every replica verified, and only then the step is *complete*: each rank
   marks it in its store, so that pruning keeps it until a newer step is complete. A failure
   mid-round (a crash, a corrupt copy) leaves the previous complete step.

``close`` ends the thread through one last round that every rank's replicator joins.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import threading
import time
from typing import Any

import numpy as np
import torch

from zensync.resilience.blocks import hash_bytes
from zensync.resilience.gate import IdleGate
from zensync.resilience.placement import replica_peers, replica_sources
from zensync.resilience.store import CorruptShard, PendingShard, ShardInfo, ShardStore
from zensync.transport import Transport

__all__ = [
    "AGREEMENT_MANIFEST_BYTES",
    "Replicator",
    "RoundRecord",
    "StepTraffic",
    "exchange",
    "pack",
    "pack_delta",
    "unpack",
]

logger = logging.getLogger(__name__)

_LENGTH = 8
GATE_PATIENCE_S = 1.0
"""How long a chunk waits for a busy sync to end before it goes anyway (recorded as forced). A sync
that long may itself wait on a rank whose save waits for this round (``max_lag_steps``)."""
AGREEMENT_MANIFEST_BYTES = 1 << 20
"""The most manifest bytes a round's agreement gathers on a rank (world size x manifest): beyond it
the manifests travel to the placement peers only, in the exchange (two collectives more a round)."""
_EMPTY = torch.empty(0, dtype=torch.uint8)
_NO_DIGESTS = np.empty(0, dtype=np.uint64)
_FIELDS = 7
"""Fixed int64 fields of an agreement row (``Replicator._agree``), before the digests and manifest."""


def _blob(header: dict[str, Any], manifest: bytes, *parts: Any) -> torch.Tensor:
    """An 8-byte header length, the header's JSON (with the manifest's length and hash), the manifest,
    then ``parts`` back to back: buffers, or files (paths) read straight into the blob."""
    header = {**header, "manifest": len(manifest), "manifest_hash": _manifest_hash(manifest)}
    head = json.dumps(header).encode()
    sizes = [os.stat(part).st_size if isinstance(part, pathlib.Path) else memoryview(part).nbytes for part in parts]
    out = bytearray(_LENGTH + len(head) + len(manifest) + sum(sizes))
    at = 0
    for piece in (len(head).to_bytes(_LENGTH, "little"), head, manifest):
        out[at : at + len(piece)] = piece
        at += len(piece)
    view = memoryview(out)
    for part, size in zip(parts, sizes, strict=True):
        if isinstance(part, pathlib.Path):
            with open(part, "rb") as f:
                if f.readinto(view[at : at + size]) != size:
                    raise OSError(f"{part} changed size while read")
        else:
            with memoryview(part) as source:
                view[at : at + size] = source.cast("B")
        at += size
    return torch.frombuffer(out, dtype=torch.uint8)


def _manifest_hash(manifest: bytes) -> str:
    """The manifest's own checksum (the sums table covers the tensors, not the JSON values)."""
    return f"{hash_bytes(np.frombuffer(manifest, dtype=np.uint8).copy()):016x}"


def _words(text: bytes) -> np.ndarray:
    """Bytes as int64 words (the last one zero-padded)."""
    return np.frombuffer(text + bytes(-len(text) % 8), dtype=np.int64)


def _int64(text: bytes) -> int:
    """The manifest's checksum (``_manifest_hash``) as a signed 64-bit int (an agreement field)."""
    return int(np.array([int(_manifest_hash(text), 16)], dtype=np.uint64).view(np.int64)[0]) if text else 0


def _donated(mine: np.ndarray | None, theirs: np.ndarray | None) -> list[int]:
    """The tensors (manifest entries) whose digests two ranks' versions share: a peer holds them."""
    if mine is None or theirs is None:
        return []
    return np.flatnonzero(mine[: theirs.size] == theirs[: mine.size]).tolist()


@dataclasses.dataclass(frozen=True, slots=True)
class _Agreement:
    """What a round's agreement decided (``Replicator._agree``), the same on every rank."""

    common: int
    """The newest step every rank has (-1: one has none): the step replicated."""
    covered: int
    """The newest step complete on every rank (-1: none); a round is due when ``common`` is newer."""
    base: int | None
    """The complete step every rank holds for deltas (None: one does not)."""
    stops: bool
    """Some rank is stopping: the round is the last, and nothing moves."""
    digests: list[np.ndarray | None]
    """Each rank's tensors' digests at ``common`` (None: its newest step is another)."""
    manifests: list[bytes | None]
    """Each rank's manifest at ``common`` (None: its newest step is another, or no dedup)."""


def _info(store: ShardStore, rank: int, step: int) -> ShardInfo:
    info = store.version(rank, step)
    if info is None:
        raise FileNotFoundError(f"no complete shard of rank {rank} at step {step} to send")
    return info


def pack(store: ShardStore, rank: int, step: int) -> torch.Tensor:
    """``rank``'s shard at ``step`` as one byte tensor: a header, the manifest, the sums table, the data.

    Raises:
        FileNotFoundError: If the store has no complete shard of ``rank`` at ``step``.
    """
    info = _info(store, rank, step)
    sums = info.path / "sums.bin"
    return _blob(
        {"kind": "full", "sums": os.stat(sums).st_size}, store.raw_manifest(info), sums, info.path / "data.bin"
    )


def pack_delta(store: ShardStore, rank: int, step: int, base_step: int | None,
               donated: list[int] | None = None, entries: int = 0) -> tuple[torch.Tensor, float, float]:  # fmt: skip
    """``rank``'s shard at ``step`` as its blocks whose hashes differ from its version ``base_step``'s
    (which the receivers hold; None: every block), with their hashes, less the ``donated`` tensors
    (indices of the manifest's ``entries`` entries, which the receiver copies from its own version of
    ``step``: ``ShardStore.put_delta``); the whole shard (``pack``) when the two versions' layouts
    differ. No pass over the data finds the blocks. Returns (the blob, the fractions of the data sent
    and donated).
    """
    new = _info(store, rank, step)
    if base_step is None and not donated:
        return pack(store, rank, step), 1.0, 0.0
    wanted = None
    if donated:
        wanted = np.ones(entries, dtype=bool)
        wanted[donated] = False
    with contextlib.ExitStack() as held:
        base = None
        if base_step is not None:
            base = _info(store, rank, base_step)
            held.enter_context(store.pinned(rank, base_step))
        delta = store.delta(new, base, wanted)
    if delta is None or not new.nbytes:
        return pack(store, rank, step), 1.0, 0.0
    ids, sums, payload = delta
    manifest = store.raw_manifest(new)
    header = {"kind": "delta", "base": base_step, "blocks": int(ids.size), "donated": donated or []}
    donated_bytes = store.tensor_bytes(new, donated or [])
    return _blob(header, manifest, ids, sums, payload), payload.size / new.nbytes, donated_bytes / new.nbytes


def unpack(store: ShardStore, blob: torch.Tensor | bytes | bytearray, donor_rank: int | None = None) -> int:
    """Keep a shard ``pack`` or ``pack_delta`` made (once it verifies); returns its step. Its donated
    tensors come from ``donor_rank``'s version of the same step in ``store``.

    Raises:
        CorruptShard: If it does not verify or cannot be read (nothing is kept).
    """
    raw = (blob.numpy().data if isinstance(blob, torch.Tensor) else memoryview(blob)).cast("B")
    try:
        length = int.from_bytes(raw[:_LENGTH], "little")
        header = json.loads(bytes(raw[_LENGTH : _LENGTH + length]))
        at = _LENGTH + length
        manifest, at = bytes(raw[at : at + int(header["manifest"])]), at + int(header["manifest"])
        if _manifest_hash(manifest) != header["manifest_hash"]:
            raise CorruptShard(f"a shard received whose manifest does not match its checksum ({len(manifest)} bytes)")
        if header["kind"] == "full":
            sums, at = raw[at : at + int(header["sums"])], at + int(header["sums"])
            return store.put_full(manifest, sums, raw[at:]).step
        count = int(header["blocks"])
        body = np.frombuffer(raw, dtype=np.uint8, offset=at)
        if body.size < 16 * count:
            raise ValueError(f"{body.size} bytes for {count} blocks' indices and hashes")
        ids = body[: 8 * count].copy().view(np.int64)
        sums = body[8 * count : 16 * count].copy().view(np.uint64)
        base = None if header["base"] is None else int(header["base"])
        donated = [int(i) for i in header.get("donated", [])]
        return store.put_delta(manifest, base, ids, sums, body[16 * count :], donor_rank, donated).step
    except CorruptShard:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptShard(f"a shard received that cannot be read: {exc}") from None


def exchange(
    transport: Transport, blobs: dict[int, torch.Tensor], expected: dict[int, int] | None = None
) -> list[tuple[int, torch.Tensor]]:
    """Send ``blobs[j]`` to rank j (one all-to-all); returns the non-empty blobs received, by source.

    ``expected``: the bytes each source sends here, where the caller knows them (every other source
    sends none): the all-to-all then skips its size exchange.
    """
    parts = [blobs.get(j, _EMPTY) for j in range(transport.world_size)]
    recv = None if expected is None else [expected.get(j, 0) for j in range(transport.world_size)]
    sent = [p for p in parts if p.numel()]
    flat = sent[0] if len(sent) == 1 else torch.cat(parts)  # one destination (a restore): no copy
    received, counts = transport.all_to_all_v(flat, [p.numel() for p in parts], recv)
    out, offset = [], 0
    for source, count in enumerate(counts):
        if count:
            out.append((source, received[offset : offset + count]))
        offset += count
    return out


@dataclasses.dataclass(slots=True)
class RoundRecord:
    """One replication round, as this rank saw it."""

    step: int
    """The step replicated."""
    base: int | None = None
    """The complete step it was sent as a delta against (None: whole)."""
    sent_fraction: float = 1.0
    """Of the shard's data, the part sent (the changed blocks of a delta, less the donated tensors)."""
    donated_fraction: float = 0.0
    """Of the shard's data, the tensors the peer copied from its own version of the step (dedup; with
    several peers, this and ``sent_fraction`` are the last peer's)."""
    sent_bytes: int = 0
    """Bytes this rank sent (its shard times its peers)."""
    received_bytes: int = 0
    chunks: int = 0
    windows: set[int] = dataclasses.field(default_factory=set)
    """The idle windows its chunks were sent in (``IdleGate.windows`` indices)."""
    max_delay_s: float = 0.0
    """The longest a chunk in flight held a gradient sync that began meanwhile."""
    forced_chunks: int = 0
    """Chunks sent while a sync was busy, after ``GATE_PATIENCE_S`` of waiting for it to end."""
    duration_s: float = 0.0
    cpu_s: float = 0.0
    """The replication thread's CPU time for the round, from completing the saved version on (not
    the transport's own threads)."""
    complete: bool = False
    """Every rank's replicas verified: the step is the newest complete checkpoint."""
    rejected: list[int] = dataclasses.field(default_factory=list)
    """Sources whose copy did not verify here."""


@dataclasses.dataclass(slots=True)
class StepTraffic:
    """Replication between two ``take_step`` calls (one training step)."""

    sent_bytes: int = 0
    chunks: int = 0
    forced_chunks: int = 0
    windows: set[int] = dataclasses.field(default_factory=set)
    max_delay_s: float = 0.0
    completed: list[int] = dataclasses.field(default_factory=list)
    """Steps that became complete meanwhile."""
    sent_fractions: list[float] = dataclasses.field(default_factory=list)
    """Of each completed round's shard data, the part sent (below 1: a delta, or donated tensors)."""
    donated_fractions: list[float] = dataclasses.field(default_factory=list)
    """Of each completed round's shard data, the part peers copied from their own versions."""
    round_s: list[float] = dataclasses.field(default_factory=list)
    """Each completed round's wall time, from its start to its agreement that every replica verified."""
    round_cpu_s: list[float] = dataclasses.field(default_factory=list)
    """Each completed round's CPU time on the replication thread (``RoundRecord.cpu_s``)."""
    complete_step: int | None = None
    """The newest complete step when taken."""

    def add(self, sent_bytes: int, window: int, delay_s: float, forced: bool) -> None:
        self.sent_bytes += sent_bytes
        self.chunks += 1
        self.forced_chunks += int(forced)
        self.windows.add(window)
        self.max_delay_s = max(self.max_delay_s, delay_s)


class Replicator:
    """The background replication of one rank's newest shards to its placement peers.

    Args:
        store: The host's store (this rank's versions and the replicas it holds).
        transport: A transport for this thread alone (``TorchTransport.duplicate()``: own group, the
            user's timeout); every rank of it runs a replicator.
        m: Replicas of each shard (on m other hosts).
        placement: "group" (Gemini's) or "ring" (``placement``).
        ranks_per_host: Consecutive ranks that share a host (their replicas go to other hosts).
        chunk_bytes: Bytes per chunk (the most a sync that begins mid-chunk waits for, on the wire).
        gate: The network's idle windows (``IdleGate``, fed by zensync's hook).
        deltas: Send a new version as its blocks that changed since the newest complete one, which
            every holder has (False: whole versions only).
        every: Start a round once the newest version is this many steps past the last round's (1:
            each version, as soon as the previous round ends).
        dedup: A tensor that the receiving rank holds identically in its own version of the step
            (equal digests, ``ShardStore.digests``: data parallel ranks hold the same model and
            optimizer state) is copied there from that version instead of sent (False: always sent).
        complete_step: The newest step complete on every rank (the same on all: ``Checkpointer``
            agrees on it); -1: the one this rank's store marks.
    """

    def __init__(self, store: ShardStore, transport: Transport, *, m: int, placement: str, ranks_per_host: int,
                 chunk_bytes: int, gate: IdleGate, deltas: bool = True, every: int = 1,
                 complete_step: int | None = -1, dedup: bool = True) -> None:  # fmt: skip
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.every = every
        self.store, self.transport, self.gate, self.chunk_bytes = store, transport, gate, chunk_bytes
        self.deltas, self.dedup = deltas, dedup
        # words of digests and of manifest each rank's agreement row carries (the widest seen: alike on every rank)
        self._widths = (0, 0)
        rank, n = transport.rank, transport.world_size
        self.m, self.ranks_per_host, self.placement = m, ranks_per_host, placement
        self.peers = replica_peers(rank, n, m, ranks_per_host=ranks_per_host, placement=placement)
        self.sources = replica_sources(rank, n, m, ranks_per_host=ranks_per_host, placement=placement)
        self.complete_step: int | None = store.complete_step(rank) if complete_step == -1 else complete_step
        """The newest step whose every shard has all its replicas (None: none yet)."""
        self.rounds: list[RoundRecord] = []
        self.error: BaseException | None = None
        """What ended the thread early (a peer lost, a timeout): replication stopped; training goes on."""
        self._cond = threading.Condition()
        self._wanted = -1  # the newest step saved here
        self._stopping = False
        self._step = StepTraffic()
        self._pending: collections.deque[PendingShard] = collections.deque()
        self._finished_step = -1
        self._accepting = True
        self._tried = -1  # the step of the last round finished, complete or not
        self._thread = threading.Thread(target=self._main, name="zensync-replicator", daemon=True)
        self._thread.start()

    def notify(self, step: int, pending: PendingShard | None = None) -> None:
        """A new local version of ``step`` is saved: replicate it (the thread starts a round). With
        ``pending`` (``ShardStore.write``'s), the thread first completes it (checksums, manifest): the
        saving thread goes on meanwhile."""
        with self._cond:
            accepted = pending is None or self._accepting
            if pending is not None and accepted:
                self._pending.append(pending)
            self._wanted = max(self._wanted, step)
            self._cond.notify_all()
        if not accepted:  # the thread has ended: complete it here
            assert pending is not None
            self.store.finish(pending)

    def _finish_pending(self, last: bool = False) -> None:
        """Complete the versions handed over by ``notify``, oldest first (``last``: and accept no more)."""
        while True:
            with self._cond:
                if not self._pending:
                    self._accepting = self._accepting and not last
                    return
                pending = self._pending.popleft()
            self.store.finish(pending)
            with self._cond:
                self._finished_step = pending.info.step
                self._cond.notify_all()

    def wait_finished(self, step: int, timeout_s: float | None = None) -> bool:
        """Block until this rank's version ``step`` is complete locally (``notify``'s pending one)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._finished_step >= step or not self._thread.is_alive(), timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop after one last round that every rank joins (every rank must call it); waits for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """The thread runs (it ends at ``close`` or on an error: ``error``)."""
        return self._thread.is_alive()

    def wait_complete(self, step: int, timeout_s: float | None = None) -> bool:
        """Block until ``step`` (or a later one) is complete; False when its round ended incomplete,
        the thread ended first or ``timeout_s`` passed."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._done(step) or self._tried >= step or not self._thread.is_alive(), timeout_s
            )
            return self._done(step)

    def _done(self, step: int) -> bool:
        return self.complete_step is not None and self.complete_step >= step

    def _main(self) -> None:
        attempted = -1
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(functools.partial(self._woken, attempted))
                cpu_started_s = time.thread_time()  # this thread's CPU: the version completed and its round
                self._finish_pending()
                with self._cond:
                    stopping, due = self._stopping, self._wanted >= attempted + self.every
                if not (stopping or due):
                    continue
                newest = self.store.versions(self.transport.rank)
                mine = newest[-1].step if newest else -1
                with self.store.pinned(self.transport.rank, mine):  # from the agreement to the round's end
                    offered = newest[-1] if newest and not stopping and self.dedup else None
                    agreed = self._agree(mine, stopping, offered)
                    if agreed.stops:
                        return
                    # the step replicated, not this rank's newest: a rank a save ahead comes back for its
                    # newer step (marking that one attempted left it never replicated: a hang until close)
                    attempted = max(attempted, agreed.common)
                    if agreed.common >= 0 and agreed.common > agreed.covered:
                        with self.store.pinned(self.transport.rank, agreed.common):
                            self._send(agreed, cpu_started_s)
        except BaseException as exc:  # noqa: BLE001 - the thread ends; the owner reports it
            self.error = exc
            logger.error("zensync checkpoint: replication stopped on rank %d: %r", self.transport.rank, exc)
        finally:
            try:  # versions handed over and not complete yet: complete them (their bytes are written)
                self._finish_pending(last=True)
            except OSError as exc:
                logger.error("zensync checkpoint: completing a version failed on rank %d: %r", self.transport.rank, exc)
            with self._cond:
                self._accepting = False
                self._cond.notify_all()

    def _woken(self, attempted: int) -> bool:
        return self._stopping or bool(self._pending) or self._wanted >= attempted + self.every

    def _base(self) -> int:
        """The complete step this rank can send deltas against and apply them to (-1: none): its own
        version of it and its replicas of every source's."""
        step = self.complete_step
        if step is None or not self.deltas:
            return -1
        ranks = [self.transport.rank, *self.sources]
        held = all(self.store.version(r, step) is not None for r in ranks)
        return step if held else -1

    def _agree(self, mine: int, stopping: bool, offered: ShardInfo | None) -> _Agreement:
        """Step 1's agreement: one all-gather of each rank's newest step, whether it stops, the base it
        holds, its newest complete step, and (with dedup) its tensors' digests and its manifest in that
        version, as words padded to ``_widths`` (a second all-gather at new widths when a rank's are
        wider: the first round, a new layout). The manifests let a round whose every shard is wholly
        donated (data parallel) end without another exchange (``_send``)."""
        digests, manifest = _NO_DIGESTS, b""
        if offered is not None:
            found = self.store.digests(offered)
            if found is not None:
                digests, manifest = found, self.store.raw_manifest(offered)
            if len(manifest) * self.transport.world_size > AGREEMENT_MANIFEST_BYTES:
                manifest = b""  # too many ranks for every manifest to go everywhere: the exchange carries it
        words = _words(manifest)
        complete = -1 if self.complete_step is None else self.complete_step
        fields = [mine, int(stopping), self._base(), complete, digests.size, len(manifest), _int64(manifest)]
        width_d, width_m = self._widths
        table = self._gather_row(fields, digests, words, width_d, width_m)
        need_d, need_m = int(table[:, 4].max()), -(-int(table[:, 5].max()) // 8)
        if need_d > width_d or need_m > width_m:  # every rank sees it: all gather again, wider
            self._widths = width_d, width_m = max(need_d, width_d), max(-(-need_m // 512) * 512, width_m)
            table = self._gather_row(fields, digests, words, width_d, width_m)
        bases = set(table[:, 2].tolist())
        common = int(table[:, 0].min())
        said_digests: list[np.ndarray | None] = []
        said_manifests: list[bytes | None] = []
        for row in table:
            current = int(row[0]) == common
            said_digests.append(row[_FIELDS : _FIELDS + int(row[4])].view(np.uint64) if current else None)
            text = row[_FIELDS + width_d :].view(np.uint8)[: int(row[5])].tobytes() if current else b""
            said_manifests.append(text if text and _int64(text) == int(row[6]) else None)
        return _Agreement(
            common=common,
            covered=int(table[:, 3].min()),
            base=bases.pop() if len(bases) == 1 and int(table[:, 2].min()) >= 0 else None,
            stops=bool(table[:, 1].any()),
            digests=said_digests,
            manifests=said_manifests,
        )

    def _gather_row(self, fields: list[int], digests: np.ndarray, words: np.ndarray, width_d: int,
                    width_m: int) -> np.ndarray:  # fmt: skip
        """Every rank's agreement row (its fields, then its digests and manifest words padded to the
        widths), as an int64 table with a row per rank."""
        row = np.zeros(_FIELDS + width_d + width_m, dtype=np.int64)
        row[:_FIELDS] = fields
        kept_d, kept_m = min(width_d, digests.size), min(width_m, words.size)
        row[_FIELDS : _FIELDS + kept_d] = digests.view(np.int64)[:kept_d]
        row[_FIELDS + width_d : _FIELDS + width_d + kept_m] = words[:kept_m]
        return torch.stack(self.transport.all_gather(torch.from_numpy(row))).numpy()

    def _wholly_donated(self, agreed: _Agreement) -> bool:
        """Every rank's shard of the agreed step equals each of its peers' own (every digest): every
        replica is the peer's own version under the sender's manifest, which the agreement carried."""
        n = self.transport.world_size
        for source in range(n):
            mine, text = agreed.digests[source], agreed.manifests[source]
            if mine is None or text is None or not mine.size:
                return False
            for peer in replica_peers(source, n, self.m, ranks_per_host=self.ranks_per_host, placement=self.placement):
                theirs = agreed.digests[peer]
                if theirs is None or theirs.size != mine.size or len(_donated(mine, theirs)) != mine.size:
                    return False
        return True

    def _pack(self, agreed: _Agreement, peer: int) -> tuple[torch.Tensor, float, float]:
        """This rank's version of the agreed step for ``peer``: a delta against the agreed base (or
        whole), less the tensors ``peer`` holds identically (equal digests: copied there from its own
        version). Returns ``pack_delta``'s (blob, fraction sent, fraction donated)."""
        rank = self.transport.rank
        mine = agreed.digests[rank]
        donated = _donated(mine, agreed.digests[peer])
        base = agreed.base if agreed.base is not None and agreed.base < agreed.common else None
        return pack_delta(self.store, rank, agreed.common, base, donated, 0 if mine is None else mine.size)

    def _send(self, agreed: _Agreement, cpu_started_s: float) -> None:
        """Steps 2-4 of the module docstring for the agreed step. The caller pins the step's local
        version until the round ends: saves meanwhile must not prune the version that becomes the
        newest complete one (the next round's base), nor the one peers' donated tensors come from."""
        rank, step = self.transport.rank, agreed.common
        record = RoundRecord(step, base=agreed.base if agreed.base is not None and agreed.base < step else None)
        started_s = time.perf_counter()
        if self._wholly_donated(agreed):
            self._keep_donated(agreed, record)
        else:
            self._exchange(agreed, record)
        verified = self.transport.all_gather(torch.tensor([int(not record.rejected)]))
        record.complete = all(bool(t[0]) for t in verified)
        if record.complete:
            self.store.mark_complete(rank, step)
            for source in self.sources:
                self.store.mark_complete(source, step)
            self.complete_step = step
        record.duration_s = time.perf_counter() - started_s
        record.cpu_s = time.thread_time() - cpu_started_s
        with self._cond:
            self.rounds.append(record)
            self._tried = step
            if record.complete:
                self._step.completed.append(step)
                self._step.sent_fractions.append(record.sent_fraction)
                self._step.donated_fractions.append(record.donated_fraction)
                self._step.round_s.append(record.duration_s)
                self._step.round_cpu_s.append(record.cpu_s)
            self._cond.notify_all()

    def _exchange(self, agreed: _Agreement, record: RoundRecord) -> None:
        """Steps 2-3: the packs for each peer, their sizes exchanged, then the chunks, each kept once
        it verifies (``unpack``)."""
        rank, step = self.transport.rank, agreed.common
        blobs = {}
        for peer in self.peers:
            blobs[peer], record.sent_fraction, record.donated_fraction = self._pack(agreed, peer)
        row = torch.tensor([blobs[j].numel() if j in blobs else 0 for j in range(self.transport.world_size)])
        sizes = torch.stack(self.transport.all_gather(row))  # sizes[source, destination]
        chunks = math.ceil(int(sizes.max()) / self.chunk_bytes)
        incoming = {source: bytearray(int(sizes[source, rank])) for source in self.sources}
        for k in range(chunks):
            waited = self.gate.wait_idle(GATE_PATIENCE_S)
            forced = waited is None  # a sync this long may wait on a rank whose save waits on this round
            if waited is None:
                record.forced_chunks += 1
                waited = self.gate.now()
            window, sent_s = waited
            at = k * self.chunk_bytes
            pieces = {peer: blob[at : at + self.chunk_bytes] for peer, blob in blobs.items()}
            expected = {s: max(0, min(self.chunk_bytes, int(sizes[s, rank]) - at)) for s in self.sources}
            for source, data in exchange(self.transport, pieces, expected):
                with data.numpy().data as view:
                    incoming[source][at : at + data.numel()] = view
                record.received_bytes += data.numel()
            delay_s = self.gate.chunk_done(sent_s)
            sent = sum(piece.numel() for piece in pieces.values())
            record.sent_bytes += sent
            record.max_delay_s = max(record.max_delay_s, delay_s)
            record.windows.add(window)
            record.chunks += 1
            with self._cond:
                self._step.add(sent, window, delay_s, forced)
        for source, received in incoming.items():
            try:
                unpack(self.store, received, donor_rank=rank)
            except CorruptShard as exc:
                logger.error("zensync checkpoint: rank %d's replica of step %d rejected: %s", source, step, exc)
                record.rejected.append(source)

    def _keep_donated(self, agreed: _Agreement, record: RoundRecord) -> None:
        """Step 2-4 when every shard is wholly donated: each source's replica is this rank's own
        version under the source's manifest (``ShardStore.put_delta``: linked, the table's hash checked)."""
        rank, n = self.transport.rank, self.transport.world_size
        record.sent_fraction, record.donated_fraction = 0.0, 1.0
        record.sent_bytes = len(agreed.manifests[rank] or b"") * (n - 1)  # the agreement carried it to every rank
        none = np.zeros(0, dtype=np.int64)
        for source in self.sources:
            text, digests = agreed.manifests[source], agreed.digests[source]
            assert text is not None and digests is not None  # _wholly_donated
            try:
                self.store.put_delta(text, None, none, none.view(np.uint64), none.view(np.uint8), rank,
                                     list(range(digests.size)))  # fmt: skip
            except (CorruptShard, OSError) as exc:  # not kept here: the round is incomplete, training goes on
                logger.error(
                    "zensync checkpoint: rank %d's replica of step %d rejected: %s", source, agreed.common, exc
                )
                record.rejected.append(source)
            record.received_bytes += len(text)
        with self._cond:
            self._step.sent_bytes += record.sent_bytes

    def take_step(self) -> StepTraffic:
        """What moved since the last call (the caller's per-step record), and the newest complete step."""
        with self._cond:
            done, self._step = self._step, StepTraffic()
        done.complete_step = self.complete_step
        return done

    def describe(self) -> dict[str, Any]:
        return {"peers": self.peers, "sources": self.sources, "chunk_bytes": self.chunk_bytes}
