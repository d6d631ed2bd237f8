"""A shard's bytes as blocks, each with a 64-bit hash: the unit the store writes, checks and sends.

A tensor is one block, or, when it is at least 2-D with rows of a multiple of 8 bytes and at least
``ROW_MIN_BYTES`` (an embedding table, a weight matrix), one block per row. The hashes of every block
of a version form its *sums table* (``sums.bin``, one uint64 per block), and the table's own hash is
in the manifest. So:

- a save writes only the blocks whose bytes changed since the version it overwrites (the rows an
  optimizer step touched, ``dirty.ChangeTracker``, or the blocks whose hash changed), and hashes them
  in the same pass (``write_blocks``);
- a delta between two versions is the blocks whose hashes differ (``changed``): no pass over the data;
- a replica is checked block by block as it arrives, and completely by its table's hash.

Tensors start at multiples of ``ALIGN`` bytes of ``data.bin`` (zero padding between), so every block
starts at a multiple of 8 and the compiled loops (``_compiled_blocks``) read 8-byte words.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import math
import mmap
import os
import pathlib
import threading
from typing import Any

import numpy as np
import torch

from zensync.resilience import _compiled_blocks as _k

__all__ = [
    "ALIGN",
    "ROW_MIN_BYTES",
    "Entry",
    "Mapped",
    "changed",
    "copy_from",
    "copy_hash_in",
    "entries_for",
    "entry_digests",
    "gather",
    "hash_bytes",
    "hash_in",
    "hash_of",
    "num_blocks",
    "payload_places",
    "tensor_words",
    "warm_up",
    "write_blocks",
]

ALIGN = 64
ROW_MIN_BYTES = 64
"""Rows shorter than this are not blocks of their own (a sums table as large as the data helps no one)."""
_EMPTY = np.empty(0, dtype=np.int64)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})  # fmt: skip
"""Tensor dtypes numpy views as they are (``tensor_words``)."""
WARM_UP_EXIT_WAIT_S = 30.0
"""At interpreter exit, how long to wait for a warm-up still loading (a compile on a fresh install)."""
_warming: threading.Thread | None = None
_warming_lock = threading.Lock()


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a shard: where its bytes are in ``data.bin`` and its hashes in ``sums.bin``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    blocks: int
    first: int
    """Index of its first block's hash in the sums table."""

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.blocks

    def starts(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Byte offsets in ``data.bin`` of its blocks (``rows`` of them, or all)."""
        index = np.arange(self.blocks, dtype=np.int64) if rows is None else rows
        return self.offset + index * self.block_bytes

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "blocks": self.blocks, "first": self.first}  # fmt: skip


def num_blocks(shape: tuple[int, ...], element_size: int) -> int:
    """Blocks of a tensor: its rows, when they qualify (module docstring), else 1."""
    if len(shape) < 2 or shape[0] < 2:
        return 1
    row_bytes = element_size * math.prod(shape[1:])
    return shape[0] if row_bytes % 8 == 0 and row_bytes >= ROW_MIN_BYTES else 1


def entries_for(tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], int, int]:
    """(entries, data bytes, blocks) of a shard holding ``tensors`` in order."""
    entries, offset, first = [], 0, 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        blocks = num_blocks(tuple(tensor.shape), tensor.element_size())
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append(Entry(key, dtype, tuple(tensor.shape), offset, nbytes, blocks, first))
        offset += -(-nbytes // ALIGN) * ALIGN
        first += blocks
    return entries, offset, first


class Mapped:
    """A version's ``data.bin`` and ``sums.bin`` mapped (shared: writes go to the files' pages), as
    numpy arrays: ``data8`` (bytes), ``data64`` (words), ``sums`` (one uint64 per block).

    Args:
        directory: The version's directory.
        nbytes, nsums: The sizes the files must have (``create``: are given; else checked).
        writable: Map for writing (else read-only).
        create: Create or resize the files (fresh pages are zero).

    Raises:
        OSError: If a file is missing, or (not ``create``) has another size: ValueError.
    """

    def __init__(
        self, directory: pathlib.Path, nbytes: int, nsums: int, *, writable: bool, create: bool = False
    ) -> None:
        self.directory, self.nbytes, self.nsums = directory, nbytes, nsums
        self.layout: Any = None
        """The layout of the version last written here (the store sets it: no manifest to parse)."""
        self.sums_hash: str | None = None
        """The sums table's hash as the store last computed or checked it (None: not known)."""
        self.entries: list[Entry] | None = None
        self._maps: list[mmap.mmap] = []
        self.data8 = self._map(directory / "data.bin", nbytes, writable, create)
        self.data64 = self.data8[: nbytes - nbytes % 8].view(np.uint64)
        self.sums = self._map(directory / "sums.bin", 8 * nsums, writable, create).view(np.uint64)
        self.inode = os.stat(f"{directory}/data.bin").st_ino

    def _map(self, path: pathlib.Path, size: int, writable: bool, create: bool) -> np.ndarray:
        flags = os.O_RDWR | (os.O_CREAT if create else 0) if writable else os.O_RDONLY
        fd = os.open(path, flags, 0o644)
        try:
            if create and os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"{path} holds {actual} bytes, the manifest {size}")
            if not size:
                return np.zeros(0, dtype=np.uint8)
            buf = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._maps.append(buf)
        return np.frombuffer(buf, dtype=np.uint8)

    def valid(self, directory: pathlib.Path) -> bool:
        """``directory`` holds the mapped files (renamed or not), at the mapped sizes (no one truncated
        or replaced them); the map then follows the rename."""
        try:
            data = os.stat(f"{directory}/data.bin")
            sums = os.stat(f"{directory}/sums.bin")
        except OSError:
            return False
        if (data.st_ino, data.st_size, sums.st_size) != (self.inode, self.nbytes, 8 * self.nsums):
            return False
        self.directory = directory
        return True

    def close(self) -> None:
        del self.data8, self.data64, self.sums
        for buf in self._maps:
            buf.close()
        self._maps.clear()


