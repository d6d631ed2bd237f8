"""The comm hook's configuration and state: per-parameter records keyed by name, step history, checkpoints."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import logging
import secrets
import threading
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from zensync.hooks.calibrate import calibrate
from zensync.hooks.decide import ParamRecord
from zensync.hooks.strategy import Strategy, resolve_strategy
from zensync.hooks.worker import CommWorker
from zensync.sync import SCHEMES, SyncOptions
from zensync.sync.compressed import COMPRESSED_SCHEMES, CompressedSync, Hierarchy
from zensync.sync.cost import CostModel
from zensync.transport import TorchTransport, Transport, resolve

__all__ = ["STRATEGIES", "HookConfig", "ZenSyncState"]

logger = logging.getLogger(__name__)

STRATEGIES = SCHEMES
"""Sync scheme names the hook accepts as strategies (``auto`` decides per parameter); compressor
specs and plan files are accepted too (``zensync.hooks.strategy``)."""
_STATE_DICT_VERSION = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HookConfig:
    """Options of ``zensync.register`` (all ranks must pass the same values)."""

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
    history_size: int = 1000
    """Step records kept in memory (oldest dropped)."""
    jsonl_path: str | None = None
    """Append one JSON line per step here; '{rank}' in the path gives one file per rank, else rank 0 writes."""
    sync_options: SyncOptions = dataclasses.field(default_factory=SyncOptions)
    """Tunables of the sparse schemes."""
    timeout: datetime.timedelta | float | None = None
    """Collective timeout (timedelta or seconds) of the process groups the hook creates; None: the
    DDP group's own timeout (init_process_group's ``timeout``), so a stuck peer fails every rank then."""

    def __post_init__(self) -> None:
        if self.timeout is not None:
            seconds = self.timeout.total_seconds() if isinstance(self.timeout, datetime.timedelta) else self.timeout
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
                raise ValueError(f"timeout={self.timeout!r} must be a positive timedelta or number of seconds")
            object.__setattr__(self, "timeout", datetime.timedelta(seconds=float(seconds)))
        if not self.strategy.endswith(".json"):  # plan files are read (on every rank) by the state
            resolve_strategy(self.strategy)
        if self.compressed_scheme not in ("auto", *COMPRESSED_SCHEMES):
            raise ValueError(
                f"compressed_scheme={self.compressed_scheme!r} is not one of auto, {', '.join(COMPRESSED_SCHEMES)}"
            )
        if self.ranks_per_node < 0:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 0 (0: flat)")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.switch_margin < 0:
            raise ValueError(f"switch_margin={self.switch_margin} must be >= 0")
        if self.explore_every < 1:
            raise ValueError(f"explore_every={self.explore_every} must be >= 1")
        if self.recheck_every < 1:
            raise ValueError(f"recheck_every={self.recheck_every} must be >= 1")
        if self.history_size < 1:
            raise ValueError(f"history_size={self.history_size} must be >= 1")
        for name in ("latency_s", "bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be positive (or None to measure it)")

    @classmethod
    def from_options(cls, strategy: str, options: dict[str, Any]) -> HookConfig:
        """Build from ``register``'s keyword options, naming any unknown option."""
        valid = [f.name for f in dataclasses.fields(cls) if f.name != "strategy"]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown zensync.register option(s) {unknown} (valid: {', '.join(valid)})")
        return cls(strategy=strategy, **options)


def _ignore_outcome(_: torch.futures.Future[torch.Tensor]) -> None:
    """A Future callback that only marks completion (never calls ``value()``, so never raises)."""


