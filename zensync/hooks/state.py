"""The comm hook's state: configuration, per-parameter memory, runtime and step log, and the step's control.

``ZenSyncState`` holds four parts, each a small class of its own:

    config    HookConfig + the resolved Strategy                (hooks.config, hooks.strategy)
    memory    ParamMemory: records, corrections, error feedback  (hooks.memory)
    runtime   Runtime: groups, lane, hierarchy, cost model       (hooks.runtime)
    log       StepLog: step counter, open and finished records   (hooks.steplog)

plus the decider and the executor built on them, and what one step needs to end cleanly (its first
failure, its async dense buckets). Checkpoints (``state_dict``) cover the step counter, the memory's
records and the cost model; the ranks compare them at the first step and every ``check_every``
steps (``check_agreement``), and a loaded checkpoint takes effect at such a step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol

import torch

from zensync import kernels
from zensync.compress import CompressedSync, Hierarchy, hierarchy
from zensync.cost import CostModel
from zensync.hooks.checkpoint import STATE_DICT_VERSION, LoadedState, fingerprint, parse_state_dict
from zensync.hooks.config import WARMUP_PROFILE, HookConfig
from zensync.hooks.decider import Decider
from zensync.hooks.executor import BucketExecutor
from zensync.hooks.hints import RowHints
from zensync.hooks.memory import ParamMemory, ParamRecord
from zensync.hooks.runtime import Runtime, load_tuning
from zensync.hooks.steplog import StepLog
from zensync.hooks.strategy import Strategy, auto_compression, read_step_profile, resolve_strategy
from zensync.hooks.warmup import WarmupProfiler
from zensync.planner import AutoChoice, StepProfile
from zensync.profiling import slowest_over_ranks
from zensync.sync import SCHEMES
from zensync.sync.agreement import compare_with_rank0_async
from zensync.sync.registration import agree, checked_parameters
from zensync.transport import Handle, MPITransport, Task, Transport, TuningTable, resolve

__all__ = ["STRATEGIES", "HookConfig", "SyncListener", "SyncListeners", "ZenSyncState"]

logger = logging.getLogger(__name__)

_SETTLING_STEPS = 2
"""The training's first steps, slower whatever syncs them (DDP's bucket rebuild, first allocations):
auto's verdict does not count them as compressed steps."""

STRATEGIES = SCHEMES
"""Sync scheme names the hook accepts as strategies (``auto`` decides per parameter); compressor
specs and plan files are accepted too (``zensync.hooks.strategy``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AutoVerdict:
    """Auto's compression measured against the dense steps it replaced (``ZenSyncState.verify_auto_choice``)."""

    spec: str
    """The compressor auto chose."""
    dense_step_s: float
    """Median measured interval of the warm-up's later dense steps (slowest rank), or, where the
    warm-up measured fewer than two, the profile's prediction of the dense step (``dense_measured``)."""
    compressed_step_s: float
    """Median measured interval of the first compressed steps after the training's first two (slowest rank)."""
    kept: bool
    """Whether the compression stays (it was ``switch_margin`` faster)."""
    dense_measured: bool = True
    """Whether ``dense_step_s`` was measured (False: predicted from the profile)."""

    def __str__(self) -> str:
        outcome = "kept" if self.kept else "not faster: dense again"
        source = "" if self.dense_measured else " (predicted by the profile: no dense step measured)"
        return (
            f"{self.spec} measured {self.compressed_step_s * 1e3:.1f} ms/step against dense "
            f"{self.dense_step_s * 1e3:.1f} ms/step{source}: {outcome}"
        )


class SyncListener(Protocol):
    """What ``ZenSyncState.add_sync_listener`` takes: told as a step's gradient collectives begin and end."""

    def sync_begins(self) -> None: ...

    def sync_ends(self) -> None: ...


