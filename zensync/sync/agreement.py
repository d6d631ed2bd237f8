"""The one agreement protocol of zensync: local checks meet in one collective, so a failure anywhere fails everywhere.

Every entry point that starts collectives on a group first agrees with its peers: ``sparse_allreduce``
(``zensync.sync.validate``: the call's arguments), ``register`` (``zensync.sync.registration``: the
hook's options and model) and the hook's per-step state check. Each does what it can check alone
without communicating, then runs this protocol:

1. Descriptors. One all-gather of every rank's fixed-size int64 descriptor (``gather_descriptors``):
   what the rank was asked to do, whether its local checks failed, its proposal for Zen's seed.
2. Messages (optional). When some rank failed, one all-gather with uneven sizes carries each rank's
   error message (``gather_messages``; empty for ranks that did not fail), so every rank can quote
   the failing ones.
3. Comparison. Every rank compares the same gathered descriptors the same way (``differing_from_rank0``,
   ``compare_with_rank0``) and so either every rank proceeds or every rank raises the same ValueError.
4. Seed. Zen's first-level hash seed of a group is agreed at the group's first use: rank 0's proposal
   wins (``agree_group_seed``) and is kept here, per transport, for every later call on the group.

Because the descriptor exchange is the first collective of a call, a rank with bad input still takes
part in exactly the collectives its peers expect, and no rank hangs waiting for a peer that gave up.
The ``*_async`` forms are coroutines for code driven by completion callbacks (the DDP hook's steps);
the blocking forms run them with ``transport.run``.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import weakref
from collections.abc import Sequence

import torch

from zensync.transport import Transport

__all__ = [
    "MAX_MESSAGE_BYTES",
    "SEED_BITS",
    "Comparison",
    "agree_group_seed",
    "compare_with_rank0",
    "compare_with_rank0_async",
    "describe_failure",
    "differing_from_rank0",
    "gather_descriptors",
    "gather_descriptors_async",
    "gather_messages_async",
    "group_seed",
    "propose_seed",
]

MAX_MESSAGE_BYTES = 4096
"""A failing rank's message is cut to this many UTF-8 bytes (it travels to every rank)."""
SEED_BITS = 62
"""Seed proposals are uniform in [0, 2**62): non-negative in an int64 descriptor slot."""

_GROUP_SEEDS: weakref.WeakKeyDictionary[Transport, int] = weakref.WeakKeyDictionary()
"""Zen's agreed seed per group, keyed by the group's transport (forgotten with the transport).

``zensync.transport.resolve`` returns the same (cached) transport for a torch.distributed group on
every call, so the seed agreed at a group's first ``sparse_allreduce`` serves all its later ones."""
_GROUP_SEEDS_LOCK = threading.Lock()
"""Simulated ranks are threads of one process, each with its own transport: writes are serialized."""


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """Every rank's gathered int64 values, and the ranks that differ from rank 0."""

    rows: list[list[int]]
    """Rank r's values at ``rows[r]``, identical on every rank."""
    differing: list[int]
    """Ranks whose compared values differ from rank 0's (empty: all agree)."""


def differing_from_rank0(values: Sequence[object]) -> list[int]:
    """The ranks whose gathered value differs from rank 0's.

    Example::

        differing_from_rank0([7, 7, 8, 7, 9])  # [2, 4]
    """
    return [rank for rank, value in enumerate(values) if value != values[0]]


def propose_seed() -> int:
    """A fresh random seed proposal (rank 0's wins; the others' are never used)."""
    return secrets.randbits(SEED_BITS)


def describe_failure(failure: BaseException | None) -> bytes:
    """The message of a rank's local failure as sent to every rank: b"" for none, else "Type: text".

    Cut to ``MAX_MESSAGE_BYTES``; never empty for a failure (an empty length means "no error").
    """
    if failure is None:
        return b""
    text = f"{type(failure).__name__}: {failure}".encode(errors="replace")
    return text[:MAX_MESSAGE_BYTES] or b"?"


