"""Packing typed tensors into one byte payload, so each exchange is a single collective.

The wire format of every packed payload (sparse schemes, compressed collectives, ``send_recv``):
the tensors' bytes back to back, read in the same order with the same dtypes and counts.

Example::

    buf = pack(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0.5]))  # 12 bytes
    reader = ByteReader(buf)
    reader.take(torch.int32, 2), reader.take(torch.float32, 1)  # the two tensors back
"""

from __future__ import annotations

import torch

__all__ = ["ByteReader", "as_bytes", "from_bytes", "pack"]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (no copy)."""
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a 1-D uint8 tensor as ``dtype`` (copying first when the offset is misaligned)."""
    itemsize = dtype.itemsize
    if buf.numel() % itemsize:
        raise ValueError(f"{buf.numel()} bytes is not a whole number of {dtype} elements")
    if buf.numel() == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    if buf.storage_offset() % itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the bytes of ``tensors`` into one uint8 tensor."""
    parts = [as_bytes(t) for t in tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


class ByteReader:
    """Reads typed sections back from a payload built with ``pack``, in order."""

    __slots__ = ("_buf", "_offset")

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self._offset = 0

    def take(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        """The next ``count`` elements of ``dtype``."""
        nbytes = count * dtype.itemsize
        if self._offset + nbytes > self._buf.numel():
            raise ValueError(
                f"payload too short: need {nbytes} bytes at offset {self._offset}, have {self._buf.numel()}"
            )
        out = from_bytes(self._buf[self._offset : self._offset + nbytes], dtype)
        self._offset += nbytes
        return out

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""
        return self._buf.numel() - self._offset