class SyncListeners:
    """The listeners a hook state tells as each step's gradient collectives begin and end (DDP's
    ``ZenSyncState``, FSDP's ``FSDPSyncState``)."""

    __slots__ = ("_listeners",)

    def __init__(self) -> None:
        self._listeners: list[SyncListener] = []

    def add(self, listener: SyncListener) -> None:
        self._listeners.append(listener)

    def begins(self) -> None:
        for listener in self._listeners:
            listener.sync_begins()

    def ends(self) -> None:
        for listener in self._listeners:
            listener.sync_ends()


class ZenSyncState:
    """State of ``zensync_hook`` for one DDP model (see the module docstring for its parts).

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
        "param_names",
        "auto_choice",
        "auto_profile",
        "auto_verdict",
        "_auto_base",
        "_dense_times",
        "_compressed_times",
        "_clock",
        "_profile_digest",
        # The parts, and the decider and executor built on them.
        "memory",
        "runtime",
        "log",
        "decider",
        "executor",
        # The open step: its first failure, whether it began, its check, its async dense buckets.
        "lock",
        "step_error",
        "step_open",
        "_check",
        "_opened_s",
        "_pending",
        "_load_mark",
        # The comparisons' schedule (steps opened since registration) and a load staged for the next one.
        "_opened",
        "_staged",
        # Row hints of the model's embeddings; the forward hook that issues each step's check.
        "hints",
        "forward_hook",
        # Strategy "auto" with profile="warmup": the warm-up's marks, and the forward-end hook.
        "warmup",
        "forward_end_hook",
        "_sync_listeners",
        # DDP's bucket layout: this step's so far, the last finished step's, a loaded one to replay.
        "_layout",
        "bucket_layout",
        "_replay",
        "_profiled_step",
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
        self.auto_choice: AutoChoice | None = None
        """Strategy "auto" with a step profile: the compressor chosen ("fp32": none) and every candidate's
        predicted step (``zensync.planner.choose_compression``); None without a profile."""
        self.auto_profile: StepProfile | None = None
        """The step profile auto chose from (given, or measured in its warm-up: ``profile="warmup"``)."""
        self.auto_verdict: AutoVerdict | None = None
        """Auto's compression checked against its measured steps (``verify_auto_choice``); None until then."""
        self._auto_base: Strategy | None = None
        """Strategy "auto" before a profile made it compress: what a verdict against the choice returns to."""
        self._dense_times: list[float] = []
        self._compressed_times: list[float] = []
        """Measured step intervals of the warm-up's dense steps and of the compressed steps after the
        choice, while ``verify_auto_choice`` waits for them."""
        self._clock: Callable[[], float] = time.perf_counter
        """The clock of the step intervals (a test scripts it)."""
        self._profile_digest = ""
        described = ""
        tuning = None
        if failure is None:
            try:
                self.strategy = resolve_strategy(config.strategy)
                self.param_names = checked_parameters(named_parameters)
                if config.transport in ("mpi", "mixed"):
                    MPITransport.check_world(base.rank, base.world_size)
                tuning = load_tuning(config.tuning, base.world_size)
                if config.profile is not None and config.profile != WARMUP_PROFILE:
                    self._auto_compression(config, base.world_size)
                described = self._describe(tuning)
            except Exception as exc:  # noqa: BLE001 - carried to every rank and re-raised by agree()
                failure = exc
        device = next(iter(self.param_names)).device if self.param_names else None
        h0_seed = agree(base, described, failure, config.sync_options.h0_seed, device)
        assert device is not None  # no parameters only after a local failure, which agree raised
        self.runtime = Runtime(base, config, h0_seed, device, tuning=tuning)
        self.memory = ParamMemory()
        self.log = StepLog(config.history_size, self._jsonl_target(config.jsonl_path, self.runtime.transport.rank))
        self.decider = Decider(config, self.strategy, self.memory, two_level=False)
        self.lock = threading.Lock()
        """Guards the memory's records and the log: async dense buckets complete on a backend thread."""
        self.executor = BucketExecutor(
            self.runtime, self.memory, self.log, config.sync_options, self.lock, overlap=config.overlap_buckets
        )
        self._pending: list[Handle[torch.Tensor]] = []
        self.step_error: BaseException | None = None
        """The first exception of the current step on this rank (``note_failure``); cleared by ``finish_step``."""
        self.step_open = False
        """Whether the current step's first bucket has been seen (its check runs: ``open_step``)."""
        self._check: Handle[torch.Tensor] | None = None
        """The open step's agreement check (``open_step``)."""
        self._opened_s: float | None = None
        """``time.perf_counter()`` when the last step opened (its record's ``step_interval_s``)."""
        self._load_mark = 0
        """Digest of the last loaded checkpoint (0: none); part of what ranks must agree on."""
        self._opened = 0
        """Steps opened since registration: the same count on every rank (each step syncs), unlike
        the step counter, which a checkpoint sets; the comparisons' schedule (``check_due``)."""
        self._staged: tuple[LoadedState, dict[str, Any]] | None = None
        """A checkpoint loaded between two comparisons (its parsed state and the dict), applied just
        before the next comparison is issued (``load_state_dict``)."""
        self.hints: RowHints | None = None
        """Row hints of the model's dense-gradient embeddings (``attach_hints``)."""
        self.forward_hook: Any = None
        """The DDP module's forward pre-hook that calls ``begin_check`` (``zensync.register``)."""
        self.warmup: WarmupProfiler | None = None
        """Strategy "auto" with ``profile="warmup"``: measures the step profile (``hooks.warmup``)."""
        if config.profile == WARMUP_PROFILE:
            shapes = {name: tuple(p.shape) for p, name in self.param_names.items()}
            dtype_bytes = next(iter(self.param_names)).element_size()
            self.warmup = WarmupProfiler(config.warmup_steps, shapes, dtype_bytes, config.auto_compressors)
        self._layout: list[list[str]] = []
        self.bucket_layout: list[list[str]] | None = None
        """The parameter names of each bucket of the last finished step, in the order they synced."""
        self._replay: list[list[str]] | None = None
        """A loaded checkpoint's bucket layout, for the first step after it (``replay_groups``)."""
        self._sync_listeners = SyncListeners()
        """Told when each step's collectives begin and end (``add_sync_listener``)."""
        self.forward_end_hook: Any = None
        """The DDP module's forward hook that marks the forward's end for ``warmup``."""
        self._profiled_step: int | None = None
        """The step that measured the warm-up profile (its interval pays for that: no prediction beside it)."""
        if self.runtime.transport.rank == 0:
            logger.info("zensync hook: %s on %d ranks", config, self.runtime.transport.world_size)
            if self.auto_choice is not None:
                _log_choice(self.auto_choice, "the profile")

    def _auto_compression(self, config: HookConfig, world_size: int) -> None:
        """Strategy "auto" with a step profile: compress where the planner predicts it pays (``auto_compression``)."""
        assert config.profile is not None
        profile, self._profile_digest = read_step_profile(config.profile)
        self.auto_profile = profile
        self._auto_base = self.strategy
        foreign = sorted({t.name for t in profile.profile.tensors} - set(self.param_names.values()))
        if foreign:
            raise ValueError(
                f"profile: its tensors {foreign[:3]}{' ...' if len(foreign) > 3 else ''} are not parameters of "
                f"this model (a profile of another model?); measure this one (zensync.profile_group)"
            )
        self.strategy, self.auto_choice = auto_compression(
            self.strategy, profile, config.auto_compressors, world_size, config.switch_margin
        )

    def measure_warmup_profile(self) -> None:
        """Strategy "auto" with ``profile="warmup"``, at the first step after the marked ones, before
        its first bucket: measure the profile (collective, blocking: ``WarmupProfiler.profile``) and
        compress from now on where the planner predicts it pays, as with a given profile."""
        assert self.warmup is not None
        transport = self.runtime.transport
        profile = self.warmup.profile(transport)
        strategy, choice = auto_compression(
            self.strategy, profile, self.config.auto_compressors, transport.world_size, self.config.switch_margin
        )
        with self.lock:
            self._auto_base = self.strategy
            self.strategy, self.auto_choice, self.auto_profile = strategy, choice, profile
            self.decider.strategy = strategy
            self._profiled_step = self.step
        if transport.rank == 0:
            _log_choice(choice, f"its warm-up profile, from step {self.step}")

    def _describe(self, tuning: TuningTable | None = None) -> str:
        """This rank's options, model and mixed-dispatch table as text; ``agree`` checks that every
        rank's is the same (a table that differed would route a collective to two backends)."""
        return json.dumps(
            {
                "config": repr(self.config),
                "tuning": None if tuning is None else tuning.to_json(),
                "plan": self.strategy.plan_digest,
                "profile": self._profile_digest,
                "params": sorted((name, list(p.shape), str(p.dtype)) for p, name in self.param_names.items()),
            },
            sort_keys=True,
        )

    @staticmethod
    def _jsonl_target(path: str | None, rank: int) -> str | None:
        if path is None:
            return None
        if "{rank}" in path:
            return path.format(rank=rank)
        return path if rank == 0 else None

    # -- setup (collectives of every rank, before training) -----------------------------------------
    def setup(self) -> None:
        """Calibrate the cost model where the strategy needs one, and build the two-level hierarchy."""
        transport = self.runtime.transport
        if self.strategy.kind != "dense":
            transport.run(self.runtime.ensure_cost_model(self.config))
        ranks_per_node = self.two_level_ranks_per_node()
        if ranks_per_node:
            self.runtime.hierarchy = hierarchy(transport, ranks_per_node)
            self.decider.two_level = True

    def attach_hints(self, module: torch.nn.Module) -> None:
        """Record the rows each dense-gradient embedding of ``module`` looks up (``config.row_hints``)."""
        if not self.config.row_hints or self.hints is not None:
            return
        seen: dict[torch.nn.Parameter, int] = {}
        for _, param in module.named_parameters(remove_duplicate=False):
            seen[param] = seen.get(param, 0) + 1
        shared = {p for p, count in seen.items() if count > 1}
        self.hints = RowHints(module.named_modules(), self.param_names, shared, self.config.hint_check_every)

    def nonzero_rows(self, name: str, x2d: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s non-zero items: from its row hint where it has one, else by a scan."""
        found = self.hints.rows(name, x2d) if self.hints is not None else None
        return kernels.nonzero_items(x2d) if found is None else found

    def skip_hints(self, names: Sequence[str]) -> None:
        """These parameters' buckets skipped detection: their recorded rows are dropped."""
        if self.hints is not None:
            self.hints.discard(names)

    def two_level_ranks_per_node(self) -> int:
        """Ranks per node of the two-level compressed schemes (0: flat), from the options or the plan."""
        plan = self.strategy.plan
        if plan is not None:
            return int(plan.two_level_ranks_per_node(self.runtime.transport.world_size))
        return self.config.ranks_per_node if self.strategy.kind == "compress" else 0

    # -- views on the parts (what users and tests read) ----------------------------------------------
    @property
    def transport(self) -> Transport:
        """The hook's own group."""
        return self.runtime.transport

    @property
    def hierarchy(self) -> Hierarchy | None:
        return self.runtime.hierarchy

    @property
    def cost_model(self) -> CostModel | None:
        return self.runtime.cost_model

    @property
    def records(self) -> dict[str, ParamRecord]:
        return self.memory.records

    @property
    def scheme_correction(self) -> dict[str, float]:
        return self.memory.scheme_correction

    @scheme_correction.setter
    def scheme_correction(self, value: dict[str, float]) -> None:
        self.memory.scheme_correction = value

    @property
    def compressed(self) -> dict[tuple[str, str], CompressedSync]:
        return self.memory.compressed

    @property
    def compression_memory_bytes(self) -> int:
        """Bytes of error-feedback memory held by all compressed syncs."""
        return self.memory.compression_memory_bytes

    def record(self, name: str) -> ParamRecord:
        """The record of parameter ``name``, created on first use."""
        return self.memory.record(name)

    @property
    def step(self) -> int:
        """Steps finished (the open step's number)."""
        return self.log.step

    @step.setter
    def step(self, value: int) -> None:
        """Set the step counter on this rank (every rank must set the same), where ``load_state_dict``
        would take effect at once: before a step that compares the ranks' engine states."""
        if not self.check_due or self.step_open or self._check is not None:
            raise RuntimeError(
                "zensync: the step counter can be set only before a step that compares the ranks' engine "
                "states (the first, then every check_every-th); load a state_dict instead, which waits for it"
            )
        self.log.restart(value)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The finished step records kept (``history_size``), oldest first, as dicts."""
        return [record.as_dict() for record in self.log.history]

    def last_step(self) -> dict[str, Any] | None:
        """The most recent finished step record, or None before the first step."""
        history = self.log.history
        return history[-1].as_dict() if history else None

    def name_of(self, param: torch.Tensor) -> str:
        """The name of a bucket parameter (a stable key across bucket rebuilds)."""
        name = self.param_names.get(param)  # type: ignore[call-overload]  # Parameters hash by identity
        if name is None:
            raise ValueError(
                "a DDP bucket holds a parameter that is not among the named_parameters given to the "
                "zensync hook state; build the state from the same model DDP wraps (ddp.module)"
            )
        return name

    # -- the step ------------------------------------------------------------------------------------
    def begin_check(self, make_check: Callable[[ZenSyncState], Coroutine[Any, Any, torch.Tensor]]) -> None:
        """Issue the coming step's agreement check now, unless one is pending (DDP's forward calls it).

        Issued at the forward, the check's round overlaps the forward and the backward instead of
        delaying the first bucket's collectives (``Transport.hold``). It compares the engine state as
        it is now, which only the hook's steps and ``load_state_dict`` change: ``load_state_dict``
        refuses to run while a check is pending, so the state the step uses is the state checked.
        """
        if self._check is None and not self.step_open and self.check_due:
            self._issue_check(make_check)

    @property
    def check_due(self) -> bool:
        """Whether the coming step compares the ranks' engine states (``HookConfig.check_every``): the
        first step after registration and every ``check_every``-th after it; every rank answers
        alike, without communicating. (A failed comparison fails the step's backward, after which
        DDP cannot run another: training goes on with a new DDP model and a new state.)"""
        return self._opened % self.config.check_every == 0

    @property
    def load_pending(self) -> bool:
        """A loaded checkpoint waits for the next comparison (``load_state_dict``)."""
        return self._staged is not None

    def _issue_check(self, make_check: Callable[[ZenSyncState], Coroutine[Any, Any, torch.Tensor]]) -> None:
        if self._staged is not None:  # the comparison sees the loaded state, on every rank that loaded it
            self._apply_loaded(self._staged[0])
            self._staged = None
        task = Task(make_check(self), self.runtime.segment_context()).start()
        self._check = task
        self.runtime.transport.hold(task)

    def open_step(self, make_check: Callable[[ZenSyncState], Coroutine[Any, Any, torch.Tensor]]) -> None:
        """Begin the step at its first bucket, with the check ``begin_check`` issued at the forward, or
        (a backward whose forward did not pass DDP's module) issued now, on the steps that compare
        (``check_due``).

        The check's all-gather is the step's first collective on the hook's group. The buckets' jobs
        start at once: their local passes (detection, compensation, compression) overlap the check's
        round if it is still running, and their collectives start when it has passed, or fail with
        its exception on every rank (``Transport.hold``).
        """
        self.step_open = True
        self._sync_listeners.begins()
        self._note_step_times(self._clock())
        if self._check is None and self.check_due:
            self._issue_check(make_check)
        self._opened += 1

    def _note_step_times(self, now_s: float) -> None:
        """The opening step's measured interval since the last one opened, and auto's prediction of it."""
        previous, self._opened_s = self._opened_s, now_s
        if previous is None:  # the first step: nothing measured, nothing to predict beside it
            return
        interval, last = now_s - previous, self.log.step - 1  # the interval is the last step's
        warm = self.decider.in_warmup(last)
        choice = self.auto_choice
        with self.lock:
            record = self.log.current
            record.step_interval_s = interval
            if choice is not None and last != self._profiled_step:
                reverted = self.auto_verdict is not None and not self.auto_verdict.kept
                record.predicted_step_s = choice.predicted_s["fp32" if warm or reverted else choice.spec]
        if self.config.profile is None or self.config.verify_steps == 0 or self.auto_verdict is not None:
            return
        if warm and last >= self.config.warmup_steps // 2:  # the later half: DDP's first steps run slower
            self._dense_times.append(interval)
        elif warm or last < _SETTLING_STEPS or last == self._profiled_step or choice is None:
            return
        elif choice.spec != "fp32":  # a choice of fp32 has nothing to verify
            self._compressed_times.append(interval)

    @property
    def verify_due(self) -> bool:
        """Whether auto's compression has run the steps ``verify_auto_choice`` compares (the same on every
        rank: the counts follow the step counter)."""
        return 0 < self.config.verify_steps <= len(self._compressed_times) and self.auto_verdict is None

    def verify_auto_choice(self) -> AutoVerdict:
        """Auto's compression against the dense steps it replaced, measured (collective, blocking; at a
        step's first bucket, on every rank, when ``verify_due``).

        The medians of the warm-up's later dense steps and of the first ``verify_steps`` compressed
        steps (not the training's first two, which run slower whatever syncs them, nor the one that
        measured a warm-up profile), each the slowest rank's; when the compressed step is not
        ``switch_margin`` faster, auto syncs densely again from this step (the error-feedback
        residuals are dropped). Without two dense steps measured (a given profile and
        ``warmup_steps`` < 4), the compressed step is compared with the profile's prediction of
        the dense one (``AutoVerdict.dense_measured`` False).
        """
        assert self.auto_choice is not None and self._auto_base is not None
        measured = len(self._dense_times) >= 2
        dense = statistics.median(self._dense_times) if measured else self.auto_choice.predicted_s["fp32"]
        compressed = statistics.median(self._compressed_times)
        dense_s, compressed_s = slowest_over_ranks(self.runtime.transport, [dense, compressed])
        kept = compressed_s * (1.0 + self.config.switch_margin) < dense_s
        verdict = AutoVerdict(
            spec=self.auto_choice.spec,
            dense_step_s=dense_s,
            compressed_step_s=compressed_s,
            kept=kept,
            dense_measured=measured,
        )
        with self.lock:
            self.auto_verdict = verdict
            self._dense_times, self._compressed_times = [], []
            if not kept:
                self.strategy = self.decider.strategy = self._auto_base
                self.memory.compressed.clear()
        if self.runtime.transport.rank == 0:
            logger.info("zensync auto: %s", verdict)
        return verdict

    def submit(self, job: Coroutine[Any, Any, torch.Tensor]) -> Task[torch.Tensor]:
        """Run a step job on the lane, on the caller's CUDA stream (captured now, on the hook's thread)."""
        return self.runtime.lane.submit(job, self.runtime.segment_context())

    def add_pending(self, handle: Handle[torch.Tensor]) -> None:
        """Remember an async dense bucket of this step; ``finish_step`` waits for it."""
        with self.lock:
            self._pending.append(handle)

    def note_failure(self, exc: BaseException) -> None:
        """Remember the first exception of this step (its original type; thread-safe)."""
        with self.lock:
            if self.step_error is None:
                self.step_error = exc

    def finish_step(self) -> BaseException | None:
        """Close the current step's record (called after the last bucket of a backward pass).

        Waits for the step's async buckets first (their statistics belong to this step). A failed
        step does not wait for them: after a failed agreement check one may have no partner on the
        other ranks and would only end in the group's timeout.

        Returns:
            The step's first failure with its original type (``note_failure``), or None.
        """
        check, self._check = self._check, None
        if check is not None:
            check.wait_done()  # a failure was noted; its collective is done on every rank, either way
            self.runtime.transport.release()
        with self.lock:
            pending, self._pending = self._pending, []
        if self.step_error is None:
            for handle in pending:
                handle.wait_done()  # completion only: a failed bucket's exception was noted
        with self.lock:
            failure, self.step_error = self.step_error, None
            self.log.finish(failure)
        self.step_open = False
        self.bucket_layout, self._layout = self._layout, []
        self._sync_listeners.ends()
        return failure

    def note_bucket(self, names: list[str]) -> None:
        """A bucket of this step syncs ``names`` (its parameters, in its order): the step's layout."""
        self._layout.append(list(names))

    def replay_groups(self, names: list[str], is_last: bool) -> list[list[str]] | None:
        """The buckets to sync the first bucket after a checkpoint load as, or None (as it is).

        DDP's first iteration after it is built fuses every gradient into one bucket, and only then
        rebuilds its buckets in the order gradients become ready. A run restored from a checkpoint
        would sync that iteration's gradients in one bucket where the uninterrupted run synced them
        in its rebuilt buckets (their parameters in the order of readiness, not the model's): a ring
        all-reduce then sums some elements in another order, and a fused compressor compresses
        other groups. Synced as the saved layout's buckets, in their order, the restored step
        issues the very collectives the uninterrupted one did. Only the one-bucket case is replayed
        (every parameter of the layout in this last bucket).
        """
        replay, self._replay = self._replay, None
        if replay is None or not is_last or replay == [names]:
            return None
        if sorted(names) != sorted(n for group in replay for n in group):
            return None
        return replay

    def add_sync_listener(self, listener: SyncListener) -> None:
        """Tell ``listener`` when each step's gradient collectives begin (the first bucket, on the
        backward's thread) and end (the last bucket's wait): the network's idle windows lie between,
        during the optimizer step and the next forward (``zensync.resilience`` sends there)."""
        self._sync_listeners.add(listener)

    async def check_agreement(self) -> None:
        """Compare the ranks' engine state in one small all-gather (the first job of a step that compares).

        The steps that compare are those ``check_due`` names.

        Raises:
            ValueError: On every rank, when some rank's step counter, schemes, scheme corrections,
                cost model or loaded checkpoint differ from rank 0's (a checkpoint loaded on some
                ranks only, or different checkpoints).
        """
        with self.lock:  # async buckets' callbacks write records
            schemes = {name: record.scheme for name, record in self.memory.records.items()}
            digest = fingerprint(self.log.step, schemes, self.memory.scheme_correction, self.runtime.cost_model)
            step = self.log.step
        comparison = await compare_with_rank0_async(
            self.runtime.transport,
            [digest, self._load_mark, step],
            compared=2,
            phase="agree",
            device=self.runtime.control_device(),
        )
        if comparison.differing:
            steps = [row[2] for row in comparison.rows]
            raise ValueError(
                f"zensync hook: ranks {comparison.differing} hold another engine state than rank 0 (step counters by "
                f"rank: {steps}); every rank must call load_state_dict with the same checkpoint"
            )

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter, per-parameter records, the cost model and each compressor's state (its
        error-feedback residuals, PowerSGD's Qs: this rank's); no process group. A checkpoint loaded
        and waiting for the next comparison (``load_pending``) as it was loaded."""
        if self._staged is not None:
            return copy.deepcopy(self._staged[1])
        model = self.runtime.cost_model
        return {
            "version": STATE_DICT_VERSION,
            "step": self.log.step,
            "records": {name: r.as_dict() for name, r in self.memory.records.items()},
            "scheme_correction": dict(self.memory.scheme_correction),
            "cost_model": None if model is None else dataclasses.asdict(model),
            "compression": {f"{key[0]}|{key[1]}": sync.state_dict() for key, sync in self.memory.compressed.items()},
            "buckets": None if self.bucket_layout is None else [list(b) for b in self.bucket_layout],
            "seed": self.runtime.h0_seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved: all of it, or (ValueError) nothing.

        Every field is validated first (``checkpoint.parse_state_dict``: types, ranges, and records of
        this model's parameters only); the state is changed only when all of it is valid. Every rank
        must load the same state dict: the next comparison of the ranks' engine states
        (``check_agreement``, on the steps ``check_due`` names) raises the same ValueError on every
        rank when they differ. The state takes effect now when the coming step compares (before the
        first step, say: the usual resume), else just before the next comparison is issued
        (``load_pending`` until then; ``state_dict`` returns it meanwhile): a checkpoint loaded on
        some ranks only must not change what they sync before the ranks have compared.
        """
        if self._check is not None or self.step_open:
            raise RuntimeError(
                "zensync: load_state_dict during a step (after DDP's forward, before the backward ended): the "
                "step's agreement check has already compared the engine state; load checkpoints before the forward"
            )
        loaded = parse_state_dict(state, set(self.param_names.values()))
        if self.check_due:
            self._apply_loaded(loaded)
            self._staged = None
        else:
            self._staged = (loaded, copy.deepcopy(state))

    def _apply_loaded(self, loaded: LoadedState) -> None:
        with self.lock:
            self.log.restart(loaded.step)
            self.memory.restore(loaded.records, loaded.scheme_correction)
            self.memory.compressed.clear()
            for (spec, collective), part in loaded.compression.items():
                self.memory.compressed_sync(spec, collective).load_state_dict(part)
            self.runtime.cost_model = loaded.cost_model
            self._replay = self.bucket_layout = loaded.buckets
            if loaded.seed is not None:
                self.runtime.h0_seed = loaded.seed
            self._load_mark = fingerprint(
                loaded.step,
                {n: r.scheme for n, r in loaded.records.items()},
                loaded.scheme_correction,
                loaded.cost_model,
                loaded.seed,
            )

    def __getstate__(self) -> dict[str, Any]:
        """Pickling keeps the configuration and the records; the process group is dropped."""
        logger.warning("zensync hook state pickled: the process group is not included; re-register after loading")
        return {"config": self.config, "state_dict": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise TypeError(
            "a pickled ZenSyncState cannot be revived without its process group: create a new state "
            "with zensync.register(...) and call load_state_dict(saved['state_dict'])"
        )

    def close(self) -> None:
        """Wait for the lane's queued jobs and a pending check (there is no thread of the hook's own to
        stop); remove the hint hooks and the forward hook."""
        if self.hints is not None:
            self.hints.close()
        for hook in (self.forward_hook, self.forward_end_hook):
            if hook is not None:
                hook.remove()
        self.forward_hook = self.forward_end_hook = None
        self.runtime.lane.drain(timeout=60)
        check, self._check = self._check, None
        if check is not None and check.wait_done(timeout=60):
            self.runtime.transport.release()


def _log_choice(choice: AutoChoice, source: str) -> None:
    """Log auto's choice and every candidate's predicted step (rank 0)."""
    logger.info(
        "zensync auto: %s, predicted %.1f ms/step from %s (%s)",
        "no compression" if choice.spec == "fp32" else choice.spec,
        choice.step_s * 1e3,
        source,
        ", ".join(f"{s} {t * 1e3:.1f}" for s, t in choice.predicted_s.items()),
    )
