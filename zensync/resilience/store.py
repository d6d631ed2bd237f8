"""Versioned checkpoint shards in a host's shared memory, as issue 18's checkpoint agent keeps them.

One shard is one rank's state at one step: every tensor's bytes in ``data.bin`` (each at a multiple
of 64 bytes), one 64-bit hash per block (a row, or a whole tensor: ``blocks``) in ``sums.bin``, and a
JSON manifest (each tensor's key, dtype, shape, offset, size and blocks, the sums table's hash, the
state's JSON values). No pickle: a shard can cross hosts and be read by anything that reads JSON and
bytes.

Layout under the store's root (``/dev/shm/...`` by default: memory that outlives the worker)::

    rank<r>/v<step:010d>/data.bin        the tensors' bytes
    rank<r>/v<step:010d>/sums.bin        a hash per block
    rank<r>/v<step:010d>/manifest.json   written last, by an atomic rename: the shard is complete
    rank<r>/complete                     the newest step replicated on every peer (``mark_complete``)
    rank<r>/spare<step>/                 a version no longer kept, its manifest renamed layout.json:
                                         the next save's pages (``SPARES``)
    rank<r>/v<step:010d>/linked          a peer's replica whose files are links to this host's own
                                         version of the step (``put_delta`` with every tensor donated)

A shard whose manifest is missing was cut off mid-write (the worker died) and is never loaded; a
shard whose bytes do not match its hashes is reported and skipped. ``load`` takes the newest
complete shard that verifies, so a failure during a save leaves the previous version. ``save``
keeps the newest ``keep`` complete versions, the version marked complete on every peer
(``mark_complete``) and versions a reader holds (``pinned``), and overwrites an older one of the
same layout in place: only the blocks that changed since that version are written (and hashed, in
the same pass), into pages already mapped. A replica from a peer arrives whole (``put_full``) or as
the blocks that changed since a version both hold (``delta`` -> ``put_delta``), less the tensors the
receiver holds identically in its own version of the step (equal ``digests``: data parallel ranks),
which it copies from there, or, when that is every tensor, links (no copy; a linked version is never
written over while the link stands).

Example::

    store = ShardStore("/dev/shm/zensync-job42")
    store.save(0, step=120, state={"model": model.state_dict(), "step": 120})
    state = store.load(0)  # {"model": {...tensors...}, "step": 120}, copies out of shared memory
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from zensync.resilience.blocks import (
    Entry,
    Mapped,
    changed,
    copy_from,
    copy_hash_in,
    entries_for,
    entry_digests,
    gather,
    hash_bytes,
    hash_in,
    hash_of,
    payload_places,
    write_blocks,
)

__all__ = ["CorruptShard", "PendingShard", "ShardInfo", "ShardStore", "flatten", "unflatten"]

logger = logging.getLogger(__name__)

FORMAT = 2
SPARES = 1
"""Versions past ``keep`` held per rank as spares: the next save overwrites one in place (its pages
mapped, only its stale blocks written) instead of writing a new file."""
_PATHS = 4096
"""Version paths ``ShardStore._dir`` remembers (then it starts again)."""
_LAYOUTS = 16
"""Layouts ``ShardStore._layout_of`` remembers (then it starts again)."""
_Seen = dict[Any, list[Entry]]
"""Files a verification checked: (data inode, sums inode, table hash) -> the entries checked."""
LINKED = "linked"
"""A version's marker file: its data and sums files are links to a donor's (``ShardStore._link``)."""
_SEP = "/"
_SCALARS = (int, float, str, bool, type(None))
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}  # fmt: skip

_ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in _DTYPES.items()}


class CorruptShard(ValueError):
    """A shard's bytes do not match its manifest (a checksum, a size or the manifest itself)."""


