"""The comm hook's options: ``HookConfig``, the keyword options of ``zensync.register``."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from typing import Any

from zensync.compress import COMPRESSED_SCHEMES, build
from zensync.hooks.strategy import resolve_strategy
from zensync.planner import AUTO_COMPRESSORS, StepProfile
from zensync.sync import SyncOptions
from zensync.transport import TuningTable

__all__ = ["WARMUP_PROFILE", "WARMUP_PROFILE_STEPS", "HookConfig"]

WARMUP_PROFILE = "warmup"
"""``profile=`` value: auto measures its step profile during its own warm-up steps."""
WARMUP_PROFILE_STEPS = 8
"""Fewest warm-up steps that measure a profile: the first half is not timed (DDP's initial buckets,
and the next steps still run slower: in compression_bench's MLP at 1 Gbit/s, timing steps 2-3 read
181 ms of backward and timing steps 4-7 read 94, against 99 in its calibration run), which leaves
four timed steps."""


TRANSPORTS = ("torch", "mpi", "mixed")
"""The values of ``HookConfig.transport``."""

_LOWER_BOUNDS = (
    ("warmup_steps", 0),
    ("switch_margin", 0),
    ("explore_every", 1),
    ("recheck_every", 1),
    ("check_every", 1),
    ("verify_steps", 0),
    ("history_size", 1),
    ("hint_check_every", 1),
)
"""Options checked only for a lower bound (name, least valid value)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HookConfig:
    """Options of ``zensync.register`` (all ranks must pass the same values).

    Attributes:
        strategy: "auto", "dense", a sparse scheme ("zen", ...), a compressor spec ("topk:0.01") or a plan file.
        compressed_scheme: Collective of compressed parameters ("auto", "allreduce", "allgather", ...).
        ranks_per_node: > 0: compressed schemes run two-level with nodes of this many ranks (0: flat).
        warmup_steps: Steps of plain averaged allreduce before sparse syncs and compression start.
        switch_margin: Keep a parameter's scheme unless another is predicted this fraction faster.
        latency_s: Per-message latency alpha in seconds (None: measured at registration).
        bandwidth_bytes_per_s: Per-rank bandwidth beta in bytes/s (None: measured at registration).
        adapt: Correct predictions by measured times and try plausible untried schemes ("auto").
        explore_every: With adapt, re-measure a close runner-up scheme every this many steps.
        recheck_every: Buckets found clearly dense re-count their non-zeros every this many steps.
        check_every: The ranks compare their engine states at the first step and every this many steps.
        verify_steps: Auto with a profile: compressed steps measured before it checks that compression paid.
        history_size: Step records kept in ``ZenSyncState.history``.
        row_hints: Embeddings with dense gradients: detect from the rows the lookups touched (verified).
        hint_check_every: With row_hints, verify a hint against the full scan every this many steps.
        overlap_buckets: A bucket lets the next one start once its last collective is issued (default True).
        transport: "torch" (the hook's collectives on a group of the DDP group's backend), "mpi"
            (through mpi4py, ``zensync.transport.mpi``; the job runs under mpiexec) or "mixed"
            (each collective on either, as ``tuning`` routes it).
        tuning: With transport="mixed": the routing table, or the file ``zensync tune`` wrote (None: measured).
        comm_thread: Start the step jobs on a thread of the hook's own (None: on GPUs only).
        jsonl_path: Append one JSON line per step here ("{rank}" in the path: one file per rank).
        sync_options: Tunables of the sparse schemes (``zensync.SyncOptions``).
        timeout: Collective timeout of the groups the hook creates (timedelta or seconds; None: the
            DDP group's timeout from init_process_group).
        profile: "auto": a step profile (``zensync.profile_group``) or its JSON file; auto compresses
            what it does not sync sparsely with the planner's choice among ``auto_compressors``.
        auto_compressors: The compressors "auto" may choose with a profile.
    """

    strategy: str = "auto"
    """'auto' (cost model per parameter), 'dense', a sparse scheme used where it beats dense, a
    compressor spec ('topk:0.01', 'powersgd:4', 'fp16') or a plan file ('plan.json'): see
    ``zensync.hooks.strategy``."""
    compressed_scheme: str = "auto"
    """Compressor strategies: the collective for compressed parameters (``COMPRESSED_SCHEMES``);
    'auto' is allreduce for allreduce-compatible compressors, else allgather. Plans carry their own."""
    ranks_per_node: int = 0
    """Compressor strategies: > 0 runs the compressed scheme two-level (intra-node reduce-scatter,
    compressed across nodes, intra-node allgather) with nodes of this many consecutive ranks."""
    warmup_steps: int = 0
    """Steps of plain averaged allreduce before sparse syncs start."""
    switch_margin: float = 0.1
    """Keep a parameter's previous scheme unless another is predicted more than this fraction faster."""
    latency_s: float | None = None
    """Per-message latency alpha; None: measured at registration."""
    bandwidth_bytes_per_s: float | None = None
    """Per-rank bandwidth beta; None: measured at registration."""
    adapt: bool = True
    """Scale each scheme's predicted time by how it measured against the prediction (``ParamRecord.learn``),
    and measure plausible schemes instead of trusting the model: each one never measured for a
    parameter (expected within 3x of the best) is tried once, one per step, after its first sync."""
    explore_every: int = 20
    """With ``adapt``: every this many steps, re-measure a parameter's runner-up scheme when it is
    expected within 1.5x of the best (a correction measured at another density must not go stale)."""
    recheck_every: int = 10
    """Buckets that were clearly dense re-measure their density only every this many steps."""
    check_every: int = 100
    """The ranks compare their engine states (``ZenSyncState.check_agreement``: one small all-gather
    beside the forward) at the first step and every this many steps after. Between two comparisons
    nothing can differ: the hook's steps change the state alike on every rank, and
    ``load_state_dict`` takes effect only at a comparison that finds the same checkpoint loaded on
    every rank. 1: every step (a checkpoint loaded mid-training then
    takes effect at the next step; an engine bug that made ranks differ is caught at once)."""
    history_size: int = 1000
    """Step records kept in memory (oldest dropped)."""
    row_hints: bool = True
    """Dense-gradient nn.Embedding/EmbeddingBag weights: detection reads only the rows the step's
    lookups touched (recorded by a forward hook), verified against a full scan on the first steps
    and every ``hint_check_every`` steps (``zensync.hooks.hints``); False: always scan."""
    hint_check_every: int = 100
    """With ``row_hints``: check a parameter's hint against the full scan every this many steps."""
    overlap_buckets: bool = True
    """A bucket's job lets the next bucket's start once it has issued its last collective, so the
    next bucket compresses while this one is on the wire and decoded (``hooks.executor``); False:
    each bucket's job runs to its end first (the results are the same either way)."""
    comm_thread: bool | None = None
    """Start each bucket's job on a thread of the hook's own instead of DDP's autograd thread, so
    its compression overlaps the backward of the layers still running (where cores are free; on
    a CPU whose cores backward already fills, it only adds a thread hand-off). None: on GPUs (NCCL
    completes its futures when the work is queued, and the jobs would run inline on the autograd
    thread otherwise), not on CPUs."""
    transport: str = "torch"
    """Where the hook's collectives run: "torch" (a group of its own with the DDP group's backend and
    ranks), "mpi" (an ``MPITransport`` on a duplicate of ``MPI.COMM_WORLD``, whose ranks must be the
    DDP group's: ``zensync.transport.mpi.init_torch_distributed`` makes them so) or "mixed" (each
    collective on the one of those two that ``tuning`` names for its operation, dtype and size:
    ``zensync.transport.MixedTransport``; also under mpiexec)."""
    tuning: TuningTable | str | os.PathLike[str] | None = dataclasses.field(default=None, repr=False)
    """With transport="mixed": the routing table, as a ``TuningTable`` or the JSON file that
    ``zensync tune`` wrote (backends named "gloo" or "nccl" for the DDP group's, "mpi"); None:
    measured at registration on this group (``zensync.transport.tune``: about a second at 2 ranks)."""
    jsonl_path: str | None = None
    """Append one JSON line per step here; '{rank}' in the path gives one file per rank, else rank 0 writes."""
    sync_options: SyncOptions = dataclasses.field(default_factory=SyncOptions)
    """Tunables of the sparse schemes."""
    timeout: datetime.timedelta | float | None = None
    """Collective timeout (timedelta or seconds) of the process groups the hook creates; None: the
    DDP group's own timeout (init_process_group's ``timeout``), so a stuck peer fails every rank then."""

    profile: StepProfile | str | os.PathLike[str] | None = dataclasses.field(default=None, repr=False)
    """'auto' on a dense model: a ``zensync.planner.StepProfile`` measured in this group
    (``zensync.profile_group``, a separate calibration run) or the path of its JSON, or "warmup":
    the hook measures it itself, the compute from its warm-up steps (plain allreduce; at least
    ``WARMUP_PROFILE_STEPS``, the default then) and the links and compressors at their end, in
    this group, before the first step that may compress (``hooks.warmup``). Auto then syncs
    the parameters it does not sync sparsely with the compressor of ``auto_compressors`` that
    ``zensync.planner.choose_compression`` predicts fastest, or densely when none is predicted more
    than ``switch_margin`` faster than dense; the choice and every candidate's predicted step are
    ``ZenSyncState.auto_choice``, and each step record puts the prediction beside the measured step.
    None: auto never compresses (it is lossless)."""
    verify_steps: int = 4
    """With ``profile``: after this many compressed steps, auto compares their measured median step with
    the warm-up's dense steps (``ZenSyncState.verify_auto_choice``) and syncs densely again when
    compression was not ``switch_margin`` faster: a prediction that misses does not keep a lossy
    gradient that does not pay. With fewer than 4 warm-up steps (none measured dense), the dense
    step is the profile's prediction of it. 0: never."""
    auto_compressors: tuple[str, ...] = AUTO_COMPRESSORS
    """With ``profile``: the compressors auto may choose, those the profile measured (fp16 rounds;
    the others are lossy with error feedback)."""

    def __post_init__(self) -> None:
        if self.timeout is not None:
            seconds = self.timeout.total_seconds() if isinstance(self.timeout, datetime.timedelta) else self.timeout
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
                raise ValueError(f"timeout={self.timeout!r} must be a positive timedelta or number of seconds")
            object.__setattr__(self, "timeout", datetime.timedelta(seconds=float(seconds)))
        if not self.strategy.endswith(".json"):  # plan files are read (on every rank) by the state
            resolve_strategy(self.strategy)
        if self.profile == WARMUP_PROFILE:
            if self.warmup_steps == 0:
                object.__setattr__(self, "warmup_steps", WARMUP_PROFILE_STEPS)
            elif self.warmup_steps < WARMUP_PROFILE_STEPS:
                raise ValueError(
                    f"profile='warmup' measures the step during the warm-up steps: warmup_steps="
                    f"{self.warmup_steps} must be >= {WARMUP_PROFILE_STEPS} (DDP settles its buckets in the first; "
                    f"0 means {WARMUP_PROFILE_STEPS})"
                )
        if self.profile is not None:
            if self.strategy != "auto":
                raise ValueError(f"profile= is read by strategy='auto' only (strategy={self.strategy!r})")
            if not isinstance(self.profile, (StepProfile, str, os.PathLike)):
                raise ValueError(
                    f"profile={type(self.profile).__name__} must be a zensync.planner.StepProfile or its JSON file path"
                )
        if isinstance(self.auto_compressors, str) or not all(isinstance(c, str) for c in self.auto_compressors):
            raise ValueError(f"auto_compressors={self.auto_compressors!r} must be a sequence of compressor specs")
        object.__setattr__(self, "auto_compressors", tuple(self.auto_compressors))
        for spec in self.auto_compressors:
            try:
                build(spec)
            except ValueError as exc:
                raise ValueError(f"auto_compressors: {spec!r}: {exc}") from None
        if self.compressed_scheme not in ("auto", *COMPRESSED_SCHEMES):
            raise ValueError(
                f"compressed_scheme={self.compressed_scheme!r} is not one of auto, {', '.join(COMPRESSED_SCHEMES)}"
            )
        for name in ("adapt", "row_hints", "overlap_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.tuning is not None and self.transport != "mixed":
            raise ValueError(f"tuning is the routing of transport='mixed'; transport={self.transport!r} has none")
        if self.comm_thread is not None and not isinstance(self.comm_thread, bool):
            raise ValueError(f"comm_thread={self.comm_thread!r} must be True, False or None")
        if self.ranks_per_node < 0:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 0 (0: flat)")
        for name, least in _LOWER_BOUNDS:
            value = getattr(self, name)
            if value < least:
                raise ValueError(f"{name}={value} must be >= {least}")
        for name in ("latency_s", "bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be positive (or None to measure it)")

    @property
    def timeout_delta(self) -> datetime.timedelta | None:
        """``timeout`` as the timedelta ``__post_init__`` made of it (None: the DDP group's)."""
        assert self.timeout is None or isinstance(self.timeout, datetime.timedelta)
        return self.timeout

    @classmethod
    def from_options(cls, strategy: str, options: dict[str, Any]) -> HookConfig:
        """Build from ``register``'s keyword options, naming any unknown option."""
        check_options(cls, options, "zensync.register")
        return cls(strategy=strategy, **options)


def check_options(config: type, options: dict[str, Any], caller: str) -> None:
    """Refuse keyword options that are not fields of the dataclass ``config`` (its strategy aside), naming them.

    Raises:
        ValueError: Naming the unknown options and the valid ones.
    """
    valid = [f.name for f in dataclasses.fields(config) if f.name != "strategy"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown {caller} option(s) {unknown} (valid: {', '.join(valid)})")
