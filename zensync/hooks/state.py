"""The comm hook's configuration and state: per-parameter records keyed by name, step history, checkpoints."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from zensync.hooks.agree import agree, checked_parameters, differing_from_rank0
from zensync.hooks.calibrate import calibrate
from zensync.hooks.checkpoint import STATE_DICT_VERSION, fingerprint, parse_state_dict
from zensync.hooks.config import HookConfig
from zensync.hooks.decide import ParamRecord
from zensync.hooks.strategy import Strategy, resolve_strategy
from zensync.hooks.worker import CommWorker
from zensync.sync import SCHEMES
from zensync.sync.compressed import CompressedSync, Hierarchy
from zensync.sync.cost import CostModel
from zensync.transport import TorchTransport, Transport, resolve

__all__ = ["STRATEGIES", "HookConfig", "ZenSyncState"]

logger = logging.getLogger(__name__)

STRATEGIES = SCHEMES
"""Sync scheme names the hook accepts as strategies (``auto`` decides per parameter); compressor
specs and plan files are accepted too (``zensync.hooks.strategy``)."""


def _ignore_outcome(_: torch.futures.Future[torch.Tensor]) -> None:
    """A Future callback that only marks completion (never calls ``value()``, so never raises)."""


class ZenSyncState:
    """State of ``zensync_hook`` for one DDP model.

    Records are keyed by parameter name, so they survive DDP's bucket rebuild after the first
    iteration. Construct it on every rank: construction is a collective (``agree``: every rank's
    local checks, options and model are compared, and any rank's failure raises the same ValueError
    on every rank), or let ``zensync.register`` do it.

    Args:
        process_group: The DDP model's process group (None: the default group), or a Transport.
        named_parameters: The model's ``named_parameters()`` (unwrapped names, no ``module.``).
        config: Hook options.
        failure: An error the caller met in its own local checks, to be raised on every rank.
    """

    __slots__ = (
        # Configuration.
        "config",
        "strategy",
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
        "step_open",
        "_load_mark",
        "_pending",
        "_jsonl",
    )

    def __init__(
        self,
        process_group: Any,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        config: HookConfig,
        *,
        failure: BaseException | None = None,
    ) -> None:
        self.config = config
        base = resolve(process_group)
        # Step 1: every local check, without communicating. Step 2: one agreement collective on the
        # DDP group carries any rank's failure (``failure``: the caller's own) to every rank.
        self.strategy = Strategy(config.strategy, "dense", ("dense",))
        self.param_names: dict[torch.nn.Parameter, str] = {}
        described = ""
        if failure is None:
            try:
                self.strategy = resolve_strategy(config.strategy)
                self.param_names = checked_parameters(named_parameters)
                described = self._describe()
            except Exception as exc:  # noqa: BLE001 - carried to every rank and re-raised by agree()
                failure = exc
        self.h0_seed: int = agree(base, described, failure, config.sync_options.h0_seed)
        """Zen's hash seed, agreed at construction (rank 0's proposal, or the user's)."""
        self.compressed: dict[tuple[str, str], CompressedSync] = {}
        self.hierarchy: Hierarchy | None = None
        self._plan_warned = False
        self._hier2_warned = False
        # A group of its own: the comm thread's collectives must not interleave with DDP's.
        # It inherits the DDP group's timeout (or ``config.timeout``), not torch's 30-minute default.
        self.transport: Transport = base
        if isinstance(base, TorchTransport):
            self.transport = base.duplicate(timeout=config.timeout_delta)
        self.dense_transport: Transport = base
        """DDP's own group: buckets that need no detection are allreduced on it straight from the
        hook, asynchronously, as torch's allreduce hook does (when it is not ``transport`` itself)."""
        self.cost_model: CostModel | None = None
        if config.latency_s is not None and config.bandwidth_bytes_per_s is not None:
            self.cost_model = CostModel(latency_s=config.latency_s, bandwidth_bytes_per_s=config.bandwidth_bytes_per_s)
        self.worker = CommWorker()
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
        self.step_open = False
        """Whether the current step's first bucket has been seen (``check_agreement`` is queued)."""
        self._load_mark = 0
        """Digest of the last loaded checkpoint (0: none); part of what ranks must agree on."""
        self._jsonl = self._jsonl_target()
        if self.transport.rank == 0:
            logger.info("zensync hook: %s on %d ranks", config, self.transport.world_size)

    # -- agreement ----------------------------------------------------------------------------------
    def _describe(self) -> str:
        """This rank's options and model as text; ``agree`` checks that every rank's is the same."""
        return json.dumps(
            {
                "config": repr(self.config),
                "plan": self.strategy.plan_digest,
                "params": sorted((name, list(p.shape), str(p.dtype)) for p, name in self.param_names.items()),
            },
            sort_keys=True,
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
        if self.step_error is None:
            for future in pending:
                # Completion only: a failed bucket's own exception was recorded by note_failure.
                future.then(_ignore_outcome).wait()
        # A failed step does not wait for its async buckets: after a failed agreement check one may
        # have no partner on the other ranks and would only end in the group's timeout.
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
        self.step_open = False
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
            "version": STATE_DICT_VERSION,
            "step": self.step,
            "records": {name: r.as_dict() for name, r in self.records.items()},
            "scheme_correction": dict(self.scheme_correction),
            "cost_model": None if model is None else dataclasses.asdict(model),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved: all of it, or (ValueError) nothing.

        Every field is validated first (``checkpoint.parse_state_dict``: types, ranges, and records of
        this model's parameters only); the state is changed only when all of it is valid. Every rank
        must load the same state dict: the next step compares the ranks' engine state
        (``check_agreement``) and raises the same ValueError on every rank when they differ.
        """
        loaded = parse_state_dict(state, set(self.param_names.values()))
        with self.lock:
            self.step = loaded.step
            self.records = loaded.records
            self.scheme_correction = loaded.scheme_correction
            self.cost_model = loaded.cost_model
            self.current = self._new_step_record()
            self._load_mark = fingerprint(
                loaded.step,
                {n: r.scheme for n, r in loaded.records.items()},
                loaded.scheme_correction,
                loaded.cost_model,
            )

    def _control_device(self) -> torch.device:
        """The transport's control device, as the model's own GPU when it is CUDA (NCCL).

        This runs on the comm thread, whose current CUDA device is not the one the user selected on
        the main thread: a bare "cuda" would name GPU 0 on every rank.
        """
        device = self.transport.control_device
        if device.type == "cuda":
            return next(iter(self.param_names)).device
        return device

    def check_agreement(self) -> None:
        """Compare the ranks' engine state in one small all-gather (a collective; the hook runs it first in each step).

        Raises:
            ValueError: On every rank, when some rank's step counter, schemes, scheme corrections,
                cost model or loaded checkpoint differ from rank 0's (a checkpoint loaded on some
                ranks only, or different checkpoints).
        """
        with self.lock:  # async buckets' callbacks write records
            schemes = {name: record.scheme for name, record in self.records.items()}
            digest = fingerprint(self.step, schemes, self.scheme_correction, self.cost_model)
        local = torch.tensor([digest, self._load_mark, self.step], dtype=torch.int64, device=self._control_device())
        with self.transport.phase("setup"):
            gathered = [t.tolist() for t in self.transport.all_gather(local)]  # host-device sync
        differing = differing_from_rank0([g[:2] for g in gathered])
        if differing:
            steps = [g[2] for g in gathered]
            raise ValueError(
                f"zensync hook: ranks {differing} hold another engine state than rank 0 (step counters by "
                f"rank: {steps}); every rank must call load_state_dict with the same checkpoint"
            )

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
