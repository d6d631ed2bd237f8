"""Versioned checkpoint shards in a host's shared memory, as issue 18's checkpoint agent keeps them.

One shard is one rank's state at one step: every tensor's bytes back to back in ``data.bin`` and a
JSON manifest (each tensor's key, dtype, shape, offset, size and CRC-32, plus the state's JSON
values). No pickle: a shard can cross hosts and be read by anything that reads JSON and bytes.

Layout under the store's root (``/dev/shm/...`` by default: memory that outlives the worker)::

    rank<r>/v<step:010d>/data.bin        the tensors' bytes
    rank<r>/v<step:010d>/manifest.json   written last, by an atomic rename: the shard is complete
    rank<r>/complete                     the newest step replicated on every peer (``mark_complete``)

A shard whose manifest is missing was cut off mid-write (the worker died) and is never loaded; a
shard whose bytes do not match its checksums is reported and skipped. ``load`` takes the newest
complete shard that verifies, so a failure during a save leaves the previous version. ``save``
keeps the newest ``keep`` complete versions, the version marked complete on every peer
(``mark_complete``) and versions a reader holds (``pinned``), and removes the others and cut-off
writes; it reuses a removed version's file when its size fits (no fresh tmpfs pages to fault in).

Example::

    store = ShardStore("/dev/shm/zensync-job42")
    store.save(0, step=120, state={"model": model.state_dict(), "step": 120})
    state = store.load(0)  # {"model": {...tensors...}, "step": 120}, copies out of shared memory
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import pathlib
import shutil
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["CorruptShard", "PendingShard", "ShardInfo", "ShardStore", "flatten", "unflatten"]

logger = logging.getLogger(__name__)

FORMAT = 1
_SEP = "/"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}  # fmt: skip


class CorruptShard(ValueError):
    """A shard's bytes do not match its manifest (a checksum, a size or the manifest itself)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PendingShard:
    """A version whose tensors are written and whose checksums and manifest are not (``ShardStore.write``)."""

    info: ShardInfo
    manifest: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    """One complete shard on disk (its manifest read, its bytes not yet checked)."""

    rank: int
    step: int
    path: pathlib.Path
    nbytes: int