def tensor_words(tensor: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(words, bytes) numpy views of a tensor's bytes (copied first if it is not contiguous on the
    CPU with an 8-byte aligned start). The words view covers the whole words only."""
    flat = tensor.detach()
    if flat.device.type != "cpu" or not flat.is_contiguous() or flat.data_ptr() % 8:
        flat = flat.cpu().contiguous().clone()
    if not flat.numel():
        raw = np.zeros(0, dtype=np.uint8)
    elif flat.dtype in _NUMPY_DTYPES and not (flat.is_conj() or flat.is_neg()):
        raw = flat.numpy().reshape(-1).view(np.uint8)  # numpy's views: a tenth of torch's per-call cost
    else:  # bfloat16 (numpy has none), or a lazily conjugated or negated view: its bytes as they are
        raw = flat.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).numpy()
    return raw[: raw.size - raw.size % 8].view(np.uint64), raw


def write_blocks(dst: Mapped, entry: Entry, tensor: torch.Tensor, rows: np.ndarray | None) -> np.ndarray:
    """Write ``tensor``'s blocks into ``dst`` and their hashes into its sums table: the blocks
    ``rows`` (sorted), or, with ``rows`` None, every block whose hash differs from the table's (the
    table then describes what ``dst`` holds). Returns the blocks written."""
    src64, src8 = tensor_words(tensor)
    table = dst.sums[entry.first : entry.first + entry.blocks]
    if rows is None:  # hash every block, copy the ones that differ
        every = np.arange(entry.blocks, dtype=np.int64) * entry.block_bytes
        fresh = hash_of(src64, src8, every, np.full(entry.blocks, entry.block_bytes, dtype=np.int64))
        rows = np.flatnonzero(fresh != table)
        table[rows] = fresh[rows]
        out = None
    else:  # only the listed blocks' places (the save's hot path: no arrays of the whole table)
        out = np.empty(rows.size, dtype=np.uint64)
    local = rows * entry.block_bytes
    lengths = np.full(rows.size, entry.block_bytes, dtype=np.int64)
    if out is None:
        _k.copy_blocks(src64, src8, local, dst.data64, dst.data8, entry.offset + local, lengths)
    else:
        _k.copy_hash_blocks(src64, src8, local, dst.data64, dst.data8, entry.offset + local, lengths, out)
        table[rows] = out
    return rows


def hash_of(data64: np.ndarray, data8: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The hashes of blocks of a buffer (its words and bytes views)."""
    out = np.empty(starts.size, dtype=np.uint64)
    _k.hash_blocks(data64, data8, starts, lengths, out)
    return out


def hash_bytes(buf: np.ndarray) -> int:
    """The hash of a whole byte buffer (a sums table's, for the manifest)."""
    raw = buf.view(np.uint8)
    return int(hash_of(raw[: raw.size - raw.size % 8].view(np.uint64), raw, np.zeros(1, np.int64),
                       np.array([raw.size], np.int64))[0])  # fmt: skip