# -- Step 1: descriptors --------------------------------------------------------------------------
async def gather_descriptors_async(
    transport: Transport, descriptor: Sequence[int], *, phase: str, device: torch.device | None = None
) -> list[list[int]]:
    """Every rank's int64 ``descriptor`` (the same length on every rank), in rank order.

    A collective of every rank of ``transport``: one all-gather, counted under ``phase``.

    Args:
        transport: The group.
        descriptor: This rank's values (each must fit an int64).
        phase: Traffic phase of the exchange ("validate", "setup").
        device: Where the descriptor tensor lives (the transport's control device when None).

    Returns:
        The gathered descriptors as Python ints, identical on every rank.
    """
    local = torch.tensor(list(descriptor), dtype=torch.int64, device=device or transport.control_device)
    with transport.phase(phase):  # issued under the phase, awaited outside it (the phase is the transport's)
        handle = transport.all_gather_async(local)
    gathered = await handle
    return [row.tolist() for row in gathered]  # host-device sync


def gather_descriptors(
    transport: Transport, descriptor: Sequence[int], *, phase: str, device: torch.device | None = None
) -> list[list[int]]:
    """Blocking ``gather_descriptors_async`` (never call it inside a coroutine the hook runs)."""
    return transport.run(gather_descriptors_async(transport, descriptor, phase=phase, device=device))


# -- Step 2: messages -----------------------------------------------------------------------------
async def gather_messages_async(
    transport: Transport, message: bytes, *, phase: str, device: torch.device | None = None
) -> list[str]:
    """Every rank's ``message`` (b"" when it did not fail) as text, in rank order.

    A collective of every rank of ``transport``: one all-gather with uneven sizes, under ``phase``.
    Invalid UTF-8 (a message cut inside a character) is replaced, not raised.
    """
    payload = torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else torch.empty(0, dtype=torch.uint8)
    with transport.phase(phase):
        handle = transport.all_gather_v_async(payload.to(device or transport.control_device))
    gathered = await handle
    return [bytes(m.cpu().tolist()).decode(errors="replace") for m in gathered]  # host-device sync


# -- Step 3: comparison ---------------------------------------------------------------------------
async def compare_with_rank0_async(
    transport: Transport,
    values: Sequence[int],
    *,
    compared: int | None = None,
    phase: str = "setup",
    device: torch.device | None = None,
) -> Comparison:
    """All-gather ``values`` (int64, the same count on every rank) and name the ranks differing from rank 0.

    Only the first ``compared`` values are compared (all when None); the rest travel along for the
    caller's message (e.g. step counters by rank). A collective of every rank of ``transport``.

    Example::

        comparison = await compare_with_rank0_async(transport, [digest, load_mark, step], compared=2)
        if comparison.differing:
            raise ValueError(f"ranks {comparison.differing} differ from rank 0")
    """
    rows = await gather_descriptors_async(transport, values, phase=phase, device=device)
    keys = [row[:compared] if compared is not None else row for row in rows]
    return Comparison(rows=rows, differing=differing_from_rank0(keys))


def compare_with_rank0(
    transport: Transport,
    values: Sequence[int],
    *,
    compared: int | None = None,
    phase: str = "setup",
    device: torch.device | None = None,
) -> Comparison:
    """Blocking ``compare_with_rank0_async`` (never call it inside a coroutine the hook runs)."""
    coro = compare_with_rank0_async(transport, values, compared=compared, phase=phase, device=device)
    return transport.run(coro)


# -- Step 4: the group's seed ---------------------------------------------------------------------
def group_seed(transport: Transport) -> int | None:
    """Zen's seed agreed for the group of ``transport``, or None before the group's first use."""
    with _GROUP_SEEDS_LOCK:
        return _GROUP_SEEDS.get(transport)


def agree_group_seed(transport: Transport, rank0_proposal: int) -> int:
    """The group's agreed seed: the one kept from its first use, else ``rank0_proposal`` (kept from now on).

    Call it with the proposal rank 0 sent in the descriptor exchange, on every rank, so every rank
    keeps the same seed. An explicit seed of a call (``SyncOptions.h0_seed``) overrides the group's
    for that call only; callers apply it themselves.
    """
    with _GROUP_SEEDS_LOCK:
        seed = _GROUP_SEEDS.get(transport)
        if seed is None:
            seed = _GROUP_SEEDS[transport] = rank0_proposal
        return seed