def flatten(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON values) of a nested dict, keyed by '/'-joined paths (tuples come back as lists).

    Raises:
        ValueError: For a key containing '/', a non-string key, or a leaf that is neither a tensor
            nor a JSON value (no pickle: a shard must be readable anywhere).
    """
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint state must be a dict, got {type(state).__name__}")
    for key, value in state.items():
        path = f"{prefix}{_encode_key(key, prefix)}"
        if isinstance(value, dict) and value:
            inner_tensors, inner_values = flatten(value, path + _SEP)
            tensors.update(inner_tensors)
            values.update(inner_values)
        elif isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise ValueError(f"checkpoint tensor {path!r} is a {type(value).__name__}: store plain tensors")
            if value.dtype not in _DTYPES.values() or value.is_sparse:
                raise ValueError(f"checkpoint tensor {path!r}: {value.dtype} {value.layout} is not stored")
            tensors[path] = value
        else:
            try:
                json.dumps(value, allow_nan=True)
            except (TypeError, ValueError):
                raise ValueError(
                    f"checkpoint value {path!r} is a {type(value).__name__}: only tensors and JSON values are stored"
                ) from None
            values[path] = value
    return tensors, values


def _encode_key(key: Any, prefix: str) -> str:
    """A dict key as a path part: a string as is, an int (an optimizer's parameter index) as '#<int>'."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"#{key}"
    if not isinstance(key, str) or not key or _SEP in key or key.startswith("#"):
        raise ValueError(
            f"checkpoint key {key!r} at {prefix or '<root>'!r}: keys are ints or non-empty strings without '/' "
            f"that do not start with '#'"
        )
    return key


def _decode_key(part: str) -> str | int:
    return int(part[1:]) if part.startswith("#") else part


def unflatten(flat: dict[str, Any]) -> dict[str | int, Any]:
    """``flatten``'s inverse (tensors and values merged; '#<int>' parts back to int keys)."""
    out: dict[str | int, Any] = {}
    for path, value in flat.items():
        *parents, leaf = (_decode_key(part) for part in path.split(_SEP))
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class ShardStore:
    """The versioned shards of every rank of one host, under ``root``.

    Args:
        root: Directory for the shards (created). Put it on a tmpfs (``/dev/shm``) for memory speed;
            the files outlive the processes that wrote them until ``clear`` or a reboot.
        keep: Complete versions kept per rank (>= 1); older ones are removed after each save.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        self.root, self.keep = pathlib.Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pins: dict[tuple[int, int], int] = {}
        """(rank, step) -> readers holding that version (``pinned``): never pruned or reused meanwhile."""

    def _dir(self, rank: int, step: int) -> pathlib.Path:
        return self.root / f"rank{rank}" / f"v{step:010d}"

    def save(self, rank: int, step: int, state: dict[str, Any]) -> ShardInfo:
        """Write ``rank``'s ``state`` at ``step`` as a new complete version; returns it.

        Tensors are written once, straight into the shared-memory file; the manifest is renamed into
        place last, so a crash mid-save leaves no complete shard for ``step``.

        Raises:
            ValueError: As ``write``.
        """
        return self.finish(self.write(rank, step, state))

    def write(self, rank: int, step: int, state: dict[str, Any]) -> PendingShard:
        """The first half of ``save``: the tensors written, the version not complete yet (no
        checksums, no manifest) and kept from pruning until ``finish`` completes it, on any thread:
        the state may change once this returns (its bytes are in the store).

        Raises:
            ValueError: For a state ``flatten`` refuses, a negative step or rank, or a step at or below
                the newest complete version's (versions only go forward).
        """
        if rank < 0 or step < 0:
            raise ValueError(f"rank={rank} and step={step} must be >= 0")
        tensors, values = flatten(state)
        newest = self.versions(rank)
        if newest and newest[-1].step >= step:
            raise ValueError(f"rank {rank} has a complete version at step {newest[-1].step}; step={step} must be later")
        entries: list[dict[str, Any]] = []
        offset = 0
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            entries.append({"key": key, "dtype": str(tensor.dtype).removeprefix("torch."),
                            "shape": list(tensor.shape), "offset": offset, "nbytes": nbytes})  # fmt: skip
            offset += nbytes
        target = self._claim(rank, step, offset)
        self._pin(rank, step, +1)
        with open(target / "data.bin", "r+b" if (target / "data.bin").exists() else "w+b") as f:
            f.truncate(offset)
            for tensor in tensors.values():
                _write(f, tensor)
        manifest = {"format": FORMAT, "rank": rank, "step": step, "nbytes": offset, "entries": entries}
        manifest["values"] = values
        return PendingShard(ShardInfo(rank, step, target, offset), manifest)

    def finish(self, pending: PendingShard) -> ShardInfo:
        """Complete a version ``write`` began: each tensor's CRC-32 from the written bytes, then the
        manifest renamed into place; older versions pruned."""
        info, manifest = pending.info, pending.manifest
        try:
            if info.nbytes:
                with (
                    open(info.path / "data.bin", "rb") as f,
                    mmap.mmap(f.fileno(), info.nbytes, access=mmap.ACCESS_READ) as buf,
                ):
                    for entry in manifest["entries"]:
                        with memoryview(buf)[entry["offset"] : entry["offset"] + entry["nbytes"]] as view:
                            entry["crc32"] = zlib.crc32(view) if entry["nbytes"] else 0
            else:
                for entry in manifest["entries"]:
                    entry["crc32"] = 0
            tmp = info.path / "manifest.json.tmp"
            tmp.write_text(json.dumps(manifest))
            os.replace(tmp, info.path / "manifest.json")
        finally:
            self._pin(info.rank, info.step, -1)
        self._prune(info.rank)
        return info

    def _claim(self, rank: int, step: int, nbytes: int) -> pathlib.Path:
        """The directory of ``rank``'s new version ``step``: a version the save will prune, renamed, when
        its data file has ``nbytes`` bytes (its manifest removed first: never complete with old bytes),
        else a new one."""
        target = self._dir(rank, step)
        if target.exists():  # a cut-off write of this step
            shutil.rmtree(target)
        with self._lock:
            infos = self.versions(rank)
            kept = self._kept(rank, self.keep - 1, infos)
            for info in infos:
                data = info.path / "data.bin"
                if info.path not in kept and data.exists() and data.stat().st_size == nbytes:
                    (info.path / "manifest.json").unlink()
                    info.path.rename(target)
                    return target
        target.mkdir(parents=True)
        return target

    def _kept(self, rank: int, newest: int, infos: list[ShardInfo]) -> set[pathlib.Path]:
        """Of ``infos`` (``versions(rank)``), the ones pruning keeps: the ``newest`` newest, the one
        marked complete, and the pinned writes (the caller holds ``_lock``)."""
        complete = self.complete_step(rank)
        pinned = {s for (r, s), n in self._pins.items() if r == rank and n > 0}
        kept = {info.path for info in infos[max(0, len(infos) - newest) :]} if newest > 0 else set()
        kept |= {self._dir(rank, step) for step in pinned}  # pinned writes not finished are kept too
        return kept | {info.path for info in infos if info.step == complete}

    @contextmanager
    def pinned(self, rank: int, step: int) -> Iterator[None]:
        """Keep ``rank``'s version ``step`` while the block reads it (a replicator on another thread)."""
        self._pin(rank, step, +1)
        try:
            yield
        finally:
            self._pin(rank, step, -1)

    def _pin(self, rank: int, step: int, change: int) -> None:
        with self._lock:
            self._pins[rank, step] = self._pins.get((rank, step), 0) + change

    def mark_complete(self, rank: int, step: int) -> None:
        """Record that ``rank``'s version ``step`` has all its replicas (kept until a newer one has)."""
        tmp = self.root / f"rank{rank}" / "complete.tmp"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, tmp.with_suffix(""))

    def complete_step(self, rank: int) -> int | None:
        """The step ``mark_complete`` last recorded for ``rank`` (None: none)."""
        try:
            return int(json.loads((self.root / f"rank{rank}" / "complete").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def versions(self, rank: int) -> list[ShardInfo]:
        """``rank``'s complete shards (a manifest in place), oldest first; their bytes are not checked."""
        base = self.root / f"rank{rank}"
        if not base.is_dir():
            return []
        found = []
        for child in sorted(base.iterdir()):
            manifest = child / "manifest.json"
            if child.name.startswith("v") and child.is_dir() and manifest.is_file():
                try:
                    data = json.loads(manifest.read_text())
                    found.append(ShardInfo(rank, int(data["step"]), child, int(data["nbytes"])))
                except (ValueError, KeyError, TypeError) as exc:
                    logger.warning("zensync checkpoint: unreadable manifest %s skipped: %s", manifest, exc)
        return sorted(found, key=lambda info: info.step)

    def version(self, rank: int, step: int) -> ShardInfo | None:
        """``rank``'s complete version of ``step`` (None: none)."""
        return next((info for info in self.versions(rank) if info.step == step), None)

    def load(self, rank: int, step: int | None = None) -> dict[str | int, Any]:
        """The newest complete shard of ``rank`` that verifies (or the one at ``step``), as a nested
        dict of tensors (copied out of shared memory) and values.

        Raises:
            FileNotFoundError: If ``rank`` has no complete shard (at ``step``, when given) that verifies;
                the message lists the corrupt ones skipped.
        """
        candidates = [v for v in self.versions(rank) if step is None or v.step == step]
        skipped = []
        for info in reversed(candidates):
            try:
                return self.read(info)
            except CorruptShard as exc:
                logger.error("zensync checkpoint: %s", exc)
                skipped.append(str(exc))
        wanted = f"at step {step}" if step is not None else "complete"
        raise FileNotFoundError(f"no {wanted} checkpoint shard of rank {rank} under {self.root} verifies"
                                + (f"; skipped: {skipped}" if skipped else ""))  # fmt: skip

    def read(self, info: ShardInfo) -> dict[str | int, Any]:
        """One shard, checked against its manifest (sizes and every tensor's CRC-32).

        Raises:
            CorruptShard: On any mismatch.
        """
        manifest, nbytes = self._manifest(info)
        entries, data = manifest["entries"], info.path / "data.bin"
        flat: dict[str, Any] = dict(manifest.get("values", {}))
        if nbytes:
            with open(data, "rb") as f, mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY) as buf:
                for entry in entries:
                    flat[entry["key"]] = _read(buf, entry, info.path)
        else:
            for entry in entries:
                flat[entry["key"]] = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        return unflatten(flat)

    def raw(self, info: ShardInfo) -> tuple[bytes, bytes]:
        """(manifest text, data bytes) of a complete shard, as they are on disk (for a peer's copy)."""
        return self.raw_manifest(info), (info.path / "data.bin").read_bytes()

    def raw_manifest(self, info: ShardInfo) -> bytes:
        """A complete shard's manifest text, as it is on disk."""
        return (info.path / "manifest.json").read_bytes()

    def put_raw(self, manifest: bytes, data: bytes | memoryview) -> ShardInfo:
        """Store a shard ``raw`` gave (another host's), as complete only once it verifies.

        Raises:
            CorruptShard: If the manifest is unreadable or the bytes do not match it (nothing is kept).
        """
        header, rank, step, _ = _header(manifest)
        held = self.version(rank, step)
        if held is not None and self.raw_manifest(held) == manifest:
            self.verify(held)  # the same version, already here (a host holding its own replica)
            return held
        return self._received(manifest, header, data)

    def put_delta(self, manifest: bytes, base_step: int, block_bytes: int, blocks: torch.Tensor,
                  data: bytes | memoryview) -> ShardInfo:  # fmt: skip
        """Store a shard sent as the blocks that changed since version ``base_step`` of the same rank,
        held here: the base's bytes copied (by the kernel), the changed ``blocks`` (indices of
        ``block_bytes``-byte blocks, ``data`` their bytes back to back) written over them, then
        verified against ``manifest`` like ``put_raw``.

        Raises:
            CorruptShard: If the manifest is unreadable, the base is missing, or the result does not
                verify (nothing is kept).
        """
        header, rank, step, nbytes = _header(manifest)
        base = self.version(rank, base_step)
        if base is None:
            raise CorruptShard(f"a delta of rank {rank}'s step {step} against step {base_step}, which is not here")
        if base.nbytes != nbytes:
            raise CorruptShard(f"a delta of rank {rank}'s step {step} ({nbytes} bytes) against {base.nbytes} bytes")
        rebuilt = bytearray(nbytes)
        with self.pinned(rank, base_step), open(base.path / "data.bin", "rb") as f:
            f.readinto(rebuilt)
        _patch(rebuilt, block_bytes, blocks, data, f"rank {rank}'s step {step}")
        return self._received(manifest, header, rebuilt)

    def _received(self, manifest: bytes, header: dict[str, Any], data: bytes | bytearray | memoryview) -> ShardInfo:
        """Verify a received shard's bytes in memory against its manifest (``header``, parsed by
        ``_header``), then write them as a complete version (into a version the save prunes, when one
        of that size is there: no fresh pages, no unlink).

        Raises:
            CorruptShard: If they do not match the manifest (nothing is written).
        """
        rank, step, nbytes, entries = header["rank"], header["step"], header["nbytes"], header["entries"]
        where = f"rank {rank}'s step {step} received"
        if len(data) != nbytes:
            raise CorruptShard(f"{where}: {len(data)} bytes, the manifest {nbytes}")
        with memoryview(data) as view:
            _check(entries, view.cast("B"), where)
            target = self._claim(rank, step, nbytes)
            with open(target / "data.bin", "r+b" if (target / "data.bin").exists() else "w+b") as f:
                f.truncate(nbytes)
                f.write(view)
        (target / "manifest.json.tmp").write_bytes(manifest)
        os.replace(target / "manifest.json.tmp", target / "manifest.json")
        self._prune(rank)
        return ShardInfo(rank, step, target, nbytes)

    def newest_verified(self, rank: int) -> ShardInfo | None:
        """``rank``'s newest complete shard whose bytes verify (None: none)."""
        return next((info for info in reversed(self.versions(rank)) if self._verifies(info)), None)

    def verified(self, rank: int) -> list[int]:
        """The steps of ``rank``'s complete versions whose bytes verify, oldest first."""
        return [info.step for info in self.versions(rank) if self._verifies(info)]

    def _verifies(self, info: ShardInfo) -> bool:
        """Whether ``verify`` passes (a failure is logged)."""
        try:
            self.verify(info)
        except CorruptShard as exc:
            logger.error("zensync checkpoint: %s", exc)
            return False
        return True

    def verify(self, info: ShardInfo) -> None:
        """Check a shard's bytes against its manifest (sizes and CRC-32s) without copying them out.

        Raises:
            CorruptShard: On any mismatch.
        """
        manifest, nbytes = self._manifest(info)
        if nbytes:
            with open(info.path / "data.bin", "rb") as f, mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ) as buf:
                _check(manifest["entries"], buf, str(info.path))

    def _manifest(self, info: ShardInfo) -> tuple[dict[str, Any], int]:
        """A shard's manifest and data size, checked against its data file's size."""
        try:
            text = (info.path / "manifest.json").read_bytes()
        except OSError as exc:
            raise CorruptShard(f"{info.path}: manifest unreadable: {exc}") from None
        manifest, _, _, nbytes = _header(text, str(info.path))
        data = info.path / "data.bin"
        size = data.stat().st_size if data.exists() else -1
        if size != nbytes:
            raise CorruptShard(f"{info.path}: data.bin holds {size} bytes, the manifest {nbytes}")
        return manifest, nbytes

    def ranks(self) -> list[int]:
        """The ranks this store holds shards of (its own and peers' replicas)."""
        found = [int(p.name[4:]) for p in self.root.glob("rank*") if p.name[4:].isdigit()]
        return sorted(found)

    def _prune(self, rank: int) -> None:
        """Keep the newest ``keep`` complete versions of ``rank``; remove older ones and cut-off writes."""
        with self._lock:
            kept = self._kept(rank, self.keep, self.versions(rank))
            for child in (self.root / f"rank{rank}").iterdir():
                if child.is_dir() and child not in kept:  # older versions, cut-off writes (one writer per rank)
                    shutil.rmtree(child, ignore_errors=True)

    def discard_after(self, step: int) -> None:
        """Remove every rank's versions after ``step`` (a restored run's abandoned future)."""
        for rank in self.ranks():
            for info in self.versions(rank):
                if info.step > step:
                    shutil.rmtree(info.path, ignore_errors=True)

    def clear(self) -> None:
        """Remove every shard under the root."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)


def _write(f: Any, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s bytes at ``f``'s position (one copy, by the kernel into tmpfs: no page faults
    in a mapping)."""
    if not tensor.numel():
        return
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    with flat.numpy().data as view:
        f.write(view)


