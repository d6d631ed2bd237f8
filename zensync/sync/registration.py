"""Register-time agreement: every rank's local checks meet in one collective, so a failure anywhere fails everywhere.

``zensync.register`` first does everything that can fail on one rank alone (options, the plan file,
the model's devices and dtypes: ``checked_parameters``) without communicating, then calls ``agree``
on the DDP group, which runs the protocol of ``zensync.sync.agreement``:

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

import zlib
from collections.abc import Iterable

import torch

from zensync.sync.agreement import (
    describe_failure,
    differing_from_rank0,
    gather_descriptors_async,
    gather_messages_async,
    propose_seed,
)
from zensync.sync.validate import SUPPORTED_DTYPES
from zensync.transport import Transport

__all__ = ["agree", "agree_async", "checked_parameters"]

_PHASE = "setup"
_F_FINGERPRINT, _F_PROPOSAL, _F_MESSAGE_BYTES = range(3)
_DEVICE_TYPES = ("cpu", "cuda")


def agree(
    transport: Transport,
    description: str,
    failure: BaseException | None,
    seed: int | None,
    device: torch.device | None = None,
    caller: str = "zensync.register",
) -> int:
    """Check that every rank set up without error and identically; return the agreed hash seed.

    A collective of every rank of ``transport`` (blocking: ``agree_async`` run to completion here).

    Args:
        transport: The group the hook serves (DDP's group).
        description: This rank's options and model, as text (compared by CRC across ranks).
        failure: This rank's local setup error, or None.
        seed: The user's hash seed, or None to propose a random one.
        device: Where the exchange's tensors live: the model's device (an NCCL rank that never
            called ``torch.cuda.set_device`` would otherwise use GPU 0); None, or another device
            type than the transport's control device: the control device (every rank must use
            the same type, a failing rank included).
        caller: The function the errors name ("zensync.register", "zensync.register_fsdp").

    Returns:
        Rank 0's seed proposal.

    Raises:
        ValueError: On every rank, when any rank failed its local checks or differs from rank 0.
    """
    return transport.run(agree_async(transport, description, failure, seed, device, caller))


async def agree_async(
    transport: Transport,
    description: str,
    failure: BaseException | None,
    seed: int | None,
    device: torch.device | None = None,
    caller: str = "zensync.register",
) -> int:
    """``agree`` as a coroutine of non-blocking collectives (same arguments, result and errors)."""
    control = transport.control_device
    device = device if device is not None and device.type == control.type else control
    message = describe_failure(failure)
    proposal = seed if seed is not None else propose_seed()
    descriptor = [zlib.crc32(description.encode()), proposal, len(message)]
    # Step 1: fingerprints, seed proposals and message lengths.
    gathered = await gather_descriptors_async(transport, descriptor, phase=_PHASE, device=device)
    failing = [rank for rank, row in enumerate(gathered) if row[_F_MESSAGE_BYTES]]
    if failing:
        # Step 2: the failing ranks' messages, quoted on every rank.
        messages = await gather_messages_async(transport, message, phase=_PHASE, device=device)
        told = "; ".join(f"rank {rank}: {messages[rank]}" for rank in failing)
        raise ValueError(f"{caller} failed on rank(s) {failing}: {told}") from failure
    # Step 3: identical setups, or the same error on every rank.
    differing = differing_from_rank0([row[_F_FINGERPRINT] for row in gathered])
    if differing:
        raise ValueError(
            f"{caller}: ranks {differing} differ from rank 0 in their hook options or in their "
            f"model's parameters (names, shapes, dtypes); every rank must register the same model with "
            f"the same options"
        )
    return int(gathered[0][_F_PROPOSAL])


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
