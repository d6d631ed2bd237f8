"""Register-time agreement: every rank's local checks meet in one collective, so a failure anywhere fails everywhere.

``zensync.register`` first does everything that can fail on one rank alone (options, the plan file,
the model's devices and dtypes) without communicating, then calls ``agree`` on the DDP group:

1. one all-gather carries each rank's fingerprint of its options and model, its proposal for Zen's
   hash seed, and the length of its error message (0: no error);
2. when any rank failed, a second all-gather carries the messages, and every rank raises the same
   ValueError quoting each failing rank's exception (type and message);
3. otherwise ranks whose fingerprint differs from rank 0's are named in the same ValueError on every
   rank, and rank 0's seed proposal is the agreed seed.

Without this a rank that fails alone (a plan file it cannot parse, a meta-device model) leaves its
peers waiting in the next collective until the group's timeout.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Iterable, Sequence

import torch

from zensync.sync.validate import SUPPORTED_DTYPES
from zensync.transport import Transport

__all__ = ["MAX_MESSAGE_BYTES", "agree", "checked_parameters", "differing_from_rank0"]

MAX_MESSAGE_BYTES = 4096
"""A failing rank's message is cut to this many UTF-8 bytes (it travels to every rank)."""


def agree(transport: Transport, description: str, failure: BaseException | None, seed: int | None) -> int:
    """Check that every rank set up without error and identically; return the agreed hash seed.

    A collective of every rank of ``transport``.

    Args:
        transport: The group the hook serves (DDP's group).
        description: This rank's options and model, as text (compared by CRC across ranks).
        failure: This rank's local setup error, or None.
        seed: The user's hash seed, or None to propose a random one.

    Returns:
        Rank 0's seed proposal.

    Raises:
        ValueError: On every rank, when any rank failed its local checks or differs from rank 0.
    """
    device = transport.control_device
    message = b"" if failure is None else _describe(failure)
    proposal = seed if seed is not None else secrets.randbits(62)
    local = torch.tensor([zlib.crc32(description.encode()), proposal, len(message)], dtype=torch.int64, device=device)
    with transport.phase("setup"):
        gathered = [t.tolist() for t in transport.all_gather(local)]  # Step 1; host-device sync
    failing = [rank for rank, g in enumerate(gathered) if g[2]]
    if failing:
        payload = (
            torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else torch.empty(0, dtype=torch.uint8)
        )
        with transport.phase("setup"):
            messages = transport.all_gather_v(payload.to(device))  # Step 2
        told = "; ".join(
            f"rank {rank}: {bytes(messages[rank].cpu().tolist()).decode(errors='replace')}" for rank in failing
        )
        raise ValueError(f"zensync.register failed on rank(s) {failing}: {told}") from failure
    differing = differing_from_rank0([g[0] for g in gathered])
    if differing:  # Step 3
        raise ValueError(
            f"zensync.register: ranks {differing} differ from rank 0 in their hook options or in their "
            f"model's parameters (names, shapes, dtypes); every rank must register the same model with "
            f"the same options"
        )
    return int(gathered[0][1])


def differing_from_rank0(values: Sequence[object]) -> list[int]:
    """The ranks whose gathered value differs from rank 0's."""
    return [rank for rank, value in enumerate(values) if value != values[0]]


def _describe(failure: BaseException) -> bytes:
    text = f"{type(failure).__name__}: {failure}".encode(errors="replace")
    return text[:MAX_MESSAGE_BYTES] or b"?"


_DEVICE_TYPES = ("cpu", "cuda")


def checked_parameters(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[torch.nn.Parameter, str]:
    """Name of each parameter, after checking that the hook can sync the model (no communication).

    Raises:
        ValueError: No parameters, a parameter on a device the hook cannot sync (meta: not
            materialized), parameters on several device types, or a trainable one of a dtype other
            than float16/bfloat16/float32/float64.
    """
    names = {p: name for name, p in named_parameters}
    if not names:
        raise ValueError("zensync.register: the model has no parameters; there is nothing to synchronize")
    device_types = set()
    for param, name in names.items():
        if param.device.type not in _DEVICE_TYPES:
            raise ValueError(
                f"zensync.register: parameter {name!r} is on device {param.device}; the hook syncs "
                f"parameters on {' or '.join(_DEVICE_TYPES)} (materialize meta-device models first, "
                f"e.g. with to_empty() and an initialization)"
            )
        device_types.add(param.device.type)
        if param.requires_grad and param.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"zensync.register: trainable parameter {name!r} has dtype {param.dtype}; gradients are "
                f"synced for {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
    if len(device_types) > 1:
        raise ValueError(
            f"zensync.register: parameters are on several device types {sorted(device_types)}; DDP "
            f"with the hook needs the model on one device"
        )
    return names