def _read(buf: mmap.mmap, entry: dict[str, Any], path: pathlib.Path) -> torch.Tensor:
    """One entry's tensor, copied out of ``buf`` (a private, writable map) after its checksum.

    Raises:
        CorruptShard: If the entry lies outside the data, or its bytes or size do not match.
    """
    offset, nbytes = _span(entry, len(buf), path)
    dtype = _DTYPES[entry["dtype"]]
    out = torch.empty(entry["shape"], dtype=dtype)
    if out.numel() * out.element_size() != nbytes:
        raise CorruptShard(f"{path}: {entry['key']!r} has {nbytes} bytes for shape {entry['shape']} {dtype}")
    if not nbytes:
        return out
    with memoryview(buf)[offset : offset + nbytes] as view:
        if zlib.crc32(view) != entry.get("crc32"):
            raise CorruptShard(f"{path}: {entry['key']!r} does not match its checksum")
        source = torch.frombuffer(view, dtype=torch.uint8)
        try:
            out.view(-1).view(torch.uint8).copy_(source)
        finally:
            del source
    return out


def _header(manifest: bytes, where: str = "a shard received") -> tuple[dict[str, Any], int, int, int]:
    """A manifest's JSON with its rank, step and data size checked (as ints) and its entries a list.

    Raises:
        CorruptShard: If it is not such a manifest.
    """
    try:
        header = json.loads(manifest)
        header["rank"], header["step"], header["nbytes"] = (
            int(header["rank"]),
            int(header["step"]),
            int(header["nbytes"]),
        )
        if not isinstance(header["entries"], list):
            raise TypeError("entries is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptShard(f"{where}: manifest unreadable: {exc}") from None
    return header, header["rank"], header["step"], header["nbytes"]


def _check(entries: list[dict[str, Any]], buf: Any, where: str) -> None:
    """Every entry of a manifest inside ``buf`` (a buffer of the data) and matching its CRC-32.

    Raises:
        CorruptShard: On any mismatch.
    """
    for entry in entries:
        offset, size = _span(entry, len(buf), pathlib.Path(where))
        with memoryview(buf)[offset : offset + size] as view:
            if size and zlib.crc32(view) != entry.get("crc32"):
                raise CorruptShard(f"{where}: {entry['key']!r} does not match its checksum")


def _patch(out: bytearray, block_bytes: int, blocks: torch.Tensor, data: bytes | memoryview, what: str) -> None:
    """Write ``data`` (the ``block_bytes`` blocks ``blocks`` back to back, the last block of ``out``
    possibly short) over ``out``'s blocks.

    Raises:
        CorruptShard: If the blocks and the data do not fit ``out``.
    """
    n, full = len(out), len(out) // block_bytes
    tail = n - full * block_bytes
    whole = blocks[blocks < full]
    short = blocks.numel() - whole.numel()  # the last block, if it is short and sent: at most once, last
    fits = bool((blocks >= 0).all()) and bool((blocks <= full).all()) and short <= (1 if tail else 0)
    if not fits or (short and int(blocks[-1]) != full) or whole.numel() * block_bytes + short * tail != len(data):
        raise CorruptShard(f"a delta of {what} does not fit its {n} bytes (blocks {blocks[:5].tolist()}...)")
    target = torch.frombuffer(out, dtype=torch.uint8)
    source = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    if whole.numel():
        target[: full * block_bytes].view(full, block_bytes)[whole] = source[: whole.numel() * block_bytes].view(
            -1, block_bytes
        )
    if whole.numel() < blocks.numel():  # the short last block
        target[full * block_bytes :] = source[whole.numel() * block_bytes :]


def _span(entry: dict[str, Any], size: int, path: pathlib.Path) -> tuple[int, int]:
    """(offset, nbytes) of a manifest entry, checked to lie inside ``size`` bytes with a known dtype.

    Raises:
        CorruptShard: If it does not.
    """
    try:
        offset, nbytes, dtype = int(entry["offset"]), int(entry["nbytes"]), entry["dtype"]
    except (KeyError, TypeError, ValueError):
        raise CorruptShard(f"{path}: a manifest entry is malformed: {entry!r}") from None
    if dtype not in _DTYPES or offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise CorruptShard(f"{path}: entry {entry.get('key')!r} ({dtype}, bytes {offset}+{nbytes}) is out of place")
    return offset, nbytes