@dataclasses.dataclass(slots=True)
class PendingShard:
    """A version whose blocks are written and whose manifest is not (``ShardStore.write``)."""

    info: ShardInfo
    manifest: dict[str, Any]
    text: tuple[str, str] = ("", "")
    """The manifest's entries and values as JSON (``finish`` writes the manifest from them)."""
    written: int = 0
    """Bytes written (the blocks that changed)."""
    violations: list[str] = dataclasses.field(default_factory=list)
    """Tensors whose listed changed rows missed a change (``write``'s audit): written by hashes."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    """One complete shard on disk (its manifest read, its bytes not yet checked)."""

    rank: int
    step: int
    path: pathlib.Path
    nbytes: int


def flatten(state: Any, prefix: str = "", check: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON values) of a nested dict, keyed by '/'-joined paths (tuples come back as lists).
    ``check`` False: the values are not checked to be JSON here (``ShardStore.write`` encodes them
    once, and raises as this would).

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
            inner_tensors, inner_values = flatten(value, path + _SEP, check)
            tensors.update(inner_tensors)
            values.update(inner_values)
        elif isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise ValueError(f"checkpoint tensor {path!r} is a {type(value).__name__}: store plain tensors")
            if value.dtype not in _DTYPES.values() or value.is_sparse:
                raise ValueError(f"checkpoint tensor {path!r}: {value.dtype} {value.layout} is not stored")
            tensors[path] = value
        else:
            if check and type(value) not in _SCALARS:  # a scalar is JSON as it is; a container is checked
                _json_value(path, value)
            values[path] = value
    return tensors, values


def _json_value(path: str, value: Any) -> str:
    """``value`` as JSON.

    Raises:
        ValueError: Naming ``path``, when it is not a JSON value.
    """
    try:
        return json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        raise ValueError(
            f"checkpoint value {path!r} is a {type(value).__name__}: only tensors and JSON values are stored"
        ) from None


def _values_json(values: dict[str, Any]) -> str:
    """A flattened state's values as one JSON object (one encoding, which is also their check).

    Raises:
        ValueError: Naming the first value that is not JSON.
    """
    try:
        return json.dumps(values, allow_nan=True)
    except (TypeError, ValueError):
        for path, value in values.items():
            _json_value(path, value)
        raise


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
        self._lock = threading.RLock()
        self._pins: dict[tuple[int, int], int] = {}
        """(rank, step) -> readers holding that version (``pinned``): never pruned or reused meanwhile."""
        self._maps: dict[int, Mapped] = {}
        """Writable maps of the versions this process writes, by data file inode (kept across saves:
        a recycled version's pages are mapped once, not faulted in again at every save)."""
        self._paths: dict[tuple[int, int], pathlib.Path] = {}
        self._complete: dict[int, tuple[tuple[int, int, int], int]] = {}
        """``complete_step``'s last reads: rank -> (the file's inode, mtime and size; the step)."""
        self._layouts: dict[tuple[Any, ...], tuple[list[Entry], int, int, list[Any], str]] = {}
        """``_layout_of``'s, by the tensors' names, dtypes and shapes."""

    def _dir(self, rank: int, step: int) -> pathlib.Path:
        found = self._paths.get((rank, step))
        if found is None:  # a path object is built once per version (the hot paths name each version often)
            if len(self._paths) >= _PATHS:
                self._paths.clear()
            found = self._paths[rank, step] = pathlib.Path(f"{self.root}/rank{rank}/v{step:010d}")
        return found

    # -- writing this rank's versions --------------------------------------------------------------
    def save(self, rank: int, step: int, state: dict[str, Any], **kw: Any) -> ShardInfo:
        """Write ``rank``'s ``state`` at ``step`` as a new complete version; returns it.

        Tensors are written once, straight into the shared-memory file; the manifest is renamed into
        place last, so a crash mid-save leaves no complete shard for ``step``.

        Raises:
            ValueError: As ``write``.
        """
        return self.finish(self.write(rank, step, state, **kw))

    def write(self, rank: int, step: int, state: dict[str, Any], changed: dict[str, np.ndarray] | None = None,
              since: int | None = None, audit_rows: int = 0,
              flat: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None) -> PendingShard:  # fmt: skip
        """The first half of ``save``: the tensors' changed blocks written and hashed, the version not
        complete yet (no manifest) and kept from pruning until ``finish`` completes it, on any thread:
        the state may change once this returns (its bytes are in the store).

        The version overwrites an older one of the same layout when one can go (its unchanged blocks
        are not written again). Which blocks changed: for a tensor in ``changed``, the blocks (rows)
        it lists as changed since this rank's version ``since`` (``dirty.ChangeTracker``), plus
        ``audit_rows`` random others, whose hashes must match version ``since``'s (a mismatch: the
        tensor's listing was wrong; it is rewritten whole and its key is in ``violations``); for any
        other tensor, the blocks whose hashes differ from the overwritten version's. ``flat``:
        ``flatten(state)``, when the caller has it (not flattened again).

        Raises:
            ValueError: For a state ``flatten`` refuses, a negative step or rank, or a step at or below
                the newest complete version's (versions only go forward).
        """
        if rank < 0 or step < 0:
            raise ValueError(f"rank={rank} and step={step} must be >= 0")
        tensors, values = flat if flat is not None else flatten(state)  # ``flat``: the caller flattened it already
        values_text = _values_json(values)
        entries, nbytes, nsums, described, entries_text = self._layout_of(tensors)
        manifest = {"format": FORMAT, "rank": rank, "step": step, "nbytes": nbytes, "nsums": nsums,
                    "entries": described, "values": values}  # fmt: skip
        target, recycled = self._claim(rank, step, manifest, forward=True)  # pinned until ``finish``
        try:
            dst = self._mapped(target, nbytes, nsums, create=not recycled)
            dst.layout, dst.entries, dst.sums_hash = _layout(manifest), entries, None
            ref = self._reference(rank, since, manifest) if recycled and changed else None
            pending = PendingShard(ShardInfo(rank, step, target, nbytes), manifest, (entries_text, values_text))
            for entry, tensor in zip(entries, tensors.values(), strict=True):
                rows = changed.get(entry.key) if changed is not None and ref is not None else None
                if rows is None or entry.blocks == 1:
                    pending.written += int(write_blocks(dst, entry, tensor, None).size) * entry.block_bytes
                    continue
                assert ref is not None
                span = slice(entry.first, entry.first + entry.blocks)
                audit = _audited(entry.blocks, min(audit_rows, entry.blocks), step)
                listed = np.zeros(entry.blocks, dtype=bool)
                listed[rows] = True
                unlisted = audit[~listed[audit]]
                wanted = (dst.sums[span] != ref.sums[span]) | listed  # also the rows changed between the two versions
                wanted[audit] = True
                write = np.flatnonzero(wanted)
                write_blocks(dst, entry, tensor, write)
                if (dst.sums[span][unlisted] != ref.sums[span][unlisted]).any():
                    pending.violations.append(entry.key)  # the listing missed a change: rewrite by hashes
                    write = write_blocks(dst, entry, tensor, None)
                pending.written += int(write.size) * entry.block_bytes
        except BaseException:  # nothing to finish: the version is left to pruning
            self._pin(rank, step, -1)
            raise
        return pending

    def _layout_of(self, tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], int, int, list[Any], str]:
        """``blocks.entries_for(tensors)``, the entries as JSON values and as JSON text: computed once
        per layout (a training run saves one layout again and again)."""
        key = tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
        found = self._layouts.get(key)
        if found is None:
            entries, nbytes, nsums = entries_for(tensors)
            described = [e.to_json() for e in entries]
            found = entries, nbytes, nsums, described, json.dumps(described)
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            self._layouts[key] = found
        return found

    def _reference(self, rank: int, since: int | None, manifest: dict[str, Any]) -> Mapped | None:
        """This rank's version ``since`` (written by this process, complete or not), when its layout
        is ``manifest``'s: the base that ``write``'s ``changed`` rows are relative to."""
        if since is None:
            return None
        found = self._described(self._dir(rank, since), "manifest.json")
        return found if found is not None and found.layout == _layout(manifest) else None

    def _described(self, directory: pathlib.Path, described: str) -> Mapped | None:
        """A version's map, with its layout and entries: from the cache (a version this process
        wrote), else from its ``described`` file (its manifest, or a spare's layout); None when it
        cannot be read."""
        try:
            inode = os.stat(f"{directory}/data.bin").st_ino
        except OSError:
            return None
        with self._lock:
            cached = self._maps.get(inode)
            if cached is not None and cached.entries is not None and cached.valid(directory):
                return cached
        try:
            header, _, _, nbytes = _header((directory / described).read_bytes(), str(directory))
            entries = _entries(header, str(directory))
            mapped = self._mapped(directory, nbytes, header["nsums"])
        except (OSError, ValueError):  # CorruptShard is a ValueError
            return None
        mapped.layout, mapped.entries, mapped.sums_hash = _layout(header), entries, None
        return mapped

    def finish(self, pending: PendingShard) -> ShardInfo:
        """Complete a version ``write`` began: the sums table's hash into the manifest, the manifest
        renamed into place; older versions pruned."""
        info, manifest = pending.info, pending.manifest
        try:
            dst = self._mapped(info.path, info.nbytes, manifest["nsums"])
            manifest["sums_hash"] = dst.sums_hash = f"{hash_bytes(dst.sums):016x}"
            entries_text, values_text = pending.text
            text = (json.dumps(manifest) if not entries_text else  # json.dumps(manifest)'s text, from its parts
                    f'{{"format": {FORMAT}, "rank": {info.rank}, "step": {info.step}, "nbytes": {info.nbytes}, '
                    f'"nsums": {manifest["nsums"]}, "entries": {entries_text}, "values": {values_text}, '
                    f'"sums_hash": "{manifest["sums_hash"]}"}}')  # fmt: skip
            _publish(f"{info.path}/manifest.json", text.encode())
        finally:
            self._pin(info.rank, info.step, -1)
        self._prune(info.rank)
        return info

    def _claim(self, rank: int, step: int, manifest: dict[str, Any],
               forward: bool = False) -> tuple[pathlib.Path, bool]:  # fmt: skip
        """The directory of ``rank``'s new version ``step``, and whether it holds an older version of
        the same layout (whose sums table describes its bytes): a spare (``_prune``), else a version
        the save will prune, renamed (its manifest removed first: never complete with old bytes),
        else a new one. The version is pinned before the lock is let go (the caller releases it):
        a prune on another thread would otherwise take the directory, which has no manifest yet,
        for a cut-off write and remove it.

        Raises:
            ValueError: With ``forward``, when ``rank`` has a complete version at ``step`` or later
                (its own versions only go forward).
        """
        target = self._dir(rank, step)
        base = f"{self.root}/rank{rank}"
        with self._lock:
            names, infos = self._listing(rank)
            if forward and infos and infos[-1].step >= step:
                raise ValueError(f"rank {rank} has a complete version at step {infos[-1].step}; step={step} must be "
                                 f"later")  # fmt: skip
            if target.name in names:  # a cut-off write of this step (or a replica received again)
                self._remove(target)
                names, infos = self._listing(rank)
            kept = self._kept(rank, self.keep - 1, infos)
            candidates = [(name, "layout.json") for name in names if name.startswith("spare")]
            candidates += [(i.path.name, "manifest.json") for i in infos if i.path.name not in kept]
            layout = _layout(manifest)
            for name, described in candidates:
                directory = f"{base}/{name}"
                if _links(directory) > 1:  # its bytes are also another version's (``_link``): never written over
                    continue
                found = self._described(pathlib.Path(directory), described)
                if found is not None and found.layout == layout:
                    os.unlink(f"{directory}/{described}")
                    os.rename(directory, target)
                    self._pin(rank, step, +1)
                    return target, True
            target.mkdir(parents=True)
            self._pin(rank, step, +1)
            return target, False

    def _mapped(self, directory: pathlib.Path, nbytes: int, nsums: int, create: bool = False) -> Mapped:
        """A writable map of a version this process writes, from the cache when still valid."""
        with self._lock:
            try:
                inode = os.stat(f"{directory}/data.bin").st_ino
            except FileNotFoundError:
                inode = -1
            cached = self._maps.pop(inode, None)
            if cached is not None and cached.valid(directory) and (cached.nbytes, cached.nsums) == (nbytes, nsums):
                self._maps[inode] = cached
                return cached
            if cached is not None:
                cached.close()
            mapped = Mapped(directory, nbytes, nsums, writable=True, create=create)
            self._maps[mapped.inode] = mapped
            return mapped

    def _remove(self, directory: pathlib.Path) -> None:
        """Remove a version's directory, and its cached map unless another version links its bytes
        (the caller holds ``_lock``)."""
        try:
            data = os.stat(f"{directory}/data.bin")
            cached = self._maps.pop(data.st_ino, None) if data.st_nlink == 1 else None
        except OSError:
            cached = None
        if cached is not None:
            cached.close()
        shutil.rmtree(directory, ignore_errors=True)

    def _kept(self, rank: int, newest: int, infos: list[ShardInfo]) -> set[str]:
        """Of ``infos`` (``versions(rank)``), the names of the ones pruning keeps: the ``newest``
        newest, the one marked complete, and the pinned writes (the caller holds ``_lock``)."""
        steps = {info.step for info in infos[max(0, len(infos) - newest) :]} if newest > 0 else set()
        steps.update(s for (r, s), n in self._pins.items() if r == rank and n > 0)  # unfinished writes too
        complete = self.complete_step(rank)
        if complete is not None:
            steps.add(complete)
        return {f"v{step:010d}" for step in steps}

    @contextlib.contextmanager
    def pinned(self, rank: int, step: int) -> Iterator[None]:
        """Keep ``rank``'s version ``step`` while the block reads it (a replicator on another thread)."""
        self._pin(rank, step, +1)
        try:
            yield
        finally:
            self._pin(rank, step, -1)

    def _pin(self, rank: int, step: int, change: int) -> None:
        with self._lock:
            held = self._pins.get((rank, step), 0) + change
            if held:
                self._pins[rank, step] = held
            else:  # released: forgotten (a long run's pins would otherwise pile up, one per step)
                del self._pins[rank, step]

    def mark_complete(self, rank: int, step: int) -> None:
        """Record that ``rank``'s version ``step`` has all its replicas (kept until a newer one has)."""
        base = f"{self.root}/rank{rank}"
        try:
            _publish(f"{base}/complete", b'{"step": %d}' % step)
        except FileNotFoundError:  # the rank's first version here
            os.makedirs(base, exist_ok=True)
            _publish(f"{base}/complete", b'{"step": %d}' % step)

    def complete_step(self, rank: int) -> int | None:
        """The step ``mark_complete`` last recorded for ``rank`` (None: none)."""
        path = f"{self.root}/rank{rank}/complete"
        try:  # read again only when the file is another (``mark_complete`` renames a new one in place)
            st = os.stat(path)
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            known = self._complete.get(rank)
            if known is not None and known[0] == seen:
                return known[1]
            with open(path, "rb") as f:
                step = int(json.loads(f.read())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._complete[rank] = (seen, step)
        return step

    # -- listing and reading -----------------------------------------------------------------------
    def versions(self, rank: int) -> list[ShardInfo]:
        """``rank``'s complete shards (a manifest in place), oldest first, from the directories' names
        and the data files' sizes; neither their manifests nor their bytes are checked (``verify``)."""
        return self._listing(rank)[1]

    def _listing(self, rank: int) -> tuple[list[str], list[ShardInfo]]:
        """The names under ``rank``'s directory, sorted (none when it does not exist), and its
        complete versions among them (``versions``), from one listing."""
        base = f"{self.root}/rank{rank}"
        try:
            names = sorted(os.listdir(base))
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        found = []
        for name in names:
            if name.startswith("v") and name[1:].isdigit() and os.path.isfile(f"{base}/{name}/manifest.json"):
                try:
                    nbytes = os.stat(f"{base}/{name}/data.bin").st_size
                except OSError:  # removed meanwhile, or its data file is gone: not complete
                    continue
                found.append(ShardInfo(rank, int(name[1:]), self._dir(rank, int(name[1:])), nbytes))
        return names, found

    def version(self, rank: int, step: int) -> ShardInfo | None:
        """``rank``'s complete version of ``step`` (None: none)."""
        path = self._dir(rank, step)
        try:
            if os.path.isfile(f"{path}/manifest.json"):
                return ShardInfo(rank, step, path, os.stat(f"{path}/data.bin").st_size)
        except OSError:
            pass
        return None

    def load(self, rank: int, step: int | None = None, seen: _Seen | None = None) -> dict[str | int, Any]:
        """The newest complete shard of ``rank`` that verifies (or the one at ``step``), as a nested
        dict of tensors (copied out of shared memory) and values. ``seen``: the files the caller's
        ``verify`` or ``verified`` checked, while nothing wrote them: their blocks are not hashed again.

        Raises:
            FileNotFoundError: If ``rank`` has no complete shard (at ``step``, when given) that verifies;
                the message lists the corrupt ones skipped.
        """
        candidates = [v for v in self.versions(rank) if step is None or v.step == step]
        skipped = []
        for info in reversed(candidates):
            try:
                return self.read(info, seen)
            except CorruptShard as exc:
                logger.error("zensync checkpoint: %s", exc)
                skipped.append(str(exc))
        wanted = f"at step {step}" if step is not None else "complete"
        raise FileNotFoundError(f"no {wanted} checkpoint shard of rank {rank} under {self.root} verifies"
                                + (f"; skipped: {skipped}" if skipped else ""))  # fmt: skip

    def read(self, info: ShardInfo, seen: _Seen | None = None) -> dict[str | int, Any]:
        """One shard, checked against its manifest (sizes, every block's hash, the table's hash; the
        block hashes skipped for files in ``seen``, as ``verify``).

        Raises:
            CorruptShard: On any mismatch.
        """
        with self._checked(info, seen) as (manifest, entries, mapped):
            flat: dict[str, Any] = dict(manifest.get("values", {}))
            for entry in entries:
                out = torch.empty(entry.shape, dtype=_DTYPES[entry.dtype])
                if entry.nbytes:
                    out.view(-1).view(torch.uint8).numpy()[:] = mapped.data8[entry.offset : entry.offset + entry.nbytes]
                flat[entry.key] = out
        return unflatten(flat)

    def verify(self, info: ShardInfo, seen: _Seen | None = None) -> None:
        """Check a shard's bytes against its manifest (sizes, block hashes, the table's hash) without
        copying them out. ``seen``: files already checked (``verified``), by inode and table hash.

        Raises:
            CorruptShard: On any mismatch.
        """
        with self._checked(info, seen):
            pass

    @contextlib.contextmanager
    def _checked(
        self, info: ShardInfo, seen: _Seen | None = None
    ) -> Iterator[tuple[dict[str, Any], list[Entry], Mapped]]:
        """A shard's manifest, entries and read-only map, once every check passed (the block checks
        skipped for files in ``seen`` with the same table hash and entries, and recorded there)."""
        try:
            text = (info.path / "manifest.json").read_bytes()
        except OSError as exc:
            raise CorruptShard(f"{info.path}: manifest unreadable: {exc}") from None
        manifest, _, _, nbytes = _header(text, str(info.path))
        entries = _entries(manifest, str(info.path))
        try:
            mapped = Mapped(info.path, nbytes, manifest["nsums"], writable=False)
        except (OSError, ValueError) as exc:
            raise CorruptShard(f"{info.path}: {exc}") from None
        try:
            try:
                key = (mapped.inode, os.stat(f"{info.path}/sums.bin").st_ino, manifest.get("sums_hash"))
            except OSError as exc:  # removed since it was mapped
                raise CorruptShard(f"{info.path}: {exc}") from None
            if seen is None or seen.get(key) != entries:
                _check_blocks(manifest, entries, mapped, str(info.path))
            if seen is not None:
                seen[key] = entries
            yield manifest, entries, mapped
        finally:
            mapped.close()

    def raw(self, info: ShardInfo) -> tuple[bytes, bytes, bytes]:
        """(manifest text, sums table, data bytes) of a complete shard, as they are (for a peer's copy)."""
        return self.raw_manifest(info), (info.path / "sums.bin").read_bytes(), (info.path / "data.bin").read_bytes()

    def raw_manifest(self, info: ShardInfo) -> bytes:
        """A complete shard's manifest text, as it is on disk."""
        return (info.path / "manifest.json").read_bytes()

    def delta(self, info: ShardInfo, base: ShardInfo | None,
              wanted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # fmt: skip
        """``info``'s blocks whose hashes differ from version ``base``'s of the same rank (None: every
        block), of the tensors ``wanted`` (a bool per manifest entry; None: all): (their indices,
        their hashes, their bytes as a payload, ``blocks.payload_places``); None when the two layouts
        differ or ``info`` cannot be read. No pass over the data finds them."""
        new = self._described(info.path, "manifest.json")
        old = None if base is None else self._described(base.path, "manifest.json")
        if new is None or new.entries is None or (base is not None and (old is None or new.layout != old.layout)):
            return None
        ids = changed(new.sums, old.sums) if old is not None else np.arange(new.sums.size, dtype=np.int64)
        if wanted is not None:
            ids = ids[np.repeat(wanted, [e.blocks for e in new.entries])[ids]]
        starts, lengths = _spans(new.entries, ids)
        return ids, new.sums[ids].copy(), gather(new, starts, lengths)

    def tensor_bytes(self, info: ShardInfo, indices: list[int]) -> int:
        """The bytes of a complete version's tensors ``indices`` (manifest entries; 0: unreadable)."""
        found = self._described(info.path, "manifest.json")
        return 0 if found is None or found.entries is None else sum(found.entries[i].nbytes for i in indices)

    def digests(self, info: ShardInfo) -> np.ndarray | None:
        """Each tensor's digest in a complete version (``blocks.entry_digests``: equal digests, equal
        tensors); None when it cannot be read."""
        found = self._described(info.path, "manifest.json")
        return None if found is None or found.entries is None else entry_digests(found.entries, found.sums)

    # -- replicas from peers -----------------------------------------------------------------------
    def put_full(self, manifest: bytes, sums: bytes | memoryview, data: bytes | memoryview) -> ShardInfo:
        """Store a shard ``raw`` gave (another host's), as complete only once it verifies.

        A version of the same manifest already here is kept when it verifies, and replaced by the
        copy received when it does not.

        Raises:
            CorruptShard: If the manifest is unreadable or the bytes do not match it (no complete
                version is kept).
        """
        header, rank, step, nbytes = _header(manifest)
        held = self.version(rank, step)
        if held is not None and self.raw_manifest(held) == manifest:
            try:
                self.verify(held)  # the same version, already here (a host holding its own replica)
                return held
            except CorruptShard as exc:  # the copy received replaces it (written over, or fresh)
                logger.error("zensync checkpoint: %s; replaced by the copy received", exc)
        entries = _entries(header, f"rank {rank}'s step {step} received")
        table = np.frombuffer(bytes(sums), dtype=np.uint64) if len(sums) % 8 == 0 else None
        if table is None or table.size != header["nsums"] or len(data) != nbytes:
            raise CorruptShard(f"rank {rank}'s step {step} received: {len(sums)} bytes of sums and {len(data)} of "
                               f"data, the manifest {8 * header['nsums']} and {nbytes}")  # fmt: skip
        payload = np.frombuffer(data, dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)
        ids = np.arange(header["nsums"], dtype=np.int64)
        return self._apply(manifest, header, entries, None, ids, table, payload, stored=True)

    def put_delta(self, manifest: bytes, base_step: int | None, ids: np.ndarray, sums: np.ndarray,
                  payload: np.ndarray, donor_rank: int | None = None,
                  donated: list[int] | None = None) -> ShardInfo:  # fmt: skip
        """Store a shard sent as its blocks ``ids`` that changed since version ``base_step`` of the
        same rank, held here (``delta``'s output; None: no base, ``ids`` and ``donated`` cover every
        block), written over an older version of that rank where one can go (its other stale blocks
        copied from the base), each block checked against its hash as it is written, then the whole
        table against the manifest's hash.

        ``donated``: manifest entries (tensors) sent as nothing, to be copied from this store's version
        of the same step of rank ``donor_rank`` (the receiver's own: data parallel ranks hold the same
        model), whose tensors there must lie at the same places; the table's hash confirms their bytes.

        Raises:
            CorruptShard: If the manifest is unreadable, the base or donor is missing or of another
                layout, or a block or the table does not verify (no complete version is kept).
        """
        header, rank, step, _ = _header(manifest)
        where = f"a delta of rank {rank}'s step {step}"
        entries = _entries(header, where)
        with contextlib.ExitStack() as held:
            source = None
            if base_step is not None:
                source = self._held(held, rank, base_step, f"{where} against step {base_step}")
                if source.layout != _layout(header):
                    raise CorruptShard(f"{where} against step {base_step}, whose layout differs")
            donor = None
            if donated:
                if donor_rank is None:
                    raise CorruptShard(f"{where}: donated tensors and no donor")
                donor = self._held(held, donor_rank, step, f"{where} with tensors from rank {donor_rank}'s")
                theirs = donor.entries or []
                if not all(0 <= i < min(len(entries), len(theirs)) and theirs[i] == entries[i] for i in donated):
                    raise CorruptShard(f"{where}: donated tensors lie elsewhere in rank {donor_rank}'s step {step}")
                if not ids.size and set(donated) == set(range(len(entries))):
                    return self._link(manifest, header, donor, donor_rank)
            return self._apply(manifest, header, entries, source, ids, sums, payload, donor=donor, donated=donated)

    def _link(self, manifest: bytes, header: dict[str, Any], donor: Mapped, donor_rank: int) -> ShardInfo:
        """Store a received version whose every tensor is donated as links to the donor's files: no
        bytes copied (data parallel ranks' identical shards). The donor's version is then never
        written over (``_claim``) while the link stands; the linked version is removed, not kept as a
        spare, when pruned."""
        rank, step, nbytes = header["rank"], header["step"], header["nbytes"]
        known = donor.sums_hash or f"{hash_bytes(donor.sums):016x}"  # known: this process wrote or checked the table
        if donor.nbytes != nbytes or known != header.get("sums_hash"):
            raise CorruptShard(
                f"rank {rank}'s step {step} received: its blocks do not make the table its manifest names"
            )
        source = self._dir(donor_rank, step)
        target = self._dir(rank, step)
        with self._lock:
            if target.exists():  # a cut-off write of this step
                self._remove(target)
            target.mkdir(parents=True)
            for name in ("data.bin", "sums.bin"):
                os.link(source / name, target / name)
            (target / LINKED).touch()
            _publish(f"{target}/manifest.json", manifest)
        self._prune(rank)
        return ShardInfo(rank, step, target, nbytes)

    def _held(self, held: contextlib.ExitStack, rank: int, step: int, where: str) -> Mapped:
        """``rank``'s complete version ``step`` mapped, pinned until ``held`` closes."""
        info = self.version(rank, step)
        if info is None:
            raise CorruptShard(f"{where}, which is not here")
        held.enter_context(self.pinned(rank, step))
        found = self._described(info.path, "manifest.json")
        if found is None or found.entries is None:
            raise CorruptShard(f"{where}, which cannot be read")
        return found

    def _apply(self, manifest: bytes, header: dict[str, Any], entries: list[Entry], base: Mapped | None,
               ids: np.ndarray, sums: np.ndarray, payload: np.ndarray, stored: bool = False,
               donor: Mapped | None = None, donated: list[int] | None = None) -> ShardInfo:  # fmt: skip
        """Write a received version: blocks ``ids`` from ``payload`` (checked against ``sums``; laid
        out as ``blocks.payload_places``, or, ``stored``, as in ``data.bin``), the ``donated``
        tensors' blocks from ``donor``, the other blocks that differ from the overwritten version's
        from ``base``."""
        rank, step, nbytes, nsums = header["rank"], header["step"], header["nbytes"], header["nsums"]
        where = f"rank {rank}'s step {step} received"
        if ids.size and (ids.min() < 0 or ids.max() >= nsums or (np.diff(ids) <= 0).any()):
            raise CorruptShard(f"{where}: block indices out of place")
        table = base.sums.copy() if base is not None else np.zeros(nsums, dtype=np.uint64)
        if ids.size != sums.size:
            raise CorruptShard(f"{where}: {ids.size} blocks and {sums.size} hashes")
        from_donor = np.zeros(nsums, dtype=bool)
        if donor is not None:
            for i in donated or ():
                span = slice(entries[i].first, entries[i].first + entries[i].blocks)
                table[span], from_donor[span] = donor.sums[span], True
        from_donor[ids] = False
        if base is None and ids.size + int(from_donor.sum()) != nsums:
            raise CorruptShard(f"{where}: {nsums - ids.size - int(from_donor.sum())} blocks neither sent nor held")
        table[ids] = sums
        if f"{hash_bytes(table):016x}" != header.get("sums_hash"):
            raise CorruptShard(f"{where}: its blocks do not make the table its manifest names")
        starts, lengths = _spans(entries, ids)
        sources, size = (starts, nbytes) if stored else payload_places(lengths)
        if size != payload.size:
            raise CorruptShard(f"{where}: {payload.size} bytes for {ids.size} blocks")
        target, recycled = self._claim(rank, step, header)  # pinned: released below
        try:
            if stored and not recycled:  # a whole version into new files: the kernel writes its pages
                if not (hash_in(payload, starts, lengths) == sums).all():  # (no page faults to fill them)
                    raise CorruptShard(f"{where}: a block does not match its hash")
                _write_file(f"{target}/data.bin", payload)
                _write_file(f"{target}/sums.bin", table)
                dst = self._mapped(target, nbytes, nsums)
            else:
                dst = self._mapped(target, nbytes, nsums, create=not recycled)
                dst.layout, dst.entries, dst.sums_hash = None, None, None  # until complete
                stale = dst.sums != table  # blocks the overwritten version lacks and the delta does not carry
                stale[ids] = False
                if donor is not None:
                    copy_from(dst, donor, *_spans(entries, np.flatnonzero(stale & from_donor)))
                if base is not None:
                    copy_from(dst, base, *_spans(entries, np.flatnonzero(stale & ~from_donor)))
                if not (copy_hash_in(dst, starts, lengths, payload, sources) == sums).all():
                    raise CorruptShard(f"{where}: a block does not match its hash")
                dst.sums[:] = table
            dst.layout, dst.entries, dst.sums_hash = _layout(header), entries, header["sums_hash"]
            _publish(f"{target}/manifest.json", manifest)
        finally:
            self._pin(rank, step, -1)
        self._prune(rank)
        return ShardInfo(rank, step, target, nbytes)

    def newest_verified(self, rank: int) -> ShardInfo | None:
        """``rank``'s newest complete shard whose bytes verify (None: none)."""
        return next((info for info in reversed(self.versions(rank)) if self._verifies(info)), None)

    def verified(self, rank: int, seen: _Seen | None = None) -> list[int]:
        """The steps of ``rank``'s complete versions whose bytes verify, oldest first. ``seen``: the
        files already checked by the caller's earlier calls (while nothing writes them): a version
        that links another's files (``_link``) is checked once."""
        return [info.step for info in self.versions(rank) if self._verifies(info, seen)]

    def intact(self, rank: int, step: int, seen: _Seen | None = None) -> bool:
        """Whether ``rank``'s complete version ``step`` is here and verifies (a failure is logged)."""
        info = self.version(rank, step)
        if info is None:
            logger.error("zensync checkpoint: rank %d's step %d is gone from %s", rank, step, self.root)
            return False
        return self._verifies(info, seen)

    def _verifies(self, info: ShardInfo, seen: _Seen | None = None) -> bool:
        """Whether ``verify`` passes (a failure is logged)."""
        try:
            self.verify(info, seen)
        except CorruptShard as exc:
            logger.error("zensync checkpoint: %s", exc)
            return False
        return True

    def ranks(self) -> list[int]:
        """The ranks this store holds shards of (its own and peers' replicas)."""
        found = [int(p.name[4:]) for p in self.root.glob("rank*") if p.name[4:].isdigit()]
        return sorted(found)

    # -- removing ----------------------------------------------------------------------------------
    def _prune(self, rank: int) -> None:
        """Keep the newest ``keep`` complete versions of ``rank``; older ones become spares (at most
        ``SPARES``: their bytes, sums table and layout, no manifest), whose pages the next version
        overwrites (``_claim``); the others and cut-off writes are removed."""
        with self._lock:
            names, infos = self._listing(rank)
            kept = self._kept(rank, self.keep, infos)
            complete = {info.path.name for info in infos}
            base = f"{self.root}/rank{rank}"
            spares = sum(name.startswith("spare") for name in names)
            for name in names:
                if not name.startswith("v") or name in kept or not os.path.isdir(f"{base}/{name}"):
                    continue
                child = f"{base}/{name}"
                if spares < SPARES and name in complete and not os.path.exists(f"{child}/{LINKED}"):
                    os.replace(f"{child}/manifest.json", f"{child}/layout.json")  # not complete from here
                    os.rename(child, f"{base}/spare{name[1:]}")
                    spares += 1
                else:  # older versions, cut-off writes (one writer per rank)
                    self._remove(pathlib.Path(child))

    def discard_after(self, step: int) -> None:
        """Remove every rank's versions after ``step`` (a restored run's abandoned future), and every
        mark of a later step as complete (that step will be trained and replicated again)."""
        with self._lock:
            for rank in self.ranks():
                for info in self.versions(rank):
                    if info.step > step:
                        self._remove(info.path)
                complete = self.complete_step(rank)
                if complete is not None and complete > step:
                    os.unlink(f"{self.root}/rank{rank}/complete")

    def clear(self) -> None:
        """Remove every shard under the root."""
        with self._lock:
            for mapped in self._maps.values():
                mapped.close()
            self._maps.clear()
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Unmap the versions this store object mapped (the files stay)."""
        with self._lock:
            for mapped in self._maps.values():
                mapped.close()
            self._maps.clear()


def _write_file(path: str, data: bytes | np.ndarray) -> None:
    """Write ``data`` (bytes, or a contiguous array's bytes) as the file ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _publish(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: ``path.tmp`` written, then renamed over it (readers see
    the old file or the new one, never a part)."""
    _write_file(f"{path}.tmp", data)
    os.replace(f"{path}.tmp", path)


def _audited(blocks: int, count: int, step: int) -> np.ndarray:
    """``count`` rows of ``blocks`` for a save's audit (``write``): spread over the tensor from a
    start that moves with ``step`` (a multiplicative hash), so that successive saves check other
    rows; no random generator to build per save."""
    start = (step * 0x9E3779B1 + 0x7F4A7C15) % blocks
    stride = max(1, blocks // max(count, 1)) + step % 7
    return np.array([(start + i * stride) % blocks for i in range(count)], dtype=np.int64)


def _links(directory: pathlib.Path | str) -> int:
    """How many names a version's data file has (0: none)."""
    try:
        return os.stat(f"{directory}/data.bin").st_nlink
    except OSError:
        return 0


def _layout(manifest: dict[str, Any]) -> Any:
    """What two versions must share for one to be written over the other (or sent as a delta)."""
    return manifest.get("format"), manifest["nbytes"], manifest.get("nsums"), manifest["entries"]


def _header(manifest: bytes, where: str = "a shard received") -> tuple[dict[str, Any], int, int, int]:
    """A manifest's JSON with its rank, step, data size and block count checked (as ints) and its
    entries a list.

    Raises:
        CorruptShard: If it is not such a manifest (or of another format).
    """
    try:
        header = json.loads(manifest)
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, not {FORMAT}")
        for field in ("rank", "step", "nbytes", "nsums"):
            header[field] = int(header[field])
        if not isinstance(header["entries"], list) or min(header["nbytes"], header["nsums"]) < 0:
            raise TypeError("entries is not a list or a size is negative")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptShard(f"{where}: manifest unreadable: {exc}") from None
    return header, header["rank"], header["step"], header["nbytes"]


def _entries(manifest: dict[str, Any], where: str) -> list[Entry]:
    """A manifest's entries, each checked to lie inside the data and the sums table.

    Raises:
        CorruptShard: If one does not (or is malformed).
    """
    out = []
    for raw in manifest["entries"]:
        try:
            entry = Entry(str(raw["key"]), str(raw["dtype"]), tuple(int(d) for d in raw["shape"]), int(raw["offset"]),
                          int(raw["nbytes"]), int(raw["blocks"]), int(raw["first"]))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            raise CorruptShard(f"{where}: a manifest entry is malformed: {raw!r}") from None
        dtype = _DTYPES.get(entry.dtype)
        numel = int(np.prod(entry.shape)) if entry.shape else 1
        fits = (
            dtype is not None and entry.offset >= 0 and entry.offset % 8 == 0 and entry.blocks >= 1
            and entry.offset + entry.nbytes <= manifest["nbytes"] and entry.first >= 0
            and entry.first + entry.blocks <= manifest["nsums"] and entry.nbytes % entry.blocks == 0
            and (entry.blocks == 1 or entry.block_bytes % 8 == 0)
            and numel * _ITEMSIZE[entry.dtype] == entry.nbytes
        )  # fmt: skip
        if not fits:
            raise CorruptShard(f"{where}: entry {entry.key!r} ({entry.dtype}, bytes {entry.offset}+{entry.nbytes}, "
                               f"blocks {entry.first}+{entry.blocks}) is out of place")  # fmt: skip
        out.append(entry)
    return out


def _spans(entries: list[Entry], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(byte starts in ``data.bin``, lengths) of the blocks ``ids`` (indices into the sums table)."""
    if not entries or not ids.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    firsts = np.array([e.first for e in entries], dtype=np.int64)
    offsets = np.array([e.offset for e in entries], dtype=np.int64)
    sizes = np.array([e.block_bytes for e in entries], dtype=np.int64)
    which = np.searchsorted(firsts, ids, side="right") - 1
    return offsets[which] + (ids - firsts[which]) * sizes[which], sizes[which]


def _check_blocks(manifest: dict[str, Any], entries: list[Entry], mapped: Mapped, where: str) -> None:
    """Every block's hash matches the table, and the table matches the manifest's hash.

    Raises:
        CorruptShard: On any mismatch.
    """
    if f"{hash_bytes(mapped.sums):016x}" != manifest.get("sums_hash"):
        raise CorruptShard(f"{where}: its sums table does not match its checksum")
    for entry in entries:
        starts = entry.starts()
        got = hash_of(mapped.data64, mapped.data8, starts, np.full(entry.blocks, entry.block_bytes, np.int64))
        if not (got == mapped.sums[entry.first : entry.first + entry.blocks]).all():
            raise CorruptShard(f"{where}: {entry.key!r} does not match its checksum")