class ZenSyncState:
    """State of ``zensync_hook`` for one DDP model.

    Records are keyed by parameter name, so they survive DDP's bucket rebuild after the first
    iteration. Construct it on every rank (it is a collective when it calibrates), or let
    ``zensync.register`` do it.

    Args:
        process_group: The DDP model's process group (None: the default group), or a Transport.
        named_parameters: The model's ``named_parameters()`` (unwrapped names, no ``module.``).
        config: Hook options.
    """

    __slots__ = (
        # Configuration.
        "config",
        "strategy",
        "_setup_error",
        # Communication: the group, its transport, the fitted alpha-beta model, the comm thread.
        "transport",
        "dense_transport",
        "cost_model",
        "worker",
        "h0_seed",
        # Compression: one CompressedSync (compressor + error feedback) per (spec, scheme), the hierarchy.
        "compressed",
        "hierarchy",
        "_plan_warned",
        "_hier2_warned",
        # Parameters: name of each parameter, and what the hook remembers about it.
        "param_names",
        "records",
        "scheme_correction",
        # Progress and statistics.
        "step",
        "history",
        "current",
        "lock",
        "step_error",
        "_pending",
        "_jsonl",
    )

    def __init__(
        self, process_group: Any, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], config: HookConfig
    ) -> None:
        self.config = config
        # A strategy that fails to resolve here (a plan file missing on this rank) is reported on
        # every rank by verify_consistent, instead of leaving the other ranks waiting.
        self._setup_error = ""
        try:
            self.strategy = resolve_strategy(config.strategy)
        except ValueError as exc:
            self._setup_error = str(exc)
            self.strategy = Strategy(config.strategy, "dense", ("dense",))
        self.compressed: dict[tuple[str, str], CompressedSync] = {}
        self.hierarchy: Hierarchy | None = None
        self._plan_warned = False
        self._hier2_warned = False
        transport = resolve(process_group)
        # A group of its own: the comm thread's collectives must not interleave with DDP's.
        # It inherits the DDP group's timeout (or ``config.timeout``), not torch's 30-minute default.
        self.transport: Transport = transport
        if isinstance(transport, TorchTransport):
            timeout = config.timeout if isinstance(config.timeout, datetime.timedelta) else None
            self.transport = transport.duplicate(timeout=timeout)
        self.dense_transport: Transport = transport
        """DDP's own group: buckets that need no detection are allreduced on it straight from the
        hook, asynchronously, as torch's allreduce hook does (when it is not ``transport`` itself)."""
        self.cost_model: CostModel | None = None
        if config.latency_s is not None and config.bandwidth_bytes_per_s is not None:
            self.cost_model = CostModel(latency_s=config.latency_s, bandwidth_bytes_per_s=config.bandwidth_bytes_per_s)
        self.worker = CommWorker()
        self.h0_seed: int | None = None
        self.param_names: dict[torch.nn.Parameter, str] = {p: name for name, p in named_parameters}
        self.records: dict[str, ParamRecord] = {}
        self.scheme_correction: dict[str, float] = {}
        """Per scheme: measured / predicted time over all parameters (prior for unmeasured ones)."""
        self.step = 0
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=config.history_size)
        self.current: dict[str, Any] = self._new_step_record()
        self.lock = threading.Lock()
        """Guards ``current`` and ``records``: async dense buckets complete on the backend's thread."""
        self._pending: list[torch.futures.Future[torch.Tensor]] = []
        self.step_error: BaseException | None = None
        """The first exception of the current step on this rank (``note_failure``); cleared by ``finish_step``."""
        self._jsonl = self._jsonl_target()
        if self.transport.rank == 0:
            logger.info("zensync hook: %s on %d ranks", config, self.transport.world_size)

    # -- agreement ----------------------------------------------------------------------------------
    def verify_consistent(self, device: torch.device) -> None:
        """Raise the same ValueError on every rank unless all ranks have the same options and model.

        Also agrees on Zen's hash seed. A collective. Ranks that disagree on the strategy would issue
        different collectives and hang; ranks whose models differ would sum unrelated gradients.
        """
        described = json.dumps(
            {
                "config": repr(self.config),
                "plan": self.strategy.plan_digest,
                "params": sorted((name, list(p.shape), str(p.dtype)) for p, name in self.param_names.items()),
            },
            sort_keys=True,
        )
        seed = self.config.sync_options.h0_seed
        proposal = seed if seed is not None else secrets.randbits(62)
        failed = int(bool(self._setup_error))
        local = torch.tensor([zlib.crc32(described.encode()), proposal, failed], dtype=torch.int64, device=device)
        with self.transport.phase("setup"):
            gathered = [t.tolist() for t in self.transport.all_gather(local)]
        failing = [rank for rank, g in enumerate(gathered) if g[2]]
        if failing:
            here = f": {self._setup_error}" if self._setup_error else ""
            raise ValueError(
                f"zensync.register: ranks {failing} could not set up strategy {self.config.strategy!r}{here}"
            )
        fingerprints = [g[0] for g in gathered]
        self.h0_seed = gathered[0][1]  # rank 0's proposal: Zen's hash seed for every parameter
        differing = [rank for rank, value in enumerate(fingerprints) if value != fingerprints[0]]
        if differing:
            raise ValueError(
                f"zensync.register: ranks {differing} differ from rank 0 in their hook options or in "
                f"their model's parameters (names, shapes, dtypes); every rank must register the same "
                f"model with the same options"
            )

    # -- compression ---------------------------------------------------------------------------------
    def compressed_sync(self, spec: str, scheme: str) -> CompressedSync:
        """The CompressedSync of (compressor spec, scheme), created on first use (it owns the EF memory)."""
        key = (spec, scheme)
        sync = self.compressed.get(key)
        if sync is None:
            sync = self.compressed[key] = CompressedSync(spec, scheme)
        return sync

    def two_level_ranks_per_node(self) -> int:
        """Ranks per node of the two-level compressed schemes (0: flat), from the options or the plan."""
        plan = self.strategy.plan
        if plan is not None:
            return plan.two_level_ranks_per_node(self.transport.world_size)
        return self.config.ranks_per_node if self.strategy.kind == "compress" else 0

    @property
    def compression_memory_bytes(self) -> int:
        """Bytes of error-feedback memory held by all compressed syncs."""
        return sum(sync.memory_bytes for sync in self.compressed.values())

    # -- calibration -------------------------------------------------------------------------------
    def agreed_seed(self, device: torch.device) -> int:
        """Zen's hash seed, agreed by ``verify_consistent`` (run now, collectively, if it has not been)."""
        if self.h0_seed is None:
            self.verify_consistent(device)
        assert self.h0_seed is not None
        return self.h0_seed

    def ensure_cost_model(self, device: torch.device) -> CostModel:
        """The alpha-beta model: user-given parts, the rest measured (a collective, done once)."""
        if self.cost_model is None:
            measured = calibrate(self.transport, device)
            self.cost_model = CostModel(
                latency_s=self.config.latency_s or measured.latency_s,
                bandwidth_bytes_per_s=self.config.bandwidth_bytes_per_s or measured.bandwidth_bytes_per_s,
            )
            if self.transport.rank == 0:
                logger.info("zensync hook: calibrated %s", self.cost_model)
        return self.cost_model

    # -- names and records --------------------------------------------------------------------------
    def name_of(self, param: torch.Tensor) -> str:
        """The name of a bucket parameter (a stable key across bucket rebuilds)."""
        name = self.param_names.get(param)  # type: ignore[call-overload]  # Parameters hash by identity
        if name is None:
            raise ValueError(
                "a DDP bucket holds a parameter that is not among the named_parameters given to the "
                "zensync hook state; build the state from the same model DDP wraps (ddp.module)"
            )
        return name

    def record(self, name: str) -> ParamRecord:
        """The record of parameter ``name``, created on first use."""
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = ParamRecord()
        return record

    @property
    def in_warmup(self) -> bool:
        return self.step < self.config.warmup_steps

    # -- steps ---------------------------------------------------------------------------------------
    def _new_step_record(self) -> dict[str, Any]:
        return {"step": self.step, "comm_time_s": 0.0, "bytes_sent": 0, "bytes_recv": 0, "params": {}}

    def add_pending(self, future: torch.futures.Future[torch.Tensor]) -> None:
        """Remember an async bucket of this step; ``finish_step`` waits for it."""
        with self.lock:
            self._pending.append(future)

    def note_failure(self, exc: BaseException) -> None:
        """Remember the first exception of this step (its original type; thread-safe)."""
        with self.lock:
            if self.step_error is None:
                self.step_error = exc

    def finish_step(self) -> BaseException | None:
        """Close the current step's record (called after the last bucket of a backward pass).

        Waits for the step's async buckets first (their statistics belong to this step).

        Returns:
            The step's first failure with its original type (``note_failure``), or None.
        """
        with self.lock:
            pending, self._pending = self._pending, []
        for future in pending:
            # Completion only: a failed bucket's own exception was recorded by note_failure.
            future.then(_ignore_outcome).wait()
        with self.lock:
            failure, self.step_error = self.step_error, None
        record = self.current
        if failure is not None:
            record["failed"] = f"{type(failure).__name__}: {failure}"
        self.history.append(record)
        if self._jsonl is not None:
            with open(self._jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        self.step += 1
        self.current = self._new_step_record()
        return failure

    def last_step(self) -> dict[str, Any] | None:
        """The most recent finished step record, or None before the first step."""
        return self.history[-1] if self.history else None

    def _jsonl_target(self) -> str | None:
        path = self.config.jsonl_path
        if path is None:
            return None
        if "{rank}" in path:
            return path.format(rank=self.transport.rank)
        return path if self.transport.rank == 0 else None

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter, per-parameter records and the cost model (no process group)."""
        model = self.cost_model
        return {
            "version": _STATE_DICT_VERSION,
            "step": self.step,
            "records": {name: r.as_dict() for name, r in self.records.items()},
            "scheme_correction": dict(self.scheme_correction),
            "cost_model": None if model is None else dataclasses.asdict(model),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        if state.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"zensync hook state_dict version {state.get('version')!r} is not {_STATE_DICT_VERSION}")
        self.step = int(state["step"])
        self.records = {name: ParamRecord(**fields) for name, fields in state["records"].items()}
        self.scheme_correction = {str(k): float(v) for k, v in state["scheme_correction"].items()}
        model = state["cost_model"]
        self.cost_model = None if model is None else CostModel(**model)
        self.current = self._new_step_record()

    def __getstate__(self) -> dict[str, Any]:
        """Pickling keeps the configuration and the records; the process group and thread are dropped."""
        logger.warning("zensync hook state pickled: the process group is not included; re-register after loading")
        return {"config": self.config, "state_dict": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise TypeError(
            "a pickled ZenSyncState cannot be revived without its process group: create a new state "
            "with zensync.register(...) and call load_state_dict(saved['state_dict'])"
        )

    def close(self) -> None:
        """Stop the communication thread."""
        self.worker.close()