def copy_from(dst: Mapped, src: Mapped, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Copy the blocks at ``starts`` (same places in both) from ``src``'s data to ``dst``'s."""
    _k.copy_blocks(src.data64, src.data8, starts, dst.data64, dst.data8, starts, lengths)


def entry_digests(entries: list[Entry], sums: np.ndarray) -> np.ndarray:
    """Each tensor's digest: the hash of its blocks' hashes and of its place (key, dtype, shape,
    offset, blocks). Two versions' tensors with equal digests hold the same bytes at the same places
    (up to a 2**-64 collision), found without reading the bytes: a replica's tensor can then come
    from the receiver's own version (data parallel ranks hold the same model) instead of the wire."""
    if not entries:
        return np.empty(0, dtype=np.uint64)
    # Step 1: each tensor's part of the table hashed, as hash_bytes would (one compiled call for all)
    table8 = sums.view(np.uint8)
    firsts = np.fromiter((e.first for e in entries), np.int64, len(entries))
    counts = np.fromiter((e.blocks for e in entries), np.int64, len(entries))
    pairs = np.empty((len(entries), 2), dtype=np.uint64)
    pairs[:, 0] = hash_of(table8[: table8.size - table8.size % 8].view(np.uint64), table8, 8 * firsts, 8 * counts)
    # Step 2: with its place, hashed again: hash_bytes of each (table hash, place hash) pair
    pairs[:, 1] = [_place_hash(entry) for entry in entries]
    starts = np.arange(len(entries), dtype=np.int64) * 16
    return hash_of(pairs.reshape(-1), pairs.reshape(-1).view(np.uint8), starts, np.full(len(entries), 16, np.int64))


@functools.lru_cache(maxsize=4096)
def _place_hash(entry: Entry) -> int:
    return hash_bytes(np.frombuffer(json.dumps(entry.to_json()).encode(), dtype=np.uint8).copy())


def changed(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Indices of the blocks whose hashes differ between two sums tables of one layout."""
    return np.flatnonzero(new != old) if new.size else _EMPTY


def payload_places(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Where blocks of ``lengths`` bytes go in a payload (each padded to 8 bytes: every block starts
    on a word), and the payload's size."""
    padded = (lengths + 7) & ~np.int64(7)
    ends = np.cumsum(padded, dtype=np.int64)
    return ends - padded, int(ends[-1]) if ends.size else 0


def copy_hash_in(dst: Mapped, starts: np.ndarray, lengths: np.ndarray, payload: np.ndarray,
                 sources: np.ndarray) -> np.ndarray:  # fmt: skip
    """Write blocks of ``payload`` (at ``sources``, multiples of 8) to ``starts`` of ``dst``'s data;
    returns their hashes (computed in the same pass). The caller checked the payload's size."""
    out = np.empty(starts.size, dtype=np.uint64)
    _k.copy_hash_blocks(*_payload_words(payload), sources, dst.data64, dst.data8, starts, lengths, out)
    return out


def hash_in(payload: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The hashes of blocks of ``payload`` (at ``starts``, multiples of 8), as ``copy_hash_in``'s."""
    return hash_of(*_payload_words(payload), starts, lengths)


def _payload_words(payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(words, bytes) views of a received payload (copied first when it starts off a word)."""
    aligned = payload if payload.ctypes.data % 8 == 0 else payload.copy()
    return aligned[: aligned.size - aligned.size % 8].view(np.uint64), aligned


def gather(src: Mapped, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bytes of blocks of ``src``'s data in a payload (``payload_places``; for a delta)."""
    places, size = payload_places(lengths)
    out = np.zeros(size, dtype=np.uint8)
    _k.copy_blocks(src.data64, src.data8, starts, out.view(np.uint64), out, places, lengths)
    return out


def warm_up(wait: bool = False) -> None:
    """Load the compiled loops on a background thread, once per process (numba's start-up, about
    0.3 s: a restarted worker pays it while it starts, not in its restore); ``wait``: until done."""
    global _warming
    with _warming_lock:
        if _warming is None:
            _warming = threading.Thread(target=_load_kernels, name="zensync-blocks-warm-up", daemon=True)
            _warming.start()
            atexit.register(_warming.join, WARM_UP_EXIT_WAIT_S)  # not torn down mid-load at exit
    if wait:
        _warming.join()


def _load_kernels() -> None:
    data = np.zeros(16, dtype=np.uint8)
    frozen = data.copy()
    frozen.setflags(write=False)  # read-only maps (``Mapped(writable=False)``) are a signature of their own
    starts, lengths, out = np.zeros(1, np.int64), np.full(1, 16, np.int64), np.empty(1, np.uint64)
    for src in (data, frozen):
        _k.hash_blocks(src.view(np.uint64), src, starts, lengths, out)
        _k.copy_hash_blocks(src.view(np.uint64), src, starts, data.view(np.uint64), data, starts, lengths, out)
        _k.copy_blocks(src.view(np.uint64), src, starts, data.view(np.uint64), data, starts, lengths)
